"""verl's `trainer.critic_warmup`: steps before it update the critic only, sync no weights and say so in the metrics;
from it on the actor updates and syncs every step (the real `Trainer.step` around recording stand-ins)."""
from __future__ import annotations

import pytest

from recipe import launch
from recipe.config_schema import ConfigError
from tests.test_colocate import make_trainer, prompts


@pytest.mark.unit
def test_critic_only_steps_before_critic_warmup(tmp_path):
    """Contract: with trainer.critic_warmup=3 (algorithm gae), steps 1 and 2 update the critic only (no
    update_policy, no weight sync, version unchanged, `trainer/actor_updated` 0, no actor metrics); step 3 updates
    both and syncs version 1 (verl's `critic_warmup <= global_steps`)."""
    trainer, events = make_trainer(tmp_path, ["trainer.critic_warmup=3"], colocated=False)
    logged = []
    for step in (1, 2, 3):
        events.clear()
        logged.append(trainer.step(step, prompts))
        updates = [e for e in events if e.endswith(("update_critic", "update_policy")) or e.startswith("sync")]
        if step < 3:
            assert updates == ["critic.update_critic"], f"step {step}: {updates}"
            assert trainer.weight_version == 0
        else:
            assert updates == ["critic.update_critic", "actor.update_policy", "sync v1"]
            assert trainer.weight_version == 1
    assert [m["trainer/actor_updated"] for m in logged] == [0.0, 0.0, 1.0]
    assert "actor/loss" not in logged[0] and "timing/sync_weights_s" not in logged[0] and "critic/loss" in logged[0]
    assert "actor/loss" in logged[2] and "timing/sync_weights_s" in logged[2]
    trainer.close()


@pytest.mark.unit
def test_critic_warmup_without_a_critic_is_refused(tmp_path):
    """Contract: a warm-up longer than one step with no critic to warm up (GRPO) is refused at start, naming the key
    and the fix, as are negative values; verl's launch-line value 0 is taken as it is."""
    data = tmp_path / "train.parquet"
    data.write_bytes(b"")
    base = ["--config-name", "cpu_tiny", f"data.train_files=[{data}]"]
    assert launch.load([*base, "trainer.critic_warmup=0"])[0].trainer.critic_warmup == 0
    with pytest.raises(ConfigError, match=r"trainer.critic_warmup=5 warms up a critic.*adv_estimator=gae"):
        launch.load([*base, "trainer.critic_warmup=5"])
    with pytest.raises(ConfigError, match="trainer.critic_warmup is -1"):
        launch.load([*base, "trainer.critic_warmup=-1", "algorithm.adv_estimator=gae"])
