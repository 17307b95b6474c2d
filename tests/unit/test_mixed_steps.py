"""Mixed steps (mixed_step.py) on the tiny Qwen2-VL (fp32, CPU, static decode step): requests
joining mid-decode are prefilled in forwards the running rows decode in too, and every request
gets the tokens, log-probabilities, text and finish reason it gets with the prefill and the decode
step apart — pipelined or not, greedy and seeded sampled rows, adapters and none, chunked prompts;
a mixed forward that raises after it moved the rows on runs the two forwards apart, unchanged."""

from __future__ import annotations

import os
import queue
import threading
import time
from types import SimpleNamespace

import pytest

from services.worker.engine import Engine, EngineConfig
from services.worker.prefill_graphs import bucket_tokens
from services.worker.requests import Failed, Finished, TextDelta, WorkRequest
from services.worker.sampling import SamplingParams
from services.worker.step_scheduler import StepScheduler
from services.worker.testing import TEST_KV_BYTES, load_random_adapters, random_image

A, B = "adapters/alpha/versions/1", "adapters/beta/versions/1"
DEVICE = os.environ.get("VALORA_TEST_DEVICE", "cpu")  # fp32 on CUDA too: the H200 session runs it there


def req(i: int, n: int, **kw) -> WorkRequest:
    return WorkRequest(f"r{i}", "Describe the image." + " more" * i, [random_image(i)], max_new_tokens=n, **kw)


def first() -> list[WorkRequest]:
    return [
        req(0, 20),
        req(1, 14, adapter=B, logprobs=2),
        req(2, 16, adapter=A, sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=5)),
    ]


def joiners(n: int) -> list[WorkRequest]:
    """Submitted when r0 has streamed n tokens: they prefill while the first ones decode."""
    return [
        req(10 + n, 6, adapter=A),
        req(20 + n, 5, logprobs=1),
        req(30 + n, 7, adapter=B, sampling=SamplingParams(temperature=1.0, top_k=20, seed=n)),
        WorkRequest(
            f"long{n}",
            "Tell me everything about this picture. " * 6,
            [random_image(40 + n)],
            max_new_tokens=4,
            adapter=A,
        ),
    ]


def run(model_path, mixed: bool, pipeline: bool = True, patch=None) -> tuple[Engine, dict]:
    """The workload on a fresh engine; returns it (stopped) and each request's summary."""
    eng = Engine(
        EngineConfig(
            model_path=model_path,
            device=DEVICE,
            decode_graphs="static",
            pipeline_decode=pipeline,
            mixed_steps=mixed,
            max_batch_size=12,
            max_prefills_per_step=3,
            max_prefill_tokens=160,
            device_slots=3,  # "long…" prefills in chunks
            kv_cache_bytes=TEST_KV_BYTES,
        )
    )  # on CUDA: not sized by what the last engine left
    eng.eos_ids = set()
    if patch is not None:
        patch(eng)
    eng.start()
    events: dict[str, list] = {}
    ended: queue.Queue = queue.Queue()

    def submit(r: WorkRequest) -> None:
        got = events[r.request_id] = []

        def sink(ev):
            got.append(ev)
            if (
                r.request_id == "r0"
                and isinstance(ev, TextDelta)
                and sum(isinstance(e, TextDelta) for e in got) in (3, 8)
            ):
                for j in joiners(len(got)):  # on the engine thread: deterministic
                    submit(j)
            if isinstance(ev, (Finished, Failed)):
                ended.put(r.request_id)

        eng.submit(eng.prepare(r), sink)

    try:
        load_random_adapters(eng, model_path, (A, B))
        with eng._wake:
            for r in first():
                submit(r)
        for _ in range(3 + 2 * 4):
            ended.get(timeout=180)
        for _ in range(500):
            if eng.stats().running == 0 and eng.stats().kv_cache_bytes == 0:
                break
            time.sleep(0.01)
    finally:
        eng.stop()
    return eng, {rid: summary(evs) for rid, evs in events.items()}


def summary(events: list) -> tuple:
    ends = [e for e in events if isinstance(e, (Finished, Failed))]
    assert ends == [events[-1]], "one terminal event, the last one"
    end = events[-1]
    assert isinstance(end, Finished), end
    r = end.result
    # log-probabilities from another forward's batch agree to rounding
    lps = tuple((lp.token_id, pytest.approx(lp.logprob, abs=1e-4)) for lp in r.logprobs)
    return "".join(e.text for e in events if isinstance(e, TextDelta)), tuple(r.token_ids), r.finish_reason, lps


@pytest.fixture(scope="module")
def apart(model_path):
    eng, out = run(model_path, mixed=False)
    assert eng.mixed is None
    return out


def watch_riders(eng: Engine, seen: list) -> None:
    """Records what each mixed step reports to the decoder's peaks, and its riders' adapters."""
    run_, observe = eng.mixed.run, eng.decoder.observe
    inside = []

    def mixed_run(batch):
        inside.append(sorted(str(s.req.adapter) for s in eng.sched.running if s not in batch))
        try:
            return run_(batch)
        finally:
            inside.pop()

    def observed(rows, entries):
        if inside:
            seen.append((rows, entries, len(set(inside[-1]) - {"None"})))
        observe(rows, entries)

    eng.mixed.run, eng.decoder.observe = mixed_run, observed


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "serial"])
def test_mixed_steps_give_every_request_its_tokens(model_path, apart, pipeline):
    seen: list = []
    eng, out = run(model_path, mixed=True, pipeline=pipeline, patch=lambda e: watch_riders(e, seen))
    assert out == apart
    assert len(out) == 11
    assert eng.mixed.steps >= 4 and eng.mixed.fallbacks == 0  # both joins (and the chunks) rode
    assert eng.kv.used_blocks == 0
    # every mixed step counts in the decoder's peaks: its riders and their distinct LoRA entries
    assert len(seen) >= eng.mixed.steps and any(entries >= 2 for _, entries, _ in seen), seen
    assert all(entries == adapters for _, entries, adapters in seen), seen


def test_a_mixed_forward_that_raises_runs_both_apart(model_path, apart):
    """The forward raises after it cached its tokens and moved every row on (the riders'
    lengths, the pieces' `prefilled`): each row is put back and the step runs as two forwards."""

    def patch(eng: Engine) -> None:
        real = eng.runner.prefill
        failures = []

        def prefill(rows, step, riders=None):
            got = real(rows, step, riders)
            if riders is not None and len(failures) < 2:
                failures.append(1)
                raise RuntimeError("injected after the mixed forward")
            return got

        eng.runner.prefill = prefill

    eng, out = run(model_path, mixed=True, patch=patch)
    assert out == apart
    assert eng.mixed.fallbacks == 2 and eng.mixed.steps >= 2


def test_padding_filled_beside_riders_stays_in_the_bucket():
    """prefill_fill_padding with mixed steps: the running rows ride in the forward, a token each,
    so the pieces filled into its bucket leave them room (without: 1090 + 100 riders run 1280)."""
    config = SimpleNamespace(
        max_prefills_per_step=4, max_prefill_tokens=1000, prefill_fill_padding=True, mixed_steps=True
    )
    sched = StepScheduler(config, None, None, threading.Condition(), padded=bucket_tokens)
    plain = SimpleNamespace(slo_left_s=None)  # no latency objective: the queue's order
    sched.prefill.extend(SimpleNamespace(context=n, prefilled=0, prefill_to=0, req=plain) for n in (900, 600))
    sched.running.extend(object() for _ in range(100))
    batch = sched.take_prefills(0.0)
    tokens = sum(s.prefill_to - s.prefilled for s in batch) + len(sched.running)
    assert len(batch) == 2 and tokens == bucket_tokens(900 + 100) == 1024
    config.mixed_steps = False  # nobody rides: the pieces fill the bucket alone
    sched.prefill[0].prefill_to = sched.prefill[1].prefill_to = 0
    batch = sched.take_prefills(0.0)
    assert sum(s.prefill_to - s.prefilled for s in batch) == 1024
