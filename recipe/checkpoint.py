"""Trainer checkpoints: atomic `global_step_<k>/` directories, a `latest` marker, retention, and what resume reads.

One checkpoint under `trainer.default_local_dir` (verl's names):

    global_step_<k>/actor/               the actor group's per-rank shards (megatron_workers.checkpoint: model,
                                         optimizer, LR scheduler, RNG, in the group's TP x PP x DP layout)
    global_step_<k>/critic/              the critic group's, when the run has a critic
    global_step_<k>/trainer_state.json   `TrainerState`: step, weight version, KL coefficient, prompt position,
                                         wandb run id
    global_step_<k>/*.pkl                what the schedule keeps between steps (recipe.schedules: one_step_off's
                                         next rollout, fully_async's groups finished or in flight)
    latest_checkpointed_iteration.txt    the step of the newest COMPLETE checkpoint

`save` writes everything into `.tmp_global_step_<k>/`, renames it to `global_step_<k>/` (one rename on one
filesystem), then replaces the marker (temp file + `os.replace`), and only then removes checkpoints beyond
`trainer.max_actor_ckpt_to_keep`. A kill at any point leaves the marker naming a complete checkpoint, and `auto`
resume goes by the marker only, never by listing directories; the next save removes a leftover temp dir.
With more than one node, `trainer.default_local_dir` must be a filesystem every Megatron rank and the driver share.

The prompt sampler is a fresh seeded shuffle per epoch (recipe.data.dataset), so its position is the number of
batches drawn: resume draws and drops that many, which puts the sampler exactly where it was.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MARKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"global_step_(\d+)")
RESUME_MODES = ("auto", "disable", "resume_path")


@dataclass
class TrainerState:
    """What the trainer itself needs to continue (the Megatron groups restore their own state)."""

    step: int
    """The last finished step; the resumed run starts at step + 1."""
    weight_version: int
    """The engines' weight version after that step; the resume sync publishes the restored actor under it."""
    kl_coef: float
    """The KL controller's current coefficient (adaptive controllers move it)."""
    batches_consumed: int
    """Prompt batches drawn so far from `RLDataset.batches` (the sampler's position)."""
    epoch: int
    """Epoch of the last batch drawn (checked on resume: a different value means the data or batch size changed)."""
    wandb_run_id: str | None = None
    """The wandb run to resume (None: no wandb)."""

    def write(self, directory: Path) -> None:
        (directory / STATE_FILE).write_text(json.dumps(dataclasses.asdict(self), indent=2))

    @classmethod
    def read(cls, directory: str | Path) -> "TrainerState":
        path = Path(directory) / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: {directory} is not a complete polyturn checkpoint "
                                    f"(give trainer.resume_from_path=<dir>/global_step_<k>)")
        return cls(**json.loads(path.read_text()))


def step_dir(root: str | Path, step: int) -> Path:
    """Where step `step`'s checkpoint lives."""
    return Path(root) / f"global_step_{step}"


def latest_step(root: str | Path) -> int | None:
    """The marker's step (the newest complete checkpoint), or None when there is no marker."""
    marker = Path(root) / MARKER
    if not marker.is_file():
        return None
    return int(marker.read_text().strip())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(root: str | Path, step: int, write: Callable[[Path], None], max_keep: int | None = None) -> Path:
    """Checkpoint `step`: `write(tmp_dir)` fills a temp dir, which is renamed to `global_step_<step>/`; then the
    marker names `step`, then all but the newest `max_keep` checkpoints are removed (None: keep all)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    tmp = root / f".tmp_{final.name}"
    for stale in root.glob(".tmp_global_step_*"):  # a save killed earlier
        shutil.rmtree(stale)
    tmp.mkdir()
    write(tmp)
    if final.exists():  # a step saved again (e.g. after resuming from an older checkpoint): replace it
        shutil.rmtree(final)
    tmp.rename(final)
    _write_atomic(root / MARKER, f"{step}\n")
    logger.info("saved checkpoint %s", final)
    if max_keep is not None:
        steps = sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir())
        for old in steps[:-max_keep]:
            shutil.rmtree(step_dir(root, old))
            logger.info("removed checkpoint %s (trainer.max_actor_ckpt_to_keep=%d)", step_dir(root, old), max_keep)
    return final


def save_run(root: str | Path, state: TrainerState, groups: dict[str, Any], files: dict[str, Any],
             max_keep: int | None = None) -> Path:
    """`save` step `state.step`: each Megatron group's shards in `<name>/` (`groups`: name -> worker group), each
    object of `files` pickled under its file name, and the trainer state."""
    def write(directory: Path) -> None:
        for name, group in groups.items():
            group.call_all("save_checkpoint", str(directory / name))
        for name, obj in files.items():
            (directory / name).write_bytes(pickle.dumps(obj))
        state.write(directory)

    return save(root, state.step, write, max_keep)


def load_run(directory: str | Path, groups: dict[str, Any]) -> tuple[TrainerState, dict[str, Any]]:
    """What `save_run` wrote: each group restored from its shards, and (the trainer state, {file name: object})."""
    directory = Path(directory)
    state = TrainerState.read(directory)
    for name, group in groups.items():
        if not (directory / name).is_dir():
            raise FileNotFoundError(f"{directory} holds no {name} checkpoint, but this run has a {name}; resume with "
                                    "the algorithm the checkpoint was trained with")
        group.call_all("load_checkpoint", str(directory / name))
    files = {p.name: pickle.loads(p.read_bytes()) for p in sorted(directory.glob("*.pkl"))}
    return state, files


def resume_dir(mode: str, root: str | Path, resume_from_path: str | None) -> Path | None:
    """The checkpoint to resume from: `auto` -> the marker's (None without one), `disable` -> None,
    `resume_path` -> `trainer.resume_from_path`."""
    if mode == "disable":
        return None
    if mode == "auto":
        step = latest_step(root)
        if step is None:
            logger.info("no %s in %s: training from the start", MARKER, root)
            return None
        path = step_dir(root, step)
        if not path.is_dir():
            raise FileNotFoundError(f"{Path(root) / MARKER} names step {step} but {path} is missing; remove the "
                                    "marker to start over, or set trainer.resume_mode=resume_path")
        return path
    if mode == "resume_path":
        if resume_from_path is None or not Path(resume_from_path).is_dir():
            raise FileNotFoundError(f"trainer.resume_from_path={resume_from_path!r} is not a directory; give a "
                                    "<trainer.default_local_dir>/global_step_<k> directory")
        return Path(resume_from_path)
    raise ValueError(f"trainer.resume_mode={mode!r}; use one of {RESUME_MODES}")
