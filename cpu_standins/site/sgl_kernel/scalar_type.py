"""The real `sgl_kernel.scalar_type` (pure Python), loaded from the installed sglang-kernel package."""
import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path

_here = _Path(__file__).resolve().parents[1]
for _entry in _sys.path:
    _candidate = _Path(_entry or ".").resolve() / "sgl_kernel" / "scalar_type.py"
    if _candidate.is_file() and _candidate.parents[1] != _here:
        _spec = _util.spec_from_file_location(__name__, _candidate)
        _module = _util.module_from_spec(_spec)
        _sys.modules[__name__] = _module
        _spec.loader.exec_module(_module)
        globals().update({k: v for k, v in vars(_module).items() if not k.startswith("__")})
        break
else:
    raise ImportError("the real sgl_kernel/scalar_type.py was not found; install sglang-kernel")
