"""SGLang's own engine, on this machine's device, against transformers on the same checkpoint.

Contracts: greedy ids equal transformers' greedy `generate`; logprobs of sampled tokens agree; weight
updates (tensor and disk) change what is served and bump the version; aborts end a request with
finish_reason "abort"; on CPU the import stand-ins are in use in the engine's subprocesses and are
never called.
"""
from __future__ import annotations

import asyncio
import time
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cpu_standins
from tests.conftest import STANDIN_LOG

PROMPTS = ["Tom has 3 apples and buys 5 more.", "What is 12 * 7?", '{"name": "calc", "x": 1}', "Hello there"]


def _hf_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    ids = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[tok].item() for step, tok in zip(out.logits, ids)]
    return ids, logprobs


@pytest.mark.integration
def test_greedy_ids_and_logprobs_match_transformers(sglang_engine, tiny_model_dir):
    """SGLang greedy output ids == transformers' greedy generate; sampled-token logprobs within 1e-3."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
               for p in PROMPTS]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]

    async def run():
        return await asyncio.gather(*[
            sglang_engine.generate(ids, {"max_new_tokens": 12, "temperature": 0.0}, f"parity-{i}")
            for i, ids in enumerate(prompt_ids)])

    results = asyncio.run(run())
    for ids, res in zip(prompt_ids, results):
        hf_ids, hf_logprobs = _hf_greedy(tiny_model_dir, ids, len(res.output_ids))
        assert res.output_ids == hf_ids[: len(res.output_ids)]
        assert len(res.output_logprobs) == len(res.output_ids)
        assert max(abs(a - b) for a, b in zip(res.output_logprobs, hf_logprobs)) < 1e-3
    assert len({tuple(r.output_ids) for r in results}) > 1, "the tiny model should not answer every prompt alike"


def load_tensors(engine, named_tensors, *, weight_version: int) -> None:
    """Load HF-named full tensors as the tensor path's senders do: one session, one bucket serialized by handle for
    every engine TP rank (`megatron_workers.shared_tensors.serialize`), closed under `weight_version`."""
    from megatron_workers.shared_tensors import serialize

    payload = serialize(list(named_tensors))
    engine.begin_weight_update()
    engine.update_weights_from_serialized([payload] * engine.tp_size)
    engine.finish_weight_update(weight_version=weight_version)


@pytest.mark.integration
def test_weight_update_from_tensor_then_disk_restores(sglang_engine, tiny_model_dir):
    """A tensor update changes what is served and its version, and drops the prefix cache of the old weights;
    reloading the checkpoint restores greedy ids."""
    from safetensors.torch import load_file

    params = {"max_new_tokens": 10, "temperature": 0.0}
    before = asyncio.run(sglang_engine.generate([5, 6, 7, 8], params, "wu-before"))
    assert asyncio.run(sglang_engine.generate([5, 6, 7, 8], params, "wu-cached")).meta["cached_tokens"] > 0
    v0 = sglang_engine.weight_version
    state = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    load_tensors(sglang_engine, [(k, v + 0.05 * torch.randn(v.shape, generator=gen)) for k, v in state.items()],
                 weight_version=v0 + 1)
    after = asyncio.run(sglang_engine.generate([5, 6, 7, 8], params, "wu-after"))
    assert after.weight_version == v0 + 1 == sglang_engine.weight_version
    assert after.meta["cached_tokens"] == 0, "the prompt's KV cached under the old weights was served after the update"
    assert after.output_logprobs != before.output_logprobs

    sglang_engine.update_weights_from_disk(str(tiny_model_dir), weight_version=v0 + 2)
    restored = asyncio.run(sglang_engine.generate([5, 6, 7, 8], params, "wu-restored"))
    assert restored.output_ids == before.output_ids
    assert restored.weight_version == v0 + 2


@pytest.mark.integration
def test_weight_checksums_are_the_checkpoints_in_a_process_that_imported_megatron(sglang_engine, tiny_model_dir):
    """The weight probe (`rollout.check_weights`) answers the checkpoint's per-tensor [sum, abs_sum, sum_sq] from a
    process that imported megatron.core, which (since 0.19) replaces `torch.storage._load_from_bytes` with its own: a
    CPU tensor pickled there is refused by SGLang's safe unpickler and its scheduler dies."""
    from safetensors.torch import load_file

    import megatron.core  # noqa: F401 - the replacement happens on import
    from megatron_workers.weights import tensor_stats

    served = sglang_engine.weight_checksums()
    state = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert served and set(served) <= set(state)
    for name, stats in served.items():
        assert stats == pytest.approx(tensor_stats(state[name]), rel=1e-6), name


@pytest.mark.integration
def test_abort_mid_generation(sglang_engine):
    """An aborted request returns what it had, with finish_reason "abort"; the engine keeps serving."""
    async def run():
        task = asyncio.create_task(sglang_engine.generate(
            [9, 10, 11], {"max_new_tokens": 2000, "temperature": 1.0, "ignore_eos": True}, "to-abort"))
        while sglang_engine.num_inflight == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        await sglang_engine.abort("to-abort")
        aborted = await asyncio.wait_for(task, timeout=60)
        after = await sglang_engine.generate([9, 10, 11], {"max_new_tokens": 4, "temperature": 0.0}, "after-abort")
        return aborted, after

    aborted, after = asyncio.run(run())
    assert aborted.finish_reason == "abort"
    assert len(aborted.output_ids) < 2000
    assert len(after.output_ids) == 4 and after.finish_reason == "length"
    assert sglang_engine.num_inflight == 0


@pytest.mark.integration
def test_idle_engine_leaves_the_cpu_to_the_trainer_and_wakes_for_a_request(sglang_engine):
    """Contract: between rollouts the engine's processes sleep (SGLang's sleep_on_idle) instead of polling at 100%
    of a core, which the trainer's ranks on the same machine need; a request still gets its answer right away."""
    import psutil

    procs = [psutil.Process(p.pid) for p in sglang_engine._procs]
    time.sleep(1.0)  # whatever ran before has finished
    before = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
    time.sleep(3.0)
    used = sum(p.cpu_times().user + p.cpu_times().system for p in procs) - before
    assert used < 0.75, f"idle engine processes used {used:.2f} CPU-seconds in 3 s"  # polling would take ~3
    out = asyncio.run(sglang_engine.generate([9, 10, 11], {"max_new_tokens": 4, "temperature": 0.0}, "after-idle"))
    assert len(out.output_ids) == 4


@pytest.mark.integration
@pytest.mark.skipif(cpu_standins.gpu_present(), reason="stand-ins are only used without a GPU")
def test_standins_used_by_engine_processes_and_never_called(sglang_engine):
    """Across engine start, generation with logprobs and a weight update, the stand-ins were imported by the
    engine's own subprocesses and none of their functions ran."""
    res = asyncio.run(sglang_engine.generate([1, 2, 3], {"max_new_tokens": 3, "temperature": 0.0}, "standin-check"))
    assert len(res.output_logprobs) == 3
    events = recorded_events(STANDIN_LOG)
    import_pids = {line.split()[-1] for line in events if line.startswith("import sgl_kernel")}
    assert import_pids - {str(os.getpid())}, f"no engine subprocess imported the stand-in: {events}"
    assert [line for line in events if line.startswith("call")] == []


@pytest.mark.unit
def test_standin_fails_loudly_and_records(tmp_path):
    """Using a stand-in for real raises and is recorded; flash_mla's stand-in raises ImportError (not OSError)."""
    log = tmp_path / "events.log"
    code = (
        "import sgl_kernel\n"
        "try:\n    sgl_kernel.copy_all_layer_kv_cache_cpu(1)\nexcept RuntimeError as e:\n    print('raised', e)\n"
        "from sgl_kernel.scalar_type import scalar_types\nprint('scalar_type real', scalar_types.int8)\n"
        "try:\n    import flash_mla\nexcept ImportError:\n    print('flash_mla ImportError')\n"
        "try:\n    from sgl_kernel import some_kernel_that_is_not_there\nexcept ImportError:\n    print('missing name ImportError')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(cpu_standins.STANDIN_DIR), "POLYTURN_STANDIN_LOG": str(log)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "raised sgl_kernel.copy_all_layer_kv_cache_cpu was called" in out.stdout
    assert "scalar_type real" in out.stdout
    assert "flash_mla ImportError" in out.stdout and "missing name ImportError" in out.stdout
    events = recorded_events(log)
    assert any(e.startswith("call sgl_kernel.copy_all_layer_kv_cache_cpu") for e in events)


@pytest.mark.unit
@pytest.mark.skipif(cpu_standins.gpu_present(), reason="the CPU adapter only changes kwargs without a GPU")
def test_cpu_adapter_selects_cpu_engine_and_bounds_kv_cache():
    """Without a GPU the engine kwargs select SGLang's CPU engine and always bound the KV cache."""
    from rollout import sglang_cpu

    given = {"attention_backend": "flashinfer", "dtype": "float32"}
    kwargs = sglang_cpu.engine_kwargs_for_this_machine(given)
    assert given == {"attention_backend": "flashinfer", "dtype": "float32"}
    assert kwargs["device"] == "cpu" and kwargs["attention_backend"] == "torch_native"
    assert kwargs["max_total_tokens"] == sglang_cpu.CPU_DEFAULT_MAX_TOTAL_TOKENS
    assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
    assert str(cpu_standins.STANDIN_DIR) in os.environ["PYTHONPATH"].split(os.pathsep)
    assert sglang_cpu.engine_kwargs_for_this_machine({"max_total_tokens": 512})["max_total_tokens"] == 512


def recorded_events(log_path: str | os.PathLike) -> list[str]:
    """Stand-in events recorded in `log_path` (POLYTURN_STANDIN_LOG): 'import <module> <pid>' and
    'call <module.function> <pid>' lines."""
    p = Path(log_path)
    return p.read_text().splitlines() if p.exists() else []
