"""Shared fixtures: a tiny HF checkpoint built on the spot (no downloads), one SGLang engine per
session, and disposable HOME/tmp state for Ray, wandb and HF caches."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# Disposable state: tests never touch the user's home. One scratch per session: the processes it starts that
# import this module (Ray workers unpickling test code) use the session's, which the session removes at its end.
_OWN_SCRATCH = "POLYTURN_TEST_SCRATCH" not in os.environ
_SCRATCH = Path(os.environ.get("POLYTURN_TEST_SCRATCH") or tempfile.mkdtemp(prefix="polyturn-tests-"))
os.environ["POLYTURN_TEST_SCRATCH"] = str(_SCRATCH)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_DIR", str(_SCRATCH / "wandb"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_TMPDIR", str(_SCRATCH / "ray"))
# Every import and call of a CPU stand-in, in any process of the session, is recorded here.
STANDIN_LOG = _SCRATCH / "standin_events.log"
os.environ["POLYTURN_STANDIN_LOG"] = str(STANDIN_LOG)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's scratch goes with it (Ray's session logs, wandb's offline runs: megabytes per session)."""
    if _OWN_SCRATCH:
        shutil.rmtree(_SCRATCH, ignore_errors=True)


_DIST_BACKEND = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """The test session's process start: the CPU adapter (no-op with a GPU), once, before any test
    module imports megatron."""
    from megatron_workers import cpu_compat

    config.stash[_DIST_BACKEND] = cpu_compat.apply_cpu_compat()


@pytest.fixture(scope="session")
def dist_backend(pytestconfig: pytest.Config) -> str:
    """The torch.distributed backend for Megatron ranks in this process ("gloo" without a GPU), as the session's
    CPU adapter answered it."""
    return pytestconfig.stash[_DIST_BACKEND]


@pytest.fixture(scope="module")
def world_of_one(dist_backend):
    """torch.distributed + Megatron groups for a single rank in this process, torn down after the module."""
    from megatron_workers import parallel
    from megatron_workers.ports import free_port

    parallel.init_distributed(0, 1, "127.0.0.1", free_port(), tp=1, pp=1, backend=dist_backend, seed=0)
    yield
    parallel.destroy()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """An HF-format Qwen2-architecture checkpoint + tokenizer with a tool-aware chat template."""
    from recipe.tiny_model import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def sglang_engine(tiny_model_dir):
    """One real SGLang engine (CPU engine when no GPU) on the tiny checkpoint, shared by the session.

    Tests that change its weights must restore them (`update_weights_from_disk(tiny_model_dir, ...)`).
    """
    from rollout.engines.sglang_engine import SGLangEngine

    engine = SGLangEngine(str(tiny_model_dir), name="test-engine", dtype="float32", random_seed=0,
                          max_total_tokens=16384, log_level="error")
    yield engine
    engine.shutdown()


@contextmanager
def local_ray_cluster(tmp_path_factory, num_cpus: int, pickle_by_value: str) -> Iterator[None]:
    """A private Ray cluster of `num_cpus` CPUs (no dashboard, temp dir under pytest's tmp) for
    one test module's fixture; functions and classes of module `pickle_by_value` are shipped to
    the Ray actors by value, so the actors need not import the test module."""
    import cloudpickle
    import ray

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")))
    cloudpickle.register_pickle_by_value(sys.modules[pickle_by_value])
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="session", autouse=True)
def hydra_schemas() -> None:
    """The schemas the presets start from, registered with Hydra as the entry points' `recipe.launch.compose` does
    (tests compose presets with Hydra's compose API directly)."""
    from recipe.config_build import register_schema
    from recipe.launch import PPO
    from recipe.sft_config import SFT

    for entry in (PPO, SFT):
        register_schema(entry.schema_node, entry.schema)
