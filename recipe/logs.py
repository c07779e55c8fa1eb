"""One logging set-up for the entry points: `setup_logging()` at a process's start.

What it does, once per process:
- Root logger at INFO with one format. Handlers already there are kept (Hydra's job logging: the
  console and `<run dir>/<job>.log`), so Hydra's log file gets the whole log; a process without
  any gets one stream handler.
- Third-party import noise is dropped: the Python warnings in `NOISY_WARNINGS` (megatron-core
  saying TransformerEngine / Apex are absent, SGLang saying AWQ / GGUF / Triton need a GPU) and
  the loggers in `QUIET_LOGGERS` below WARNING/ERROR. The warning filters also go into
  `PYTHONWARNINGS`, which every process started later inherits (Ray workers, SGLang's scheduler
  and detokenizer), so call this before Ray starts.

Where it departs from the common `basicConfig(force=True)`: force would remove Hydra's file handler.
Progress bars are separate: the loops' tqdm bars are off when stderr is not a terminal
(`disable=None`), where the per-step console line of `recipe.tracking` is the progress line.
"""
from __future__ import annotations

import logging
import os
import re
import warnings

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Message prefixes (as written, no ',' or ':': they travel in PYTHONWARNINGS) of warnings that say only that a
# GPU-only or optional package is absent; each is raised once per importing process.
NOISY_WARNINGS: tuple[str, ...] = (
    "Transformer Engine and Apex are not installed",  # megatron.core optimizer / fsdp / clip_grads
    "Apex is not installed",  # megatron.core norms
    "Only CUDA",  # SGLang's AWQ and GGUF quantization modules ("Only CUDA, HIP and XPU support AWQ currently.")
    "Triton is not supported on current platform",  # SGLang's fla kernels
)

# Loggers that report, at WARNING, what a CPU machine or a driver without a GPU always lacks.
QUIET_LOGGERS: dict[str, int] = {
    "torch.utils.cpp_extension": logging.ERROR,  # "No CUDA runtime is found, using CUDA_HOME=..."
}


def setup_logging(level: int = logging.INFO) -> None:
    """Configure this process's logging and warning filters (idempotent); see the module docstring."""
    for prefix in NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(prefix))
    inherited = [x for x in os.environ.get("PYTHONWARNINGS", "").split(",") if x]
    ours = [f"ignore:{prefix}" for prefix in NOISY_WARNINGS]
    os.environ["PYTHONWARNINGS"] = ",".join(inherited + [x for x in ours if x not in inherited])
    for name, logger_level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(logger_level)
    root = logging.getLogger()
    root.setLevel(level)
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    for handler in root.handlers:
        handler.setFormatter(logging.Formatter(FORMAT))
