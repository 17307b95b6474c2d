"""bench/serve_bench.py: the mixed-vision request mix as a pure function (ranks round-robin, one
request in 8 with three images, sizes and decoding alternating, every adapter meeting every kind),
then the bench for real on the CPU with the tiny model: a closed-loop and a Poisson load twice each
on one cluster, rows well formed, every request served, the spread reported, no process left."""

from __future__ import annotations

import collections
import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_scale_bench import processes_of  # the same VALORA_HOME scan (tests/e2e is on sys.path)
from transformers import AutoTokenizer

from bench.serve_bench import (
    BLOCK,
    IMAGE_SIZES,
    MAX_NEW_TOKENS,
    RANKS,
    TOP_P,
    GpuSampler,
    adapter_ranks,
    build_requests,
    mix_summary,
    prompt_words,
    request_mix,
)
from valora.cluster import STATE_FILE

REPO = Path(__file__).resolve().parents[2]
ROW_KEYS = (
    "run",
    "throughput_rps",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
    "gpu_busy",
    "eager_decode_steps",
    "decode_graphs",
    "failed",
)
WORDS = [" alpha", " beta", " gamma", " delta", " omega"]


def test_request_mix_follows_the_workload():
    n = 32 * BLOCK  # 512: the block offsets' longest cycle (4 blocks x 8) comes round
    specs = request_mix(n, seed=7, words=WORDS)
    assert [s.index for s in specs] == list(range(n))
    assert adapter_ranks() == list(RANKS) * 4
    assert [s.adapter for s in specs] == [i % 16 for i in range(n)]  # adapters round-robin
    assert all(s.rank == RANKS[s.adapter % 4] for s in specs)  # ranks round-robin over the adapters
    assert [s.max_new_tokens for s in specs] == [MAX_NEW_TOKENS[i % 3] for i in range(n)]
    for b in range(n // BLOCK):
        block = specs[b * BLOCK : (b + 1) * BLOCK]
        sizes = [s.image_sizes[0] for s in block]
        greedy = [s.greedy for s in block]
        # alternating request to request within a block, half and half
        assert all(x != y for x, y in itertools.pairwise(sizes)) and sizes.count(IMAGE_SIZES[0]) == BLOCK // 2
        assert all(x != y for x, y in itertools.pairwise(greedy)) and sum(greedy) == BLOCK // 2
        assert sum(len(s.image_sizes) == 3 for s in block) == BLOCK // 8  # one in 8 with three images
    assert all(len(set(s.image_sizes)) == 1 and len(s.image_sizes) in (1, 3) for s in specs)
    assert all(20 <= s.prompt_tokens <= 60 and s.prompt_tokens == len(s.prompt.split()) for s in specs)
    assert {s.prompt_tokens for s in specs} >= {20, 60}
    # none of the kinds go together: every adapter meets every size, count and decoding, and
    # every combination of them occurs
    for a in range(16):
        mine = [s for s in specs if s.adapter == a]
        assert {s.image_sizes[0] for s in mine} == set(IMAGE_SIZES)
        assert {s.greedy for s in mine} == {True, False} and {len(s.image_sizes) for s in mine} == {1, 3}
    kinds = collections.Counter((s.image_sizes[0], len(s.image_sizes), s.greedy) for s in specs)
    assert kinds == {
        (size, count, g): (n * 7 // 8 if count == 1 else n // 8) // 4
        for size in IMAGE_SIZES
        for count in (1, 3)
        for g in (True, False)
    }
    by_rank = collections.Counter((s.rank, len(s.image_sizes), s.image_sizes[0]) for s in specs)
    assert by_rank == {
        (rank, count, size): (n * 7 // 8 if count == 1 else n // 8) // 8
        for rank in RANKS
        for count in (1, 3)
        for size in IMAGE_SIZES
    }
    # deterministic from the seed
    assert request_mix(40, 7, WORDS) == specs[:40]
    assert [s.prompt for s in request_mix(40, 8, WORDS)] != [s.prompt for s in specs[:40]]
    mix = mix_summary(specs)
    assert mix["images_per_request"] == {"1": n * 7 // 8, "3": n // 8} and mix["greedy"] == mix["top_p"] == n // 2
    assert mix["ranks"] == {str(r): n // 4 for r in RANKS} and mix["adapters"] == 16


def test_prompts_have_their_token_counts(model_path):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    words = prompt_words(tokenizer)
    assert len(words) > 20 and all(len(tokenizer(w)["input_ids"]) == 1 for w in words)
    for s in request_mix(64, 3, words):
        assert len(tokenizer(s.prompt)["input_ids"]) == s.prompt_tokens


def test_build_requests_takes_images_in_order():
    specs = request_mix(16, 0, WORDS, adapters=4, image_sizes=(56, 84))
    pngs = [f"png-{k}".encode() for k in range(sum(len(s.image_sizes) for s in specs))]
    refs = [f"adapters/a{i}@bench" for i in range(4)]
    reqs = build_requests(specs, pngs, refs)
    assert [img.data for r in reqs for img in r.input.images] == pngs
    for s, r in zip(specs, reqs, strict=True):
        assert r.input.adapter == refs[s.adapter] and r.input.prompt == s.prompt
        assert len(r.input.images) == len(s.image_sizes)
        p = r.input.params
        assert p.max_new_tokens == s.max_new_tokens
        assert (p.temperature, round(p.top_p, 3)) == ((0.0, 0.0) if s.greedy else (1.0, TOP_P)), p
    assert len({r.request_id for r in reqs}) == len(reqs)
    assert all(not r.input.adapter for r in build_requests(specs, pngs, []))  # no adapters: the base model


@pytest.mark.e2e
def test_closed_and_poisson_runs_on_the_cpu(model_path, tmp_path):
    home, out = tmp_path / "home", tmp_path / "serve.json"
    requests = 12
    cmd = [
        sys.executable,
        "-m",
        "bench.serve_bench",
        "--model",
        str(model_path),
        "--home",
        str(home),
        "--out",
        str(out),
        "--requests",
        str(requests),
        "--concurrency",
        "4",
        "--rate",
        "20",
        "--repeat",
        "2",
        "--warmup",
        "4",
        "--adapters",
        "4",
        "--image-sizes",
        "56,84",
        "--max-new-tokens",
        "2,4,8",
    ]
    marks = tmp_path / "marks"  # where a profiler learns that a measured run started (h200_session.sh)
    marks.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # no copy of the results elsewhere
    env["SERVE_BENCH_MARK_DIR"] = str(marks)
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    data = json.loads(out.read_text())
    info, rows = data["info"], data["rows"]
    assert data["failures"] == []
    assert info["workload"] == "mixed-vision" and info["git_commit"] and info["torch"]
    assert info["args"]["device"] == "cpu" and info["args"]["requests"] == requests and info["gpus"] == 0
    assert [r["run"] for r in rows] == ["closed-4 #1", "closed-4 #2", "poisson-20 #1", "poisson-20 #2"]
    # what was sent follows the workload: 4 adapters of ranks 8/16/32/64, request 7 with 3 images
    assert info["mix"] == mix_summary(
        request_mix(requests, 0, prompt_words(AutoTokenizer.from_pretrained(model_path)), 4, RANKS, (56, 84), (2, 4, 8))
    )
    assert info["mix"]["images_per_request"] == {"1": 11, "3": 1} and info["mix"]["ranks"] == {str(r): 3 for r in RANKS}
    for r in rows:
        assert all(k in r for k in ROW_KEYS), r
        assert r["requests"] == r["ok"] == requests and r["failed"] == 0 and r["errors"] == {}, r
        assert r["throughput_rps"] > 0 and r["output_tokens"] > 0
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ROW_KEYS[2:6])
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["e2e_p50_ms"] <= r["e2e_p99_ms"]
        assert r["ttft_p50_ms"] <= r["e2e_p50_ms"]
        assert r["gpu_busy"] is None and r["gpu_samples"] == 0  # CPU
        assert r["adapters_served"] == 4 and r["image_tokens"] > 0
        graphs = r["decode_graphs"]  # null: a worker without decode graphs
        assert graphs is None or (
            set(graphs) >= {"replays", "captures", "new_keys", "eager_steps"}
            and r["eager_decode_steps"] == graphs["eager_steps"] >= 0
        ), graphs
        assert r["worker_steps"]["steps"] > 0
    assert [(r["mode"], r["concurrency"], r["rate"]) for r in rows[1:3]] == [("closed", 4, 0.0), ("poisson", 0, 20.0)]
    spread = {s["load"]: s for s in data["spread"]}
    assert set(spread) == {"closed-4", "poisson-20"}
    assert spread["closed-4"]["throughput_rps"] == [rows[0]["throughput_rps"], rows[1]["throughput_rps"]]
    assert spread["closed-4"]["headline"] == "throughput_rps" and spread["poisson-20"]["headline"] == "ttft_p99_ms"
    assert all(isinstance(s["within_10pct"], bool) for s in spread.values())
    assert "req/s" in run.stdout  # the rich table
    assert sorted(p.name for p in marks.iterdir()) == [f"measuring-{i}" for i in range(1, 5)]
    assert all(int(p.read_text()) > 0 for p in marks.iterdir())  # the worker's pid
    assert processes_of(home) == [] and not (home / STATE_FILE).exists()


def test_gpu_sampler_means_the_samples_of_a_window(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"  # prints what `--query-gpu=utilization.gpu -lms` prints, then stops
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\nprintf \'50\\n[N/A]\\n70\\n\'\nexec sleep 30\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    t0 = time.perf_counter()
    sampler = GpuSampler(["3"], interval_ms=100)
    try:
        deadline = time.monotonic() + 10
        while len(sampler.samples) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        t1 = time.perf_counter()
        assert sampler.mean(t0, t1) == 0.6 and sampler.count(t0, t1) == 2  # "[N/A]" skipped
        assert sampler.mean(t1 + 1, t1 + 2) is None and sampler.count(t1 + 1, t1 + 2) == 0
    finally:
        sampler.close()
    assert sampler.proc.poll() is not None
    assert (tmp_path / "args").read_text().split() == [
        "--query-gpu=utilization.gpu",
        "--format=csv,noheader,nounits",
        "-lms",
        "100",
        "-i",
        "3",
    ]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi: no samples, said why
    missing = GpuSampler(["0"])
    assert missing.proc is None and missing.error and missing.mean(0, math.inf) is None
    missing.close()
