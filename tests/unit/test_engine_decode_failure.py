"""A decode step that raises for one row, on the tiny Qwen2-VL (fp32): rows decoding together with
different adapters, a sampled row and one asking for log-probabilities; one row's decode step
raises (its forward, or the choice of its token). Only that row fails; the others finish with
the tokens they get alone, pipelined or not, and nothing leaks (decoder.py, `_isolate`)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from services.worker.requests import Failed, Finished, WorkRequest
from services.worker.sampling import SamplingParams
from services.worker.testing import random_image
from tests.unit.test_engine_prefill import A, B, C, outcome, started_engine, submit_together, wait_idle

BAD = "bad"


@pytest.fixture(scope="module")
def engine(model_path, tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "steps.jsonl"
    eng = started_engine(model_path, step_trace=str(trace))
    eng.eos_ids = set()  # every row decodes to its max_new_tokens: the bad row is decoding when it fails
    yield eng
    eng.stop()


@contextlib.contextmanager
def failing_decode(engine, where, fails, after: int = 0):
    """Raises in every decode step whose rows' request ids `fails(ids)` picks, once `after` such
    steps have run: from a pre-hook on the last decoder layer (`where="layer"`: the layers
    before it have written the rows' new keys and values) or in the choice of the step's tokens
    (`"sampling"`: the forward ran, the rows' lengths counted their new token). Yields the failed
    steps' request ids, in order."""
    current: list[str] = []
    calls: list[list[str]] = []
    seen = [0]
    runner = engine.runner
    chooser = runner.tokens
    decode, choose = runner.decode, chooser.choose

    def picked() -> bool:
        if not current or not fails(current):
            return False
        seen[0] += 1
        return seen[0] > after

    def tracked(rows, step, bucket, ids=None):
        current[:] = [s.req.request_id for s in rows]
        if where == "sampling":
            return decode(rows, step, bucket, ids=ids)
        try:
            return decode(rows, step, bucket, ids=ids)
        finally:
            current.clear()

    def choosing(rows, greedy, logits, counters, pending=None):
        try:
            if picked():  # the prefill's first tokens come here too: `current` is set by decode only
                calls.append(list(current))
                raise RuntimeError("injected decode failure")
            return choose(rows, greedy, logits, counters, pending=pending)
        finally:
            current.clear()

    def boom(mod, args):
        if picked():
            calls.append(list(current))
            raise RuntimeError("injected decode failure")

    runner.decode = tracked
    if where == "sampling":
        chooser.choose = choosing
        hook = None
    else:
        hook = engine.model.model.language_model.layers[-1].register_forward_pre_hook(boom)
    try:
        yield calls
    finally:
        if hook is not None:
            hook.remove()
        del runner.decode
        chooser.__dict__.pop("choose", None)


def requests() -> list[WorkRequest]:
    r = lambda rid, prompt, n, **kw: WorkRequest(rid, prompt, [random_image(len(rid))], max_new_tokens=n, **kw)
    return [
        r("base", "Hi.", 10),
        r("a-logprobs", "Describe every object in this picture.", 6, adapter=A, logprobs=2),
        r(BAD, "What is it?", 12, adapter=B),
        r("c", "Tell me a short story about a cat.", 12, adapter=C),
        r("sampled", "Guess.", 8, adapter=B, sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=7)),
    ]


@pytest.mark.parametrize("where,pipelined", [("layer", True), ("sampling", True), ("layer", False)])
def test_a_row_whose_decode_step_fails_fails_alone_and_its_batch_goes_on(engine, where, pipelined):
    """The bad row's third decode step raises, batched and then alone: it fails (INTERNAL,
    ENGINE_STEP_FAILED, with the error) after streaming its first tokens; every other row of
    the batch finishes with the tokens (and log-probabilities) it gets alone; the batch's step
    ran once more row by row, the bad row's alone once; nothing is held after. Before, every row
    decoding beside the bad one failed with it."""
    reqs = requests()
    engine.decoder.pipeline = pipelined
    engine.decoder.isolated_steps = engine.decoder.failed_rows = 0
    try:
        alone = {r.request_id: engine.generate(r)[1] for r in reqs if r.request_id != BAD}
        pipelined_before = engine.decoder.pipelined_steps
        with failing_decode(engine, where, lambda ids: BAD in ids, after=2) as calls:
            got = {rid: outcome(q) for rid, q in submit_together(engine, reqs).items()}
    finally:
        engine.decoder.pipeline = True
    assert (engine.decoder.pipelined_steps > pipelined_before) == pipelined
    assert [sorted(c) for c in calls] == [sorted(r.request_id for r in reqs), [BAD]], calls
    deltas, bad = got.pop(BAD)
    assert isinstance(bad, Failed) and bad.error.reason == "ENGINE_STEP_FAILED", bad
    assert "injected decode failure" in str(bad.error)
    assert deltas  # it was decoding: its first tokens were streamed before its step failed
    for rid, (deltas, ev) in got.items():
        want = alone[rid]
        assert isinstance(ev, Finished), (rid, ev)
        assert ev.result.token_ids == want.token_ids and ev.result.output_tokens == want.output_tokens, rid
        assert ev.result.text == "".join(deltas) == want.text, rid
        ids = lambda lps: [(t.token_id, [i for i, _ in t.top]) for t in lps]
        assert ids(ev.result.logprobs) == ids(want.logprobs), rid
        assert [t.logprob for t in ev.result.logprobs] == pytest.approx([t.logprob for t in want.logprobs], abs=1e-5)
    assert got["a-logprobs"][1].result.logprobs  # the log-probabilities came through the retry too
    assert engine.alive
    wait_idle(engine)
    assert (engine.decoder.isolated_steps, engine.decoder.failed_rows) == (1, 1)
    engine.trace._file.flush()
    lines = [json.loads(line) for line in Path(engine.config.step_trace).read_text().splitlines()]
    (step,) = [line for line in lines if "decode_retried_rows" in line][-1:]
    assert (step["decode_rows"], step["decode_retried_rows"], step["decode_failed_rows"]) == (5, 5, 1)
    ok = engine.generate(WorkRequest("after", "What is it?", [random_image(3)], adapter=B, max_new_tokens=4))
    assert ok[1].output_tokens == 4


def test_a_decode_step_that_always_fails_fails_every_row_and_the_engine_goes_on(engine):
    """Every decode step raises (a broken device): the batch's, then each row's alone — every
    decoding row fails, once each; the engine serves the next request."""
    reqs = requests()[:3]
    with failing_decode(engine, "layer", lambda ids: True) as calls:
        got = {rid: outcome(q)[1] for rid, q in submit_together(engine, reqs).items()}
    assert sorted(map(len, calls)) == [1, 1, 1, 3], calls
    for rid, ev in got.items():
        assert isinstance(ev, Failed) and ev.error.reason == "ENGINE_STEP_FAILED", (rid, ev)
    assert engine.alive
    wait_idle(engine)
    assert isinstance(engine.generate(reqs[0])[1].token_ids, list)


def test_one_decoding_row_that_fails_is_not_retried(engine):
    """A batch of one row: its error is its own, no retry (one failed forward)."""
    engine.decoder.isolated_steps = 0
    r = WorkRequest("one", "Hi.", [random_image(1)], adapter=A, max_new_tokens=6)
    with failing_decode(engine, "layer", lambda ids: True) as calls:
        deltas, ev = outcome(submit_together(engine, [r])["one"])
    assert calls == [["one"]] and isinstance(ev, Failed) and ev.error.reason == "ENGINE_STEP_FAILED"
    assert engine.decoder.isolated_steps == 0
    wait_idle(engine)
