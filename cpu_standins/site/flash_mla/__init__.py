"""CPU stand-in for `flash_mla`: importing it fails with ImportError, which callers already handle.

The real package raises OSError on a machine without libcuda, which megatron-core does not catch.
"""
raise ImportError("flash_mla needs CUDA; this is polyturn's CPU stand-in (cpu_standins/site/flash_mla)")
