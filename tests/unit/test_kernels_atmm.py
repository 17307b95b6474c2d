"""CPU tests of what the ATMM/switch Python wrappers plan: segment metadata, tile table, fallback."""

import json

import pytest
import torch

from kernels.atmm import BT_MENU, AtmmPlan, LoraWeights, atmm_, lora_weights_from_lists
from kernels.reference import SegmentPlan, multi_lora_reference_
from kernels.switch import LoraTerm, SwitchPlan, merge_, switch_, unmerge_
from kernels.tile_table import (
    TileConfig,
    TileTable,
    default_fused_groups,
    fused_group_options,
    fused_groups,
    fused_heuristic_config,
    heuristic_config,
    rank_block,
    segment_bucket,
    shape_key,
    table_filename,
    token_bucket,
)


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
    assert meta[2 + cap : 2 + cap + 4] == [0, -1, 1, 2]
    for i, bt in enumerate(BT_MENU):
        base = 2 + 2 * cap + i * (cap + 1)
        counts = [-(-20 // bt), 0, -(-49 // bt), -(-80 // bt)]
        want = [0, counts[0], counts[0], counts[0] + counts[2], sum(counts)]
        assert meta[base : base + 5] == want
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
    # deferred: the tables change at flush() only (the ATMM backend batches a step's new slots)
    a, b = torch.zeros(32, 8, dtype=torch.bfloat16), torch.zeros(8, 24, dtype=torch.bfloat16)
    w.set(0, a, b, 2.0, flush=False)
    assert w.rank_table.tolist() == [0, 0]
    w.flush()
    assert w.rank_table.tolist() == [8, 0] and w.scale_table.tolist() == [2.0, 0.0]
    assert w.a_ptrs.tolist() == [a.data_ptr(), 0] and w.b_ptrs.tolist() == [b.data_ptr(), 0]


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
    t = TileTable(
        "NVIDIA H200",
        "sm90",
        "bfloat16",
        {shape_key(4096, 4096, 16, 16, 8): cfg_a, shape_key(4096, 4096, 16, 1024, 8): cfg_b},
        {},
    )
    assert t.lookup(4096, 4096, 16, 16, 8) is cfg_a  # exact bucket: one dict lookup
    assert t.lookup(4096, 4096, 16, 12, 5) is cfg_a  # same bucket
    assert t.lookup(4096, 4096, 16, 700, 8) is cfg_b  # nearest measured token bucket
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
    expand |= {(16, int(w)) for w in re.findall(r"EXPAND_FMA\(\d+, (\d+)\)", src)}  # CUDA-core: BT 16
    assert (16, 512) in expand and (16, 1024) in expand
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
    expand |= {(16, int(w)) for w in re.findall(r"EXPAND_FMA\(\d+, (\d+)\)", src)}  # CUDA-core: BT 16
    assert (16, 512) in expand and (16, 1024) in expand
    grouped = set(re.findall(r'"(grouped_\w+)"', (root / "csrc" / "grouped.cu").read_text())) | {""}
    fused = {tuple(map(int, m)) for m in re.findall(r"FUSED\((\d+), (\d+), (\d+), (\d+)\)", src)}
    from kernels.triton_sgmv import TRITON_MENU

    for path in (root / "tile_tables").glob("*.json"):
        t = TileTable.load(path)
        for key, c in t.entries.items():
            rs = int(key.split("/")[1][1:])
            if c.backend == "triton":  # a Triton menu entry (JIT-compiled, any split-K)
                assert (c.shrink_bt, c.shrink_bk, c.shrink_stages, c.expand_bt, c.expand_bn, c.warps) in TRITON_MENU, (
                    key
                )
                assert c.split_k >= 1 and not c.grouped, key
                continue
            if c.backend == "fused":  # a fused kernel of the menu: (BT, BN, rank block, cluster)
                assert (c.shrink_bt, c.expand_bn, rank_block(rs), c.cluster) in fused, key
                assert c.split_k >= 1 and c.expand_bt == c.shrink_bt, key
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
    t = TileTable(
        "NVIDIA H200",
        "sm90",
        "bfloat16",
        {"4096x4096/r16/t4096/s16": tri, "4096x4096/r16/t16/s16": TileConfig(16, 64, 4, 8, 16, 64)},
        {},
    )
    path = tmp_path / "t.json"
    t.save(path)
    raw = json.loads(path.read_text())
    assert raw["entries"]["4096x4096/r16/t4096/s16"]["backend"] == "triton"
    assert raw["entries"]["4096x4096/r16/t4096/s16"]["warps"] == 8
    assert raw["entries"]["4096x4096/r16/t16/s16"]["backend"] == "cuda"
    assert TileTable.load(path).entries == t.entries
    # tables written before the backend field load as the CUDA backends
    old = {
        "gpu": "g",
        "arch": "sm90",
        "dtype": "bfloat16",
        "entries": {
            "4096x4096/r16/t16/s16": {
                "shrink_bt": 16,
                "shrink_bk": 64,
                "shrink_stages": 4,
                "split_k": 8,
                "expand_bt": 16,
                "expand_bn": 64,
                "grouped": "",
            },
            "4096x4096/r16/t64/s16": {
                "shrink_bt": 16,
                "shrink_bk": 64,
                "shrink_stages": 4,
                "split_k": 8,
                "expand_bt": 16,
                "expand_bn": 64,
                "grouped": "grouped_bf16_m64n128",
            },
        },
    }
    back = TileTable.from_json(old)
    assert back.entries["4096x4096/r16/t16/s16"].backend == "cuda"
    assert back.entries["4096x4096/r16/t64/s16"].backend == "cutlass_grouped"


def _dispatch_case(monkeypatch, table_cfg, triton_ok):
    import kernels.atmm as am

    calls = []
    for name in am.BACKEND_RUNNERS:
        monkeypatch.setitem(
            am.BACKEND_RUNNERS, name, lambda ext, y, x, plan, w, cfg, dtype, pdl, name=name: calls.append((name, cfg))
        )
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


@pytest.mark.parametrize(
    "cfg",
    [
        TileConfig(16, 64, 4, 8, 16, 64),
        TileConfig(16, 64, 4, 8, 16, 64, "grouped_bf16_m64n128"),
        TileConfig(32, 64, 3, 2, 32, 128, backend="triton"),
        TileConfig.fused(16, 128, 8, 2),
    ],
)
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


# ---- the fused single-launch backend (menu, table entries, dispatch, launch arguments) ----------


def _menu(name):
    import re
    from pathlib import Path

    src = (Path(__file__).resolve().parents[2] / "kernels" / "csrc" / name).read_text()
    return [tuple(map(int, m)) for m in re.findall(r"FUSED\((\d+), (\d+), (\d+), (\d+)\)", src)]


def _fused_smem(bt, bn, rb, elem=2):
    """FusedCfg<T, BT, BN, RB, CL>::SMEM (csrc/atmm.cuh), mirrored: what the tile search prunes by."""

    def al(v):
        return (v + 127) & ~127

    rp, bk, stages = 16 * rb, 64, 4
    pipe = stages * (bt * (bk + 8) + bk * (rp + 8)) * elem
    red = 4 * bt * rp * 4
    cs = bt * (bn + 4) * 4
    return al(max(pipe, red, cs)) + al(bt * rp * 4) + 2 * al(bt * (rp + 8) * elem) + 2 * al(rp * (bn + 8) * elem)


def test_fused_menu_covers_both_dtypes_and_fits_the_h200():
    from kernels.tile_search import seg_cache_bytes

    bf16, fp16 = _menu("atmm_bf16.cu"), _menu("atmm_fp16.cu")
    assert set(fp16) <= set(bf16) and len(bf16) >= 8 and {rb for _, _, rb, _ in fp16} == {1, 2, 4}
    for bt, bn, rb, cl in bf16:
        assert bt in BT_MENU and bn % 64 == 0 and rb in (1, 2, 4) and cl in (1, 2, 4, 8)
        assert (bt // 16) * rb <= 16 and (bt // 16) * (bn // 64) <= 8  # accumulator fragments per warp
        # H200: 227 KB per block, plan capacity 64 segments
        assert _fused_smem(bt, bn, rb) + seg_cache_bytes(64) <= 227 * 1024, (bt, bn, rb, cl)
    assert any(rb == 4 for _, _, rb, _ in bf16) and any(cl == 1 for *_, cl in bf16)


def test_fused_tile_config_names_and_checks():
    c = TileConfig.fused(16, 128, 8, 2)
    assert c.backend == "fused" and c.cluster == 8 and c.split_k == 2 and c.expand_bt == 16
    assert c.fused_name("bfloat16", 1) == "fused_bf16_bt16_bn128_r1_c8"
    assert c.fused_name("float16", 4) == "fused_fp16_bt16_bn128_r4_c8"
    with pytest.raises(ValueError, match="cluster"):
        TileConfig(16, 64, 4, 1, 16, 128, backend="fused", cluster=3)
    with pytest.raises(ValueError, match="shrink_bt"):
        TileConfig(16, 64, 4, 1, 32, 128, backend="fused", cluster=8)
    with pytest.raises(ValueError, match="grouped"):
        TileConfig(16, 64, 4, 1, 16, 128, "grouped_bf16_m64n128", backend="fused")
    assert TileConfig(16, 64, 4, 8, 16, 64).cluster == 1  # other backends: default
    t = TileTable("g", "sm90", "bfloat16", {"4096x4096/r16/t16/s16": c}, {})
    assert TileTable.from_json(t.to_json()).entries["4096x4096/r16/t16/s16"] == c


def test_fused_group_counts():
    assert fused_groups(4, 4096, 128, 8) == 4 and fused_groups(64, 4096, 128, 8) == 4  # 32 chunks / 8 CTAs
    assert fused_groups(8, 512, 128, 8) == 1 and fused_groups(0, 4096, 128, 1) == 1
    assert fused_group_options(4096, 128, 8, 8) == [1, 2, 4]
    assert fused_group_options(4096, 128, 1, 8) == [1, 2, 4, 8, 16, 32]
    assert fused_group_options(4096, 128, 8, 62) == [1]  # 62 tiles x 8 already ~4 per SM
    assert default_fused_groups(4096, 128, 8, 8) == 2  # 8 tiles x 2 groups x 8 = 128 CTAs on 132 SMs
    h = fused_heuristic_config(4096, 16, 16, 8)
    assert h == TileConfig.fused(16, 128, 8, 2)
    assert fused_heuristic_config(4096, 32, 512, 4).shrink_bt == 32
    assert fused_heuristic_config(4096, 128, 16, 8) is None  # ranks > 64: no fused kernel


def test_fused_config_with_rank_128_falls_back_to_the_heuristic(monkeypatch):
    import kernels.atmm as am

    cfg = TileConfig.fused(16, 128, 8, 2)
    assert am.choose_config(cfg, 64, 64, 64, 32, 2) is cfg
    assert am.choose_config(cfg, 64, 64, 128, 32, 2) == heuristic_config(64, 64, 128, 32, 2)


def test_fused_launch_goes_through_atmm_shrink_with_groups_and_cluster_tiles(monkeypatch):
    import kernels.atmm as am

    calls = []

    class FakeExt:
        def atmm_shrink(self, *args):
            calls.append(args)

    monkeypatch.setattr(am, "_kernel_ext", lambda y: FakeExt())
    monkeypatch.setattr(am, "config_id", lambda name: {"fused_bf16_bt16_bn128_r2_c4": 7}[name])
    monkeypatch.setattr(am, "_fused_ids", {})
    a, b = weights([16, 32], h_in=64, h_out=1024)
    w = lora_weights_from_lists([t.bfloat16() for t in a], [t.bfloat16() for t in b], [1.0, 1.0])
    plan = AtmmPlan(8, 64).update_from_token_slots([0] * 20 + [1] * 12, w.ranks)
    x = torch.zeros(32, 64, dtype=torch.bfloat16)
    y = torch.zeros(32, 1024, dtype=torch.bfloat16)
    atmm_(y, x, plan, w, config=TileConfig.fused(16, 128, 4, 16))
    (args,) = calls
    assert args[0] is y and args[1] is x and args[2] is plan.meta and args[8] is plan.workspace
    cfg_id, groups, rank_stride, tiles, pdl = args[9:]
    # 8 column chunks of 128 over clusters of 4 CTAs: at most 2 groups; tiles x cluster
    assert (cfg_id, groups, rank_stride, tiles, pdl) == (7, 2, 32, plan.tiles[16] * 4, True)


def test_weights_track_16_byte_alignment():
    w = LoraWeights(3, 64, 32, torch.bfloat16)
    assert w.aligned16
    store = torch.zeros(64 * 16 + 8, dtype=torch.bfloat16)
    a_odd = store[1 : 1 + 64 * 16].view(64, 16)  # contiguous, 2 bytes past an aligned start
    assert a_odd.is_contiguous() and a_odd.data_ptr() % 16
    w.set(0, torch.zeros(64, 16, dtype=torch.bfloat16), torch.zeros(16, 32, dtype=torch.bfloat16), 1.0)
    assert w.aligned16
    w.set(1, a_odd, torch.zeros(16, 32, dtype=torch.bfloat16), 1.0)
    assert not w.aligned16
    w.clear(1)
    assert w.aligned16
    assert not LoraWeights(1, 60, 32, torch.bfloat16).aligned16  # rows of x / A not 16-byte multiples


def test_misaligned_weights_never_reach_the_cuda_kernels(monkeypatch):
    import kernels.atmm as am

    calls = []
    for name in am.BACKEND_RUNNERS:
        monkeypatch.setitem(
            am.BACKEND_RUNNERS, name, lambda ext, y, x, plan, w, cfg, dtype, pdl, name=name: calls.append((name, cfg))
        )
    monkeypatch.setattr(am, "_kernel_ext", lambda y: object())
    a, b = weights([16, 16], h_in=64, h_out=64)
    store = torch.zeros(64 * 16 + 8, dtype=torch.bfloat16)
    a_odd = store[1 : 1 + 64 * 16].view(64, 16)
    a_odd.copy_(a[0].bfloat16())
    w = lora_weights_from_lists([a_odd, a[1].bfloat16()], [t.bfloat16() for t in b], [1.0, 1.0])
    plan = AtmmPlan(8, 64).update_from_token_slots([0] * 20 + [1] * 12, w.ranks)
    x = torch.randn(32, 64).bfloat16()
    y = torch.randn(32, 64).bfloat16()
    monkeypatch.setattr(am, "triton_available", lambda: True)
    atmm_(y.clone(), x, plan, w, config=TileConfig.fused(16, 128, 8, 1))
    assert calls == [("triton", am._UNALIGNED_TRITON)]
    monkeypatch.setattr(am, "triton_available", lambda: False)  # no triton: the torch reference
    got = atmm_(y.clone(), x, plan, w, config=TileConfig(16, 64, 4, 8, 16, 64))
    want = multi_lora_reference_(y.clone(), x, plan.segment_plan, w.a, w.b, w.scales)
    assert len(calls) == 1 and torch.equal(got, want)


def test_triton_alignment_check_is_host_side():
    from kernels import triton_sgmv as ts

    a, b = weights([16], h_in=64, h_out=32)
    w = lora_weights_from_lists([a[0].bfloat16()], [b[0].bfloat16()], [1.0])
    x, y, ws = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(64)
    assert ts.aligned_launch(y, x, w, ws)
    assert not ts.aligned_launch(y, x, w, ws[1:])  # workspace view off 16 bytes
    assert not ts.aligned_launch(y, torch.zeros(4 * 64 + 1, dtype=torch.bfloat16)[1:].view(4, 64), w, ws)


def test_tile_search_prunes_fused_configs_and_keeps_them_out_of_the_shrink_list():
    from kernels.tile_search import candidates, fused_candidates, seg_cache_bytes

    def cfg(i, name, kind="shrink", bt=16, rb=1, smem=30000, bn=0, bm=0):
        return {
            "id": i,
            "name": name,
            "kind": kind,
            "dtype": "bfloat16",
            "bt": bt,
            "bk": 64,
            "stages": 4,
            "rb": rb,
            "bn": bn,
            "bm": bm,
            "smem_r16": smem,
            "smem_r128": smem,
        }

    class Ext:
        def configs(self):
            return [
                cfg(0, "shrink_bf16_bt16_bk64_s4_r1"),
                cfg(1, "fused_bf16_bt16_bn128_r1_c8", bn=128, bm=8),
                cfg(2, "fused_bf16_bt64_bn128_r1_c8", bt=64, bn=128, bm=8),
                cfg(3, "fused_bf16_bt16_bn128_r4_c8", rb=4, smem=90000, bn=128, bm=8),
                cfg(4, "fused_bf16_bt16_bn256_r1_c8", smem=232448 - seg_cache_bytes(64) + 1, bn=256, bm=8),
                cfg(5, "expand_bf16_bt16_bn128", kind="expand", bn=128),
            ]

    shr, exp, _ = candidates(Ext(), "bfloat16", 16, 4096, 16, 1 << 20, 232448)
    assert [c["id"] for c in shr] == [0] and [c["id"] for c in exp] == [5]
    # 16 tokens over 8 segments: no 64-token tiles; over the shared-memory limit: pruned; rank block 1 only
    assert [c["id"] for c in fused_candidates(Ext(), "bfloat16", 16, 16, 8, 64, 232448)] == [1]
    assert [c["id"] for c in fused_candidates(Ext(), "bfloat16", 16, 1024, 8, 64, 232448)] == [1, 2]
    assert [c["id"] for c in fused_candidates(Ext(), "bfloat16", 64, 16, 8, 64, 232448)] == [3]
    assert fused_candidates(Ext(), "bfloat16", 128, 16, 8, 64, 232448) == []


def test_tile_search_times_the_cuda_core_expand_for_small_token_counts_only():
    from kernels.tile_search import candidates
    from kernels.tile_table import FMA_EXPAND_MAX_TOKENS

    def cfg(i, name, kind, bt=16, bn=0):
        return {
            "id": i,
            "name": name,
            "kind": kind,
            "dtype": "bfloat16",
            "bt": bt,
            "bk": 64,
            "stages": 4,
            "rb": 1,
            "bn": bn,
            "bm": 0,
            "smem_r16": 1000,
            "smem_r128": 1000,
        }

    class Ext:
        def configs(self):
            return [
                cfg(0, "shrink_bf16_bt16_bk64_s4_r1", "shrink"),
                cfg(1, "expand_bf16_bt16_bn256", "expand", bn=256),
                cfg(2, "expand_bf16_bt16_bn1024", "expand", bn=1024),
            ]

    def expands(tokens):
        return [c["id"] for c in candidates(Ext(), "bfloat16", 16, 4096, tokens, 1 << 24, 232448)[1]]

    assert expands(16) == expands(FMA_EXPAND_MAX_TOKENS) == [1, 2]
    assert expands(FMA_EXPAND_MAX_TOKENS + 1) == [1]


def test_kernels_do_not_import_bench():
    import re
    from pathlib import Path

    for path in (Path(__file__).resolve().parents[2] / "kernels").glob("*.py"):
        assert not re.search(r"^\s*(from|import)\s+bench\b", path.read_text(), re.M), path.name
