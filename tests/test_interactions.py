"""Interaction plug-in contract, YAML registry and routing, finalize guarantees, GSM8K and tutor built-ins."""

from __future__ import annotations

import asyncio
import importlib
import sys
from pathlib import Path

import pytest
import yaml

from rollout.interactions import BaseInteraction, InteractionConfigError, InteractionRegistry
from rollout.interactions.gsm8k import solution_steps

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "tool_configs" / "gsm8k_interaction_config.yaml"

# Written by a user against the documented BaseInteraction signature only.
USER_MODULE = '''
from rollout.interactions import BaseInteraction

LOG = []

class EchoUserInteraction(BaseInteraction):
    """Repeats the assistant's last words back; ends after `turns` user turns."""

    def __init__(self, config):
        super().__init__(config)
        self.turns = {}

    async def start_interaction(self, instance_id=None, **kwargs):
        instance_id = await super().start_interaction(instance_id)
        self.turns[instance_id] = 0
        LOG.append(("start", instance_id, kwargs))
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        self.turns[instance_id] += 1
        done = self.turns[instance_id] >= self.config.get("turns", 2)
        return done, "you said: " + messages[-1]["content"], 0.5 * self.turns[instance_id], {"n": self.turns[instance_id]}

    async def calculate_score(self, instance_id, **kwargs):
        return float(self.turns[instance_id])

    async def finalize_interaction(self, instance_id, **kwargs):
        LOG.append(("finalize", instance_id))
        del self.turns[instance_id]


class BrokenInteraction(BaseInteraction):
    async def generate_response(self, instance_id, messages, **kwargs):
        raise KeyError("ground_truth")


class NotAnInteraction:
    pass
'''

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
    "#### 72"
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_interactions.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("user_interactions", None)
    return importlib.import_module("user_interactions")


def chat(*assistant_texts: str) -> list[dict]:
    messages = [
        {"role": "user", "content": "Natalia sold clips to 48 friends in April, and half as many in May. How many?"}
    ]
    for text in assistant_texts:
        messages.append({"role": "assistant", "content": text})
    return messages


@pytest.mark.unit
def test_user_interaction_via_yaml_full_lifecycle(tmp_path, user_module):
    """Contract: an interaction written against the documented signature loads from verl's YAML and runs
    start -> generate_response (should_terminate, text, score, metadata) -> calculate_score -> finalize."""
    path = tmp_path / "interaction.yaml"
    path.write_text(
        yaml.safe_dump(
            {"interaction": [{"class_name": "user_interactions.EchoUserInteraction", "config": {"turns": 2}}]}
        )
    )
    registry = InteractionRegistry.from_config(path)
    assert registry.names == ["echouser"]  # verl's default name: class name without "Interaction", lower-cased
    runner = registry.route({"name": "echouser", "topic": "math"})

    async def go():
        async with runner.session(**{"topic": "math"}) as iid:
            first = await runner.respond(iid, [{"role": "assistant", "content": "hello"}])
            second = await runner.respond(iid, [{"role": "assistant", "content": "bye"}])
            return iid, first, second, await runner.calculate_score(iid)

    iid, first, second, score = asyncio.run(go())
    assert (first.should_terminate, first.text, first.score, first.metadata) == (
        False,
        "you said: hello",
        0.5,
        {"n": 1},
    )
    assert (second.should_terminate, second.text, second.score) == (True, "you said: bye", 1.0)
    assert score == 2.0
    assert user_module.LOG == [("start", iid, {"topic": "math"}), ("finalize", iid)]
    assert registry.counts() == {"echouser": (1, 1)}


@pytest.mark.unit
def test_name_defaults_and_single_interaction_routing(user_module):
    """`name` defaults from the class as verl derives it (Gsm8kInteraction -> gsm8k, Gsm8kTutorInteraction ->
    gsm8ktutor); with one interaction a sample may omit the name."""
    from rollout.interactions.gsm8k import Gsm8kInteraction, Gsm8kTutorInteraction

    score_fn = {"score_fn": "recipe.tasks.gsm8k.compute_score"}
    assert Gsm8kInteraction(score_fn).name == "gsm8k" and Gsm8kTutorInteraction(score_fn).name == "gsm8ktutor"
    assert Gsm8kInteraction({"name": "grader", **score_fn}).name == "grader"
    registry = InteractionRegistry.from_config(
        {"interaction": [{"class_name": "user_interactions.EchoUserInteraction"}]}
    )
    assert registry.route({}).name == "echouser" and registry.route(None).name == "echouser"


@pytest.mark.unit
def test_unknown_interaction_name_refused_at_validation_with_known_names():
    """Routing: a sample naming an unknown interaction is refused by validate_sample, listing the known names;
    with several interactions a sample without a name is refused too."""
    registry = InteractionRegistry.from_config(CONFIG)
    assert registry.names == ["gsm8k", "gsm8k_tutor"]
    registry.validate_sample({"name": "gsm8k_tutor", "ground_truth": "72"})
    with pytest.raises(
        InteractionConfigError,
        match=r"'gsm8k_teacher' is not registered; known interactions: \['gsm8k', 'gsm8k_tutor'\]",
    ):
        registry.validate_sample({"name": "gsm8k_teacher"})
    with pytest.raises(InteractionConfigError, match="has no 'name'"):
        registry.validate_sample({"ground_truth": "72"})


@pytest.mark.unit
@pytest.mark.parametrize(
    "entries, message",
    [
        (
            [{"class_name": "user_interactions.NotAnInteraction"}],
            r"interaction\[0\]\.class_name: .*NotAnInteraction lacks \[.start_interaction.",
        ),
        ([{"class_name": "nowhere.Thing"}], r"interaction\[0\]\.class_name: cannot import module 'nowhere'"),
        (
            [
                {"name": "a", "class_name": "user_interactions.EchoUserInteraction"},
                {"name": "a", "class_name": "user_interactions.EchoUserInteraction"},
            ],
            "two interactions are named 'a'",
        ),
        (
            [{"class_name": "user_interactions.EchoUserInteraction", "kwargs": {}}],
            r"interaction\[0\]: unknown keys \['kwargs'\]",
        ),
        (
            [{"class_name": "rollout.interactions.gsm8k.Gsm8kInteraction", "config": {"max_user_turns": 0, "score_fn": "recipe.tasks.gsm8k.compute_score"}}],
            r"interaction\[0\]: building Gsm8kInteraction failed: .*max_user_turns must be >= 1",
        ),
    ],
)
def test_bad_interaction_yaml_refused_at_load(tmp_path, user_module, entries, message):
    """YAML errors name the file, the entry and the fix, at load."""
    path = tmp_path / "i.yaml"
    path.write_text(yaml.safe_dump({"interaction": entries}))
    with pytest.raises(InteractionConfigError, match=message):
        InteractionRegistry.from_config(path)


@pytest.mark.unit
def test_raising_interaction_ends_turn_with_error_and_is_finalized(user_module):
    """Fault: an interaction that raises gives a terminating turn with `error`; finalize is still called."""
    registry = InteractionRegistry.from_config({"interaction": [{"class_name": "user_interactions.BrokenInteraction"}]})
    runner = registry.route(None)

    async def go():
        async with runner.session() as iid:
            return await runner.respond(iid, chat("72"))

    turn = asyncio.run(go())
    assert turn.should_terminate and turn.error == "KeyError: 'ground_truth'" and turn.text == ""
    assert registry.counts() == {"broken": (1, 1)}


@pytest.mark.unit
def test_hung_interaction_times_out_and_cancelled_trajectories_finalize(user_module):
    """Fault: generate_response past timeout_s ends the turn with an error; trajectories cancelled
    mid-turn (rollout abort) still finalize every started instance."""

    class Sleepy(BaseInteraction):
        async def generate_response(self, instance_id, messages, **kwargs):
            await asyncio.sleep(60)

    registry = InteractionRegistry([Sleepy({"timeout_s": 0.1})])
    runner = registry.route(None)

    async def trajectory():
        async with runner.session() as iid:
            return await runner.respond(iid, chat("1"))

    turn = asyncio.run(trajectory())
    assert turn.should_terminate and turn.error == "timeout after 0.1s"

    runner.timeout_s = 30.0

    async def abort_all():
        tasks = [asyncio.create_task(trajectory()) for _ in range(5)]
        await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.01)

    asyncio.run(abort_all())
    assert registry.counts() == {"sleepy": (6, 6)} and runner.live_instances == set()


@pytest.mark.unit
def test_gsm8k_interaction_retries_until_correct():
    """GSM8K interaction: a wrong answer gets verl's retry feedback (not terminating); a correct one ends with 1.0."""
    runner = InteractionRegistry.from_config(CONFIG).route({"name": "gsm8k"})

    async def go():
        async with runner.session(ground_truth="72") as iid:
            wrong = await runner.respond(iid, chat("She sold 70 clips."))
            right = await runner.respond(iid, chat("She sold 70 clips.", "48 + 24 = 72\n#### 72"))
            return wrong, right, await runner.calculate_score(iid)

    wrong, right, score = asyncio.run(go())
    assert not wrong.should_terminate and wrong.score == 0.0 and "incorrect" in wrong.text
    assert right.should_terminate and right.score == 1.0 and right.text == "Your response is correct!"
    assert score == 1.0


@pytest.mark.unit
def test_gsm8k_interaction_stops_after_max_user_turns():
    """GSM8K interaction: after `max_user_turns` wrong answers it terminates by itself (score 0)."""
    runner = InteractionRegistry.from_config(CONFIG).route({"name": "gsm8k"})

    async def go():
        async with runner.session(ground_truth="72") as iid:
            return [await runner.respond(iid, chat(f"#### {n}")) for n in (1, 2, 3)]

    turns = asyncio.run(go())
    assert [t.should_terminate for t in turns] == [False, False, True]
    assert turns[-1].metadata == {"user_turn": 3} and "out of attempts" in turns[-1].text


@pytest.mark.unit
def test_tutor_reveals_reference_steps_in_order_and_samples_mix_interactions():
    """Tutor interaction: each wrong answer reveals the next reference step (calculator notes removed);
    one batch routes samples to different interactions by interaction_kwargs.name."""
    assert solution_steps(GSM8K_SOLUTION) == [
        "Natalia sold 48/2 = 24 clips in May.",
        "Natalia sold 48+24 = 72 clips altogether in April and May.",
    ]
    registry = InteractionRegistry.from_config(CONFIG)
    samples = [
        {"name": "gsm8k_tutor", "ground_truth": "72", "solution": GSM8K_SOLUTION},
        {"name": "gsm8k", "ground_truth": "72"},
    ]

    async def run_sample(kwargs):
        runner = registry.route(kwargs)
        async with runner.session(**kwargs) as iid:
            return [await runner.respond(iid, chat(f"#### {n}")) for n in (10, 20)]

    async def go():
        return await asyncio.gather(*(run_sample(s) for s in samples))

    tutor_turns, grader_turns = asyncio.run(go())
    assert [t.text for t in tutor_turns] == [
        "Not quite. Hint: Natalia sold 48/2 = 24 clips in May.",
        "Not quite. Hint: Natalia sold 48+24 = 72 clips altogether in April and May.",
    ]
    assert all("reflect on your answer" in t.text for t in grader_turns)
    assert registry.counts() == {"gsm8k": (1, 1), "gsm8k_tutor": (1, 1)}


@pytest.mark.unit
def test_tutor_requires_reference_solution():
    """The tutor refuses a sample without interaction_kwargs.solution, naming the missing key."""
    runner = InteractionRegistry.from_config(CONFIG).route({"name": "gsm8k_tutor"})
    async def go():
        async with runner.session(ground_truth="72"):
            pass

    with pytest.raises(ValueError, match="interaction_kwargs.solution"):
        asyncio.run(go())
    assert runner.num_opened == 0
