"""Early adapter release's policies on the host (services/worker/release.py): the fraction's point,
and the SENTENCE_END rule's — a token that ends the first sentence or line after some content, at
or past the fraction's least count, then one token more."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.worker.release import ReleasePolicy, ReleaseWatch, SentenceEnds
from services.common.release_rules import ReleaseRule


def ends_at(pieces: list[str]) -> list[int]:
    """The 1-based pieces after which SentenceEnds says a sentence or line ended."""
    watch, text, out = SentenceEnds(), "", []
    for i, piece in enumerate(pieces, 1):
        text += piece
        if watch.ended(text):
            out.append(i)
    return out


@pytest.mark.parametrize(
    "pieces, want",
    [
        (["Red", "."], [2]),
        (["Red", ".", " It", " is", "!"], [2, 5]),
        (["Yes", "?", "\n", "No"], [2, 3]),
        (["3", ".", "5", " apples", "."], [2, 5]),  # "3." may end one: the release still waits a token
        (["Red", " square", "\n"], [3]),  # a line ends it, punctuation or not
        (["\n", "\n", "...", " ok"], []),  # no letter or digit before: not a sentence
        ([" a", ".\n"], [2]),  # one token, one end
        (['He said "', "Hi", '."'], [3]),
        (['"Hi', '."', " Then"], [2]),
        (["好", "。"], [2]),  # CJK full stop
        (["red"], []),  # a bare answer ends with EOS, not with a mark
        (["e", ".g", ". x"], [3]),  # a heuristic: "e.g." counts (a mark inside "e.g" does not)
    ],
)
def test_sentence_ends(pieces, want):
    assert ends_at(pieces) == want


def test_a_closer_after_a_seen_mark_ends_it_again_but_old_text_never():
    w = SentenceEnds()
    assert w.ended("Yes.")
    assert w.ended('Yes."')  # the quote closes the same sentence: a closer extends the match
    assert not w.ended('Yes." and')  # nothing new ended
    assert not w.ended('Yes." and more')


def run(policy: ReleasePolicy, pieces: list[str]) -> int:
    """The tokens after which a request with `policy` producing `pieces` is released (0: never)."""
    watch, text = ReleaseWatch(policy), ""
    for n, piece in enumerate(pieces, 1):
        text += piece
        if watch.due(n, text):
            assert watch.at == n
            return n
    return 0


def test_release_points():
    answer = ["Red", ".", " The", " square", " is", " red", ".", " Done", "."]
    fraction = ReleasePolicy.of(0.25, ReleaseRule.NONE, 8, adapter=True)
    assert fraction == ReleasePolicy(2, False) and run(fraction, answer) == 2
    assert ReleaseWatch(fraction).comes_with(2) and not ReleaseWatch(fraction).comes_with(1)
    rule = ReleasePolicy.of(0.0, ReleaseRule.SENTENCE_END, 8, adapter=True)
    assert rule == ReleasePolicy(0, True) and rule.active
    assert run(rule, answer) == 3  # "." ends the first sentence: " The" still the adapter's
    assert not ReleaseWatch(rule).comes_with(100)  # unknown until the text says
    # with a least share: the first sentence end at or past ceil(0.25 * 16) = 4 tokens
    assert run(ReleasePolicy.of(0.25, ReleaseRule.SENTENCE_END, 16, adapter=True), answer) == 8
    assert run(rule, ["red"]) == 0 and run(rule, ["\n", "Red", "\n", "x"]) == 4
    # nothing to release without an adapter, or with no policy
    assert not ReleasePolicy.of(0.5, ReleaseRule.SENTENCE_END, 8, adapter=False).active
    assert not ReleasePolicy.of(0.0, ReleaseRule.NONE, 8, adapter=True).active
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(InvalidArgument) as err:
            ReleasePolicy.of(bad, ReleaseRule.SENTENCE_END, 8, adapter=True)
        assert err.value.field_violations[0].field == "item.params.adapter_release_fraction"


def test_unknown_rule_values_are_refused_naming_the_field():
    from services.worker.preprocess import release_rule

    assert release_rule(0) == ReleaseRule.NONE and release_rule(1) == ReleaseRule.SENTENCE_END
    with pytest.raises(InvalidArgument) as err:
        release_rule(7)
    assert err.value.field_violations[0].field == "item.params.adapter_release_rule"
