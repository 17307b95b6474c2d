"""CUDA ATMM and switch kernels vs the torch references on fresh random inputs (small grid).

Skipped without CUDA or the built extension. Every config of the menu that fits is exercised,
including every fused single-launch config (bf16 and fp16) at several column-group counts.
"""

import random

import pytest
import torch

from kernels.atmm import AtmmPlan, atmm_, config_id, extension, fused_launch_args, lora_weights_from_lists
from kernels.reference import SegmentPlan, multi_lora_reference_
from kernels.switch import LoraTerm, SwitchPlan
from kernels.tile_table import (TileConfig, fused_group_options, fused_groups, fused_heuristic_config,
                                heuristic_config)

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
@pytest.mark.parametrize("tokens,ranks,h_in,h_out", [
    (1, [16], 4096, 4096),
    (16, [8, 16, 32, 64], 3584, 512),
    (37, [16] * 8, 1024, 2048),
    (300, [8, 16, 32, 64], 4096, 1024),
    (257, [128, 8], 2048, 1024),
    (1024, [16] * 3, 1024, 4096),
])
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
@pytest.mark.parametrize("tokens,ranks,h_in,h_out", [(16, [8, 16], 512, 512), (300, [8, 16, 32, 64], 1024, 1024),
                                                     (1100, [16, 128], 2048, 768)])
def test_atmm_cutlass_grouped_expand_matches_reference(grouped, tokens, ranks, h_in, h_out):
    import dataclasses

    a, b, scales, slots, x, y = make_case(tokens, ranks, h_in, h_out, torch.bfloat16, seed=tokens + 3)
    w = lora_weights_from_lists(a, b, scales)
    plan = AtmmPlan(max_segments=8, max_tokens=2048, device="cuda").update_from_token_slots(slots, w.ranks)
    want = reference(y, x, slots, a, b, scales)
    cfg = dataclasses.replace(heuristic_config(h_in, h_out, plan.rank_stride, tokens, plan.active_segments),
                              grouped=grouped)
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
            EXT.atmm(got, x, plan.meta, plan.seg_cap, w.a_ptrs, w.b_ptrs, w.rank_table, w.scale_table,
                     plan.workspace, sh["id"], config_id("expand_bf16_bt16_bn64"), split_k, plan.rank_stride,
                     plan.tiles[sh["bt"]], plan.tiles[16], True)
            torch.cuda.synchronize()
            assert rel_err(got.float() - y.float(), delta_ref) < 2e-2, (sh["name"], split_k)
            assert rel_err(got, want) < 4e-3, (sh["name"], split_k)
    for ex in [c for c in cfgs if c["kind"] == "expand"]:
        got = y.clone()
        EXT.atmm(got, x, plan.meta, plan.seg_cap, w.a_ptrs, w.b_ptrs, w.rank_table, w.scale_table, plan.workspace,
                 config_id("shrink_bf16_bt16_bk64_s4_r8"), ex["id"], 2, plan.rank_stride, plan.tiles[16],
                 plan.tiles[ex["bt"]], False)
        torch.cuda.synchronize()
        assert rel_err(got, want) < 4e-3, ex["name"]


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
    EXT.atmm_shrink(y, x, plan.meta, plan.seg_cap, w.a_ptrs, w.b_ptrs, w.rank_table, w.scale_table, plan.workspace,
                    cfg["id"], g, plan.rank_stride, tiles, pdl)


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
        groups = sorted({1, fused_groups(3, h_out, cfg["bn"], cfg["bm"]),
                         fused_group_options(h_out, cfg["bn"], cfg["bm"], ntiles)[-1]})
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

    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _REJECT_SCRIPT], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0 and "ALL OK" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])


@pytest.mark.parametrize("config", ["switch_bf16_bm64_bn128", "switch_bf16_bm128_bn64", "switch_bf16_bm32_bn256",
                                    "switch_bf16_bm64_bn64"])
def test_switch_matches_reference(config):
    g = torch.Generator(device="cuda").manual_seed(3)
    shapes = [(512, 256), (1000, 264), (256, 1024)]
    ws = [torch.randn(m, n, device="cuda", generator=g).bfloat16() for m, n in shapes]
    def term(m, n, r, s):
        return LoraTerm((torch.randn(n, r, device="cuda", generator=g) * 0.05).bfloat16(),
                        (torch.randn(r, m, device="cuda", generator=g) * 0.05).bfloat16(), s)
    new = [term(m, n, r, 0.7) for (m, n), r in zip(shapes, [16, 8, 64])]
    old = [term(m, n, r, -1.5) for (m, n), r in zip(shapes, [8, 128, 16])]
    want = []
    for w, tn, to in zip(ws, new, old):
        d = tn.scale * (tn.a.float() @ tn.b.float()).t() + to.scale * (to.a.float() @ to.b.float()).t()
        want.append((w.float() + d).bfloat16())
    got = [w.clone() for w in ws]
    SwitchPlan(got, new, old, config=config).run()
    torch.cuda.synchronize()
    for gw, ww, w0 in zip(got, want, ws):
        diff = (gw.float() - ww.float()).abs()
        # one rounding of the same fp32 value: at most one bf16 ulp apart
        assert (diff <= ww.float().abs() * 2**-7 + 1e-6).all()
        assert not torch.equal(gw, w0)
    single = [w.clone() for w in ws]
    SwitchPlan(single, new, config=config).run()
    torch.cuda.synchronize()
    for gw, w0, tn in zip(single, ws, new):
        want1 = (w0.float() + tn.scale * (tn.a.float() @ tn.b.float()).t()).bfloat16()
        assert ((gw.float() - want1.float()).abs() <= want1.float().abs() * 2**-7 + 1e-6).all()
