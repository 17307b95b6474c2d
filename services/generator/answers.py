"""Scoring a text task's answers: normalised exact match, as SQuAD's and VQA's evaluations do.

`normalize_answer` lowercases, drops punctuation, drops the articles "a", "an" and "the" and
collapses whitespace (SQuAD v1.1's `normalize_answer`); an answer is right when its normal form
equals the reference's. "The Red square." and "red square" match; "red" and "dark red" do not.
"""

from __future__ import annotations

import re
import string
from typing import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, punctuation and articles removed, whitespace collapsed."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(reference)


def exact_match_accuracy(predictions: Sequence[str], references: Sequence[str]) -> float:
    """The share of `predictions` that match their reference (0 for none)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not references:
        return 0.0
    return sum(exact_match(p, r) for p, r in zip(predictions, references)) / len(references)
