"""verl v0.9's trainer keys that change what a run trains on: `trainer.val_only` (validate, then stop) and
`data.train_max_samples` / `data.val_max_samples` (read only N prompts of a split), as verl does them."""
from __future__ import annotations

import pytest

from recipe.config_schema import ConfigError
from recipe.data.samples import take_samples
from tests.test_colocate import make_trainer

pytestmark = pytest.mark.unit


def test_max_samples_keeps_the_first_n_or_a_seeded_draw():
    """Contract (verl's RLHFDataset): N <= 0 or N >= the rows keeps every row; without shuffle the first N; with
    shuffle N distinct rows drawn by a generator seeded with the run's seed (the same seed draws the same rows, in
    numpy's default_rng(seed).choice order)."""
    rows = list(range(10))
    assert take_samples(rows, -1, shuffle=True, seed=0) == rows
    assert take_samples(rows, 10, shuffle=True, seed=0) == rows
    assert take_samples(rows, 3, shuffle=False, seed=0) == [0, 1, 2]
    drawn = take_samples(rows, 4, shuffle=True, seed=7)
    assert len(set(drawn)) == 4 and drawn == take_samples(rows, 4, shuffle=True, seed=7)
    import numpy as np

    assert drawn == np.random.default_rng(7).choice(10, size=4, replace=False).tolist()
    assert drawn != take_samples(rows, 4, shuffle=True, seed=8)


def test_val_only_validates_once_and_trains_nothing(tmp_path):
    """Contract (verl's val_only): fit runs the validation before training, then returns: no rollout, no update,
    no checkpoint; without the key the same trainer trains its steps."""
    val = tmp_path / "val.parquet"
    val.write_bytes(b"")
    for val_only, want_steps in ((True, 0), (False, 1)):
        (tmp_path / str(val_only)).mkdir()
        trainer, events = make_trainer(tmp_path / str(val_only), [f"data.val_files=[{val}]",
                                                                   f"trainer.val_only={val_only}",
                                                                   "trainer.total_training_steps=1"], colocated=False)
        validated, stepped = [], []
        trainer.validator = object()
        trainer.validate = validated.append
        trainer.step = lambda step, draw: stepped.append(step)
        trainer._end_step = lambda step: None
        trainer.fit(iter([]))
        assert (validated, stepped) == ([0], list(range(1, want_steps + 1)))
        trainer.close()


@pytest.mark.parametrize("overrides", [["trainer.val_only=true"],
                                       ["trainer.val_only=true", "trainer.val_before_train=false"]])
def test_val_only_that_would_validate_nothing_is_refused(tmp_path, overrides):
    """Contract: val_only without data.val_files, or with val_before_train=False, would neither validate nor train:
    refused in one line naming trainer.val_only and what to set."""
    val = tmp_path / "val.parquet"
    val.write_bytes(b"")
    extra = [f"data.val_files=[{val}]"] if "trainer.val_before_train=false" in overrides else []
    with pytest.raises(ConfigError, match=r"trainer.val_only=True validates once .* drop trainer.val_only"):
        make_trainer(tmp_path, [*overrides, *extra], colocated=False)
