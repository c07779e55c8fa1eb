"""An offloaded Megatron worker between training phases: what reads or writes its parameters brings them back first.

On a GPU, `offload` empties the device storage the parameters are views of (`runner._move_storage`), so a
weight sync or a checkpoint that touched them there would read freed memory. In hybrid placement the
trainer syncs right after that offload (tests/test_colocate.py). On a CPU offloading moves no bytes, so this
test records the moves around each reader, in order.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_syncs_checkpoints_and_exports_of_an_offloaded_actor_bring_its_params_back_then_offload_them(
        world_of_one, tiny_model_dir, tmp_path, monkeypatch):
    from megatron_workers import checkpoint, model as mmodel
    from megatron_workers.actor import MegatronActor
    from megatron_workers.config import ActorConfig, OptimConfig
    from megatron_workers.sync_plan import SyncPlan

    actor = MegatronActor(tiny_model_dir, ActorConfig(optim=OptimConfig(lr=1e-5, use_distributed_optimizer=False)))
    events: list = []

    def recorded(name, fn):
        def wrapper(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)
        return wrapper

    real_move = actor._move
    monkeypatch.setattr(actor, "_move", lambda what, to_host: (
        events.append(("offload" if to_host else "onload", sorted(k for k, v in what.items() if v))),
        real_move(what, to_host))[1])
    monkeypatch.setattr(actor._weight_sender, "send", recorded("export", actor._weight_sender.send))
    monkeypatch.setattr(checkpoint, "save_rank", recorded("save", checkpoint.save_rank))
    monkeypatch.setattr(checkpoint, "load_rank", recorded("load", checkpoint.load_rank))
    monkeypatch.setattr(checkpoint, "export_hf", recorded("export_hf", checkpoint.export_hf))  # the disk sync's
    monkeypatch.setattr(mmodel, "export_hf_state_dict", recorded("hf_state_dict", mmodel.export_hf_state_dict))
    plan = SyncPlan(transport="none", bucket_bytes=1 << 20, dtype="float32", key="offloaded", checksums=False)

    resident = actor.send_weights(plan)
    assert events == ["export"], "a resident actor moves nothing"
    events.clear()

    actor.offload(params=True, grads=True, optimizer=True)
    sent = actor.send_weights(plan)
    actor.save_checkpoint(str(tmp_path / "ckpt"))
    actor.load_checkpoint(str(tmp_path / "ckpt"))
    actor.export_hf(str(tmp_path / "hf"))
    actor.hf_state_dict()
    actor.onload()
    expected = [("offload", ["grads", "optimizer", "params"])]
    for steps in (["export"], ["save"], ["load"], ["export_hf", "hf_state_dict"], ["hf_state_dict"]):  # export_hf
        expected += [("onload", ["params"]), *steps, ("offload", ["params"])]  # gathers the state dict too
    expected.append(("onload", ["grads", "optimizer", "params"]))
    assert events == expected
    assert sent["bytes"] == resident["bytes"] > 0
