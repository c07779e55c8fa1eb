"""Metrics sinks: console (logging), wandb, tensorboard, and a jsonl file that is always written; the run's record
files.

`Tracking.log(metrics, step)` sends one step's flat `{"rollout/...": x, "actor/...": y}` dict to
every configured sink. The jsonl file (`metrics.jsonl` in the run's output dir, one object per
`log` call with a `step` key) is written whatever `trainer.logger` says, so a run leaves a
machine-readable record even without wandb; tests read it. The console line leads with the
`HEADLINE` metrics a person watches (score, validation score, response length, tool-call rate,
turns, KL, grad norm, entropy, step and sync time), then every other metric in name order.

One record per step, whatever happened before the run: a fresh run (`resume_step=None`) sets an
older run's `metrics.jsonl` and step dumps (`<dump_dir>/<step>.jsonl`, `trainer.rollout_data_dir` /
`validation_data_dir`) aside as `<name>.<k>` (the first free k) and starts anew; a run resumed from
checkpoint step k drops every record after step k (the killed run logged steps it will redo) and
appends from there.

wandb follows its own environment: `WANDB_MODE=offline` (the tests) writes the run under
`<dir>/wandb/offline-run-*` for a later `wandb sync`; without an API key on a machine with
no login, set WANDB_MODE=offline yourself (`wandb_login_problem` says so before Ray starts). A resumed run
passes the saved `run_id` and continues that wandb run (`resume="allow"`). `log_table` sends a few sample
trajectories as a wandb table (and logs their count on the console).

tensorboard (verl's sink of that name): torch.utils.tensorboard's SummaryWriter writes each step's scalars under
$TENSORBOARD_DIR (verl's variable), else `<dir>/tensorboard`; the config refuses the sink before Ray when the
`tensorboard` package is missing.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# (console label, metric-name pattern) in console order; a label whose pattern matches several names (e.g. one
# validation score per data source) shows each under its full name.
HEADLINE: tuple[tuple[str, str], ...] = (
    ("score", r"critic/score/mean"),
    ("val_score", r"val-core/.+/reward/mean@\d+"),
    ("response_length", r"rollout/response_length/mean"),
    ("tool_call_rate", r"rollout/tool/call_rate|val-aux/.+/tool_call_rate"),
    ("turns", r"rollout/turns/assistant_mean|val-aux/.+/num_turns/mean"),
    ("kl", r"actor/kl_loss|actor/reward_kl_penalty"),
    ("grad_norm", r"actor/grad_norm"),
    ("entropy", r"actor/entropy"),
    ("step_s", r"timing/step_s"),
    ("sync_s", r"timing/sync_weights_s"),
)
_STEP_FILE = re.compile(r"(\d+)\.jsonl")


def console_line(metrics: dict[str, float], step: int) -> str:
    """`step k | <headline metrics> | <the rest by name>`: what the console logs for one `Tracking.log` call."""
    head, shown = [], set()
    for label, pattern in HEADLINE:
        names = sorted(k for k in metrics if re.fullmatch(pattern, k))
        for name in names:
            head.append(f"{label if len(names) == 1 else name}={metrics[name]:.4g}")
        shown.update(names)
    rest = [f"{k}={v:.4g}" for k, v in sorted(metrics.items()) if k not in shown]
    return " | ".join([f"step {step}", *(" ".join(part) for part in (head, rest) if part)])


def set_aside(path: Path) -> Path:
    """Rename `path` to `<path>.<k>`, the first k >= 1 not taken; returns the new path."""
    k = 1
    while path.with_name(f"{path.name}.{k}").exists():
        k += 1
    target = path.with_name(f"{path.name}.{k}")
    path.rename(target)
    return target


def step_files(directory: Path) -> dict[int, Path]:
    """`<directory>/<step>.jsonl` files by step (none when the directory does not exist)."""
    if not directory.is_dir():
        return {}
    return {int(m.group(1)): p for p in directory.iterdir() if (m := _STEP_FILE.fullmatch(p.name))}


def _keep_through(path: Path, step: int) -> int:
    """Rewrite the jsonl file `path` (atomically) without the records after `step`; returns how many it dropped."""
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [x for x in lines if x.strip() and json.loads(x)["step"] <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(x + "\n" for x in kept), encoding="utf-8")
    os.replace(tmp, path)
    return len(lines) - len(kept)


def wandb_login_problem(loggers: list[str]) -> str | None:
    """Why `wandb.init` would fail for lack of a login with these `trainer.logger` sinks, in one line; None when it
    would not. wandb's own lookup: WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, ~/.netrc, its settings file;
    WANDB_MODE=offline / disabled need no login."""
    if "wandb" not in loggers:
        return None
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib import wbauth

    settings = wandb_setup.singleton().settings  # the environment and settings file, as wandb.init reads them
    if settings._offline or settings._noop:
        return None
    try:
        auth = wbauth.authenticate_session(host=settings.base_url, source="polyturn", prompt=False,
                                           update_session=False)
    except Exception as err:  # credentials found in the wrong format (wandb's AuthenticationError)
        return (f"trainer.logger={loggers} includes wandb but its credentials are unusable ({err}); run `wandb login` "
                "again or fix WANDB_API_KEY")
    if auth is not None:
        return None
    return (f"trainer.logger={loggers} includes wandb but no wandb login or API key was found for {settings.base_url}: "
            "run `wandb login`, set WANDB_API_KEY, set WANDB_MODE=offline, or drop wandb from trainer.logger")


class Tracking:
    """Console + wandb + jsonl metrics for one run, and its record files kept one per step."""

    def __init__(self, loggers: list[str], project: str, experiment: str, out_dir: str | Path,
                 config: dict[str, Any] | None = None, run_id: str | None = None, resume_step: int | None = None,
                 dump_dirs: Iterable[str | Path | None] = ()):
        """`resume_step`: the checkpoint step a resumed run continues from (None: a fresh run); `dump_dirs`: the
        directories of per-step JSONL dumps (None entries skipped) that follow the same rule as metrics.jsonl."""
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.out_dir / "metrics.jsonl"
        self._start_records(resume_step, [Path(d) for d in dump_dirs if d])
        self._jsonl = self.jsonl_path.open("a", encoding="utf-8")
        self.console = "console" in loggers
        self.wandb_run = None
        self.tensorboard = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(os.environ.get("TENSORBOARD_DIR") or str(self.out_dir / "tensorboard"))
        if "wandb" in loggers:
            import wandb

            # run_id (from a resumed checkpoint): the same wandb run continues
            self.wandb_run = wandb.init(project=project, name=experiment, dir=str(self.out_dir), config=config or {},
                                        id=run_id, resume="allow" if run_id else None)

    def _start_records(self, resume_step: int | None, dump_dirs: list[Path]) -> None:
        """Fresh run: set older record files aside. Resumed run: drop the records after `resume_step`."""
        dumps = [p for d in dump_dirs for p in step_files(d).items()]
        if resume_step is None:
            old = ([self.jsonl_path] if self.jsonl_path.exists() else []) + [p for _, p in dumps]
            for path in old:
                logger.info("a fresh run in %s: an older run's %s set aside as %s", path.parent, path.name,
                            set_aside(path).name)
            return
        dropped = _keep_through(self.jsonl_path, resume_step) if self.jsonl_path.exists() else 0
        for step, path in dumps:
            if step > resume_step:
                path.unlink()
        later = sorted(step for step, _ in dumps if step > resume_step)
        if dropped or later:
            logger.info("resuming after step %d: dropped %d metrics.jsonl records and the dumps of steps %s that "
                        "the run will redo", resume_step, dropped, later)

    @property
    def run_id(self) -> str | None:
        """The wandb run's id (saved in checkpoints so that a resumed run continues it); None without wandb."""
        return self.wandb_run.id if self.wandb_run is not None else None

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record one step's metrics in every sink."""
        clean = {k: float(v) for k, v in sorted(metrics.items())}
        self._jsonl.write(json.dumps({"step": step, **{k: v if math.isfinite(v) else None for k, v in clean.items()}}) + "\n")
        self._jsonl.flush()
        if self.console:
            logger.info("%s", console_line(clean, step))
        if self.wandb_run is not None:
            self.wandb_run.log(clean, step=step)
        if self.tensorboard is not None:
            for k, v in clean.items():
                self.tensorboard.add_scalar(k, v, step)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """A small table of examples (wandb only; the console gets a one-line note)."""
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.log({name: wandb.Table(columns=columns, data=rows)}, step=step)
        if self.console:
            logger.info("step %d: %s: %d rows", step, name, len(rows))

    def finish(self) -> None:
        """Flush and close every sink."""
        self._jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.finish()
            self.wandb_run = None
            wandb.teardown()  # stop wandb's service process now, not at interpreter exit
