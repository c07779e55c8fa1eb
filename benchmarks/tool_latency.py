"""Python-tool call latency, cold (a sandbox started per call) against warm (`pool_size`, the sandbox pool).

    python -m benchmarks.tool_latency [--levels 1 8 64 --calls 32 --config tool_configs/python_calc_tool_config.yaml] [--smoke]

The `python` tool of `--config` (its limits and isolation, as training uses it) is called through its
`ToolRunner`, as the agent loop calls it, with a calculator-sized script. At each concurrency level `c`,
bursts of `c` concurrent calls are timed: cold with `pool_size: 0`, then warm with `pool_size: c`, the pool
refilled before each burst (a rollout's tool calls come in bursts between generation turns; `refill_s`
is how long the pool took to refill after the largest burst). Each burst's latency is per call (the
runner's `execute`). `cpu_s_per_call` is the machine's CPU time (from /proc/stat: every process, and the
kernel's teardown of the sandboxes' namespaces, which no rusage counts) from the first burst until the
machine settles after the last, per call; the warm figure therefore includes starting and tearing down
the sandbox each call used, ahead of or after it, and any other load on the machine. Before each burst the
machine is given up to 5 s to settle (the kernel tears namespaces down after their processes are gone). At
least `--calls` calls and four bursts are timed per level and mode: a burst that meets a pause of the host
process (a full garbage collection takes tens of ms here) moves a two-burst median by half a burst.

The machine's 1-minute load average is recorded before and after (`load_1m_start`, `load_1m_end`): the
figures mean little without it on a shared machine.

`--smoke`: levels 1 and 4, one burst each: the same code path in seconds (the suite runs it).

Last line: JSON with RESULT_KEYS (the headline at the largest level: `cold_*`, `warm_*`) and, per level c,
`{cold,warm}_c{c}_{p50_ms,p99_ms,cpu_s_per_call}`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from rollout.tools import ToolRegistry
from rollout.tools.sandbox_isolation import namespaces_available

logger = logging.getLogger(__name__)

RESULT_KEYS = (
    "concurrency", "cold_p50_ms", "cold_p99_ms", "cold_cpu_s_per_call", "warm_p50_ms", "warm_p99_ms",
    "warm_cpu_s_per_call", "refill_s", "load_1m_start", "load_1m_end",
)
REPO = Path(__file__).resolve().parents[1]
CODE = "import math\nprint(math.factorial(20) % 97, 17 * 23 + 4)"


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile by the nearest-rank method (q=0.5: median of an odd count)."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def cpu_s() -> float:
    """CPU seconds the whole machine has been busy (every core, user and kernel time; /proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:7]) - idle) / os.sysconf("SC_CLK_TCK")


async def settle(max_wait_s: float = 5.0, window_s: float = 0.1) -> None:
    """Wait until the machine is below a quarter of a core busy over `window_s`, at most `max_wait_s`."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        before = cpu_s()
        await asyncio.sleep(window_s)
        if cpu_s() - before < 0.25 * window_s:
            return


def tool_entry(config_path: Path, pool_size: int) -> dict[str, Any]:
    """The config's python tool, with `pool_size` set (and `rlimits_unsafe` where namespaces are unavailable)."""
    entry = dict(yaml.safe_load(config_path.read_text())["tools"][0])
    config = {**entry["config"], "pool_size": pool_size}
    if config.get("isolation", "namespaces") == "namespaces" and not namespaces_available(
            shutil.which("unshare"), os.geteuid() == 0):
        logger.warning("namespaces are unavailable here: measuring isolation rlimits_unsafe (not a sandbox)")
        config["isolation"] = "rlimits_unsafe"
    return {**entry, "config": config}


async def measure(config_path: Path, level: int, bursts: int, warm: bool) -> dict[str, float]:
    """`bursts` bursts of `level` concurrent calls; per-call latency percentiles and CPU seconds."""
    registry = ToolRegistry.from_config({"tools": [tool_entry(config_path, level if warm else 0)]})
    runner = registry.runner(registry.names[0])
    pool = runner.tool.pool
    latencies: list[float] = []
    refill_s = 0.0
    try:
        async with runner.session() as iid:  # starts the pool filling (the python tool's `create`)
            if pool is not None and not await asyncio.to_thread(pool.wait_ready, 600):
                raise RuntimeError(f"the sandbox pool did not fill {level} workers within 600 s")
            await settle()
            cpu_start = cpu_s()

            async def call() -> float:
                start = time.perf_counter()
                result = await runner.execute(iid, {"code": CODE})
                if result.error is not None or "exit_code: 0" not in result.text:
                    raise RuntimeError(f"python tool call failed: {result.text[:500]}")
                if warm and not result.metrics.get("warm"):
                    raise RuntimeError("a warm call found the pool empty; the figure would mix cold calls in")
                return time.perf_counter() - start

            for burst in range(bursts):
                if burst:
                    await settle()
                times = await asyncio.gather(*(call() for _ in range(level)))
                logger.debug("burst %d of %d: p50 %.1f ms", burst + 1, level, 1000 * percentile(times, 0.5))
                latencies += times
                if pool is not None:
                    refill_start = time.perf_counter()
                    if not await asyncio.to_thread(pool.wait_ready, 600):
                        raise RuntimeError("the sandbox pool did not refill within 600 s")
                    refill_s = max(refill_s, time.perf_counter() - refill_start)
            await settle()
            cpu_per_call = (cpu_s() - cpu_start) / len(latencies)
    finally:
        await registry.aclose()
    return {"p50_ms": 1000 * percentile(latencies, 0.5), "p99_ms": 1000 * percentile(latencies, 0.99),
            "cpu_s_per_call": cpu_per_call, "refill_s": refill_s}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 64], help="concurrent calls per burst")
    parser.add_argument("--calls", type=int, default=32, help="at least this many timed calls per level and mode")
    parser.add_argument("--config", type=Path, default=REPO / "tool_configs" / "python_calc_tool_config.yaml")
    parser.add_argument("--smoke", action="store_true", help="levels 1 and 4, one burst each (seconds)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    levels = [1, 4] if args.smoke else sorted(args.levels)
    out: dict[str, Any] = {"load_1m_start": os.getloadavg()[0]}
    for level in levels:
        bursts = 1 if args.smoke else max(4, math.ceil(args.calls / level))
        for mode in ("cold", "warm"):
            figures = asyncio.run(measure(args.config, level, bursts, warm=mode == "warm"))
            logger.info("%s c=%d: %d calls, p50 %.1f ms, p99 %.1f ms, %.3f CPU-s per call", mode, level,
                        bursts * level, figures["p50_ms"], figures["p99_ms"], figures["cpu_s_per_call"])
            for key in ("p50_ms", "p99_ms", "cpu_s_per_call"):
                out[f"{mode}_c{level}_{key}"] = round(figures[key], 4)
            if mode == "warm":
                out["refill_s"] = round(figures["refill_s"], 3)
    top = levels[-1]
    out["concurrency"] = top
    for mode in ("cold", "warm"):
        for key in ("p50_ms", "p99_ms", "cpu_s_per_call"):
            out[f"{mode}_{key}"] = out[f"{mode}_c{top}_{key}"]
    out["load_1m_end"] = os.getloadavg()[0]
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
