"""Shared fixtures: a tiny HF checkpoint built on the spot (no downloads), one SGLang engine per
session, and disposable HOME/tmp state for Ray, wandb and HF caches."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Disposable state: tests never touch the user's home.
_SCRATCH = Path(tempfile.mkdtemp(prefix="polyturn-tests-"))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_DIR", str(_SCRATCH / "wandb"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_TMPDIR", str(_SCRATCH / "ray"))
# Every import and call of a CPU stand-in, in any process of the session, is recorded here.
STANDIN_LOG = _SCRATCH / "standin_events.log"
os.environ["POLYTURN_STANDIN_LOG"] = str(STANDIN_LOG)


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
