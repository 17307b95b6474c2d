"""The decode step over the paged KV cache (decode_graphs.py) in the engine, on the tiny Qwen2-VL
(fp32, CPU, no capture): one graph key per padded batch size whatever the batch's composition,
preemption when the pool runs out giving the same tokens as a pool that never does, and a
request that could never fit refused when prepared."""

from __future__ import annotations

import queue

import pytest

from services.common.errors import InvalidArgument
from services.worker.decode_graphs import bucket_rows
from services.worker.engine import Engine, EngineConfig
from services.worker.requests import Failed, Finished, WorkRequest
from services.common.modes import Mode
from services.worker.sampling import SamplingParams
from services.worker.testing import load_random_adapters, random_image

A, B = "adapters/alpha/versions/1", "adapters/beta/versions/1"


def requests() -> list[WorkRequest]:
    adapters = [None, A, B, A, B, None]
    lengths = [3, 40, 9, 17, 40, 1]  # rows leave at different steps
    out = [
        WorkRequest(
            f"r{i}", "Describe the image." + " more" * i, [random_image(i)], adapter=adapters[i], max_new_tokens=n
        )
        for i, n in enumerate(lengths)
    ]
    out.append(
        WorkRequest(
            "sampled",
            "What color?",
            [random_image(9)],
            adapter=A,
            max_new_tokens=12,
            sampling=SamplingParams(temperature=0.8, top_k=20, seed=7),
        )
    )
    return out


def run(
    model_path, reqs: list[WorkRequest] | None = None, merged: Mode | None = None, before=None, **config
) -> tuple[dict, Engine]:
    """`before(engine)`: called once the adapters are loaded, before the requests."""
    reqs = reqs or requests()
    config = {"decode_graphs": "static", "max_batch_size": 8, "max_prefills_per_step": 8, "device_slots": 3, **config}
    eng = Engine(EngineConfig(model_path=model_path, **config))
    eng.eos_ids = set()  # every request runs its full length
    eng.start()
    try:
        load_random_adapters(eng, model_path, (A, B))
        if merged is not None:
            eng.set_mode(merged, A)
        if before is not None:
            before(eng)
        events: queue.Queue = queue.Queue()
        with eng._wake:  # all admitted in one step: identical batches in every run
            for r in reqs:
                eng.submit(eng.prepare(r), events.put)
        out = {}
        while len(out) < len(reqs):
            ev = events.get(timeout=120)
            if isinstance(ev, Failed):
                raise ev.error
            if isinstance(ev, Finished):
                out[ev.result.request_id] = ev.result.token_ids
        return out, eng
    finally:
        eng.stop()


def test_one_key_per_batch_bucket(model_path):
    # 8 rows leaving one by one, adapters mixed: whatever the rows' composition, lengths and
    # blocks, a step's key is its padded row count (and whether LoRA runs).
    lengths = [2, 3, 4, 5, 6, 30, 30, 30]
    reqs = [
        WorkRequest(
            f"r{i}",
            "Describe the image." + " more" * i,
            [random_image(i)],
            adapter=(None, A, B)[i % 3],
            max_new_tokens=n,
        )
        for i, n in enumerate(lengths)
    ]
    out, eng = run(model_path, reqs)
    assert [len(out[r.request_id]) for r in reqs] == lengths
    g = eng.graphs
    assert {k[0] for k in g.entries} == {bucket_rows(n) for n in (8, 7, 6, 5, 4, 3)} == {8, 6, 4, 3}
    assert g.new_keys == len(g.entries) <= 2 * 4  # every key made once: nothing else forces a new one
    assert g.static_steps > 25 and g.replays == 0 and g.eager_steps == 0  # no CUDA: nothing captured
    assert eng.kv.used_blocks == 0


@pytest.mark.parametrize("merged", [None, Mode.MIXTURE], ids=["unmerged", "mixture"])
def test_preemption_recomputes_the_same_tokens(model_path, merged):
    roomy, eng = run(model_path, merged=merged)
    assert eng.sched.preemptions == 0
    # 30 blocks of 8 tokens: the 7 prompts (~30-40 tokens each) fit, their growth does not
    block_bytes = eng.kv_pool.block_bytes // (eng.kv.block_size // 8)
    tight, eng = run(model_path, merged=merged, kv_block_size=8, kv_cache_bytes=31 * block_bytes)
    assert eng.kv.usable_blocks == 30
    assert eng.sched.preemptions > 0
    assert tight == roomy
    assert eng.kv.used_blocks == 0


def test_request_larger_than_the_pool_is_refused(model_path):
    eng = Engine(EngineConfig(model_path=model_path, kv_block_size=8, kv_cache_bytes=1 << 16))
    too_long = WorkRequest("big", "Describe the image.", [random_image(0)], max_new_tokens=eng.kv.usable_blocks * 8)
    with pytest.raises(InvalidArgument) as e:
        eng.prepare(too_long)
    assert e.value.reason == "EXCEEDS_KV_CACHE"
    eng.prepare(WorkRequest("fits", "Hi.", [], max_new_tokens=4))


@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
def test_a_row_that_fails_while_decoding_fails_alone(model_path, monkeypatch, pipeline):
    # The poisoned request's detokenizer raises at its 5th token: that request fails, the others
    # in its batch run to their lengths, and its blocks go back to the pool.
    from services.worker import prefiller

    class Poisoned(prefiller.IncrementalDetokenizer):
        def push(self, token):
            if "POISON" in self._stop and len(self._ids) >= 4:
                raise RuntimeError("poisoned row")
            return super().push(token)

    monkeypatch.setattr(prefiller, "IncrementalDetokenizer", Poisoned)
    reqs = requests()
    reqs[1] = WorkRequest(
        "poisoned", "Describe the image.", [random_image(1)], adapter=A, max_new_tokens=20, stop=["POISON"]
    )
    eng = Engine(
        EngineConfig(
            model_path=model_path,
            decode_graphs="static",
            max_batch_size=8,
            max_prefills_per_step=8,
            device_slots=3,
            pipeline_decode=pipeline,
        )
    )
    eng.eos_ids = set()
    eng.start()
    try:
        load_random_adapters(eng, model_path, (A, B))
        events: queue.Queue = queue.Queue()
        with eng._wake:
            for r in reqs:
                eng.submit(eng.prepare(r), lambda ev, rid=r.request_id: events.put((rid, ev)))
        ends = {}
        while len(ends) < len(reqs):
            rid, ev = events.get(timeout=120)
            if isinstance(ev, (Failed, Finished)):
                ends[rid] = ev
    finally:
        eng.stop()
    assert isinstance(ends.pop("poisoned"), Failed)
    assert {rid: len(ev.result.token_ids) for rid, ev in ends.items()} == {
        r.request_id: r.max_new_tokens for r in reqs if r.request_id != "poisoned"
    }
    assert eng.kv.used_blocks == 0


def test_chunked_prefill_interleaves_decode_and_gives_the_same_tokens(model_path):
    # A 24-token budget: every prompt (~30-40 tokens with its image) is prefilled in chunks, one
    # request at a time, while the ones before it decode; with a tight pool some are preempted
    # and prefilled again in chunks over prompt + generated tokens. Tokens as prefilled whole.
    whole, eng = run(model_path)
    block_bytes = eng.kv_pool.block_bytes // (eng.kv.block_size // 8)
    chunked, eng = run(model_path, max_prefill_tokens=24, kv_block_size=8, kv_cache_bytes=31 * block_bytes)
    assert chunked == whole
    assert eng.sched.preemptions > 0
    beside = [d for p, d, _ in eng.step_log if p == 1 and d > 0]  # a chunk and a decode step in one step
    assert len(beside) >= 6, eng.step_log
    assert eng.kv.used_blocks == 0
