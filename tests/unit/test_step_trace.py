"""The engine's step trace (VALORA_STEP_TRACE): one line per step with its queues, rows and each
phase's host time, and the summary bench/step_trace_summary.py makes of it."""

from __future__ import annotations

import json

from bench.step_trace_summary import prefill_fit, summarize
from services.worker.engine import Engine, EngineConfig
from services.worker.requests import WorkRequest
from services.worker.testing import TEST_KV_BYTES, random_image
from tests.unit.test_engine import run_concurrently


def test_every_step_is_traced_with_its_rows_and_phases(model_path, tmp_path):
    path = tmp_path / "steps.jsonl"
    eng = Engine(
        EngineConfig(
            model_path=model_path,
            max_batch_size=4,
            max_prefills_per_step=2,
            kv_cache_bytes=TEST_KV_BYTES,
            default_max_new_tokens=4,
            step_trace=str(path),
        )
    )
    eng.eos_ids = set()  # every request decodes its 4 tokens
    eng.start()
    try:
        requests = [WorkRequest(request_id=f"r{i}", prompt="what is this?", images=[random_image(i)]) for i in range(3)]
        contexts = [eng.prepare(r).prompt_tokens for r in requests]
        run_concurrently(eng, requests)
    finally:
        eng.stop()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == eng.steps
    for r in records:
        assert set(r["host_ms"]) >= {"admit", "prefill", "decode", "sync"}, r
        assert "gpu_ms" not in r  # CPU: no device spans
    prefills = [r for r in records if r["prefill_rows"]]
    # one step admits all three, prefilled two then one (max_prefills_per_step)
    assert [r["prefill_rows"] for r in prefills] == [2, 1]
    assert sum(r["prefill_tokens"] for r in prefills) == sum(contexts)
    assert prefills[0]["queued"] == 3 and prefills[1]["prefilling"] == 1
    assert all("inputs" in r["host_ms"] for r in prefills)
    # each row's 2nd..4th token in a decode step; pipelined, a row may ride one more step the host
    # only then finds it finished
    assert 3 * 3 <= sum(r["decode_rows"] for r in records) <= 3 * 4

    summary = summarize(records)
    assert summary["steps"] == len(records)
    assert summary["prefill"]["steps"] == 2 and summary["prefill"]["prefill_rows"] == 1.5
    assert summary["decode_only"]["steps"] == len(records) - 2
    assert summarize(records, start=records[-1]["t"] + 1)["steps"] == 0


def test_the_prefill_fit_splits_a_step_into_prompt_tokens_and_the_rest():
    """Device times made of 14 ms a step plus 22 us a prompt token (riders beside each prefill)
    give that fit back, whatever one warm-up step took; decode-only steps and CPU traces (no
    device times) give none."""
    records = [
        {
            "t": float(i),
            "queued": 1,
            "prefilling": 0,
            "running": 100,
            "prefill_rows": 2,
            "prefill_tokens": n,
            "decode_rows": 100,
            "host_ms": {"prefill": 1.0},
            "gpu_ms": {"prefill": 14.0 + 0.022 * n},
        }
        for i, n in enumerate((300, 900, 1800, 2600, 3100))
    ]
    records[0]["gpu_ms"]["prefill"] = 900.0  # a step that captured its graph
    records.append(
        {
            "t": 9.0,
            "queued": 0,
            "prefilling": 0,
            "running": 100,
            "prefill_rows": 0,
            "prefill_tokens": 0,
            "decode_rows": 100,
            "host_ms": {"decode": 1.0},
            "gpu_ms": {"decode": 12.0},
        }
    )
    fit = summarize(records)["prefill_fit"]
    assert fit["us_per_token"] == 22.0 and fit["fixed_ms"] == 14.0 and fit["steps"] == 5, fit
    cpu = [{k: v for k, v in r.items() if k != "gpu_ms"} for r in records]
    assert prefill_fit(cpu) is None and "prefill_fit" not in summarize(cpu)
