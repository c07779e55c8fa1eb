"""Metrics sinks: console (logging), wandb, and a jsonl file that is always written.

`Tracking.log(metrics, step)` sends one step's flat `{"rollout/...": x, "actor/...": y}` dict to
every configured sink. The jsonl file (`metrics.jsonl` in the run's output dir, one object per
step with a `step` key) is written whatever `trainer.logger` says, so a run leaves a
machine-readable record even without wandb; tests read it.

wandb follows its own environment: `WANDB_MODE=offline` (the tests) writes the run under
`<dir>/wandb/offline-run-*` for a later `wandb sync`; without an API key on a machine with
no login, set WANDB_MODE=offline yourself. A resumed run passes the saved `run_id` and continues that
wandb run (`resume="allow"`). `log_table` sends a few sample trajectories as a
wandb table (and logs their count on the console).
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class Tracking:
    """Console + wandb + jsonl metrics for one run."""

    def __init__(self, loggers: list[str], project: str, experiment: str, out_dir: str | Path,
                 config: dict[str, Any] | None = None, run_id: str | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.out_dir / "metrics.jsonl"
        self._jsonl = self.jsonl_path.open("a", encoding="utf-8")
        self.console = "console" in loggers
        self.wandb_run = None
        if "wandb" in loggers:
            import wandb

            # run_id (from a resumed checkpoint): the same wandb run continues
            self.wandb_run = wandb.init(project=project, name=experiment, dir=str(self.out_dir), config=config or {},
                                        id=run_id, resume="allow" if run_id else None)

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
            logger.info("step %d: %s", step, " ".join(f"{k}={v:.4g}" for k, v in clean.items()))
        if self.wandb_run is not None:
            self.wandb_run.log(clean, step=step)

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
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.finish()
            self.wandb_run = None
            wandb.teardown()  # stop wandb's service process now, not at interpreter exit
