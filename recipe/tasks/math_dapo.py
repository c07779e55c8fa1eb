"""DAPO math (DAPO-Math-17k and the AIME sets): the scorer verl's default uses for its `math_dapo` sources.

Rows come from the DAPO recipe's parquet files (data_source "math_dapo", the AIME test sets under
sources starting with "aime"); no preprocessing lives here.

Scoring (`compute_score`) is verl's `reward_score.math_dapo` rule (Minerva's): only the last 300
characters of the response are read; the answer is the rest of the line after the last
`Answer:` (any case, spaces allowed around the colon; "[INVALID]" when there is none). Answer and
ground truth are both normalized (`normalize_answer`: the part after the last `=`, spaces, `\\text{}`
and `\\textbf{}` wrappers, `$`, unit words such as "degrees" or "cm" and a list of other fillers
dropped, `\\frac12` -> `\\frac{1}{2}`, `\\sqrt2` -> `\\sqrt{2}`, `1,000` -> `1000`) and compared as
text. With `strict_box_verify=True` the answer is instead the last `\\boxed{...}` of the final 100
characters (or of those from 100 before the last pause token, `pause_tokens_index`), compared
unnormalized.

Returns verl's dict: `score` 1.0 when equal else -1.0 (a missing answer is wrong, not neutral),
`acc` (bool) and `pred` (the normalized answer; the raw boxed text, or None, under
`strict_box_verify`). Departs from verl: a ground truth that is not text is compared as `str()` of it
(verl stops with an error).
"""
from __future__ import annotations

import re
from typing import Any

DATA_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
"""verl's DAPO-math data sources (v0.9 `default_compute_score`)."""
DATA_SOURCE_PREFIXES = ("aime",)
"""verl also scores every data source starting with "aime" this way (aime24, aime_2025, ...)."""
VERL_ALIASES = {"verl.utils.reward_score.math_dapo.compute_score": f"{__name__}.compute_score"}
"""verl's DAPO-math scorer."""

TAIL_CHARS = 300  # only the end of a response is read, as in verl
BOX_TAIL_CHARS = 100  # ... and under strict_box_verify only its last 100 characters
NO_ANSWER = "[INVALID]"
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# (old, new) in this order, then every filler below removed, in this order
_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
            (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_FILLERS = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
            ",\\!", "{,}", '"', "\\dots")
# (pattern, replacement) in this order: keep what is inside the first $...$, unwrap text-like macros, brace
# one-character \frac and \sqrt arguments
_REWRITE = ((re.compile(r".*?\$(.*?)\$.*"), r"$\1$"), (re.compile(r"\\text\{(.*?)\}"), r"\1"),
            (re.compile(r"\\textbf\{(.*?)\}"), r"\1"), (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
            (re.compile(r"\\boxed\{(.*)\}"), r"\1"), (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),
            (re.compile(r"sqrt([^{])"), r"sqrt{\1}"))


def normalize_answer(answer: str) -> str:
    """A final answer in the form DAPO compares (see the module docstring)."""
    answer = answer.split("=")[-1]
    for old, new in _REPLACE:
        answer = answer.replace(old, new)
    for filler in _FILLERS:
        answer = answer.replace(filler, "")
    for pattern, replacement in _REWRITE:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def last_boxed(text: str) -> str | None:
    """What is inside the last `\\boxed{...}` of `text` (braces matched); None when there is none or it is open."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0 and text[i] == "}":
            return text[start + len("\\boxed{"):i]
    return None


def _boxed_answer(tail: str, pause_tokens_index: list[int] | None) -> str | None:
    """The strict-box answer: the last boxed one near the end (or near the last pause token)."""
    if pause_tokens_index is None:
        return last_boxed(tail[-BOX_TAIL_CHARS:])
    if len(pause_tokens_index) != 4:
        raise ValueError(f"pause_tokens_index has {len(pause_tokens_index)} entries; verl's DAPO scorer takes 4")
    return last_boxed(tail[pause_tokens_index[-1] - BOX_TAIL_CHARS:])


def compute_score(solution_str: str, ground_truth: object, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> dict[str, Any]:
    """{"score": 1.0 or -1.0, "acc": bool, "pred": the answer read} (see the module docstring)."""
    tail = solution_str[-TAIL_CHARS:]
    truth = str(ground_truth)
    if strict_box_verify:
        pred = _boxed_answer(tail, pause_tokens_index)
        correct = pred == truth
    else:
        found = _ANSWER_LINE.findall(tail)
        pred = normalize_answer(found[-1] if found else NO_ANSWER)
        correct = pred == normalize_answer(truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
