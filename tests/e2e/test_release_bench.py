"""bench/release_bench.py: its release settings, then the bench for real on the CPU, briefly — a
generated directory of the built-in text task square-colour (its layout, on a random adapter: a
training would take longer than the bench) served by a real cluster under three policies set on
the task: rows with accuracy, accuracy Δ and throughput × against no release, the fixed run's
release counts as the policy says (a fraction of 0.5 of 6 tokens: every request released, half its
tokens on the base path), every request unmerged, no process left."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_scale_bench import processes_of  # the same VALORA_HOME scan (tests/e2e is on sys.path)

from bench.release_bench import Setting, parse_args, parse_settings
from valora.cluster import STATE_FILE

REPO = Path(__file__).resolve().parents[2]


def test_settings_parse_as_tasks_show_them():
    got = parse_settings("none, 0.25,sentence_end,sentence_end>=0.5")
    assert got == [Setting(), Setting(0.25), Setting(0.0, "sentence_end"), Setting(0.5, "sentence_end")]
    assert [s.name for s in got] == ["none", "0.25", "sentence_end", "sentence_end>=0.5"]  # `valora tasks list`'s
    for bad in ("0.5,sentence_end", "none,none", "none,1.5", "none,sentence-end"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_settings(bad)


def test_defaults_per_device():
    """The CPU smoke run's loads, and the H200's: a batch where the LoRA term weighs."""
    cpu = parse_args([])
    assert (cpu.concurrency, cpu.fixed_requests, cpu.fixed_tokens, cpu.policy) == (8, 64, 32, "slora")
    gpu = parse_args(["--device", "cuda", "--arch", "qwen2-vl-7b", "--atmm"])
    assert (gpu.concurrency, gpu.fixed_requests, gpu.fixed_tokens, gpu.dtype) == (64, 512, 128, "bfloat16")
    assert [s.name for s in gpu.settings] == ["none", "0.25", "0.5", "0.75", "sentence_end"]


@pytest.fixture
def generated(model_path, tmp_path) -> Path:
    """What `python -m services.generator generate --order square-colour --limit 12` writes
    (Bundle.write, pipeline.manifest), with a random adapter in place of a trained one."""
    from services.common.adapter_format import BaseModelShapes, make_random_bundle
    from services.generator import pipeline
    from services.generator.bundle import Bundle
    from services.generator.datasets import build_tasks
    from services.generator.training import TrainConfig

    task = "square-colour"
    shapes = BaseModelShapes.from_config(json.loads((model_path / "config.json").read_text()))
    data, cfg = make_random_bundle(shapes, rank=4, seed=5, lora_alpha=8)
    bundle = Bundle("release-0", data, cfg, {}, (task,))
    result = pipeline.StrategyResult("greedy-fusion", [[task]], {task: {"threshold": 0.0, "accuracy": 0.0}})
    out = tmp_path / "generated"
    bundle.write(out)
    manifest = pipeline.manifest(
        str(model_path), build_tasks([task], limit=12), [task], {task: 0.0}, 0.0, 4, 8.0, TrainConfig(), 12,
        [bundle], result, max_new_tokens={task: 6},
    )  # fmt: skip
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.mark.e2e
def test_three_settings_on_the_cpu(model_path, generated, tmp_path):
    home, out = tmp_path / "home", tmp_path / "release.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.release_bench",
        *("--generated", str(generated), "--home", str(home), "--out", str(out)),
        *("--settings", "none,0.5,sentence_end", "--concurrency", "2", "--warmup", "2"),
        *("--test-images", "4", "--fixed-requests", "4", "--fixed-tokens", "6"),
    ]
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # no copy of the results elsewhere
    t0 = time.monotonic()
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    data = json.loads(out.read_text())
    info, rows = data["info"], data["rows"]
    assert data["failures"] == [] and info["bench"] == "release" and info["device"] == "cpu"
    assert info["args"]["policy"] == "slora" and info["adapters"].startswith("generated: ")
    assert info["tasks"] == {"square-colour": {"test_images": 4, "max_new_tokens": 6}}
    assert [r["setting"] for r in rows] == ["none", "0.5", "sentence_end"]
    for r in rows:
        a, f = r["answers"], r["fixed"]
        assert a["failed"] == f["failed"] == 0 and len(r["rounds"]) == 1, r
        assert 0 <= a["accuracy_mean"] <= 1 and set(a["accuracy"]) == {"square-colour"}
        assert a["same_as_generator"] == {}  # (this manifest keeps no test predictions)
        assert a["tokens_per_s"] > 0 and f["tokens_per_s"] > 0 and f["throughput_rps"] > 0
        assert set(r["rounds"][0]["fixed"]["modes"]) == {"unmerged"}  # slora: a released row leaves the plan
        if r["setting"] == "none":
            assert "accuracy_delta" not in a and "throughput_x" not in f
            assert f["released_share"] == 0 and f["base_token_share"] == 0
        else:
            assert abs(a["accuracy_delta"] - (a["accuracy_mean"] - rows[0]["answers"]["accuracy_mean"])) < 1e-3
            assert f["throughput_x"] > 0 and a["throughput_x"] > 0
    half = rows[1]["fixed"]
    assert (half["released_share"], half["base_token_share"]) == (1.0, 0.5)  # after 3 of 6 tokens, every one
    assert 0 <= rows[2]["fixed"]["released_share"] <= 1
    assert "Δ acc" in run.stdout  # the rich table
    assert processes_of(home) == [] and not (home / STATE_FILE).exists()
    print(f"bench wall {time.monotonic() - t0:.1f} s")
