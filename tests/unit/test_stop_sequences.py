"""Stop sequences in the incremental detokenizer: the KMP matcher against a brute-force search,
and streamed text that is the text before the first stop sequence, holding back exactly what may
still begin one (random texts over a two-letter alphabet, where stops overlap themselves)."""

from __future__ import annotations

import random

from services.worker.detokenizer import IncrementalDetokenizer, StopMatcher


def _longest_prefix_suffix(text: str, stop: str) -> int:
    return max((n for n in range(len(stop) + 1) if text.endswith(stop[:n])), default=0)


def test_matcher_tracks_the_longest_prefix_of_the_stop_the_text_ends_with():
    rnd = random.Random(0)
    for _ in range(300):
        stop = "".join(rnd.choice("ab") for _ in range(rnd.randint(1, 7)))
        m, text = StopMatcher(stop), ""
        for _ in range(40):
            c = rnd.choice("ab")
            text += c
            whole = m.feed(c)
            assert whole == text.endswith(stop)
            want = _longest_prefix_suffix(text, stop)
            assert m.matched == want, (stop, text)


def test_streamed_text_stops_at_the_first_stop_and_holds_back_only_possible_starts():
    rnd = random.Random(1)
    for _ in range(300):
        stops = ["".join(rnd.choice("ab") for _ in range(rnd.randint(2, 6))) for _ in range(rnd.randint(1, 3))]
        full = "".join(rnd.choice("abc") for _ in range(rnd.randint(0, 60)))
        d = IncrementalDetokenizer(None, stop=stops)
        streamed, i = "", 0
        while i < len(full) and not d.stopped:
            n = rnd.randint(1, 4)
            d._append(full[i : i + n])
            streamed += d._take(final=False)
            i += n
            if not d.stopped:  # what is held back may still begin a stop sequence, nothing more
                held = d.text[len(streamed) :]
                assert len(held) == max(_longest_prefix_suffix(d.text, s) for s in stops)
        streamed += d._take(final=True)
        found = [(full.find(s) + len(s), full.find(s)) for s in stops if s in full]
        # cut where the stop sequence completed first (its first character) began
        want = full[: min(found)[1]] if found else full
        assert streamed == d.text == want, (stops, full)
