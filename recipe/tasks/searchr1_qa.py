"""Search-R1 question answering (NQ, TriviaQA, PopQA, HotpotQA, 2Wiki, MuSiQue, Bamboogle): verl's exact-match scorer.

Rows come from verl's `examples/data_preprocess/preprocess_search_r1_dataset.py` (data_source
"searchR1_<set>", ground truth `{"target": [answers]}`); the search tool itself is verl's, which
polyturn does not ship (see the README's plug-in table). No preprocessing lives here.

Scoring (`compute_score`) is verl's `reward_score.search_r1_like_qa_em` rule: the answer is the text
inside the last `<answer>...</answer>` of the response (it may span lines), stripped. Answer and
each target are normalized SQuAD-style (lower case, punctuation removed, the words a/an/the removed,
whitespace collapsed) and the answer scores `score` (1.0) when it equals one of the targets, but a
quarter of it when the response has more than 10 `<answer>` or `</answer>` tags (answer spamming);
`format_score` (0.0) when it matches none; 0.0 when there is no answer.

Departs from verl: a ground truth that is plain text or a list of answers, not `{"target": ...}`,
is taken as the targets itself (verl stops with an error); the score is always a float.
"""
from __future__ import annotations

import re
import string

DATA_SOURCES = ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle")
"""verl's Search-R1 data sources (v0.9 `default_compute_score`)."""
VERL_ALIASES = {"verl.utils.reward_score.search_r1_like_qa_em.compute_score": f"{__name__}.compute_score"}
"""verl's Search-R1 exact-match scorer."""

MAX_TAGS = 10  # more answer tags than this divides the score by 4
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLE = re.compile(r"\b(a|an|the)\b")
_NO_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalization: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLE.sub(" ", text.lower().translate(_NO_PUNCTUATION)).split())


def extract_answer(solution_str: str) -> str | None:
    """The stripped text of the last `<answer>...</answer>`; None when there is none."""
    found = _ANSWER.findall(solution_str)
    return found[-1].strip() if found else None


def targets_of(ground_truth: object) -> list[str]:
    """The accepted answers of a row: `ground_truth["target"]` (text or a list of texts), or the ground truth itself."""
    target = ground_truth.get("target") if isinstance(ground_truth, dict) else ground_truth
    return [target] if isinstance(target, str) else [str(t) for t in target]


def compute_score(solution_str: str, ground_truth: object, format_score: float = 0.0, score: float = 1.0) -> float:
    """Exact-match score of the last `<answer>` against the row's targets (see the module docstring)."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    if normalize_answer(answer) not in {normalize_answer(t) for t in targets_of(ground_truth)}:
        return float(format_score)
    spammed = max(solution_str.count("<answer>"), solution_str.count("</answer>")) > MAX_TAGS
    return float(score) / 4 if spammed else float(score)
