"""bench/decode_keys.py on a short closed loop: every static decode step is counted once, and
padding the rows makes no more graph keys than exact rows."""

import json

from bench import decode_keys


def test_decode_keys_counts_each_static_step(tmp_path):
    rows = decode_keys.main(["--requests", "16", "--concurrency", "6", "--max-batch-size", "8", "--new-tokens", "6",
                             "--out", str(tmp_path / "keys.json")])
    assert [r["pad_decode_rows"] for r in rows] == [False, True]
    for r in rows:
        assert r["static_steps"] == r["warm-up"] + r["capture"] + r["replay"] > 0
        assert r["keys"] == r["warm-up"]  # each key's first step is its warm-up
    exact, padded = rows
    assert padded["keys"] <= exact["keys"]
    assert json.loads((tmp_path / "keys.json").read_text())["rows"] == rows
