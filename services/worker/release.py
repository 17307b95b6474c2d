"""Early adapter release (LoRazor): when a request's adapter goes and it decodes on the base path.

A request's policy (`ReleasePolicy`, from GenerationParams' adapter_release_fraction and
adapter_release_rule) is one of:

- a fraction f: the adapter is released once ceil(f * max_new_tokens) tokens were generated with it;
- the rule SENTENCE_END (with f the least share generated before it counts, 0 for none): a token
  that ends the answer's first sentence or line (`SentenceEnds`), then one more token with the
  adapter, then the release.

Both are decided on the host as each token is taken (outputs.OutputProcessor.accept), from the
token count and the text the worker streams anyway: no device work, no sync. The one token more of
the rule is what makes its release point one position of the sequence, the same whether decoding
is pipelined or not: when the rule fires on a pending token (decoder.py), the step after it is
already launched with the adapter; with `ReleaseWatch.at` set one past the firing token, that step's
token is taken at once (Decoder.holdable says no, as for a fraction's point) and the steps after it
run on the base path. It is also the token that says whether the answer goes on: after a
VQA-style answer ("Red.") the adapter still decides to end it (EOS).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from services.common.errors import invalid_field
from services.common.release_rules import ReleaseRule

# A sentence's end: a terminal mark (closing quotes or brackets after it) at the end of the text
# or before whitespace — "3." then "5" ends one too, released after the "5" — or a line break.
_SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f][\"'\u201d\u2019)\]]*(?=\s|$)|\n")
_LOOKBACK = 3  # a match may begin this far back: a mark and two closers that a closer of the new text extends


class SentenceEnds:
    """Watches a request's text grow (`ended` after each token, with the text so far) for the end
    of a sentence or line after some letters or digits; O(new characters) a token."""

    def __init__(self) -> None:
        self.seen = 0  # characters of the text looked at
        self.content = False  # whether they hold a letter or digit

    def ended(self, text: str) -> bool:
        """Whether the text added since the last call ends a sentence or a line that follows
        some content (a line break or a mark before any letter or digit does not count)."""
        seen, self.seen = self.seen, len(text)
        found = False
        for m in _SENTENCE_END.finditer(text, max(0, seen - _LOOKBACK)):
            if m.end() <= seen:  # ended before this text: counted (or not) then
                continue
            if self.content or _has_content(text, seen, m.start()):
                found = True
                break
        self.content = self.content or _has_content(text, seen, len(text))
        return found


def _has_content(text: str, start: int, end: int) -> bool:
    return any(c.isalnum() for c in text[start:end])


@dataclass(frozen=True)
class ReleasePolicy:
    """A request's early release: `after_tokens`, the fraction's count (without the rule: the
    release point; with it: the tokens generated before a sentence end counts), and whether the
    SENTENCE_END rule decides."""

    after_tokens: int = 0
    at_sentence_end: bool = False

    @property
    def active(self) -> bool:
        return self.after_tokens > 0 or self.at_sentence_end

    @classmethod
    def of(cls, fraction: float, rule: ReleaseRule, max_new_tokens: int, adapter: bool) -> ReleasePolicy:
        """The policy of a request asking for `max_new_tokens` (none without an adapter: there is
        nothing to release); INVALID_ARGUMENT for a fraction outside [0, 1]."""
        if not math.isfinite(fraction) or not 0 <= fraction <= 1:
            raise invalid_field("item.params.adapter_release_fraction", f"{fraction} is not in [0, 1]")
        if not adapter:
            return cls()
        return cls(math.ceil(fraction * max_new_tokens), rule == ReleaseRule.SENTENCE_END)


class ReleaseWatch:
    """A running request's release point: `at`, the tokens after which its adapter goes (0: none,
    or not known yet while the rule watches its text)."""

    def __init__(self, policy: ReleasePolicy) -> None:
        self.policy = policy
        self.at = 0 if policy.at_sentence_end else policy.after_tokens
        self._ends = SentenceEnds() if policy.at_sentence_end else None

    def due(self, tokens: int, text: str) -> bool:
        """After a token is taken (`tokens` of them now, `text` so far): whether the adapter goes
        now. The rule, when it sees its sentence end, sets the point one token later."""
        if self._ends is not None and not self.at and self._ends.ended(text) and tokens >= self.policy.after_tokens:
            self.at = tokens + 1
        return self.comes_with(tokens)

    def comes_with(self, tokens: int) -> bool:
        """Whether the release comes once `tokens` tokens are taken (known before their text)."""
        return 0 < self.at <= tokens
