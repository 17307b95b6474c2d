"""bench/paged_attention_bench.py's CPU parts: argument parsing, the row builders (lengths, shuffled
page tables, packed tokens scattered into a pool and into the SDPA arena, both read back by the
reference to the same attention), the KV-bytes floor and the table. No timing."""

import json

import torch

from bench import paged_attention_bench as pab
from kernels.paged_attention import paged_decode_attention_reference


def test_defaults_are_the_brief():
    a = pab.parse_args([])
    assert (a.batch, a.min_len, a.max_len, a.heads, a.kv_heads, a.head_dim) == ([8, 32, 64], 300, 1200, 28, 4, 128)
    assert a.block_sizes == [16, 32, 64] and 1 in a.splits and a.layers == 20


def test_builders_agree_with_the_reference():
    lens = pab.make_lengths(5, 1, 70, seed=3)
    assert lens == pab.make_lengths(5, 1, 70, seed=3) and all(1 <= n <= 70 for n in lens)
    tables, num_blocks = pab.make_tables(lens, 8, seed=1)
    used = [int(p) for i, n in enumerate(lens) for p in tables[i, : -(-n // 8)]]
    assert len(set(used)) == len(used) == num_blocks  # every page owned once, all in range
    assert int(tables.min()) >= 0 and int(tables.max()) < num_blocks
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, sum(lens), 2, 16, generator=g)
    q = torch.randn(len(lens), 6, 16, generator=g)
    slots = pab.token_slots(lens, tables, 8)
    kp, vp = pab.to_pool(k, slots, num_blocks, 8), pab.to_pool(v, slots, num_blocks, 8)
    out = paged_decode_attention_reference(q, kp, vp, tables, torch.tensor(lens, dtype=torch.int32), 0.25)
    cap = pab.arena_cap(max(lens))
    ka, va = pab.to_arena(k, lens, cap), pab.to_arena(v, lens, cap)
    mask = (torch.arange(cap)[None, :] < torch.tensor(lens)[:, None]).view(len(lens), 1, 1, cap)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.view(len(lens), 2, 3, 16), ka, va, attn_mask=mask, scale=0.25
    ).reshape(len(lens), 6, 16)
    torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=1e-5)


def test_floor_and_table():
    assert pab.arena_cap(1200) == 2048 and pab.arena_cap(10) == 256
    nbytes = pab.kv_bytes([300, 500], 4, 128)
    assert nbytes == 2 * 800 * 4 * 128 * 2
    assert abs(pab.floor_us(4.8e6) - 1.0) < 1e-9
    case = {
        "batch": 2,
        "floor_us": 1.0,
        "kv_bytes": nbytes,
        "arena_floor_us": 2.0,
        "arena_cap": 512,
        "rows": [
            {"method": "paged_bs16", "us": 3.0, "max_abs_err": 1e-3, "note": "S=16"},
            {"method": "varlen_packed", "us": None, "note": "unsupported"},
        ],
    }
    text = pab.format_table([case])
    assert "paged_bs16" in text and "3.00" in text and "unsupported" in text


def test_dry_run_builds_every_method_and_writes_results(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    rc = pab.main(
        [
            "--dry-run",
            "--batch",
            "3",
            "--min-len",
            "5",
            "--max-len",
            "40",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--block-sizes",
            "8",
            "16",
            "--splits",
            "1",
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
    (case,) = data["cases"]
    methods = {r["method"]: r for r in case["rows"]}
    assert {"paged_bs8", "paged_bs8_s1", "paged_bs16", "sdpa_arena"} <= set(methods)
    assert methods["sdpa_arena"]["ok"]  # the arena built from the same tokens gives the reference's answer
    assert case["kv_bytes"] == 2 * sum(case["lens"]) * 2 * 16 * 2 and "info" in data
