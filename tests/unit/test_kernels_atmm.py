"""CPU tests of what the ATMM/switch Python wrappers plan: segment metadata, tile table, fallback."""

import json

import pytest
import torch

from kernels.atmm import BT_MENU, AtmmPlan, LoraWeights, atmm_, lora_weights_from_lists
from kernels.reference import SegmentPlan, multi_lora_reference_
from kernels.switch import LoraTerm, SwitchPlan, merge_, switch_, unmerge_
from kernels.tile_table import (TileConfig, TileTable, heuristic_config, rank_block, segment_bucket, shape_key,
                                table_filename, token_bucket)


def weights(ranks, h_in=32, h_out=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(h_in, r, generator=g) for r in ranks]
    b = [torch.randn(r, h_out, generator=g) for r in ranks]
    return a, b


def test_plan_metadata_layout_and_tiles():
    plan = AtmmPlan(max_segments=6, max_tokens=200)
    ranks = [16, 8, 64, 0]
    plan.update([0, 20, 21, 70, 150], [0, -1, 1, 2], ranks)
    cap = 6
    meta = plan.meta.tolist()
    assert meta[0] == 4
    assert meta[1:6] == [0, 20, 21, 70, 150]
    assert meta[2 + cap:2 + cap + 4] == [0, -1, 1, 2]
    for i, bt in enumerate(BT_MENU):
        base = 2 + 2 * cap + i * (cap + 1)
        counts = [-(-20 // bt), 0, -(-49 // bt), -(-80 // bt)]
        want = [0, counts[0], counts[0], counts[0] + counts[2], sum(counts)]
        assert meta[base:base + 5] == want
        assert plan.tiles[bt] == sum(counts)
    assert plan.rank_stride == 64  # max rank among used slots, multiple of 16
    assert plan.active_segments == 3 and plan.num_tokens == 150


def test_plan_rejects_bad_segments():
    plan = AtmmPlan(max_segments=2, max_tokens=10)
    with pytest.raises(ValueError, match="capacity"):
        plan.update([0, 1, 2, 3], [0, 0, 0], [8])
    with pytest.raises(ValueError, match="capacity"):
        plan.update([0, 11], [0], [8])
    with pytest.raises(ValueError, match="holds no adapter"):
        plan.update([0, 4], [1], [8])
    with pytest.raises(ValueError, match="non-decreasing"):
        plan.update([0, 5, 3], [0, 0], [8])
    with pytest.raises(ValueError, match="len"):
        plan.update([0, 5], [0, 0], [8])


def test_weights_check_shapes_dtype_and_rank():
    w = LoraWeights(2, 32, 24, torch.bfloat16)
    with pytest.raises(ValueError, match="A must be"):
        w.set(0, torch.zeros(16, 8, dtype=torch.bfloat16), torch.zeros(8, 24, dtype=torch.bfloat16), 1.0)
    with pytest.raises(ValueError, match="B must be"):
        w.set(0, torch.zeros(32, 8, dtype=torch.bfloat16), torch.zeros(16, 24, dtype=torch.bfloat16), 1.0)
    with pytest.raises(ValueError, match="multiple of 8"):
        w.set(0, torch.zeros(32, 12, dtype=torch.bfloat16), torch.zeros(12, 24, dtype=torch.bfloat16), 1.0)
    with pytest.raises(ValueError, match="bfloat16"):
        w.set(0, torch.zeros(32, 8), torch.zeros(8, 24), 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        w.set(0, torch.zeros(8, 32, dtype=torch.bfloat16).t(), torch.zeros(8, 24, dtype=torch.bfloat16), 1.0)
    with pytest.raises(IndexError):
        w.set(5, torch.zeros(32, 8, dtype=torch.bfloat16), torch.zeros(8, 24, dtype=torch.bfloat16), 1.0)
    w.set(1, torch.zeros(32, 16, dtype=torch.bfloat16), torch.zeros(16, 24, dtype=torch.bfloat16), 0.5)
    assert w.ranks == [0, 16] and w.rank_table.tolist() == [0, 16] and w.scale_table.tolist() == [0.0, 0.5]
    assert w.a_ptrs[1].item() == w.a[1].data_ptr()
    w.clear(1)
    assert w.ranks == [0, 0] and w.a_ptrs.tolist() == [0, 0]


def test_atmm_falls_back_to_reference_on_cpu():
    a, b = weights([8, 16, 32])
    a16 = [t.bfloat16() for t in a]
    b16 = [t.bfloat16() for t in b]
    w = lora_weights_from_lists(a16, b16, [0.5, 1.0, 2.0])
    slots = [0, 0, 2, 2, 2, -1, 1]
    plan = AtmmPlan(8, 16).update_from_token_slots(slots, w.ranks)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 32, generator=g).bfloat16()
    y = torch.randn(7, 24, generator=g).bfloat16()
    want = multi_lora_reference_(y.clone(), x, SegmentPlan.from_token_slots(slots), a16, b16, [0.5, 1.0, 2.0])
    got = atmm_(y.clone(), x, plan, w)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="plan covers"):
        atmm_(y[:3].clone(), x[:3], plan, w)
    with pytest.raises(ValueError, match="features"):
        atmm_(y, x[:, :16], plan, w)


def test_tile_table_keys_buckets_and_lookup(tmp_path):
    assert [token_bucket(t) for t in (1, 2, 3, 16, 17, 1000)] == [1, 2, 4, 16, 32, 1024]
    assert [segment_bucket(s) for s in (1, 2, 4, 5, 16, 17, 64)] == [1, 4, 4, 16, 16, 64, 64]
    assert [rank_block(r) for r in (16, 32, 48, 64, 80, 128)] == [1, 2, 4, 4, 8, 8]
    assert shape_key(4096, 4096, 16, 100, 8) == "4096x4096/r16/t128/s16"
    cfg_a = TileConfig(16, 64, 4, 8, 16, 64)
    cfg_b = TileConfig(64, 128, 3, 1, 64, 128)
    t = TileTable("NVIDIA H200", "sm90", "bfloat16",
                  {shape_key(4096, 4096, 16, 16, 8): cfg_a, shape_key(4096, 4096, 16, 1024, 8): cfg_b}, {})
    assert t.lookup(4096, 4096, 16, 16, 8) is cfg_a       # exact bucket: one dict lookup
    assert t.lookup(4096, 4096, 16, 12, 5) is cfg_a       # same bucket
    assert t.lookup(4096, 4096, 16, 700, 8) is cfg_b      # nearest measured token bucket
    assert t.lookup(4096, 4096, 16, 40, 8) is cfg_a
    assert t.lookup(1024, 4096, 16, 40, 8) == heuristic_config(1024, 4096, 16, 40, 8)  # unknown shape
    path = tmp_path / table_filename("NVIDIA H200", "sm90", "bfloat16")
    t.save(path)
    assert path.name == "nvidia_h200-sm90-bfloat16.json"
    back = TileTable.load(path)
    assert back.entries == t.entries and back.lookup(4096, 4096, 16, 700, 8) == cfg_b
    assert json.loads(path.read_text())["gpu"] == "NVIDIA H200"


def test_heuristic_configs_exist_in_the_menu():
    # every heuristic pick must name a compiled configuration (names follow the .cu menu)
    import re
    from pathlib import Path

    src = (Path(__file__).resolve().parents[2] / "kernels" / "csrc" / "atmm_bf16.cu").read_text()
    shrink = {tuple(map(int, m)) for m in re.findall(r"SHRINK\((\d+), (\d+), (\d+), (\d+)\)", src)}
    expand = {tuple(map(int, m)) for m in re.findall(r"EXPAND\((\d+), (\d+)\)", src)}
    gsrc = (Path(__file__).resolve().parents[2] / "kernels" / "csrc" / "grouped.cu").read_text()
    grouped = set(re.findall(r'"(grouped_bf16_\w+)"', gsrc)) | {""}
    for h_in, h_out in [(4096, 4096), (3584, 512), (18944, 3584)]:
        for rs in (16, 32, 64, 128):
            for tokens in (1, 7, 16, 64, 300, 1024, 8192):
                for segs in (1, 8, 64):
                    c = heuristic_config(h_in, h_out, rs, tokens, min(tokens, segs))
                    assert (c.shrink_bt, c.shrink_bk, c.shrink_stages, rank_block(rs)) in shrink
                    assert (c.expand_bt, c.expand_bn) in expand
                    assert c.grouped in grouped
                    assert c.split_k >= 1 and h_in // c.split_k >= 64


def test_committed_tile_tables_name_compiled_configs():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "kernels"
    src = (root / "csrc" / "atmm_bf16.cu").read_text()
    shrink = {tuple(map(int, m)) for m in re.findall(r"SHRINK\((\d+), (\d+), (\d+), (\d+)\)", src)}
    expand = {tuple(map(int, m)) for m in re.findall(r"EXPAND\((\d+), (\d+)\)", src)}
    grouped = set(re.findall(r'"(grouped_\w+)"', (root / "csrc" / "grouped.cu").read_text())) | {""}
    from kernels.triton_sgmv import TRITON_MENU

    for path in (root / "tile_tables").glob("*.json"):
        t = TileTable.load(path)
        for key, c in t.entries.items():
            rs = int(key.split("/")[1][1:])
            if c.backend == "triton":  # a Triton menu entry (JIT-compiled, any split-K)
                assert (c.shrink_bt, c.shrink_bk, c.shrink_stages, c.expand_bt, c.expand_bn, c.warps) in TRITON_MENU, key
                assert c.split_k >= 1 and not c.grouped, key
                continue
            assert (c.shrink_bt, c.shrink_bk, c.shrink_stages, rank_block(rs)) in shrink, key
            assert (c.expand_bt, c.expand_bn) in expand, key
            assert c.grouped in grouped, key


def test_tile_config_backend_field_and_json_schema(tmp_path):
    assert TileConfig(16, 64, 4, 8, 16, 64).backend == "cuda"
    assert TileConfig(16, 64, 4, 8, 16, 64, "grouped_bf16_m64n128").backend == "cutlass_grouped"
    assert TileConfig(16, 64, 4, 8, 16, 64, backend="cutlass_grouped").backend == "cuda"  # grouped decides
    tri = TileConfig(32, 64, 3, 4, 32, 128, backend="triton", warps=8)
    assert tri.backend == "triton" and tri.warps == 8
    with pytest.raises(ValueError, match="backend"):
        TileConfig(16, 64, 4, 8, 16, 64, backend="cublas")
    with pytest.raises(ValueError, match="grouped"):
        TileConfig(16, 64, 4, 8, 16, 64, "grouped_bf16_m64n128", backend="triton")
    t = TileTable("NVIDIA H200", "sm90", "bfloat16", {"4096x4096/r16/t4096/s16": tri,
                                                      "4096x4096/r16/t16/s16": TileConfig(16, 64, 4, 8, 16, 64)}, {})
    path = tmp_path / "t.json"
    t.save(path)
    raw = json.loads(path.read_text())
    assert raw["entries"]["4096x4096/r16/t4096/s16"]["backend"] == "triton"
    assert raw["entries"]["4096x4096/r16/t4096/s16"]["warps"] == 8
    assert raw["entries"]["4096x4096/r16/t16/s16"]["backend"] == "cuda"
    assert TileTable.load(path).entries == t.entries
    # tables written before the backend field load as the CUDA backends
    old = {"gpu": "g", "arch": "sm90", "dtype": "bfloat16", "entries": {
        "4096x4096/r16/t16/s16": {"shrink_bt": 16, "shrink_bk": 64, "shrink_stages": 4, "split_k": 8, "expand_bt": 16, "expand_bn": 64,
              "grouped": ""},
        "4096x4096/r16/t64/s16": {"shrink_bt": 16, "shrink_bk": 64, "shrink_stages": 4, "split_k": 8, "expand_bt": 16, "expand_bn": 64,
              "grouped": "grouped_bf16_m64n128"}}}
    back = TileTable.from_json(old)
    assert back.entries["4096x4096/r16/t16/s16"].backend == "cuda"
    assert back.entries["4096x4096/r16/t64/s16"].backend == "cutlass_grouped"


def _dispatch_case(monkeypatch, table_cfg, triton_ok):
    import kernels.atmm as am

    calls = []
    for name in am.BACKEND_RUNNERS:
        monkeypatch.setitem(am.BACKEND_RUNNERS, name,
                            lambda ext, y, x, plan, w, cfg, dtype, pdl, name=name: calls.append((name, cfg)))
    monkeypatch.setattr(am, "_kernel_ext", lambda y: object())  # as if on a GPU with the extension built
    monkeypatch.setattr(am, "triton_available", lambda: triton_ok)
    a, b = weights([16, 16], h_in=64, h_out=64)
    w = lora_weights_from_lists([t.bfloat16() for t in a], [t.bfloat16() for t in b], [1.0, 1.0])
    plan = AtmmPlan(8, 64).update_from_token_slots([0] * 20 + [1] * 12, w.ranks)
    table = TileTable("g", "sm90", "bfloat16", {shape_key(64, 64, 16, 32, 2): table_cfg}, {})
    x = torch.zeros(32, 64, dtype=torch.bfloat16)
    y = torch.zeros(32, 64, dtype=torch.bfloat16)
    atmm_(y, x, plan, w, table=table)
    assert len(calls) == 1
    return calls[0]


@pytest.mark.parametrize("cfg", [TileConfig(16, 64, 4, 8, 16, 64),
                                 TileConfig(16, 64, 4, 8, 16, 64, "grouped_bf16_m64n128"),
                                 TileConfig(32, 64, 3, 2, 32, 128, backend="triton")])
def test_atmm_dispatches_to_the_backend_the_table_names(monkeypatch, cfg):
    name, used = _dispatch_case(monkeypatch, cfg, triton_ok=True)
    assert name == cfg.backend and used is cfg


def test_atmm_triton_entry_falls_back_to_cuda_without_triton(monkeypatch):
    name, used = _dispatch_case(monkeypatch, TileConfig(32, 64, 3, 2, 32, 128, backend="triton"), triton_ok=False)
    assert name in ("cuda", "cutlass_grouped") and used == heuristic_config(64, 64, 16, 32, 2)


def test_triton_module_imports_without_triton_and_reports_it():
    import importlib.util

    import kernels.atmm as am
    from kernels import triton_sgmv

    have = importlib.util.find_spec("triton") is not None
    assert triton_sgmv.available() == have == am.triton_available()
    if not have:
        with pytest.raises(RuntimeError, match="triton"):
            triton_sgmv.atmm_triton_(None, None, None, None, TileConfig(16, 64, 3, 1, 16, 128, backend="triton"))


def test_triton_menu_candidates_and_split_plan():
    from kernels import triton_sgmv as ts

    for h_in in (512, 3584, 4096, 11008, 18944):
        for split in (1, 2, 3, 7, 32):
            for bk in (64, 128):
                n, k_per = ts.split_plan(h_in, split, bk)
                assert k_per % bk == 0 and (n - 1) * k_per < h_in <= n * k_per  # covers K, none empty
    assert ts.candidates(4096, 4096, 16, 16, 8) == [m for m in ts.TRITON_MENU if m[0] == 16 and m[3] == 16]
    assert ts.candidates(4096, 4096, 16, 4096, 8) == list(ts.TRITON_MENU)
    assert ts.DEFAULT_SHAPE in ts.candidates(4096, 4096, 16, 1, 1)
    assert [ts.rank_pad(r) for r in (8, 16, 32, 48, 64, 80, 128)] == [16, 16, 32, 64, 64, 128, 128]
    assert ts.default_split(4096, 8) == 16 and ts.default_split(4096, 1000) == 1
    for s in ts.split_candidates(4096, 64, 8):
        assert 4096 // s >= 64


def test_switch_fallback_is_unmerge_then_merge():
    g = torch.Generator().manual_seed(2)
    w0 = [torch.randn(24, 32, generator=g).bfloat16(), torch.randn(16, 40, generator=g).bfloat16()]
    def term(out, inp, r, s):
        return LoraTerm(torch.randn(inp, r, generator=g).bfloat16(), torch.randn(r, out, generator=g).bfloat16(), s)
    m = [term(24, 32, 8, 2.0), term(16, 40, 16, 2.0)]
    n = [term(24, 32, 16, 0.5), term(16, 40, 8, 0.5)]
    ws = [w.clone() for w in w0]
    merge_(ws, m)
    for w, base, t in zip(ws, w0, m):
        want = (base.float() + t.scale * (t.a.float() @ t.b.float()).t()).bfloat16()
        assert torch.equal(w, want)
    switch_(ws, n, m)
    unmerge_(ws, n)
    for w, base in zip(ws, w0):  # back to the base up to bf16 rounding of the intermediate states
        assert (w.float() - base.float()).abs().max() < 0.5


def test_switch_plan_checks_shapes():
    w = [torch.zeros(24, 32, dtype=torch.bfloat16)]
    bad = [LoraTerm(torch.zeros(24, 8, dtype=torch.bfloat16), torch.zeros(8, 32, dtype=torch.bfloat16), 1.0)]
    with pytest.raises(ValueError, match="A must be"):
        SwitchPlan(w, bad)
    odd = [LoraTerm(torch.zeros(32, 4, dtype=torch.bfloat16), torch.zeros(4, 24, dtype=torch.bfloat16), 1.0)]
    with pytest.raises(ValueError, match="multiple of 8"):
        SwitchPlan(w, odd)
    with pytest.raises(ValueError, match="one term per"):
        SwitchPlan(w, [])
