"""CPU adapter contract: Megatron-Core is adapted by one explicit call at a process's start
(`megatron_workers.cpu_compat.apply_cpu_compat()`), never as an import side effect; importing the
Megatron modules without it fails loudly, naming the call. SGLang's deterministic inference on CPU comes from
rollout/sglang_cpu.py's plug-in: a MurmurHash3 op for seeded sampling and row-by-row matrix products."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import cpu_standins

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(cpu_standins.gpu_present(), reason="the adapter changes nothing with a GPU")]

REPO = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_megatron_import_before_the_call_fails_naming_it_and_one_call_adapts_the_process():
    code = ("try:\n"
            "    import megatron_workers.model\n"
            "except ImportError as e:\n"
            "    print('REFUSED' if 'cpu_compat.apply_cpu_compat()' in str(e) else 'OTHER')\n"
            "from megatron_workers import cpu_compat\n"
            "backend = cpu_compat.apply_cpu_compat()\n"
            "import torch, megatron_workers.actor, megatron.core.utils as u\n"
            "print(backend, torch.cuda.current_device(), u.torch.zeros(1, device='cuda').device,\n"
            "      cpu_compat.apply_cpu_compat())")
    out = _python(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["REFUSED", "gloo", "cpu", "cpu", "gloo"]


def _murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """Textbook MurmurHash3_x86_32 over bytes (an independent reference for the torch op)."""
    mask, h = 0xFFFFFFFF, seed
    rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & mask  # noqa: E731
    for i in range(0, len(data) - len(data) % 4, 4):
        k = rotl((int.from_bytes(data[i:i + 4], "little") * 0xCC9E2D51) & mask, 15) * 0x1B873593 & mask
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & mask
    tail = data[len(data) - len(data) % 4:]
    if tail:
        h ^= rotl((int.from_bytes(tail, "little") * 0xCC9E2D51) & mask, 15) * 0x1B873593 & mask
    h ^= len(data)
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = ((h ^ (h >> shift)) * mult) & mask
    return h ^ (h >> 16)


def test_seeded_sampling_hash_op_is_murmur3_of_seed_position_and_column():
    """Contract: `sgl_kernel::murmur_hash32_cpu` (SGLang's CPU op for seeded sampling, which only sgl-kernel's CPU
    build ships) hashes each (seed, position, column) as MurmurHash3 of four little-endian 32-bit words, the words
    SGLang's GPU kernel hashes, for any 64-bit seed."""
    import struct

    import torch

    from rollout import sglang_cpu

    assert _murmur3_x86_32(b"hello") == 0x248BFA47 and _murmur3_x86_32(b"", 1) == 0x514E28B7  # published vectors
    sglang_cpu._define_murmur_hash32_cpu()
    seeds, positions = [0, 1, 42, 2**40 + 12345, 2**63 - 1, 2**64 - 5], [0, 5, 100, 2**31 + 7, 77, 3]
    out = torch.ops.sgl_kernel.murmur_hash32_cpu.default(torch.tensor(seeds, dtype=torch.uint64),
                                                         torch.tensor(positions), torch.arange(64))
    assert out.dtype == torch.uint32 and out.shape == (6, 64)
    expected = [[_murmur3_x86_32(struct.pack("<IIII", s & 0xFFFFFFFF, s >> 32, p, c)) for c in range(64)]
                for s, p in zip(seeds, positions)]
    assert out.to(torch.int64).tolist() == expected


def test_cpu_batch_invariant_matrix_products_compute_each_row_alone():
    """Contract: the matrix products installed for deterministic inference on CPU give each row what it gets alone
    (bit for bit), whatever the number of rows, and agree with torch's."""
    import torch

    from rollout import sglang_cpu

    g = torch.Generator().manual_seed(0)
    a, b, bias = torch.randn(9, 48, generator=g), torch.randn(48, 80, generator=g), torch.randn(80, generator=g)
    mm, addmm = sglang_cpu._mm_by_rows(a, b), sglang_cpu._addmm_by_rows(bias, a, b, beta=0.5, alpha=2.0)
    for i in range(9):
        assert torch.equal(mm[i], sglang_cpu._mm_by_rows(a[i:i + 1], b)[0])
        assert torch.equal(addmm[i], sglang_cpu._addmm_by_rows(bias, a[i:i + 1], b, beta=0.5, alpha=2.0)[0])
    torch.testing.assert_close(mm, a @ b)
    torch.testing.assert_close(addmm, torch.addmm(bias, a, b, beta=0.5, alpha=2.0))
    assert sglang_cpu._mm_by_rows(a[:0], b).shape == (0, 80)


def test_sglang_loads_the_cpu_plugin_and_it_acts_only_on_an_adapted_engine():
    """Contract: polyturn's SGLang plug-in is registered under SGLang's general-plugin entry point, and in a process
    whose engine was not adapted to CPU it registers nothing."""
    from importlib.metadata import entry_points

    assert [ep.value for ep in entry_points(group="sglang.srt.plugins") if ep.name == "polyturn_cpu"] == \
        ["rollout.sglang_cpu:sglang_plugin"]
    out = _python("import os\n"
                  "os.environ.pop('POLYTURN_SGLANG_CPU', None)\n"
                  "from rollout import sglang_cpu\n"
                  "import cpu_standins; cpu_standins.activate()\n"
                  "from sglang.srt.plugins.hook_registry import HookRegistry\n"
                  "sglang_cpu.sglang_plugin(); print(len(HookRegistry._hooks))\n"
                  "os.environ['POLYTURN_SGLANG_CPU'] = '1'\n"
                  "sglang_cpu.sglang_plugin(); print(sorted(HookRegistry._hooks))")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == [
        "0", "['sglang.srt.model_executor.model_runner.ModelRunner.maybe_enable_batch_invariant_mode']"]
