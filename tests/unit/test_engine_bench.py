"""The §3 engine benchmark on the tiny model (CPU, fp32): rows in the issue's schema, and the
engine's greedy tokens equal HF + PEFT's for every run both implement (same weights, one seed)."""

import json
import subprocess
import sys
from pathlib import Path

from bench import engine_bench


def test_engine_bench_rows_and_agreement_with_peft(tmp_path):
    rows = engine_bench.main(
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
            "3",
            "--adapters",
            "2",
            "--new-tokens",
            "3",
            "--reps",
            "1",
            "--peer-reps",
            "1",
            "--warmup",
            "0",
            "--out-dir",
            str(tmp_path),
            "--name",
            "engine-test",
        ]
    )
    saved = json.loads((tmp_path / "engine-test.json").read_text())
    assert saved == rows
    assert {(r["impl"], r["run"]) for r in rows} == {
        *(("valora", run) for run in engine_bench.RUNS),
        *(("hf_peft", run) for run in ("base", "merged", "unmerged_one", "unmerged_mixed")),
    }
    for r in rows:
        assert set(r) == {"impl", "run", "generate_ms", "prefill_ms"}
        assert r["generate_ms"] > 0 and r["prefill_ms"] > 0
    detail = json.loads((tmp_path / "engine-test.detail.json").read_text())
    assert detail["token_agreement"] == {"base": 1.0, "merged": 1.0, "unmerged_one": 1.0, "unmerged_mixed": 1.0}
    for run, cmp in detail["first_token_logits"].items():  # same weights, fp32: same first-token logits
        assert cmp["relerr"] < 1e-4 and cmp["top1_agreement"] == 1.0, (run, cmp)
    assert set(detail["first_token_logits"]) == {"base", "merged", "unmerged_one", "unmerged_mixed"}
    assert detail["valora"]["peak_decode_entries"] == 2  # the mixed run decoded both adapters in one batch


def test_engine_bench_profiles_each_run(tmp_path):
    # structure only: on CPU the profiler sees the calling thread's ops, not the engine thread's
    # (on CUDA it records every device kernel, which is what the kernel tables are for)
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
            "2",
            "--new-tokens",
            "2",
            "--reps",
            "1",
            "--warmup",
            "0",
            "--skip-peer",
            "--profile",
            "base,unmerged_mixed",
            "--out-dir",
            str(tmp_path),
            "--name",
            "engine-prof",
        ]
    )
    kernels = json.loads((tmp_path / "engine-prof.kernels.json").read_text())
    assert set(kernels) == {"base/generate", "base/prefill", "unmerged_mixed/generate", "unmerged_mixed/prefill"}
    for ops in kernels.values():
        assert ops and all(v["calls"] > 0 and v["us"] > 0 for v in ops.values())
    assert (tmp_path / "engine-prof.profile.txt").read_text()


def test_engine_bench_rejects_unknown_profile_run(tmp_path):
    import pytest

    with pytest.raises(SystemExit):
        engine_bench.main(["--arch", "tiny", "--model-dir", str(tmp_path / "tiny"), "--profile", "bogus"])


def test_engine_bench_tensor_parallel_gives_one_process_tokens(tmp_path):
    # --tp 2 on CPU (gloo; its own process, so no process group is left in this one): the same
    # greedy tokens as one process for every run, rows tagged tp=2
    common = [
        "--arch",
        "tiny",
        "--model-dir",
        str(tmp_path / "tiny"),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--batch",
        "3",
        "--adapters",
        "2",
        "--new-tokens",
        "3",
        "--reps",
        "1",
        "--warmup",
        "0",
        "--skip-peer",
        "--decode-graphs",
        "static",
        "--out-dir",
        str(tmp_path),
    ]
    one = engine_bench.main([*common, "--name", "one"])
    subprocess.run(
        [sys.executable, "-m", "bench.engine_bench", *common, "--tp", "2", "--name", "two"],
        check=True,
        timeout=600,
        cwd=Path(engine_bench.__file__).resolve().parents[1],
    )
    two = json.loads((tmp_path / "two.json").read_text())
    assert [(r["run"], r["tp"]) for r in two] == [(r["run"], 2) for r in one]
    one_detail, two_detail = (json.loads((tmp_path / f"{n}.detail.json").read_text()) for n in ("one", "two"))
    assert two_detail["workload"]["tp"] == 2 and two_detail["valora"]["tp"] == 2
    assert set(two_detail["valora"]["tokens"]) == set(engine_bench.RUNS)
    assert two_detail["valora"]["tokens"] == one_detail["valora"]["tokens"]


def test_engine_bench_on_a_tiny_llava_agrees_with_peft(tmp_path):
    """`--arch llava-1.5` (the family's tiny model): the HF + PEFT peer gets LLaVA's chat text,
    and every run's greedy tokens and first-token logits equal the engine's."""
    rows = engine_bench.main(
        [
            "--arch",
            "llava-1.5",
            "--model-dir",
            str(tmp_path / "llava"),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--batch",
            "2",
            "--adapters",
            "2",
            "--new-tokens",
            "2",
            "--reps",
            "1",
            "--peer-reps",
            "1",
            "--warmup",
            "0",
            "--out-dir",
            str(tmp_path),
            "--name",
            "engine-llava",
        ]
    )
    assert {r["impl"] for r in rows} == {"valora", "hf_peft"}
    detail = json.loads((tmp_path / "engine-llava.detail.json").read_text())
    assert detail["token_agreement"] == {"base": 1.0, "merged": 1.0, "unmerged_one": 1.0, "unmerged_mixed": 1.0}
    for run, cmp in detail["first_token_logits"].items():
        assert cmp["relerr"] < 1e-4 and cmp["top1_agreement"] == 1.0, (run, cmp)
