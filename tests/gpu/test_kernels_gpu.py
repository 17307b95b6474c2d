"""CUDA ATMM and switch kernels vs the torch references on fresh random inputs (small grid).

Skipped without CUDA or the built extension. Every config of the menu that fits is exercised,
including every fused single-launch config (bf16 and fp16) at several column-group counts.
"""

import random

import pytest
import torch

from kernels.atmm import AtmmPlan, atmm_, config_id, extension, fused_launch_args, lora_weights_from_lists
from kernels.reference import SegmentPlan, multi_lora_reference_
from kernels import switch as sw_mod
from kernels.switch import LoraTerm, SwitchPlan
from kernels.tile_table import TileConfig, fused_group_options, fused_groups, fused_heuristic_config, heuristic_config

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
EXT = extension()
if EXT is None:
    pytest.skip("kernels extension not built", allow_module_level=True)

DT = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_case(tokens, ranks, h_in, h_out, dtype, seed, none_frac=0.1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = random.Random(seed)
    n = len(ranks)
    a = [(torch.randn(h_in, r, device="cuda", generator=g) / h_in**0.5).to(dtype) for r in ranks]
    b = [(torch.randn(r, h_out, device="cuda", generator=g) / r**0.5).to(dtype) for r in ranks]
    scales = [rnd.choice([0.5, 1.0, 2.0]) for _ in ranks]
    slots = sorted(rnd.randrange(n) if rnd.random() > none_frac else -1 for _ in range(tokens))
    rnd.shuffle(slots)
    slots.sort(key=lambda s: (s < 0, s))  # grouped, -1 tokens at the end
    x = torch.randn(tokens, h_in, device="cuda", generator=g).to(dtype)
    y = torch.randn(tokens, h_out, device="cuda", generator=g).to(dtype)
    return a, b, scales, slots, x, y


def reference(y, x, slots, a, b, scales):
    out = y.float().clone()
    plan = SegmentPlan.from_token_slots(slots)
    multi_lora_reference_(out, x.float(), plan, [t.float() for t in a], [t.float() for t in b], scales)
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "tokens,ranks,h_in,h_out",
    [
        (1, [16], 4096, 4096),
        (16, [8, 16, 32, 64], 3584, 512),
        (37, [16] * 8, 1024, 2048),
        (300, [8, 16, 32, 64], 4096, 1024),
        (257, [128, 8], 2048, 1024),
        (1024, [16] * 3, 1024, 4096),
    ],
)
def test_atmm_matches_reference_default_tiles(dtype, tokens, ranks, h_in, h_out):
    dt = DT[dtype]
    a, b, scales, slots, x, y = make_case(tokens, ranks, h_in, h_out, dt, seed=tokens * 7 + len(ranks))
    w = lora_weights_from_lists(a, b, scales)
    plan = AtmmPlan(max_segments=16, max_tokens=2048, device="cuda").update_from_token_slots(slots, w.ranks)
    want = reference(y, x, slots, a, b, scales)
    got = y.clone()
    atmm_(got, x, plan, w)
    torch.cuda.synchronize()
    assert torch.isfinite(got.float()).all()
    # y is rounded once (bf16 eps 2^-8): error relative to y stays at rounding level
    assert rel_err(got, want) < (4e-3 if dt == torch.bfloat16 else 1e-3)
    # untouched rows (slot -1) are bit-identical
    none_rows = [i for i, s in enumerate(slots) if s < 0]
    if none_rows:
        assert torch.equal(got[none_rows], y[none_rows])


@pytest.mark.parametrize("grouped", ["grouped_bf16_m64n128", "grouped_bf16_m128n128"])
@pytest.mark.parametrize(
    "tokens,ranks,h_in,h_out",
    [(16, [8, 16], 512, 512), (300, [8, 16, 32, 64], 1024, 1024), (1100, [16, 128], 2048, 768)],
)
def test_atmm_cutlass_grouped_expand_matches_reference(grouped, tokens, ranks, h_in, h_out):
    import dataclasses

    a, b, scales, slots, x, y = make_case(tokens, ranks, h_in, h_out, torch.bfloat16, seed=tokens + 3)
    w = lora_weights_from_lists(a, b, scales)
    plan = AtmmPlan(max_segments=8, max_tokens=2048, device="cuda").update_from_token_slots(slots, w.ranks)
    want = reference(y, x, slots, a, b, scales)
    cfg = dataclasses.replace(
        heuristic_config(h_in, h_out, plan.rank_stride, tokens, plan.active_segments), grouped=grouped
    )
    got = y.clone()
    atmm_(got, x, plan, w, config=cfg)
    torch.cuda.synchronize()
    assert rel_err(got, want) < 4e-3
    # x·A is rounded to bf16 once before the CUTLASS GEMM: the LoRA delta carries ~bf16 error
    assert rel_err(got.float() - y.float(), want - y.float()) < 1e-2
    none_rows = [i for i, s in enumerate(slots) if s < 0]
    if none_rows:
        assert torch.equal(got[none_rows], y[none_rows])
    graph = torch.cuda.CUDAGraph()
    out = y.clone()
    with torch.cuda.graph(graph):
        atmm_(out, x, plan, w, config=cfg)
    new_slots = sorted(random.Random(9).choice([-1, 0, 1]) for _ in range(tokens))
    plan.update_from_token_slots(new_slots, w.ranks)
    out.copy_(y)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference(y, x, new_slots, a, b, scales)) < 4e-3


def test_atmm_every_config_and_split_k():
    dt = torch.bfloat16
    a, b, scales, slots, x, y = make_case(150, [8, 16, 32, 64, 128], 1024, 1024, dt, seed=11)
    w = lora_weights_from_lists(a, b, scales)
    plan = AtmmPlan(max_segments=8, max_tokens=256, device="cuda").update_from_token_slots(slots, w.ranks)
    want = reference(y, x, slots, a, b, scales)
    delta_ref = want - y.float()
    cfgs = [c for c in EXT.configs() if c["dtype"] == "bfloat16"]
    for sh in [c for c in cfgs if c["kind"] == "shrink" and c["name"].startswith("shrink_") and c["rb"] == 8]:
        for split_k in (1, 3, 8):
            got = y.clone()
            EXT.atmm(
                got,
                x,
                plan.meta,
                plan.seg_cap,
                w.a_ptrs,
                w.b_ptrs,
                w.rank_table,
                w.scale_table,
                plan.workspace,
                sh["id"],
                config_id("expand_bf16_bt16_bn64"),
                split_k,
                plan.rank_stride,
                plan.tiles[sh["bt"]],
                plan.tiles[16],
                True,
            )
            torch.cuda.synchronize()
            assert rel_err(got.float() - y.float(), delta_ref) < 2e-2, (sh["name"], split_k)
            assert rel_err(got, want) < 4e-3, (sh["name"], split_k)
    for ex in [c for c in cfgs if c["kind"] == "expand"]:
        got = y.clone()
        EXT.atmm(
            got,
            x,
            plan.meta,
            plan.seg_cap,
            w.a_ptrs,
            w.b_ptrs,
            w.rank_table,
            w.scale_table,
            plan.workspace,
            config_id("shrink_bf16_bt16_bk64_s4_r8"),
            ex["id"],
            2,
            plan.rank_stride,
            plan.tiles[16],
            plan.tiles[ex["bt"]],
            False,
        )
        torch.cuda.synchronize()
        assert rel_err(got, want) < 4e-3, ex["name"]


def _xa_case(tokens, ranks, h_in, h_out, dt, seed):
    """A base GEMM's output with the slots' x·A as extra columns (at shuffled offsets), as the
    engine's folded projections produce it: y and xa are column views of one (T, h_out + R) tensor."""
    a, b, scales, slots, x, y0 = make_case(tokens, ranks, h_in, h_out, dt, seed)
    order = list(range(len(ranks)))
    random.Random(seed).shuffle(order)
    cols, c = [0] * len(ranks), 8  # a gap of 8 unused columns first: offsets need not start at 0
    for k in order:
        cols[k], c = c, c + ranks[k]
    out = torch.zeros(tokens, h_out + c, device="cuda", dtype=dt)
    out[:, :h_out] = y0
    for k in range(len(ranks)):
        out[:, h_out + cols[k] : h_out + cols[k] + ranks[k]] = (x.float() @ a[k].float()).to(dt)
    return a, b, scales, slots, x, y0, out, cols


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "tokens,ranks,h_in,h_out",
    [
        (16, [8, 16, 48, 64], 3584, 4608),
        (300, [16] * 8, 1024, 2048),
        (5, [128, 8], 512, 1024),
        (16, [32] * 8, 3584, 37888),
    ],
)
def test_atmm_expand_xa_matches_reference_every_expand(dtype, tokens, ranks, h_in, h_out):
    """expand_xa (the folded projections' expand) on every compiled expand config equals the
    reference expand of the same bf16/fp16 x·A, into a strided y; rows of slot -1 untouched."""
    from kernels.atmm import atmm_expand_xa_
    from kernels.reference import lora_expand_reference_

    dt = DT[dtype]
    a, b, scales, slots, x, y0, out, cols = _xa_case(tokens, ranks, h_in, h_out, dt, seed=tokens + h_out)
    w = lora_weights_from_lists(a, b, scales)
    plan = AtmmPlan(max_segments=16, max_tokens=512, device="cuda").update_from_token_slots(slots, w.ranks)
    xa = out[:, h_out:]
    want = lora_expand_reference_(y0.float().clone(), xa, cols, plan.segment_plan, [t.float() for t in b], scales)
    cols_dev = torch.tensor(cols + [0] * (w.num_slots - len(cols)), dtype=torch.int32, device="cuda")
    none_rows = [i for i, s in enumerate(slots) if s < 0]
    for ex in [c for c in EXT.configs() if c["dtype"] == dtype and c["kind"] == "expand"]:
        got = out.clone()
        y = got[:, :h_out]
        EXT.atmm_expand_xa(
            y,
            got[:, h_out:],
            cols_dev,
            plan.meta,
            plan.seg_cap,
            w.b_ptrs,
            w.rank_table,
            w.scale_table,
            plan.workspace,
            ex["id"],
            plan.rank_stride,
            plan.tiles[ex["bt"]],
            True,
        )
        torch.cuda.synchronize()
        assert rel_err(y, want) < (4e-3 if dt == torch.bfloat16 else 1e-3), ex["name"]
        assert rel_err(y.float() - y0.float(), want - y0.float()) < 2e-2, ex["name"]
        assert torch.equal(got[:, h_out:], out[:, h_out:])  # xa is read, never written
        if none_rows:
            assert torch.equal(y[none_rows], y0[none_rows])
    got = out.clone()  # the Python entry point (tile table or heuristic config) in a CUDA graph, replayed
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        atmm_expand_xa_(got[:, :h_out].clone(), got[:, h_out:], cols_dev, plan, w)  # warm-up (config ids)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        atmm_expand_xa_(got[:, :h_out], got[:, h_out:], cols_dev, plan, w)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(got[:, :h_out], want) < (4e-3 if dt == torch.bfloat16 else 1e-3)


def test_cuda_core_expand_is_in_the_menu():
    """The decode shapes' CUDA-core expand (BN >= FMA_EXPAND_MIN_BN) is compiled for both dtypes, so
    the every-expand tests above run it."""
    from kernels.tile_table import FMA_EXPAND_MIN_BN

    for dtype in ("bfloat16", "float16"):
        wide = [
            c["name"]
            for c in EXT.configs()
            if c["kind"] == "expand" and c["dtype"] == dtype and c["bn"] >= FMA_EXPAND_MIN_BN
        ]
        assert len(wide) == 2, wide


def test_atmm_cuda_graph_replays_new_plans():
    dt = torch.bfloat16
    a, b, scales, slots, x, y = make_case(64, [16, 32, 8], 1024, 768, dt, seed=5)
    w = lora_weights_from_lists(a, b, scales)
    plan = AtmmPlan(max_segments=8, max_tokens=64, device="cuda").update_from_token_slots(slots, w.ranks)
    cfg = heuristic_config(1024, 768, 32, 64, 3)
    out = y.clone()
    atmm_(out, x, plan, w, config=cfg)  # warm-up (JIT, attributes)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        atmm_(out, x, plan, w, config=cfg)
    for seed in range(3):
        rnd = random.Random(seed)
        new_slots = sorted(rnd.choice([-1, 0, 1, 2]) for _ in range(64))
        plan.update_from_token_slots(new_slots, w.ranks)
        out.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference(y, x, new_slots, a, b, scales)) < 4e-3


def test_expand_xa_graph_replays_new_plans_every_expand():
    """The folded projections' expand captured once per config and replayed for other adapter
    mixes over the same tokens (other segment and tile counts than at capture): what lets the
    decode graph key drop them (AtmmBackend.launch_key)."""
    from kernels.reference import lora_expand_reference_

    dt = torch.bfloat16
    tokens, ranks, h_in, h_out = 32, [16, 16, 16, 16], 1024, 3584
    a, b, scales, slots, x, y0, out, cols = _xa_case(tokens, ranks, h_in, h_out, dt, seed=21)
    w = lora_weights_from_lists(a, b, scales)
    plan = AtmmPlan(max_segments=16, max_tokens=tokens, device="cuda").update_from_token_slots(slots, w.ranks)
    cols_dev = torch.tensor(cols + [0] * (w.num_slots - len(cols)), dtype=torch.int32, device="cuda")
    for ex in [c for c in EXT.configs() if c["dtype"] == "bfloat16" and c["kind"] == "expand"]:
        plan.update_from_token_slots(slots, w.ranks)
        got = out.clone()

        def launch():
            EXT.atmm_expand_xa(
                got[:, :h_out],
                got[:, h_out:],
                cols_dev,
                plan.meta,
                plan.seg_cap,
                w.b_ptrs,
                w.rank_table,
                w.scale_table,
                plan.workspace,
                ex["id"],
                plan.rank_stride,
                plan.tiles[ex["bt"]],
                True,
            )

        launch()  # warm-up (attributes)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        for seed in range(3):
            rnd = random.Random(seed)
            new_slots = sorted(rnd.choice([-1, 0, 1, 2, 3]) for _ in range(tokens))
            plan.update_from_token_slots(new_slots, w.ranks)
            got.copy_(out)
            graph.replay()
            torch.cuda.synchronize()
            want = lora_expand_reference_(
                y0.float().clone(), out[:, h_out:], cols, plan.segment_plan, [t.float() for t in b], scales
            )
            assert rel_err(got[:, :h_out], want) < 4e-3, (ex["name"], seed)


# ---- fused single-launch kernels (kind "shrink" in the registry, launched through atmm_shrink) ----
FUSED = [c for c in EXT.configs() if c["name"].startswith("fused_")]
FUSED_RANKS = {1: [8, 16], 2: [8, 16, 24, 32], 4: [8, 16, 32, 64]}
# (tokens, adapters, h_in, h_out): K not a multiple of cluster x 64, h_out not of BN, one token,
# many 1-3 token segments, the headline shape
FUSED_CASES = [(150, 4, 1032, 776), (1, 1, 520, 136), (64, 40, 1024, 1024), (16, 8, 4096, 4096)]


def lora_case(tokens, ranks, h_in, h_out, dtype, seed):
    """make_case with at least one LoRA token (the delta check is 0/0 otherwise)."""
    a, b, scales, slots, x, y = make_case(tokens, ranks, h_in, h_out, dtype, seed)
    if all(s < 0 for s in slots):
        slots[0] = 0
    return a, b, scales, slots, x, y


def run_fused(cfg, y, x, plan, w, groups, pdl=True):
    tc = TileConfig.fused(cfg["bt"], cfg["bn"], cfg["bm"], groups)  # bm carries the cluster size
    g, tiles = fused_launch_args(tc, w.h_out, plan)
    EXT.atmm_shrink(
        y,
        x,
        plan.meta,
        plan.seg_cap,
        w.a_ptrs,
        w.b_ptrs,
        w.rank_table,
        w.scale_table,
        plan.workspace,
        cfg["id"],
        g,
        plan.rank_stride,
        tiles,
        pdl,
    )


def test_every_fused_config_is_in_the_menu():
    names = {c["name"] for c in FUSED}
    assert len(FUSED) >= 12 and {n.replace("fp16", "bf16") for n in names if "fp16" in n} <= names
    assert all(c["kind"] == "shrink" and c["bm"] in (1, 2, 4, 8) and c["rb"] in (1, 2, 4) for c in FUSED)


@pytest.mark.parametrize("name", [c["name"] for c in FUSED])
def test_fused_config_matches_reference(name):
    cfg = next(c for c in FUSED if c["name"] == name)
    dt = DT[cfg["dtype"]]
    ranks_pool = FUSED_RANKS[cfg["rb"]]
    for i, (tokens, n, h_in, h_out) in enumerate(FUSED_CASES):
        ranks = [ranks_pool[k % len(ranks_pool)] for k in range(n)]
        a, b, scales, slots, x, y = lora_case(tokens, ranks, h_in, h_out, dt, seed=1000 + 17 * i + cfg["id"])
        w = lora_weights_from_lists(a, b, scales)
        plan = AtmmPlan(max_segments=64, max_tokens=256, device="cuda").update_from_token_slots(slots, w.ranks)
        assert plan.rank_stride <= 16 * cfg["rb"]
        want = reference(y, x, slots, a, b, scales)
        delta_ref = want - y.float()
        none_rows = [j for j, s in enumerate(slots) if s < 0]
        ntiles = plan.tiles[cfg["bt"]]
        groups = sorted(
            {
                1,
                fused_groups(3, h_out, cfg["bn"], cfg["bm"]),
                fused_group_options(h_out, cfg["bn"], cfg["bm"], ntiles)[-1],
            }
        )
        for g in groups:
            for pdl in (True, False):
                got = y.clone()
                run_fused(cfg, got, x, plan, w, g, pdl)
                torch.cuda.synchronize()
                what = (name, tokens, h_in, h_out, g, pdl)
                assert torch.isfinite(got.float()).all(), what
                assert rel_err(got, want) < (4e-3 if dt == torch.bfloat16 else 1e-3), what
                # x·A kept at ~fp32 (hi + lo halves): the LoRA delta itself is accurate
                assert rel_err(got.float() - y.float(), delta_ref) < 1e-2, what
                if none_rows:
                    assert torch.equal(got[none_rows], y[none_rows]), what


def test_fused_through_atmm_and_pdl_chain_in_a_graph_with_new_plans():
    # op 2 reads op 1's output as its x: with PDL the fused kernel must wait for its predecessor
    dt = torch.bfloat16
    a1, b1, s1, slots, x, y1 = lora_case(48, [16, 8, 16], 1024, 512, dt, seed=71)
    a2, b2, s2, _, _, y2 = lora_case(48, [8, 16, 16], 512, 768, dt, seed=72)
    w1, w2 = lora_weights_from_lists(a1, b1, s1), lora_weights_from_lists(a2, b2, s2)
    plan = AtmmPlan(max_segments=64, max_tokens=48, device="cuda").update_from_token_slots([0] * 48, w1.ranks)
    cfg1 = fused_heuristic_config(512, 16, 48, 1)
    cfg2 = TileConfig.fused(16, 128, 4, 2)

    def step(o1, o2):
        atmm_(o1, x, plan, w1, config=cfg1)
        atmm_(o2, o1, plan, w2, config=cfg2)

    def want(step_slots):
        r1 = reference(y1, x, step_slots, a1, b1, s1)
        return r1, reference(y2, r1.to(dt), step_slots, a2, b2, s2)

    o1, o2 = y1.clone(), y2.clone()
    step(o1, o2)  # eager (warm-up: attributes, JIT)
    torch.cuda.synchronize()
    r1, r2 = want([0] * 48)
    assert rel_err(o1, r1) < 4e-3 and rel_err(o2, r2) < 4e-3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captured with one segment: replays cover plans with more tiles
        step(o1, o2)
    for seed in range(3):
        rnd = random.Random(seed)
        new_slots = sorted((rnd.choice([-1, 0, 1, 2]) for _ in range(48)), key=lambda s: (s < 0, s))
        if all(s < 0 for s in new_slots):
            new_slots[0] = 0
        plan.update_from_token_slots(new_slots, w1.ranks)
        o1.copy_(y1)
        o2.copy_(y2)
        graph.replay()
        torch.cuda.synchronize()
        r1, r2 = want(new_slots)
        assert rel_err(o1, r1) < 4e-3 and rel_err(o2, r2) < 4e-3, seed
        none_rows = [j for j, s in enumerate(new_slots) if s < 0]
        if none_rows:
            assert torch.equal(o1[none_rows], y1[none_rows])


_REJECT_SCRIPT = r"""
import sys, torch
from kernels.atmm import AtmmPlan, config_id, extension, lora_weights_from_lists
ext = extension()
g = torch.Generator(device="cuda").manual_seed(1)
a = [(torch.randn(256, 16, device="cuda", generator=g) / 16).bfloat16()]
b = [torch.randn(16, 256, device="cuda", generator=g).bfloat16()]
w = lora_weights_from_lists(a, b, [1.0])
x = torch.randn(16, 256, device="cuda").bfloat16()
y = torch.randn(16, 256, device="cuda").bfloat16()
plan = AtmmPlan(max_segments=4, max_tokens=16, device="cuda").update_from_token_slots([0] * 16, w.ranks)
sh, ex = config_id("shrink_bf16_bt16_bk64_s4_r2"), config_id("expand_bf16_bt16_bn64")
def args(shrink=sh, expand=ex, split_k=1, rs=16, ws=plan.workspace, meta=plan.meta):
    return (meta, plan.seg_cap, w.a_ptrs, w.b_ptrs, w.rank_table, w.scale_table, ws, shrink, expand, split_k, rs,
            1, 1, False)
cases = {
    "x is": lambda: ext.atmm(y, x.half(), *args()),
    "CUDA": lambda: ext.atmm(y.cpu(), x.cpu(), *args()),
    "unit stride": lambda: ext.atmm(y, x.t().contiguous().t(), *args()),
    "tokens": lambda: ext.atmm(y[:8], x, *args()),
    "kind": lambda: ext.atmm(y, x, *args(shrink=ex)),
    "dtype": lambda: ext.atmm(y, x, *args(shrink=config_id("shrink_fp16_bt16_bk64_s4_r2"))),
    "rank_stride": lambda: ext.atmm(y, x, *args(rs=24)),
    "workspace": lambda: ext.atmm(y, x, *args(ws=plan.workspace[:10])),
    "meta": lambda: ext.atmm(y, x, *args(meta=plan.meta.float())),
    "out of range": lambda: ext.atmm(y, x, *args(shrink=10**6)),
}
for want, fn in cases.items():
    print("case", want, flush=True)
    try:
        fn()
    except RuntimeError as e:
        if want not in str(e):
            print("WRONG MESSAGE", want, "->", str(e)[:300]); sys.exit(2)
    else:
        print("NO ERROR", want); sys.exit(3)
torch.cuda.synchronize()
print("ALL OK")
"""


def test_atmm_binding_rejects_bad_inputs():
    # in a child process: a crash in an error path must fail this test, not the whole run
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", _REJECT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0 and "ALL OK" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])


# ---- switch kernels: every compiled config, in place and out of place --------------------------------
SWITCH_CONFIGS = [c["name"] for c in EXT.configs() if c["kind"] == "switch"]
_SW_DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
_SW_ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10}


def test_every_switch_family_is_compiled():
    names = set(SWITCH_CONFIGS)
    for dt in ("bf16", "fp16"):
        assert f"switch_{dt}_bm64_bn128" in names
        assert any(n.startswith(f"switch_{dt}_pipe_") for n in names)
        assert any(n.startswith(f"switch_{dt}_regs_") for n in names)
    for d in (torch.bfloat16, torch.float16):
        assert sw_mod.DEFAULT_CONFIG[d] in names and sw_mod.FALLBACK_CONFIG[d] in names


def _sw_term(m, n, r, s, g, dtype):
    # factors sized so the delta is O(0.5): any misplaced element is many ulps off
    return LoraTerm(
        (torch.randn(n, r, device="cuda", generator=g) * 0.3).to(dtype),
        (torch.randn(r, m, device="cuda", generator=g) * 0.3).to(dtype),
        s,
    )


def _sw_check(got, w0, terms, dtype, tag):
    delta = torch.zeros(w0.shape, device="cuda")
    for t in terms:
        if t is not None:
            delta += t.scale * (t.a.float() @ t.b.float()).t()
    want32 = w0.float() + delta
    want = want32.to(dtype)
    diff = (got.float() - want.float()).abs()
    # one rounding of (nearly) the same fp32 value: at most one ulp apart
    # (the deltas are O(0.2-1), many ulps: a misplaced or missing update fails this)
    assert (diff <= want.float().abs() * _SW_ULP[dtype] + 1e-6).all(), (tag, diff.max().item())
    assert rel_err(got, want) <= 1e-2 and rel_err(got, want32) <= 1e-2, tag


def _sw_case(config, seed, shapes, pairs):
    dtype = _SW_DT[config.split("_")[1]]
    g = torch.Generator(device="cuda").manual_seed(seed)
    w0 = [torch.randn(m, n, device="cuda", generator=g).to(dtype) for m, n in shapes]
    first = [None if r1 == 0 else _sw_term(m, n, r1, 0.7, g, dtype) for (m, n), (r1, _) in zip(shapes, pairs)]
    second = [None if r2 == 0 else _sw_term(m, n, r2, -1.5, g, dtype) for (m, n), (_, r2) in zip(shapes, pairs)]
    return dtype, w0, first, second


def _sw_pairs(config):
    # mixed ranks per matrix (r1, r2); 0 = no such term. The pipe/regs families take padded
    # r1 + r2 <= 128, the original kernel up to 256.
    pairs = [(16, 16), (8, 24), (32, 64), (64, 64), (0, 16), (24, 0), (0, 0), (128, 0)]
    if sw_mod.config_max_rank(config) >= 256:
        pairs += [(128, 128), (128, 16)]
    return pairs


@pytest.mark.parametrize("config", SWITCH_CONFIGS)
@pytest.mark.parametrize("out_of_place", [False, True])
def test_switch_matches_reference(config, out_of_place):
    """Odd shapes (M, N multiples of 8, not of any tile), mixed ranks, missing terms."""
    pairs = _sw_pairs(config)
    shapes = [
        (520, 264),
        (1000, 136),
        (72, 1032),
        (8, 8),
        (136, 520),
        (264, 72),
        (48, 40),
        (1032, 8),
        (16, 2056),
        (200, 600),
    ][: len(pairs)]
    dtype, w0, first, second = _sw_case(config, 11 + SWITCH_CONFIGS.index(config), shapes, pairs)
    got = [torch.full_like(w, 3.0) for w in w0] if out_of_place else [w.clone() for w in w0]
    keep = [w.clone() for w in w0]
    plan = SwitchPlan(got, first, second, config=config, sources=w0 if out_of_place else None)
    assert plan.config == config
    plan.run()
    torch.cuda.synchronize()
    for i, (gw, w, t1, t2) in enumerate(zip(got, w0, first, second)):
        _sw_check(gw, w, [t1, t2], dtype, (config, out_of_place, i, shapes[i], pairs[i]))
    if out_of_place:
        assert all(torch.equal(a, b) for a, b in zip(w0, keep))  # the source is only read
    # one term (merge), in place, on the result
    single = [w.clone() for w in got]
    terms = [
        t if t is not None else _sw_term(w.shape[0], w.shape[1], 8, 0.25, torch.Generator(device="cuda"), dtype)
        for t, w in zip(first, got)
    ]
    SwitchPlan(single, terms, config=config).run()
    torch.cuda.synchronize()
    for i, (gw, w, t) in enumerate(zip(single, got, terms)):
        _sw_check(gw, w, [t], dtype, (config, "merge", i))


@pytest.mark.parametrize("config", SWITCH_CONFIGS)
def test_switch_many_tiles_every_grid(config):
    """Enough tiles that every CTA walks several runs / chunks (band slots and descriptors change
    mid-pipeline), under the persistent grid and under 1 CTA per SM."""
    dtype = _SW_DT[config.split("_")[1]]
    shapes = [(1032, 2056), (2056, 1032), (520, 4104), (4104, 264)] * 2
    pairs = [(16, 16), (8, 8), (16, 0), (32, 16)] * 2
    _, w0, first, second = _sw_case(config, 101, shapes, pairs)
    for policy in (0, 1):
        got = [torch.empty_like(w) for w in w0]
        EXT.set_grid_policy(policy)
        try:
            SwitchPlan(got, first, second, config=config, sources=w0).run()
            torch.cuda.synchronize()
        finally:
            EXT.set_grid_policy(0)
        for i, (gw, w, t1, t2) in enumerate(zip(got, w0, first, second)):
            _sw_check(gw, w, [t1, t2], dtype, (config, policy, i))


def test_switch_default_config_falls_back_for_large_ranks():
    g = torch.Generator(device="cuda").manual_seed(5)
    for dtype in (torch.bfloat16, torch.float16):
        w0 = torch.randn(256, 512, device="cuda", generator=g).to(dtype)
        t1, t2 = _sw_term(256, 512, 128, 0.5, g, dtype), _sw_term(256, 512, 64, -0.5, g, dtype)
        got = w0.clone()
        plan = SwitchPlan([got], [t1], [t2])
        assert plan.rmax == 192 and sw_mod.config_max_rank(plan.config) >= 192
        plan.run()
        torch.cuda.synchronize()
        _sw_check(got, w0, [t1, t2], dtype, "fallback")


def test_switcher_kernel_path_on_cuda():
    """The worker's switcher takes the kernel for bf16 CUDA weights (one launch per switch) and
    lands within one ulp of its torch path; ranks the kernel cannot take use the torch op."""
    from types import SimpleNamespace

    from services.worker.adapter_weights import AdapterWeights
    from services.worker.adapter_staging import DeviceAdapter
    from services.worker.switcher import Switcher

    g = torch.Generator(device="cuda").manual_seed(9)
    shapes = {
        (0, "q_proj"): (256, 256),
        (0, "down_proj"): (256, 688),
        (0, "up_proj"): (688, 256),
        (1, "q_proj"): (256, 256),
    }

    def layers():
        out = {}
        for k, (o, i) in shapes.items():
            lin = torch.nn.Linear(i, o, bias=False, device="cuda", dtype=torch.bfloat16)
            out[k] = SimpleNamespace(base=lin)
        return out

    lk, lt = layers(), layers()
    for k in shapes:
        w = torch.randn(shapes[k], device="cuda", generator=g).bfloat16()
        lk[k].base.weight.data.copy_(w)
        lt[k].base.weight.data.copy_(w)
    ads = []
    for n, r in enumerate((16, 8, 4)):  # rank 4: not for the kernel
        a = {k: (torch.randn(i, r, device="cuda", generator=g) * 0.3).bfloat16() for k, (o, i) in shapes.items()}
        b = {k: (torch.randn(r, o, device="cuda", generator=g) * 0.3).bfloat16() for k, (o, i) in shapes.items()}
        ads.append(DeviceAdapter(AdapterWeights(f"adapters/a{n}/versions/1", "x", r, 2.0 / r, a, b), a, b))
    for strategy in ("pristine", "delta"):
        fast = Switcher(lk, strategy=strategy, resync_every=4)
        slow = Switcher(lt, strategy=strategy, resync_every=4, use_kernel=False)
        assert fast.use_kernel
        for x in [ads[0], ads[1], ads[0], ads[2], ads[1], None, ads[0], ads[1]]:
            fast.set(x)
            slow.set(x)
            torch.cuda.synchronize()
            for k in shapes:
                a, b = lk[k].base.weight.float(), lt[k].base.weight.float()
                assert ((a - b).abs() <= b.abs() * 2**-7 * (1 if strategy == "pristine" else 4) + 1e-6).all(), (
                    strategy,
                    k,
                )
        assert fast.kernel_launches >= 5
        fast.set(ads[0])  # pristine: bit-identical to a fresh merge however many switches came before
        if strategy == "pristine":
            ref = layers()
            for k in shapes:
                ref[k].base.weight.data.copy_(fast.pristine[k])
            Switcher(ref).set(ads[0])
            for k in shapes:
                assert torch.equal(lk[k].base.weight, ref[k].base.weight), k
        fast.set(None)
        slow.set(None)
        for k in shapes:
            assert torch.equal(lk[k].base.weight, fast.pristine[k])


def test_plan_updates_never_wait_for_the_device():
    """Back-to-back plan updates (a prefill's, then the decode step's launched behind it) queue
    their copies and return: with ~0.2 s of device work queued, two updates take the host well
    under that, and the device's metadata is the last update's once it ran."""
    import time

    plan = AtmmPlan(max_segments=8, max_tokens=256, device="cuda")
    plan.update([0, 4], [0], [16])
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s at 2 GHz
    t0 = time.perf_counter()
    plan.update([0, 2, 8], [1, 0], [16, 32])
    plan.update([0, 3, 5, 9], [0, 1, 2], [16, 16, 8])
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert host_s < 0.05, host_s
    meta = plan.meta.cpu().tolist()
    assert meta[0] == 3 and meta[1:5] == [0, 3, 5, 9]
