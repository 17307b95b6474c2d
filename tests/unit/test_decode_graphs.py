"""The static decode step that CUDA graphs capture (decode_graphs.py), run without capture on the
tiny Qwen2-VL (fp32, CPU): same tokens as the eager decode for mixed adapters, merged/mixture
modes, sequences joining and leaving (arena re-packs), sampled rows, and a cache that fills up
(the full step falls back to eager and grows the buffers)."""

from __future__ import annotations

import queue

import pytest

from services.worker.engine import Engine, EngineConfig
from services.worker.kv_batch import DecodeBatch
from services.worker.requests import Failed, Finished, Mode, WorkRequest
from services.worker.sampling import SamplingParams
from services.worker.testing import load_random_adapters, random_image

A, B = "adapters/alpha/versions/1", "adapters/beta/versions/1"


def requests() -> list[WorkRequest]:
    adapters = [None, A, B, A, B, None]
    lengths = [3, 40, 9, 17, 40, 1]  # rows leave at different steps: the batch re-packs
    out = [WorkRequest(f"r{i}", "Describe the image." + " more" * i, [random_image(i)], adapter=adapters[i],
                       max_new_tokens=n) for i, n in enumerate(lengths)]
    out.append(WorkRequest("sampled", "What color?", [random_image(9)], adapter=A, max_new_tokens=12,
                           sampling=SamplingParams(temperature=0.8, top_k=20, seed=7)))
    return out


def run(model_path, mode: str, merged: Mode | None = None, pad: bool = True,
        reqs: list[WorkRequest] | None = None) -> tuple[dict, Engine]:
    reqs = reqs or requests()
    eng = Engine(EngineConfig(model_path=model_path, decode_graphs=mode, max_batch_size=8, max_prefills_per_step=8,
                              device_slots=3, kv_headroom=4, pad_decode_rows=pad))
    eng.eos_ids = set()  # every request runs its full length
    eng.start()
    try:
        load_random_adapters(eng, model_path, (A, B))
        if merged is not None:
            eng.set_mode(merged, A)
        events: queue.Queue = queue.Queue()
        with eng._wake:  # all prefilled in one step: identical batches in both runs
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


@pytest.mark.parametrize("merged", [None, Mode.MIXTURE], ids=["unmerged", "mixture"])
def test_static_decode_equals_eager(model_path, merged, monkeypatch):
    monkeypatch.setattr(DecodeBatch, "MIN_CAPACITY", 16)  # prompts ~30 tokens + 40 new: the cache fills up
    eager, _ = run(model_path, "off", merged)
    static, eng = run(model_path, "static", merged)
    assert static == eager
    assert {len(t) for t in static.values()} == {3, 40, 9, 17, 1, 12}
    graphs = eng.graphs
    assert graphs is not None and graphs.captures == 0 and graphs.replays == 0  # no CUDA: never captured
    assert graphs.static_steps > 20  # most steps ran static ...
    assert len({k[1] for k in graphs.entries}) >= 2  # ... at more than one capacity (the cache grew)


def test_static_steps_pad_rows_to_a_power_of_two(model_path):
    # 8 rows leaving one by one down to 5: padded static steps stay on one 8-row key per KV
    # arena (the two arenas alternate at each re-pack), with the exact rows' tokens; exact-row
    # steps make a key at every batch size.
    lengths = [2, 3, 4, 30, 30, 30, 30, 30]
    reqs = [WorkRequest(f"r{i}", "Describe the image." + " more" * i, [random_image(i)],
                        adapter=(None, A, B)[i % 3], max_new_tokens=n) for i, n in enumerate(lengths)]
    padded, eng = run(model_path, "static", reqs=reqs)
    exact, eng_exact = run(model_path, "static", pad=False, reqs=reqs)
    assert padded == exact
    assert {k[0] for k in eng.graphs.entries} == {8}
    assert {k[0] for k in eng_exact.graphs.entries} >= {8, 6, 5}
    assert eng.graphs.new_keys == 2 < eng_exact.graphs.new_keys
    assert eng.graphs.static_steps == eng_exact.graphs.static_steps > 20


def test_eager_decode_plans_once_per_batch(model_path, monkeypatch):
    # Without static steps there is nothing to pad: a decode step plans its own rows once, and
    # steps of the same batch reuse that plan (40 decode steps, a handful of batch compositions).
    from services.worker import engine as engine_mod

    built = []
    step_lora = engine_mod.StepLora
    monkeypatch.setattr(engine_mod, "StepLora", lambda *a, **kw: built.append(a[1]) or step_lora(*a, **kw))
    out, eng = run(model_path, "off")
    assert len(out) == len(requests()) and eng.graphs is None
    assert len(built) < 15, len(built)
    assert all(len(rows) <= len(requests()) for rows in built)
