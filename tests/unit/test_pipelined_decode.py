"""Pipelined decode (decoder.Decoder) on the tiny Qwen2-VL with the static decode step
(decode_graphs="static", fp32, CPU): every request gets the same events — text deltas in order,
tokens, finish reason, exactly one terminal event — with pipelining on and off, for rows finishing
at different steps (length, stop sequence, EOS), cancellation, sampled rows (chosen on the
device, pipelined too), requests joining mid-decode, early adapter release and mixture mode; the next step
really is launched before the previous step's tokens are accepted, and no step is launched that
no row needs; the engine bench records whether it was on."""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field

import pytest

from bench import engine_bench
from services.worker.engine import Engine, EngineConfig
from services.worker.lora_manager import Command
from services.worker.requests import Failed, Finished, FinishReason, TextDelta, WorkRequest
from services.common.modes import Mode
from services.worker.sampling import SamplingParams
from services.worker.config import WorkerSettings, engine_config
from services.worker.testing import load_random_adapters, random_image

A, B = "adapters/alpha/versions/1", "adapters/beta/versions/1"


def req(i: int, n: int, **kw) -> WorkRequest:
    return WorkRequest(f"r{i}", "Describe the image." + " more" * i, [random_image(i)], max_new_tokens=n, **kw)


@dataclass
class Outcome:
    events: list = field(default_factory=list)

    @property
    def terminal(self):
        return self.events[-1]

    @property
    def deltas(self) -> int:
        return sum(isinstance(e, TextDelta) for e in self.events)

    def summary(self) -> tuple:
        deltas = tuple(e.text for e in self.events if isinstance(e, TextDelta))
        end = self.terminal
        if isinstance(end, Finished):
            r = end.result
            return deltas, tuple(r.token_ids), r.finish_reason, r.text
        return deltas, end.error.reason


@dataclass
class Run:
    eng: Engine
    out: dict[str, Outcome] = field(default_factory=dict)
    handles: dict = field(default_factory=dict)
    ended: queue.Queue = field(default_factory=queue.Queue)
    order: list = field(default_factory=list)  # (request id, event kind) across requests, as emitted
    hook: object = None  # hook(run, rid, event), in the sink: on the engine thread, so deterministic

    def submit(self, r: WorkRequest) -> None:
        outcome = self.out[r.request_id] = Outcome()

        def sink(ev):
            outcome.events.append(ev)
            self.order.append((r.request_id, type(ev).__name__))
            if self.hook is not None:
                self.hook(self, r.request_id, ev)
            if isinstance(ev, (Finished, Failed)):
                self.ended.put(r.request_id)

        self.handles[r.request_id] = self.eng.submit(self.eng.prepare(r), sink)

    def wait_idle(self) -> None:
        """Until the step that ended the last request has published its stats."""
        for _ in range(500):
            s = self.eng.stats()
            if s.running == 0 and s.kv_cache_bytes == 0:
                return
            time.sleep(0.01)


def run(
    model_path,
    requests,
    pipeline: bool,
    *,
    merged: Mode | None = None,
    eos: set[int] | None = None,
    hook=None,
    expect: int | None = None,
) -> Run:
    """Runs `requests` (admitted and prefilled together in one step) until `expect` requests
    (default: all) have ended; then stops the engine."""
    eng = Engine(
        EngineConfig(
            model_path=model_path,
            decode_graphs="static",
            pipeline_decode=pipeline,
            max_batch_size=8,
            max_prefills_per_step=8,
            device_slots=3,
        )
    )
    eng.eos_ids = set() if eos is None else eos
    eng.start()
    r = Run(eng, hook=hook)
    try:
        load_random_adapters(eng, model_path, (A, B))
        if merged is not None:
            eng.set_mode(merged, A)
        with eng._wake:
            for q in requests:
                r.submit(q)
        for _ in range(expect or len(requests)):
            r.ended.get(timeout=120)
        r.wait_idle()
        return r
    finally:
        eng.stop()


def well_formed(r: Run) -> None:
    for rid, outcome in r.out.items():
        ends = [e for e in outcome.events if isinstance(e, (Finished, Failed))]
        assert ends == [outcome.terminal], f"{rid}: one terminal event, the last one"


def same_both_ways(model_path, requests, same_order: bool = True, **kw) -> tuple[Run, Run]:
    """Runs with pipelining off, then on: every request's events must be equal, and (unless
    requests join mid-decode) so must their interleaving across requests."""
    off, on = run(model_path, requests, False, **kw), run(model_path, requests, True, **kw)
    well_formed(off)
    well_formed(on)
    assert {k: v.summary() for k, v in on.out.items()} == {k: v.summary() for k, v in off.out.items()}
    if same_order:
        assert on.order == off.order
    assert off.eng.decoder.pipelined_steps == 0
    return on, off


@pytest.mark.parametrize("merged", [None, Mode.MIXTURE], ids=["unmerged", "mixture"])
def test_rows_finishing_at_different_steps(model_path, merged):
    """Adapters mixed in the batch, lengths ending at different steps, early adapter release (the
    LoRA plan changes mid-decode)."""
    adapters = [None, A, B, A, B, None, A]
    lengths = [3, 30, 9, 17, 30, 2, 12]
    requests = [req(i, n, adapter=a) for i, (a, n) in enumerate(zip(adapters, lengths))]
    requests[3].adapter_release_fraction = 0.5  # leaves the LoRA segments after 9 tokens
    requests[6].adapter_release_fraction = 0.25
    on, off = same_both_ways(model_path, requests, merged=merged)
    assert [len(on.out[q.request_id].terminal.result.token_ids) for q in requests] == lengths
    assert on.eng.decoder.pipelined_steps >= 15
    assert on.eng.graphs.static_steps == off.eng.graphs.static_steps  # no step launched that no row needed
    assert all(
        isinstance(on.eng.step_log[i][2], float) and on.eng.step_log[i][2] > 0 for i in range(len(on.eng.step_log))
    )


def rule_release_point(tokenizer, tokens: list[int], least: int) -> int:
    """Where the SENTENCE_END rule releases a request that would decode `tokens` with its adapter
    (the first token that ends a sentence at or past `least` tokens, then one more; 0: never
    before the last token), from the text the worker streams."""
    from services.worker.detokenizer import IncrementalDetokenizer
    from services.worker.release import SentenceEnds

    detok, ends = IncrementalDetokenizer(tokenizer), SentenceEnds()
    for k, token in enumerate(tokens, 1):
        detok.push(token)
        if ends.ended(detok.text) and k >= least:
            return k + 1 if k + 1 < len(tokens) else 0
    return 0


def test_sentence_end_rule_releases_at_one_position_pipelined_or_not(model_path):
    """The SENTENCE_END rule decides from the streamed text, which the host sees one step late
    when pipelined: its release point (one token past the sentence end) is the same position
    either way — every event equal with pipelining on and off — and up to it the tokens are
    the adapter's (the run without release); a least share (0.25 of 24: 6 tokens) moves it on.
    The tiny model's text has no punctuation of its own: a small bias on "." gives it some."""
    from services.worker.model import load_processor
    from services.common.release_rules import ReleaseRule

    tokenizer = load_processor(model_path).tokenizer
    n, adapters = 24, [A, B, A, B, None, A]
    dots = SamplingParams(logit_bias=((tokenizer.convert_tokens_to_ids("."), 0.7),))
    plain = run(model_path, [req(i, n, adapter=a, sampling=dots) for i, a in enumerate(adapters)], False)
    ruled = [
        req(i, n, adapter=a, sampling=dots, adapter_release_rule=ReleaseRule.SENTENCE_END)
        for i, a in enumerate(adapters)
    ]
    ruled[2].adapter_release_fraction = ruled[3].adapter_release_fraction = 0.25
    on, off = same_both_ways(model_path, ruled)
    released = 0
    for q in ruled:
        full = plain.out[q.request_id].terminal.result.token_ids
        want = rule_release_point(tokenizer, full, 6 if q.adapter_release_fraction else 0) if q.adapter else 0
        got = [r.out[q.request_id].terminal.result for r in (on, off)]
        assert [g.released_after_tokens for g in got] == [want, want], q.request_id
        if want:
            assert got[0].token_ids[:want] == full[:want] and got[0].token_ids != full, q.request_id
            released += 1
    assert released >= 2, "the tiny model's text ended no sentence: the test has no teeth"
    assert on.eng.decoder.pipelined_steps >= 15


def test_stop_sequences(model_path):
    base = run(model_path, [req(i, 16) for i in range(4)], False)
    texts = {rid: o.terminal.result.text for rid, o in base.out.items()}
    assert all(len(t) >= 8 for t in texts.values())
    requests = [
        req(0, 16, stop=[texts["r0"][3:5]]),
        req(1, 16, stop=[texts["r1"][6:8]]),
        req(2, 16),
        req(3, 16, stop=["no such text"]),
    ]
    on, _ = same_both_ways(model_path, requests)
    reasons = [on.out[q.request_id].terminal.result.finish_reason for q in requests]
    assert reasons == [FinishReason.STOP_SEQUENCE, FinishReason.STOP_SEQUENCE, FinishReason.LENGTH, FinishReason.LENGTH]
    assert on.eng.decoder.pipelined_steps >= 5


def test_eos(model_path):
    """An EOS id the greedy path produces mid-decode for one request, and nowhere before that."""
    requests = [req(i, 20) for i in range(4)]
    tokens = {rid: o.terminal.result.token_ids for rid, o in run(model_path, requests, False).out.items()}
    k, eos = next(
        (k, t)
        for k, t in enumerate(tokens["r1"])
        if k >= 3
        and t not in tokens["r1"][:k]
        and all(t not in ts[: k + 1] for rid, ts in tokens.items() if rid != "r1")
    )
    on, _ = same_both_ways(model_path, requests, eos={eos})
    assert on.out["r1"].terminal.result.finish_reason == FinishReason.EOS
    assert on.out["r1"].terminal.result.token_ids == tokens["r1"][: k + 1]
    assert on.eng.decoder.pipelined_steps >= k - 2


def test_cancellation_mid_decode_frees_the_kv_cache(model_path):
    """r1 is cancelled from its sink at its 5th text delta; the others go on; KV bytes end at 0."""

    def hook(r: Run, rid: str, ev) -> None:
        if rid == "r1" and isinstance(ev, TextDelta) and r.out[rid].deltas == 5:
            r.handles[rid].cancel()

    on, off = same_both_ways(model_path, [req(0, 14), req(1, 40), req(2, 24)], hook=hook)
    for r in (on, off):
        assert r.out["r1"].terminal.error.reason == "CANCELLED" and r.out["r1"].deltas == 5
        assert r.out["r2"].terminal.result.finish_reason == FinishReason.LENGTH
        assert r.eng.stats().kv_cache_bytes == 0 and r.eng.stats().running == 0
    assert on.eng.decoder.pipelined_steps >= 10


def test_sampled_rows_pipeline_too(model_path):
    """Seeded sampled rows (top-k and top-p) in the batch for the whole decode: their tokens are
    chosen on the device, so steps pipeline as with greedy rows only, and the outputs are those
    of the unpipelined engine."""
    top_k = SamplingParams(temperature=0.8, top_k=20, seed=7)
    top_p = SamplingParams(temperature=1.0, top_p=0.9, seed=8)
    requests = [req(0, 8), req(1, 20, sampling=top_k, adapter=A), req(2, 12, adapter=B, sampling=top_p), req(3, 5)]
    on, _ = same_both_ways(model_path, requests)
    assert on.eng.decoder.pipelined_steps >= 10


def test_logit_bias_holds_in_every_step_pipelined_too(model_path):
    """OpenAI's logit_bias on greedy rows (chosen on the device, never the raw argmax): +100 on one
    token makes every token that one; -100 on the plain answer's tokens keeps each of them out of
    every step; a row without a bias in the batch keeps its answer. Pipelined as unpipelined."""
    plain = run(model_path, [req(0, 12), req(1, 12)], False)
    answer = {rid: o.terminal.result.token_ids for rid, o in plain.out.items()}
    forced = next(t for t in range(300, 600) if t not in answer["r0"])
    banned = tuple((t, -100.0) for t in sorted(set(answer["r0"])))
    requests = [
        req(0, 12, sampling=SamplingParams(logit_bias=((forced, 100.0),))),
        req(1, 12),
        WorkRequest(
            "ban",
            "Describe the image.",
            [random_image(0)],
            max_new_tokens=12,
            sampling=SamplingParams(logit_bias=banned),
        ),
    ]
    on, _ = same_both_ways(model_path, requests)
    got = {rid: o.terminal.result.token_ids for rid, o in on.out.items()}
    assert got["r0"] == [forced] * 12
    assert got["r1"] == answer["r1"]
    assert len(got["ban"]) == 12 and not set(got["ban"]) & set(answer["r0"])
    assert got["ban"][0] != answer["r0"][0]  # the greedy token, banned, changed
    assert on.eng.decoder.pipelined_steps >= 10


def test_requests_joining_mid_decode(model_path):
    """Requests submitted from a sink mid-decode (deterministic step): they join the running
    batch (a prefill, then a re-pack) and everyone's outputs are unchanged. Their tokens
    interleave differently: the step after the submit was already launched when pipelined, so
    they join one step later."""

    def hook(r: Run, rid: str, ev) -> None:
        if rid == "r0" and isinstance(ev, TextDelta) and r.out[rid].deltas in (4, 9):
            n = r.out[rid].deltas
            r.submit(req(10 + n, 12, adapter=A))
            r.submit(req(20 + n, 7))

    on, _ = same_both_ways(model_path, [req(0, 24), req(1, 18, adapter=B)], same_order=False, hook=hook, expect=6)
    assert set(on.out) == {"r0", "r1", "r14", "r24", "r19", "r29"}
    assert on.eng.decoder.peak_rows >= 4
    # every decode step, those right after a join too, launched from the pending device tokens
    # (the prefill's first ones included): the host never waited for the device between them
    assert on.eng.decoder.pipelined_steps == on.eng.graphs.static_steps >= 20


def test_commands_run_between_fully_taken_steps(model_path):
    """A command (mode switch, ...) queued mid-decode runs with no decode step pending: the
    requests it affects have taken every token launched before it."""
    seen = []

    def hook(r: Run, rid: str, ev) -> None:
        if rid == "r0" and isinstance(ev, TextDelta) and r.out[rid].deltas in (3, 8):
            run = r.eng.adapters.run  # a probe command: what is pending when it runs
            pending = r.eng.decoder
            r.eng.adapters.run = lambda c, run=run: seen.append(list(pending.pending)) if c.name == "probe" else run(c)
            with r.eng._wake:
                r.eng.inbox._commands.append((Command("probe"), threading.Event(), {}))

    on, _ = same_both_ways(model_path, [req(0, 16), req(1, 20, adapter=A)], hook=hook)
    assert seen == [[]] * 4 and on.eng.decoder.pipelined_steps >= 8


def test_the_next_step_launches_before_the_previous_tokens_are_accepted(model_path):
    """The order of events for one greedy request of N tokens: the first from the prefill, then
    decode steps L1..L(N-1). Pipelined, step k+1 is launched before step k's token is accepted
    (L1 before the prefill's), and no step follows the last token's (N-1 launches, no
    speculative one)."""
    n = 12
    for pipeline in (False, True):
        eng = Engine(EngineConfig(model_path=model_path, decode_graphs="static", pipeline_decode=pipeline))
        eng.eos_ids = set()
        log: list[str] = []
        step, accept = eng.graphs.step, eng.outputs.accept

        def launch(*a, step=step, **kw):
            log.append(f"L{eng.graphs.static_steps + 1}")
            return step(*a, **kw)

        def accepted(s, token, *rest, accept=accept):
            log.append(f"t{len(s.tokens) + 1}")
            accept(s, token, *rest)

        eng.graphs.step, eng.outputs.accept = launch, accepted
        eng.start()
        try:
            _, result = eng.generate(req(0, n))
        finally:
            eng.stop()
        assert len(result.token_ids) == n
        if pipeline:  # the prefill's token too is taken once the step it feeds is launched
            want = [x for k in range(1, n) for x in (f"L{k}", f"t{k}")] + [f"t{n}"]
            assert eng.decoder.pipelined_steps == n - 1
        else:
            want = ["t1"] + [x for k in range(1, n) for x in (f"L{k}", f"t{k + 1}")]
        assert log == want


def test_stopping_the_engine_takes_the_pending_step(model_path):
    """The engine stops (set from a sink: deterministic) while a step is pending: the tokens
    already launched reach their requests, then ENGINE_DOWN; every stream is a prefix of the
    full answer, nothing duplicated."""
    full = run(model_path, [req(0, 20), req(1, 20)], True)
    seen = {}

    def hook(r: Run, rid: str, ev) -> None:
        if rid == "r0" and isinstance(ev, TextDelta) and r.out[rid].deltas == 6:
            r.eng.inbox.stop.set()
            seen["seq"] = next(s for s in r.eng.sched.running if s.req.request_id == rid)
            seen["tokens"] = len(seen["seq"].tokens)

    stopped = run(model_path, [req(0, 20), req(1, 20)], True, hook=hook)
    well_formed(stopped)
    for rid, o in stopped.out.items():
        assert o.terminal.error.reason == "ENGINE_DOWN"
        text = "".join(e.text for e in o.events if isinstance(e, TextDelta))
        assert full.out[rid].terminal.result.text.startswith(text)
    s = seen["seq"]
    assert len(s.tokens) == seen["tokens"] + 1  # the step launched before the stop was seen
    assert s.tokens == full.out["r0"].terminal.result.token_ids[: len(s.tokens)]


def test_pipeline_decode_setting(monkeypatch):
    for name in ("VALORA_PIPELINE_DECODE",):
        monkeypatch.delenv(name, raising=False)
    assert WorkerSettings().pipeline_decode is True and engine_config(WorkerSettings()).pipeline_decode
    monkeypatch.setenv("VALORA_PIPELINE_DECODE", "false")
    assert engine_config(WorkerSettings()).pipeline_decode is False
    monkeypatch.setenv("VALORA_PIPELINE_DECODE", "sometimes")
    with pytest.raises(ValueError, match="pipeline_decode"):
        WorkerSettings()


@pytest.mark.parametrize("flags, on", [([], True), (["--no-pipeline"], False)], ids=["default", "no-pipeline"])
def test_engine_bench_records_pipelining(tmp_path, flags, on):
    engine_bench.main(
        [
            "--arch",
            "tiny",
            "--model-dir",
            str(tmp_path / "tiny"),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--batch",
            "2",
            "--adapters",
            "1",
            "--new-tokens",
            "5",
            "--reps",
            "1",
            "--warmup",
            "0",
            "--skip-peer",
            "--decode-graphs",
            "static",
            "--out-dir",
            str(tmp_path),
            "--name",
            "e",
            *flags,
        ]
    )
    detail = json.loads((tmp_path / "e.detail.json").read_text())["valora"]
    assert detail["pipeline_decode"] is on
    assert (detail["pipelined_steps"] > 0) is on
