"""Inference engines behind the `RolloutEngine` seam (`base.py`), and the router that spreads trajectories over them.

In production every engine is an SGLang `Engine` inside a Ray actor (`engine_actor.py`); the
driver holds `EngineClient` handles only. `sglang_engine.py` is the in-process client the actor
hosts (also the weight-sync receive side); `weight_probe.py` runs inside SGLang's scheduler for
the post-sync checksum check.
"""
