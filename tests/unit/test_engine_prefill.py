"""Batched prefill of the worker engine on the tiny Qwen2-VL (fp32): requests of different
prompt lengths, adapters (and none), output kinds, images and videos prefilled in ONE forward
answer exactly as each does alone (packed into one sequence, no padding); the step's token
bound; a failing batched forward fails only the rows whose own forward fails."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import threading
from pathlib import Path

import pytest

from services.worker.engine import Engine, EngineConfig
from services.worker.prefill_graphs import bucket_tokens
from services.worker.requests import Failed, Finished, FinishReason, OutputKind, TextDelta, WorkRequest
from services.common.modes import Mode
from services.worker.sampling import SamplingParams
from services.worker.testing import TEST_KV_BYTES, random_adapter_bundle, random_image

A, B, C = "adapters/alpha/versions/1", "adapters/beta/versions/2", "adapters/gamma/versions/1"
LABELS = ["red", "green", "blue", "yellow"]
MAX_NEW = 8
DEVICE = os.environ.get("VALORA_TEST_DEVICE", "cpu")


def started_engine(model_path, **config) -> Engine:
    """The module's engine (`config` overrides its settings), started, with adapters A, B, C."""
    eng = Engine(
        EngineConfig(
            **{
                **dict(
                    model_path=model_path,
                    device=DEVICE,
                    max_batch_size=12,
                    max_prefills_per_step=12,
                    device_slots=3,
                    default_max_new_tokens=MAX_NEW,
                    kv_cache_bytes=TEST_KV_BYTES,
                ),
                **config,
            }
        )
    )
    eng.start()
    for name, b in {
        A: random_adapter_bundle(model_path, rank=4, lora_alpha=8, seed=1),
        B: random_adapter_bundle(model_path, rank=8, lora_alpha=4, seed=2, heads={"color": LABELS}),
        C: random_adapter_bundle(model_path, rank=2, lora_alpha=2, seed=3, target_modules=("q_proj", "v_proj")),
    }.items():
        assert eng.load_adapter_bytes(name, b.sha256, b.data, b.config_json, b.heads)
    return eng


@pytest.fixture(scope="module")
def engine(model_path, tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "steps.jsonl"  # the step trace, read by the failure tests
    eng = started_engine(model_path, step_trace=str(trace))
    yield eng
    eng.stop()


@pytest.fixture
def prefills(engine):
    """Records the request ids of every step's prefill pieces (whole contexts and chunks), in step
    order — prefilled alone or with the running rows riding (mixed steps)."""
    batches: list[list[str]] = []
    take = engine.sched.take_prefills

    def record(now):
        seqs = take(now)
        if seqs:
            batches.append([s.req.request_id for s in seqs])
        return seqs

    engine.sched.take_prefills = record
    yield batches
    del engine.sched.take_prefills


def submit_together(engine, requests) -> dict[str, queue.Queue]:
    """Queues every request while the engine loop is held, so one step admits them all."""
    sinks = {}
    with engine._wake:  # re-entrant: submit() takes it too; _admit() waits for it
        for r in requests:
            q: queue.Queue = queue.Queue()
            engine.submit(engine.prepare(r), q.put)
            sinks[r.request_id] = q
    return sinks


def outcome(q: queue.Queue):
    """(deltas, final event) of one request."""
    deltas = []
    while True:
        ev = q.get(timeout=60)
        if isinstance(ev, TextDelta):
            deltas.append(ev.text)
        else:
            return deltas, ev


def mixed_requests() -> list[WorkRequest]:
    r = lambda rid, prompt, imgs=(), **kw: WorkRequest(rid, prompt, list(imgs), max_new_tokens=MAX_NEW, **kw)
    return [
        r("base-1img", "Hi.", [random_image(1)]),
        r(
            "a-1img-long",
            "Describe every object in this picture, its colour and where it is.",
            [random_image(2)],
            adapter=A,
        ),
        r("b-2img", "What changed between them?", [random_image(3), random_image(4, 112)], adapter=B),
        r("a-2img", "Compare.", [random_image(5, 112), random_image(6)], adapter=A),
        r("c-text", "Tell me a short story about a cat.", adapter=C),
        r("label", "What color is it?", [random_image(7)], adapter=B, output_kind=OutputKind.LABEL, head="color"),
        r(
            "base-video",
            "What happens?",
            [random_image(8)],
            videos=[[random_image(9), random_image(10), random_image(11)]],
        ),
        r(
            "sampled",
            "Guess.",
            [random_image(1)],
            adapter=C,
            sampling=SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=11),
        ),
    ]


def test_batched_prefill_equals_each_request_alone(engine, prefills, monkeypatch):
    reqs = mixed_requests()
    lengths = {r.request_id: engine.prepare(r).prompt_tokens for r in reqs}
    assert len(set(lengths.values())) >= 6, lengths  # rows of different lengths, packed
    plans = []
    plan = engine.lora.plan
    monkeypatch.setattr(
        engine.lora, "plan", lambda seqs, t, pad=0: plans.append((t, plan(seqs, t, pad))) or plans[-1][1]
    )
    engine.vision.cache.clear()
    engine.prefiller.peak_rows = 0
    together = {rid: outcome(q) for rid, q in submit_together(engine, reqs).items()}
    assert len(prefills) == 1 and sorted(prefills[0]) == sorted(lengths), prefills
    assert engine.prefiller.peak_rows == len(reqs)
    # One LoRA plan for the batch: a row per request with its own token count (packed), rows
    # grouped by entry (no permutation, so ATMM can take it), entries A, B, C once each; the
    # forward's padding to its token bucket (prefill_graphs.py) rides in the last row's segment.
    ((counts, step),) = [(t, st) for t, st in plans if not isinstance(t, int)]
    total = sum(lengths.values())
    pad = bucket_tokens(total) - total
    assert pad > 0 and step.plan.num_tokens == total + pad
    assert sorted([*counts[:-1], counts[-1] - pad]) == sorted(lengths.values())
    assert len(step.row_entries) == len(reqs)
    assert step.perm is None and sorted(step.row_entries) == step.row_entries and len(step.entries) == 3
    del prefills[:]
    engine.vision.cache.clear()
    alone = {}
    for r in reqs:
        alone[r.request_id] = outcome(submit_together(engine, [r])[r.request_id])
    assert prefills == [[r.request_id] for r in reqs]
    for rid, (deltas, ev) in together.items():
        want_deltas, want = alone[rid]
        assert isinstance(ev, Finished) and isinstance(want, Finished), (rid, ev, want)
        got, want = ev.result, want.result
        assert got.prompt_tokens == want.prompt_tokens == lengths[rid]
        if rid == "label":
            assert got.finish_reason == FinishReason.LABEL and got.label == want.label
            assert [s[0] for s in got.scores] == [s[0] for s in want.scores]
            assert [s[1] for s in got.scores] == pytest.approx([s[1] for s in want.scores], abs=1e-5)
            continue
        assert got.token_ids == want.token_ids and len(got.token_ids) > 0, rid
        assert got.text == want.text == "".join(deltas) == "".join(want_deltas), rid
        assert got.mode == want.mode == (Mode.BASE if rid.startswith("base") else Mode.UNMERGED)


def test_prefill_bound_counts_tokens_and_keeps_fifo(engine, prefills):
    short = [
        WorkRequest(f"s{i}", "Hi.", [random_image(20 + i)], adapter=A if i % 2 else None, max_new_tokens=3)
        for i in range(3)
    ]
    long = WorkRequest(
        "long",
        "Describe the picture in detail, every object and colour. " * 4,
        [random_image(30, 112)],
        max_new_tokens=3,
    )
    n = engine.prepare(short[0]).prompt_tokens
    assert engine.prepare(long).prompt_tokens > 2 * n
    old = engine.config.max_prefill_tokens
    engine.config.max_prefill_tokens = 2 * n  # two short rows fit; the long one alone exceeds it
    try:
        results = {rid: outcome(q) for rid, q in submit_together(engine, [*short[:2], long, short[2]]).items()}
    finally:
        engine.config.max_prefill_tokens = old
    # the long one in chunks of the budget, alone, before the one behind it (FIFO)
    chunks = -(-engine.prepare(long).prompt_tokens // (2 * n))
    assert [sorted(b) for b in prefills] == [["s0", "s1"], *[["long"]] * chunks, ["s2"]] and chunks >= 2
    for r in [*short, long]:  # the same tokens as prefilled whole (the budget restored)
        _, ev = results[r.request_id]
        assert isinstance(ev, Finished) and ev.result.output_tokens == 3
        assert ev.result.token_ids == engine.generate(r)[1].token_ids, r.request_id


def test_objectives_are_admitted_and_prefilled_earliest_due_first(engine, prefills):
    """Requests carrying what is left of a latency objective (the valora policy's workers) are
    prefilled earliest due first, a request without one as due 30 s after it arrived, one already
    over its objective last; the same requests without objectives stay first come, first served.
    The tokens do not change."""
    left = {"late": -1.0, "bulk": None, "loose": 20.0, "video-b": 8.0, "video-a": 5.0}
    reqs = [
        WorkRequest(rid, "Hi.", [random_image(60 + i)], adapter=A, max_new_tokens=2, slo_left_s=s)
        for i, (rid, s) in enumerate(left.items())
    ]
    old = engine.config.max_prefills_per_step
    engine.config.max_prefills_per_step = 1  # a prefill a step: the order is the queue's
    try:
        with_objectives = {rid: outcome(q) for rid, q in submit_together(engine, reqs).items()}
        order = [b[0] for b in prefills]
        prefills.clear()
        plain = [dataclasses.replace(r, slo_left_s=None) for r in reqs]
        without = {rid: outcome(q) for rid, q in submit_together(engine, plain).items()}
    finally:
        engine.config.max_prefills_per_step = old
    assert order == ["video-a", "video-b", "loose", "bulk", "late"]
    assert [b[0] for b in prefills] == list(left)
    for rid in left:
        assert with_objectives[rid][1].result.token_ids == without[rid][1].result.token_ids, rid


def test_rows_of_different_lengths_share_the_budget_unpadded(engine, prefills):
    """A short and a long row whose padded batch (2 x the long one) is over the budget but whose
    tokens are not: one forward."""
    short = WorkRequest("short", "Hi.", [random_image(50)], max_new_tokens=2)
    long = WorkRequest(
        "long", "Describe the picture in detail, every object and colour. " * 2, [random_image(51)], max_new_tokens=2
    )
    n, m = engine.prepare(short).prompt_tokens, engine.prepare(long).prompt_tokens
    assert m > n
    old = engine.config.max_prefill_tokens
    engine.config.max_prefill_tokens = n + m  # < 2 * m
    try:
        results = {rid: outcome(q)[1] for rid, q in submit_together(engine, [short, long]).items()}
    finally:
        engine.config.max_prefill_tokens = old
    assert [sorted(b) for b in prefills] == [["long", "short"]]
    assert all(isinstance(ev, Finished) and ev.result.output_tokens == 2 for ev in results.values())


def test_a_chunked_context_shares_its_steps_with_the_requests_around_it(engine, prefills):
    """Chunked prefill without head-of-line blocking: a short request and the first chunk of a
    long one (the budget's rest) in one forward, then the long one's last chunk and the short
    request behind it in the next; the tokens are each request's alone."""
    before = WorkRequest("before", "Hi.", [random_image(60)], max_new_tokens=3)
    long = WorkRequest(
        "long",
        "Describe the picture in detail, every object and colour. " * 4,
        [random_image(61, 112)],
        max_new_tokens=3,
    )
    after = WorkRequest("after", "Hi.", [random_image(62)], max_new_tokens=3)
    n, m = engine.prepare(before).prompt_tokens, engine.prepare(long).prompt_tokens
    assert engine.prepare(after).prompt_tokens == n and m > 2 * n
    old = engine.config.max_prefill_tokens
    engine.config.max_prefill_tokens = n + m - m // 2  # before + half of long; then long's rest + after
    try:
        results = {rid: outcome(q)[1] for rid, q in submit_together(engine, [before, long, after]).items()}
    finally:
        engine.config.max_prefill_tokens = old
    assert prefills == [["before", "long"], ["long", "after"]], prefills
    for r in (before, long, after):
        assert results[r.request_id].result.token_ids == engine.generate(r)[1].token_ids, r.request_id


@contextlib.contextmanager
def failing_prefill(engine, module, fails):
    """Raises inside every prefill forward whose rows' request ids `fails(ids)` picks, from a
    pre-hook on `module` (a decoder layer: the layers before it have written the rows' keys and
    values; the LM head: every piece is cached, the first tokens are being chosen). Yields the
    failed forwards' request ids, in order."""
    current: list[str] = []
    calls: list[list[str]] = []
    prefill = engine.runner.prefill

    def tracked(rows, step):
        current[:] = [s.req.request_id for s in rows]
        try:
            return prefill(rows, step)
        finally:
            current.clear()

    def boom(mod, args):
        if current and fails(current):  # decode steps run these modules too: never fail them
            calls.append(list(current))
            raise RuntimeError("injected prefill failure")

    engine.runner.prefill = tracked
    hook = module.register_forward_pre_hook(boom)
    try:
        yield calls
    finally:
        hook.remove()
        del engine.runner.prefill


def wait_idle(engine):
    """Until no sequence, cache or adapter pin is left (the last events reach sinks first)."""
    for _ in range(200):
        s = engine.stats()
        if s.running == 0 and s.kv_cache_bytes == 0:
            break
        threading.Event().wait(0.01)
    assert s.running == 0 and s.kv_cache_bytes == 0
    assert not engine.pool._pins  # the failed requests' adapter slots were released


@pytest.mark.parametrize("where", ["layer", "head"])
def test_a_row_whose_forward_fails_fails_alone_and_its_batch_goes_on(engine, prefills, where):
    """A prefill batch whose forward raises is prefilled again row by row: only the row whose own
    forward raises fails (INTERNAL with the error, once: never retried again); the others — the
    last chunk of a context whose first chunk was cached a step before, an adapter's row and a
    LABEL row — answer what they answer alone, a decoding request goes on, and nothing leaks.
    Before, every request of the batch failed."""
    lm = engine.model.model.language_model
    module = lm.layers[-1] if where == "layer" else engine.model.lm_head
    running: queue.Queue = queue.Queue()
    long_running = WorkRequest("keeps-going", "Count.", [random_image(40)], adapter=A, max_new_tokens=24)
    engine.submit(engine.prepare(long_running), running.put)
    assert isinstance(running.get(timeout=60), TextDelta)  # decoding
    chunked = WorkRequest(
        "chunked",
        "Describe the picture in detail, every object and colour. " * 4,
        [random_image(44, 112)],
        adapter=C,
        max_new_tokens=4,
    )
    reqs = [
        chunked,
        WorkRequest("bad", "Hi.", [random_image(41)], adapter=B, max_new_tokens=4),
        WorkRequest("plain", "Describe it.", [random_image(42)], max_new_tokens=4),
        WorkRequest("label", "Which color?", [random_image(43)], adapter=B, output_kind=OutputKind.LABEL, head="color"),
    ]
    m = engine.prepare(chunked).prompt_tokens
    assert sum(engine.prepare(r).prompt_tokens for r in reqs[1:]) < m - 16
    old = engine.config.max_prefill_tokens
    engine.config.max_prefill_tokens = m - 8  # step 1: its first chunk; step 2: its last 8 tokens and the rest
    engine.prefiller.isolated_batches = engine.prefiller.failed_rows = 0
    del prefills[:]
    try:
        with failing_prefill(engine, module, lambda ids: "bad" in ids) as calls:
            got = {rid: outcome(q)[1] for rid, q in submit_together(engine, reqs).items()}
    finally:
        engine.config.max_prefill_tokens = old
    assert [sorted(b) for b in prefills] == [["chunked"], ["bad", "chunked", "label", "plain"]], prefills
    assert sorted(map(sorted, calls)) == [["bad"], ["bad", "chunked", "label", "plain"]], calls  # the row once alone
    bad = got.pop("bad")
    assert (
        isinstance(bad, Failed)
        and bad.error.reason == "ENGINE_STEP_FAILED"
        and "injected prefill failure" in str(bad.error)
    )
    for r in reqs[2:] + reqs[:1]:
        ev, want = got[r.request_id], engine.generate(r)[1]  # alone, the budget restored
        assert isinstance(ev, Finished), (r.request_id, ev)
        assert ev.result.token_ids == want.token_ids and ev.result.label == want.label, r.request_id
        assert [s for _, s in ev.result.scores] == pytest.approx([s for _, s in want.scores], abs=1e-5)
    assert got["chunked"].result.output_tokens == 4 and got["label"].result.label in LABELS
    deltas, ev = outcome(running)
    assert isinstance(ev, Finished) and ev.result.output_tokens == 24
    assert engine.alive
    wait_idle(engine)
    assert (engine.prefiller.isolated_batches, engine.prefiller.failed_rows) == (1, 1)
    # the step's trace line: its phases once each (the retries' time is its prefill's), the retry said
    engine.trace._file.flush()
    lines = [json.loads(line) for line in Path(engine.config.step_trace).read_text().splitlines()]
    (step,) = [line for line in lines if "prefill_retried_rows" in line][-1:]
    assert (step["prefill_rows"], step["prefill_retried_rows"], step["prefill_failed_rows"]) == (4, 4, 1)
    assert set(step["host_ms"]) <= {"admit", "inputs", "prefill", "decode", "sync"} and "prefill" in step["host_ms"]


def test_failed_batched_forwards_fail_their_requests_only(engine):
    """A forward that fails every time (a broken device): the batch, then each row alone, fail —
    every request of the batch fails, once each, and the decoding request beside them goes on."""
    running: queue.Queue = queue.Queue()
    long = WorkRequest("keeps-going", "Count.", [random_image(40)], adapter=A, max_new_tokens=24)
    engine.submit(engine.prepare(long), running.put)
    assert isinstance(running.get(timeout=60), TextDelta)  # decoding
    with failing_prefill(engine, engine.model.model.language_model, lambda ids: True) as calls:
        failed = {
            rid: outcome(q)[1]
            for rid, q in submit_together(
                engine,
                [
                    WorkRequest("f1", "Hi.", [random_image(41)], adapter=B, max_new_tokens=4),
                    WorkRequest("f2", "Describe it.", [random_image(42, 112)], max_new_tokens=4),
                    WorkRequest(
                        "f3", "Which color?", [random_image(43)], adapter=B, output_kind=OutputKind.LABEL, head="color"
                    ),
                ],
            ).items()
        }
    assert len(calls) == 4 and sorted(map(len, calls)) == [1, 1, 1, 3], calls  # the batch, then each row once
    for rid, ev in failed.items():
        assert isinstance(ev, Failed) and ev.error.reason == "ENGINE_STEP_FAILED", (rid, ev)
        assert "injected prefill failure" in str(ev.error)
    deltas, ev = outcome(running)
    assert isinstance(ev, Finished) and ev.result.output_tokens == 24
    assert engine.alive
    assert (
        engine.generate(WorkRequest("after", "Hi.", [random_image(41)], adapter=B, max_new_tokens=4))[1].output_tokens
        == 4
    )
    wait_idle(engine)


def test_label_request_prefilled_in_chunks_answers_alike(engine):
    # A LABEL request keeps no KV cache, except while its chunks need the ones before them.
    r = WorkRequest(
        "label",
        "Which color is it? " * 6,
        [random_image(50, 112)],
        adapter=B,
        output_kind=OutputKind.LABEL,
        head="color",
    )
    whole = engine.generate(r)[1]
    old = engine.config.max_prefill_tokens
    engine.config.max_prefill_tokens = 16
    try:
        chunked = engine.generate(r)[1]
    finally:
        engine.config.max_prefill_tokens = old
    assert engine.prepare(r).prompt_tokens > 2 * 16
    assert chunked.label == whole.label
    assert [s for _, s in chunked.scores] == pytest.approx([s for _, s in whole.scores], abs=1e-4)
    assert engine.kv.used_blocks == 0


def test_padded_prefill_gives_the_tokens_of_the_unpadded_one(engine, model_path):
    """prefill_graphs' padding (the packed tokens rounded up to a bucket, rows up to the step's
    most, the padding in the last row's LoRA segment) changes no row's tokens, label or scores;
    its entries are keyed by bucket: fewer keys than prefill steps of distinct token counts."""
    off = started_engine(model_path, prefill_graphs="off")
    try:
        reqs = mixed_requests()
        graphs = engine.runner.prefill_graphs
        padded_before = graphs.padding_tokens
        results = {}
        for eng in (engine, off):
            eng.vision.cache.clear()
            got = results[eng] = {rid: outcome(q)[1] for rid, q in submit_together(eng, reqs).items()}
            for r in reqs[:4]:  # alone: other token counts, other buckets
                got["alone-" + r.request_id] = outcome(submit_together(eng, [r])[r.request_id])[1]
        assert graphs.padding_tokens > padded_before and off.runner.prefill_graphs.padding_tokens == 0
        for rid, got in results[engine].items():
            want = results[off][rid]
            assert isinstance(got, Finished) and isinstance(want, Finished), (rid, got, want)
            assert got.result.token_ids == want.result.token_ids and got.result.label == want.result.label, rid
            assert [s[1] for s in got.result.scores] == pytest.approx([s[1] for s in want.result.scores], abs=1e-5)
        assert {k[0] for k in graphs.entries} <= {bucket_tokens(n) for n in range(1, 4096)}
        assert all(k[1] == 12 for k in graphs.entries)  # rows padded to max_prefills_per_step
        assert {k[0] for k in off.runner.prefill_graphs.entries} != {k[0] for k in graphs.entries}
    finally:
        off.stop()


def test_a_forward_that_raises_leaves_its_graph_entry_as_it_was(monkeypatch):
    """step_graphs.GraphSet (prefill and decode graphs) with a fake CUDA graph API: a forward that
    raises — in its warm-up, or in a capture and then eagerly — leaves the entry and the counters
    as they were, so the key's next forward warms up again (a capture over a failed warm-up runs
    lazy initialisation inside the capture) and the failure is not held against the key's
    captures (three would make it graph-less for good); a capture that fails on its own counts."""
    import torch

    from services.worker import step_graphs

    class FakeGraph:
        replays = 0

        def replay(self):
            FakeGraph.replays += 1

    capturing = []

    @contextlib.contextmanager
    def capture(*args, **kwargs):
        capturing.append(True)
        try:
            yield
        finally:
            capturing.clear()

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    graphs = step_graphs.GraphSet("test", torch.device("cpu"), capture=False, max_graphs=4)
    graphs.capture = True  # as on CUDA
    fail = {"forward": False, "capture": False}

    def forward(e):
        if fail["forward"] or (fail["capture"] and capturing):
            raise RuntimeError("injected")
        return (torch.ones(1),)

    def run(e):
        return graphs.run(e, forward)

    e = graphs.entry(("k",), step_graphs.GraphEntry)
    fail["forward"] = True
    for _ in range(step_graphs.MAX_CAPTURE_FAILURES + 1):  # a warm-up that raises, every time
        with pytest.raises(RuntimeError):
            run(e)
    assert (e.seen, graphs.warmup_steps, graphs.static_steps) == (0, 0, 0)
    fail["forward"] = False
    run(e)  # the warm-up
    assert (e.seen, graphs.warmup_steps, e.graph) == (1, 1, None)
    fail["forward"] = True
    for _ in range(step_graphs.MAX_CAPTURE_FAILURES + 1):  # the capture raises, then the eager forward
        with pytest.raises(RuntimeError):
            run(e)
    assert (e.failures, e.graphless, graphs.capture_failures, graphs.eager_steps, e.seen) == (0, False, 0, 0, 1)
    fail.update(forward=False, capture=True)  # the capture alone fails: counted, the eager forward answers
    assert run(e)[0].item() == 1 and (e.failures, graphs.capture_failures, graphs.eager_steps) == (1, 1, 1)
    fail["capture"] = False
    run(e)
    assert isinstance(e.graph, FakeGraph) and graphs.captures == 1 and FakeGraph.replays == 1 and e.seen == 3


@pytest.mark.parametrize(
    "n,bucket",
    [
        (1, 128),
        (128, 128),
        (129, 256),
        (1000, 1024),
        (1024, 1024),
        (1025, 1280),
        (2048, 2048),
        (2049, 2560),
        (8000, 8192),
    ],
)
def test_bucket_tokens(n, bucket):
    assert bucket_tokens(n) == bucket


def test_pieces_fill_the_padding_of_the_forwards_bucket(engine, prefills):
    """prefill_fill_padding: a step whose budget stops the next request (left under the smallest
    chunk) takes a piece of it into the tokens its forward pads to the graph bucket anyway; the
    forward runs no more tokens (the same bucket), fewer of them padding; the tokens are each
    request's alone. Off (the default), the same requests leave the padding empty."""
    reqs = [WorkRequest(f"fill-{i}", "Describe it.", [random_image(70 + i)], max_new_tokens=2) for i in range(3)]
    n = engine.prepare(reqs[0]).prompt_tokens
    assert all(engine.prepare(r).prompt_tokens == n for r in reqs)
    assert bucket_tokens(2 * n) > 2 * n  # room in the bucket
    old = engine.config.max_prefill_tokens, engine.config.prefill_fill_padding
    results = {}
    try:
        for fill in (False, True):
            engine.config.max_prefill_tokens, engine.config.prefill_fill_padding = 2 * n + 8, fill
            del prefills[:]
            pad0 = engine.runner.prefill_graphs.padding_tokens
            got = {rid: outcome(q)[1] for rid, q in submit_together(engine, reqs).items()}
            results[fill] = (list(prefills), engine.runner.prefill_graphs.padding_tokens - pad0, got)
    finally:
        engine.config.max_prefill_tokens, engine.config.prefill_fill_padding = old
    ids = [r.request_id for r in reqs]
    assert results[False][0] == [ids[:2], ids[2:]], results[False][0]
    room = bucket_tokens(2 * n) - 2 * n
    first = [ids, ids[2:]] if room < n else [ids]  # the third whole when it fits the padding
    assert results[True][0] == first, results[True][0]
    assert results[True][1] < results[False][1]  # fewer padding tokens run
    for r in reqs:
        want = engine.generate(r)[1].token_ids
        assert all(results[f][2][r.request_id].result.token_ids == want for f in (False, True)), r.request_id
