"""Qwen3 end to end through weight sync: the tiny-model kit's Qwen3 (q/k norms, head_dim != hidden/heads) is
loaded into Megatron (TP = PP = 1, in this process), its weights are changed, and the stage's streaming export
(`adapters.iter_stage_hf_tensors`, the HF names the sync sends) is loaded into one SGLang engine serving
`Qwen3ForCausalLM`. Its greedy ids then equal transformers' on the same export, and differ before the sync."""
from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import save_file

from megatron_workers import adapters, parallel
from megatron_workers import model as mmodel
from megatron_workers.ports import free_port
from tests.test_sglang_engine import PROMPTS, _hf_greedy, load_tensors

pytestmark = pytest.mark.integration

MAX_NEW_TOKENS = 10


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from recipe.tiny_model import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), arch="qwen3", seed=0)


@pytest.fixture(scope="module")
def qwen3_engine(qwen3_dir):
    from rollout.engines.sglang_engine import SGLangEngine

    engine = SGLangEngine(str(qwen3_dir), name="qwen3-engine", dtype="float32", random_seed=0,
                          max_total_tokens=2048, log_level="error")
    yield engine
    engine.shutdown()


def _prompt_ids(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"] for p in PROMPTS]


def _engine_greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    async def run():
        return await asyncio.gather(*[
            engine.generate(ids, {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0}, f"qwen3-{i}-{id(ids)}")
            for i, ids in enumerate(prompts)])
    return [r.output_ids for r in asyncio.run(run())]


def test_sync_into_sglang_serves_the_megatron_qwen3_weights(dist_backend, qwen3_dir, qwen3_engine, tmp_path):
    """Contract: after a sync of a changed Megatron Qwen3, SGLang greedy-decodes exactly the ids transformers
    does on the exported checkpoint (4 prompts), which are not the ids it served before the sync."""
    hf_config, state = mmodel.load_hf_checkpoint(qwen3_dir)
    prompts = _prompt_ids(qwen3_dir)
    before = _engine_greedy(qwen3_engine, prompts)
    parallel.init_distributed(0, 1, "127.0.0.1", free_port(), tp=1, pp=1, backend=dist_backend, seed=0)
    try:
        gpt = mmodel.build_gpt_model(hf_config)
        adapters.load_hf_weights(gpt, state, hf_config)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # stands in for a training step: every tensor moves, q/k norms included
            for param in gpt.parameters():
                param.mul_(1 + 0.3 * torch.randn(param.shape, generator=gen))
        exported = dict(adapters.iter_stage_hf_tensors(gpt, hf_config))
        load_tensors(qwen3_engine, exported.items(), weight_version=1)
    finally:
        parallel.destroy()
    assert any(name.endswith("q_norm.weight") for name in exported)
    export_dir = tmp_path / "export"
    export_dir.mkdir()
    for path in qwen3_dir.iterdir():
        if path.name != "model.safetensors":
            (export_dir / path.name).write_bytes(path.read_bytes())
    save_file({n: t.contiguous() for n, t in exported.items()}, str(export_dir / "model.safetensors"))

    after = _engine_greedy(qwen3_engine, prompts)
    reference = [_hf_greedy(export_dir, ids, MAX_NEW_TOKENS)[0] for ids in prompts]
    assert after == [ids[: len(got)] for ids, got in zip(reference, after)]
    assert all(len(got) > 0 for got in after)
    assert after != before, "the sync did not change what the engine serves"
