"""bench/orchestration_bench.py: the two-app schedule turned into requests (video chunks of four
frames to task heads, retrieval questions to text tasks, the same text in every policy's run), then
the bench for real on the CPU with the tiny model under two policies (the scheduler restarted
between them): a row per policy and application, every request served, video answered by task
heads, attainment and latencies well formed, the scheduler's own SLO counts agreeing, no process
left."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_scale_bench import processes_of  # the same VALORA_HOME scan (tests/e2e is on sys.path)

from bench.orchestration_bench import build_requests, parse_args, touch_trace
from services.scheduler.traces import adapter_names, two_app_trace, video_adapter_names
from valora.cluster import STATE_FILE
from valora_protos.v1 import types_pb2

REPO = Path(__file__).resolve().parents[2]
WORDS = [" alpha", " beta", " gamma", " delta", " omega"]


def test_schedule_becomes_task_requests():
    trace = two_app_trace(seconds=5, streams=3, retrieval_rate=4, video_tasks=2, retrieval_adapters=3, seed=1)
    task_of = {
        **{n: f"tasks/video-{i}" for i, n in enumerate(video_adapter_names(2))},
        **{n: f"tasks/retrieval-{j}" for j, n in enumerate(adapter_names(3))},
    }
    pngs = [f"png-{k}".encode() for k in range(sum(r.images for r in trace))]
    reqs = build_requests(trace, task_of, WORDS, pngs, "valora")
    assert [img.data for r in reqs for img in r.input.images] == pngs  # taken in order, each once
    for t, r in zip(trace, reqs, strict=True):
        assert r.request_id == f"valora-{t.request_id}" and r.input.task == task_of[t.adapter]
        assert len(r.input.prompt.split()) == t.prompt_tokens  # one word, one token
        if t.slo_class == "video":  # a chunk of 4 frames to a task head
            assert len(r.input.images) == 4 and r.input.output_kind == types_pb2.OUTPUT_KIND_LABEL
        else:
            assert len(r.input.images) == 1 and r.input.output_kind == types_pb2.OUTPUT_KIND_TEXT
            assert r.input.params.max_new_tokens == t.output_tokens >= 2
    assert {t.slo_class for t in trace} == {"video", "retrieval"}
    # the same text for every policy's run (images aside)
    again = build_requests(trace, task_of, WORDS, pngs, "slora")
    assert [r.input.prompt for r in again] == [r.input.prompt for r in reqs]
    # the warm-up touches every task once
    args = parse_args(["--video-tasks", "2", "--retrieval-adapters", "3"])
    assert sorted(task_of[t.adapter] for t in touch_trace(args)) == sorted(task_of.values())


@pytest.mark.e2e
def test_two_policies_on_the_cpu(model_path, tmp_path):
    home, out = tmp_path / "home", tmp_path / "orchestration.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.orchestration_bench",
        "--model",
        str(model_path),
        "--home",
        str(home),
        "--out",
        str(out),
        "--policies",
        "valora,slora",
        "--streams",
        "2",
        "--rate",
        "2",
        "--duration",
        "2.5",
        "--warmup-s",
        "0",  # every task once only
        "--video-tasks",
        "2",
        "--retrieval-adapters",
        "2",
        "--mean-output-tokens",
        "4",
        "--max-output-tokens",
        "6",
    ]
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # no copy of the results elsewhere
    t0 = time.monotonic()
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    data = json.loads(out.read_text())
    info, rows = data["info"], data["rows"]
    assert data["failures"] == []
    assert info["workload"] == "two-app" and info["device"] == "cpu" and info["git_commit"] and info["gpus"] == 0
    assert info["args"]["policies"] == ["valora", "slora"] and info["args"]["frames"] == 4
    schedule = info["schedule"]
    assert [(r["policy"], r["app"]) for r in rows] == [
        (p, a) for p in ("valora", "slora") for a in ("video", "retrieval")
    ]
    assert info["policies"]["slora"]["scheduler_restart_s"] > 0 and info["policies"]["slora"]["warmup_failed"] == 0
    for r in rows:
        assert r["requests"] == schedule[r["app"]]["requests"] > 0, r  # the same schedule for each policy
        assert r["ok"] == r["requests"] and r["failed"] == 0 and r["errors"] == {}, r
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("mean_ms", "p50_ms", "p99_ms", "throughput_rps")), r
        assert r["p50_ms"] <= r["p99_ms"]
        assert 0 <= r["attainment"] <= 1 and r["within"] + r["over"] == r["requests"], r
        assert r["slo_ms"] == (1000.0 if r["app"] == "video" else 5000.0)
        # the scheduler counted every request of the class; it saw less of each one's time than the client
        assert sum(r["scheduler_slo"].values()) == r["requests"] and r["scheduler_slo"]["within"] >= r["within"], r
        assert r["switches_per_s"] >= 0 and set(r["mode_switches"]) == {"merge", "unmerge", "switch"}
        assert sum(r["modes"].values()) == r["ok"]
        if r["app"] == "video":  # every chunk answered by its task head, no text
            assert r["labels"] == r["ok"] and r["output_tokens"] == 0, r
        else:
            assert r["labels"] == 0 and r["output_tokens"] > 0, r
    by = {(r["policy"], r["app"]): r for r in rows}
    # the restarted scheduler ran slora: every request unmerged, no weights switched
    assert set(by["slora", "video"]["modes"]) | set(by["slora", "retrieval"]["modes"]) == {"unmerged"}
    assert by["slora", "video"]["switches_per_s"] == 0
    assert "attain" in run.stdout  # the rich table
    assert processes_of(home) == [] and not (home / STATE_FILE).exists()
    print(f"bench wall {time.monotonic() - t0:.1f} s")
