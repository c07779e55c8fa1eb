"""The Slurm launcher, on a real Slurm: `scripts/slurm/polyturn.sbatch` submitted with `sbatch` to the controller of
this machine (`scripts/slurm/local_cluster.sh` sets up a one-node one), waited for, and judged by Slurm's own record
of the job (`scontrol show job`) and the job's log.

Skipped, saying why, where `sbatch` is not on the PATH or no controller answers `scontrol ping`. The allocation is
one node without GPUs (`--gpus-per-node=0` overrides the script's 8), so the trainer plans CPU bundles.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from megatron_workers.ports import free_port
from recipe.tasks import gsm8k
from tests.test_trainer_e2e import RECORDS

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "scripts" / "slurm" / "polyturn.sbatch"
JOB_TIMEOUT_S = 900
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1200)]


def _no_slurm() -> str | None:
    """Why Slurm cannot run a job here, or None."""
    if shutil.which("sbatch") is None:
        return "sbatch is not on the PATH (install Slurm, e.g. `bash scripts/slurm/local_cluster.sh` as root)"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    if " is UP" not in ping.stdout:
        return f"no Slurm controller answers `scontrol ping` ({(ping.stdout + ping.stderr).strip()[:200]})"
    return None


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The GSM8K-format train parquet (8 records) the jobs train on; skips the module without a Slurm."""
    if reason := _no_slurm():
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm_data")
    for split in gsm8k.SPLITS:
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return gsm8k.preprocess(root / "data", root)["train"]


def submit(log: Path, overrides: list[str]) -> tuple[dict[str, str], str]:
    """Submit the sbatch script on one node without GPUs, wait until the job ends; its `scontrol show job` record
    and its log. Fails when a process of the job's Ray cluster outlives the job."""
    port = free_port()
    env = {**os.environ, "RAY_PORT": str(port)}  # sbatch passes the environment on to the job
    job = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--time=00:30:00", "--job-name=polyturn-test",
         f"--output={log}", str(SBATCH), *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, check=True, timeout=60).stdout.strip().split(";")[0]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30).stdout
        record = dict(f.split("=", 1) for f in out.split() if "=" in f)
        if record.get("JobState") not in {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", None}:
            left = ray_processes(port)
            assert not left, f"the job's Ray processes outlived it: {left}"
            return record, log.read_text(errors="replace")
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], timeout=30)
            pytest.fail(f"job {job} still {record.get('JobState')} after {JOB_TIMEOUT_S}s:\n" + log.read_text()[-4000:])
        time.sleep(5)


def ray_processes(port: int) -> list[str]:
    """Command lines of the running processes that belong to the Ray cluster at `port` (they name its GCS port)."""
    own = re.compile(rf"(:|port=){port}\b")
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["status"] != psutil.STATUS_ZOMBIE and "ray" in cmd and own.search(cmd):
            found.append(cmd[:200])
    return found


def test_sbatch_trains_cpu_tiny_on_ray_started_over_the_allocation(data, tmp_path):
    """Contract: the script starts Ray on the allocation through srun, waits for its node, fills `trainer.nnodes`
    from the allocation, the trainer joins that Ray cluster (RAY_ADDRESS) and trains the step, Ray stops, and
    Slurm records the job COMPLETED with exit code 0."""
    out = tmp_path / "out"
    record, log = submit(tmp_path / "job.log", [
        "--config-name", "cpu_tiny", f"data.train_files=[{data}]", f"trainer.default_local_dir={out}",
        "trainer.total_training_steps=1", "data.max_response_length=24",
        # the engine on a bundle of its own: in hybrid mode on CPU the engine and the Megatron rank share one core
        "actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1", "rollout.n_gpus_per_node=1"])
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), f"{record}\n{log[-4000:]}"
    assert re.search(r"polyturn-slurm: Ray up: 1/1 node\(s\), resources \{[^}]*'CPU': 2\.0", log), log[-4000:]
    assert "trainer.nnodes=1" in log  # filled from the allocation: the overrides did not give it
    ray_address = re.search(r"Ray head \S+ at (\S+)", log).group(1)
    assert f"joined the Ray cluster at {ray_address}" in log, log[-4000:]
    assert re.search(r"^.*step 1 \| ", log, re.M), log[-4000:]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert "polyturn-slurm: trainer exited 0" in log


def test_the_job_fails_with_the_trainers_exit_code(data, tmp_path):
    """Contract: a launch the trainer refuses (an unknown key: one line, exit 2) makes the job FAILED with exit
    code 2, and Ray is stopped all the same."""
    record, log = submit(tmp_path / "job.log", ["--config-name", "cpu_tiny", f"data.train_files=[{data}]",
                                                "trainer.no_such_key=1"])
    assert (record["JobState"], record["ExitCode"]) == ("FAILED", "2:0"), f"{record}\n{log[-4000:]}"
    assert "trainer.no_such_key" in log and "polyturn-slurm: trainer exited 2" in log, log[-4000:]
