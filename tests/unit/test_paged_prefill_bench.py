"""bench/paged_prefill_bench.py's CPU parts: argument parsing, the cases, the FLOP count and the
offset-causal mask, the table, and a dry run that builds every method (ours, the split
decode + chunk pair, the SDPA peers over contiguous and gathered K/V) and checks it against the
reference. No timing."""

import json

from bench import paged_prefill_bench as ppb


def test_defaults_are_the_brief():
    a = ppb.parse_args([])
    assert (a.chunks, a.prefixes, a.mixed_decode_rows, a.mixed_chunk) == ([512, 2048], [0, 2048, 8192], 32, 1024)
    assert (a.heads, a.kv_heads, a.head_dim, a.block_sizes[0]) == (28, 4, 128, 16)
    names = [c["name"] for c in ppb.make_cases(a)]
    assert len(names) == 7 and "chunk2048_prefix8192" in names and names[-1] == "mixed32dec_chunk1024_prefix2048"
    mixed = ppb.make_cases(a)[-1]
    assert mixed["n"] == [1] * 32 + [1024] and all(299 <= p <= 1199 for p in mixed["prefix"][:32])
    assert ppb.parse_config("128x64x8x3") == {"block_m": 128, "tile_n": 64, "num_warps": 8, "num_stages": 3}
    assert ppb.config_name(ppb.parse_config("64x32x4x2")) == "m64_n32_w4_s2"


def test_flops_and_mask():
    assert ppb.attended_pairs([3], [0]) == 6 and ppb.attended_pairs([1, 2], [4, 1]) == 5 + (1 * 2 + 3)
    assert ppb.attention_flops([512], [0], 28, 128) == 4 * 28 * 128 * 512 * 513 // 2
    mask = ppb.offset_causal_mask(2, 5, "cpu")
    assert mask.tolist() == [[True, True, True, True, False], [True] * 5]
    assert mask.sum().item() == ppb.attended_pairs([2], [3])
    assert ppb.tflops(10**12, 1e6) == 1.0 and ppb.tflops(1, None) is None


def test_dry_run_builds_every_method_and_writes_results(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    rc = ppb.main(
        [
            "--dry-run",
            "--chunks",
            "8",
            "--prefixes",
            "0",
            "5",
            "--mixed-decode-rows",
            "3",
            "--mixed-chunk",
            "6",
            "--mixed-prefix",
            "4",
            "--decode-min-len",
            "1",
            "--decode-max-len",
            "20",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--block-sizes",
            "8",
            "16",
            "--configs",
            "16x16x4x1",
            "--layers",
            "2",
            "--name",
            "dry",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "dry.json").read_text())
    cases = {c["name"]: c for c in data["cases"]}
    assert set(cases) == {"chunk8_prefix0", "chunk8_prefix5", "mixed3dec_chunk6_prefix4"} and "info" in data
    assert data["config"]["configs"] == ["m16_n16_w4_s1"]
    for name, c in cases.items():
        methods = {r["method"]: r for r in c["rows"]}
        want = {"paged_bs8", "paged_bs8_m16_n16_w4_s1", "paged_bs16", "sdpa_mask", "gather_sdpa_mask"}
        want |= {"sdpa_causal"} if name == "chunk8_prefix0" else set()
        want |= {"paged_split_bs8"} if name.startswith("mixed") else set()
        assert set(methods) == want, name
        assert all(r["ok"] for r in c["rows"]), c["rows"]  # every peer built from the same tokens agrees
    assert cases["chunk8_prefix5"]["flops"] == 4 * 4 * 16 * (8 * 5 + 36)
    assert cases["mixed3dec_chunk6_prefix4"]["n"] == [1, 1, 1, 6]
