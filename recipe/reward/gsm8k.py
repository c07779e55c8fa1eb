"""GSM8K answer scoring: the one scorer the outcome reward, the gsm8k tool and the gsm8k interaction share.

verl's default semantics: the solution is cut to its last 300 characters, `strict` takes the
number after the last `####` (GSM8K's answer format) and scores 0 when there is none (a format
miss); `flexible` (opt-in) takes the last number anywhere. A found answer scores `score` when
it equals the ground truth, else `format_score`.

Where it departs from verl's `gsm8k.compute_score`: numbers are compared by value after
dropping `$`, `,` and a trailing `.` ("1,000" == "1000" == "1000.00"; verl compares the
strings), and `#### 72` and `####72` both count. A ground truth that is not a number is
compared as text (it never raises: a bad row scores 0, it does not stop the run). The rollout's
gsm8k tool and interaction receive this function by dotted path from their YAML
(`recipe.reward.gsm8k.compute_score`); the rollout never imports it.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

DATA_SOURCES = ("openai/gsm8k", "gsm8k")
METHODS = ("strict", "flexible")
CLIP_CHARS = 300  # only the end of a solution is searched, as in verl

_STRICT = re.compile(r"#### *(-?\$?[0-9][0-9.,]*)")
_NUMBER = re.compile(r"-?\$?[0-9][0-9.,]*|-?\.[0-9]+")


def normalize_number(text: str) -> str | None:
    """`"$1,000."` -> `"1000"`; None when the text is not a finite number."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    normalized = format(value.normalize(), "f")
    return "0" if normalized in {"-0", "0"} else normalized


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer among the last CLIP_CHARS characters, normalized; None when there is none."""
    if method not in METHODS:
        raise ValueError(f"unknown gsm8k extraction method {method!r}; use one of {METHODS}")
    tail = solution_str[-CLIP_CHARS:]
    matches = (_STRICT if method == "strict" else _NUMBER).findall(tail)
    for candidate in reversed(matches):
        number = normalize_number(candidate)
        if number is not None:
            return number
    return None


def compute_score(solution_str: str, ground_truth: object, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """`score` if the answer equals `ground_truth`, `format_score` if an answer was found but differs, 0.0 if none."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    truth = str(ground_truth).strip()
    return score if answer == (normalize_number(truth) or truth) else format_score
