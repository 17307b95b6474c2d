"""bench.long_context_bench on the tiny model (CPU): short streams and a long chunked prompt
beside them all finish inside the KV pool, and the results file says so."""

from __future__ import annotations

import json

from bench import long_context_bench


def test_long_context_bench_runs_and_reports(tmp_path):
    got = long_context_bench.main(
        [
            "--arch",
            "tiny",
            "--model-dir",
            str(tmp_path / "tiny"),
            "--device",
            "cpu",
            "--short",
            "3",
            "--short-tokens",
            "12",
            "--long-tokens",
            "1200",
            "--long-new",
            "3",
            "--batch",
            "4",
            "--max-prefill-tokens",
            "512",
            "--out-dir",
            str(tmp_path),
            "--name",
            "lc",
        ]
    )
    saved = json.loads((tmp_path / "lc.json").read_text())
    assert saved["finished"] == got["finished"] == 4 and not saved["failures"]
    assert abs(saved["long_prompt_tokens"] - 1200) <= 8  # the prompt the bench meant
    assert 0 < saved["kv_peak_bytes"] <= saved["kv_pool_bytes"] and saved["kv_used_after"] == 0
    assert saved["long_ttft_ms"] > 0 and saved["short_max_gap_ms"]["max"] > 0  # the streams ran beside it
