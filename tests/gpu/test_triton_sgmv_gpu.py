"""ATMM's Triton backend (kernels.triton_sgmv) vs the torch reference on fresh random inputs.

Mixed ranks, slot -1 segments, every tile shape of the menu, split-K 1 (plain stores) and > 1
(atomics), bf16 and fp16, and graph replay for new plans. Skipped without CUDA or triton.
"""

import random

import pytest
import torch

from kernels import triton_sgmv
from kernels.atmm import AtmmPlan, atmm_, extension, lora_weights_from_lists
from kernels.reference import SegmentPlan, multi_lora_reference_
from kernels.tile_table import TileConfig

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if not triton_sgmv.available():
    pytest.skip("needs triton", allow_module_level=True)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_case(tokens, ranks, h_in, h_out, dtype, seed, none_frac=0.15):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = random.Random(seed)
    n = len(ranks)
    a = [(torch.randn(h_in, r, device="cuda", generator=g) / h_in**0.5).to(dtype) for r in ranks]
    b = [(torch.randn(r, h_out, device="cuda", generator=g) / r**0.5).to(dtype) for r in ranks]
    scales = [rnd.choice([0.5, 1.0, 2.0]) for _ in ranks]
    slots = sorted(
        (rnd.randrange(n) if rnd.random() > none_frac else -1 for _ in range(tokens)), key=lambda s: (s < 0, s)
    )
    if all(s < 0 for s in slots):  # at least one LoRA token (else the delta check is 0/0)
        slots[0] = 0
    # a -1 segment between adapters too (not only at the end)
    mid = tokens // 2
    slots = slots[:mid] + [-1] * 3 + slots[mid:]
    x = torch.randn(len(slots), h_in, device="cuda", generator=g).to(dtype)
    y = torch.randn(len(slots), h_out, device="cuda", generator=g).to(dtype)
    return a, b, scales, slots, x, y


def reference(y, x, slots, a, b, scales):
    out = y.float().clone()
    multi_lora_reference_(
        out, x.float(), SegmentPlan.from_token_slots(slots), [t.float() for t in a], [t.float() for t in b], scales
    )
    return out


def plan_for(slots, ranks, cap=16, max_tokens=2048):
    p = SegmentPlan.from_token_slots(slots)
    return AtmmPlan(max_segments=cap, max_tokens=max_tokens, device="cuda").update(p.seg_starts, p.seg_slots, ranks)


CASES = {
    "mixed_r64": (300, [8, 16, 32, 64], 1024, 1024, torch.bfloat16),
    "r128_r24": (257, [128, 8, 24], 2048, 768, torch.bfloat16),
    "fp16": (37, [16] * 6, 512, 4096, torch.float16),
    "one_token": (1, [16], 4096, 512, torch.bfloat16),
}
# every menu shape with split-K atomics (3) and with plain stores (1); the other cases at the default
COMBOS = (
    [(m, 3, "mixed_r64") for m in triton_sgmv.TRITON_MENU]
    + [(m, 1, "r128_r24") for m in triton_sgmv.TRITON_MENU]
    + [
        (triton_sgmv.DEFAULT_SHAPE, 2, "fp16"),
        (triton_sgmv.DEFAULT_SHAPE, 1, "one_token"),
        (triton_sgmv.DEFAULT_SHAPE, 4, "one_token"),
    ]
)


@pytest.mark.parametrize("shape,split,case", COMBOS)
def test_triton_backend_matches_reference(shape, split, case):
    tokens, ranks, h_in, h_out, dtype = CASES[case]
    a, b, scales, slots, x, y = make_case(tokens, ranks, h_in, h_out, dtype, seed=tokens + split + shape[0])
    w = lora_weights_from_lists(a, b, scales)
    plan = plan_for(slots, w.ranks)
    bm, bk, stages, bme, bn, warps = shape
    cfg = TileConfig(bm, bk, stages, split, bme, bn, backend="triton", warps=warps)
    want = reference(y, x, slots, a, b, scales)
    got = y.clone()
    triton_sgmv.atmm_triton_(got, x, plan, w, cfg)
    torch.cuda.synchronize()
    assert torch.isfinite(got.float()).all()
    assert rel_err(got, want) < (4e-3 if dtype == torch.bfloat16 else 1e-3)
    # x·A is rounded to 16 bits once before the expand: the delta carries ~bf16 error
    assert rel_err(got.float() - y.float(), want - y.float()) < 1.5e-2
    none_rows = [i for i, s in enumerate(slots) if s < 0]
    assert none_rows and torch.equal(got[none_rows], y[none_rows])


def test_atmm_dispatches_to_triton_and_graph_replays_new_plans():
    dt = torch.bfloat16
    a, b, scales, slots, x, y = make_case(200, [16, 64, 8], 1024, 768, dt, seed=21)
    w = lora_weights_from_lists(a, b, scales)
    plan = plan_for(slots, w.ranks)
    cfg = TileConfig(16, 64, 3, 4, 16, 128, backend="triton")
    run = (
        (lambda out: atmm_(out, x, plan, w, config=cfg))
        if extension() is not None
        else (lambda out: triton_sgmv.atmm_triton_(out, x, plan, w, cfg))
    )
    out = y.clone()
    run(out)  # warm-up (JIT)
    torch.cuda.synchronize()
    assert rel_err(out, reference(y, x, slots, a, b, scales)) < 4e-3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(out)
    for seed in range(3):
        rnd = random.Random(seed)
        new_slots = sorted((rnd.choice([-1, 0, 1, 2]) for _ in range(len(slots))), key=lambda s: (s < 0, s))
        p = SegmentPlan.from_token_slots(new_slots)
        plan.update(p.seg_starts, p.seg_slots, w.ranks)
        out.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference(y, x, new_slots, a, b, scales)) < 4e-3


def test_alignment_hints_only_when_the_host_check_holds():
    # aligned weights take the hinted kernels (16-byte vector loads of A and B); an A that starts
    # 2 bytes past a 16-byte boundary takes the same kernels without hints; both match the reference
    tokens, ranks, h_in, h_out, dtype = CASES["mixed_r64"]
    a, b, scales, slots, x, y = make_case(tokens, ranks, h_in, h_out, dtype, seed=5)
    want = reference(y, x, slots, a, b, scales)
    store = torch.empty(a[1].numel() + 8, device="cuda", dtype=dtype)
    a_odd = store[1 : 1 + a[1].numel()].view(a[1].shape)
    a_odd.copy_(a[1])
    cfg = TileConfig(16, 64, 3, 3, 16, 128, backend="triton")
    for a_set, aligned in (([*a], True), ([a[0], a_odd, *a[2:]], False)):
        w = lora_weights_from_lists(a_set, b, scales)
        plan = plan_for(slots, w.ranks)
        assert w.aligned16 == aligned
        assert triton_sgmv.aligned_launch(y, x, w, plan.workspace) == aligned
        got = y.clone()
        triton_sgmv.atmm_triton_(got, x, plan, w, cfg)
        torch.cuda.synchronize()
        assert rel_err(got, want) < 4e-3, aligned
        assert rel_err(got.float() - y.float(), want - y.float()) < 1.5e-2, aligned
    if extension() is not None:  # a CUDA config with misaligned weights is routed to Triton (correct)
        got = y.clone()
        atmm_(got, x, plan, w, config=TileConfig(16, 64, 4, 2, 16, 128))
        torch.cuda.synchronize()
        assert rel_err(got, want) < 4e-3
