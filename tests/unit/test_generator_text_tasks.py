"""Text tasks (VQA-style answers): normalised exact match."""

from __future__ import annotations

import pytest

from services.generator.answers import exact_match, exact_match_accuracy, normalize_answer


def test_answers_are_normalised_as_squad_does():
    assert normalize_answer("  The Red   square. ") == "red square"
    assert normalize_answer("An apple, a day!") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles are whole words only
    assert exact_match("Yellow!", "yellow") and not exact_match("dark red", "red")
    assert exact_match_accuracy(["red", "A blue", "green"], ["red", "blue", "red"]) == pytest.approx(2 / 3)
    assert exact_match_accuracy([], []) == 0.0
    with pytest.raises(ValueError):
        exact_match_accuracy(["red"], [])
