"""`python -m cpu_standins check-install`: the GPU half of `scripts/install.sh`.

On a node where `nvidia-smi -L` lists GPUs: torch must see them and every GPU-path import must work
(`cpu_standins.install_problems`); each problem is one line on stderr and the exit status is 1. Without
GPUs it says so and exits 0 (the CPU path uses the stand-ins instead).
"""
from __future__ import annotations

import sys

import cpu_standins


def main(argv: list[str]) -> int:
    if argv != ["check-install"]:
        print("usage: python -m cpu_standins check-install", file=sys.stderr)
        return 2
    probe = cpu_standins.probe_gpus()
    if not probe.driver_gpus:
        print("polyturn: nvidia-smi lists no GPU: the CPU path (import stand-ins) will be used")
        return 0
    problems = cpu_standins.install_problems(probe)
    for line in problems:
        print(f"polyturn: {line}", file=sys.stderr)
    if problems:
        return 1
    print(f"polyturn: torch sees {probe.torch_gpus} of {probe.driver_gpus} GPU(s) ({probe.versions()}); "
          f"imports ok: {', '.join(cpu_standins.GPU_IMPORTS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
