import torch

from kernels.reference import SegmentPlan, multi_lora_reference_, switch_reference_


def test_plan_from_token_slots_groups_runs():
    plan = SegmentPlan.from_token_slots([2, 2, -1, 0, 0, 0])
    assert plan.seg_starts == [0, 2, 3, 6]
    assert plan.seg_slots == [2, -1, 0]


def test_multi_lora_matches_per_token_loop():
    g = torch.Generator().manual_seed(7)
    ranks = [4, 8, 2]
    a = [torch.randn(16, r, generator=g) for r in ranks]
    b = [torch.randn(r, 12, generator=g) for r in ranks]
    scales = [0.5, 2.0, 1.0]
    slots = [1, 1, 1, -1, 0, 2, 2]
    x = torch.randn(len(slots), 16, generator=g)
    y0 = torch.randn(len(slots), 12, generator=g)
    y = multi_lora_reference_(y0.clone(), x, SegmentPlan.from_token_slots(slots), a, b, scales)
    for t, k in enumerate(slots):
        want = y0[t] if k < 0 else y0[t] + scales[k] * (x[t] @ a[k] @ b[k])
        torch.testing.assert_close(y[t], want, rtol=1e-5, atol=1e-5)


def test_switch_is_unmerge_then_merge():
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(10, 6, generator=g)
    am, bm, an, bn = (
        torch.randn(3, 6, generator=g),
        torch.randn(10, 3, generator=g),
        torch.randn(5, 6, generator=g),
        torch.randn(10, 5, generator=g),
    )
    merged_m = w0 + 2.0 * bm @ am
    w = merged_m.clone()
    switch_reference_(w, torch.cat([0.5 * bn, -2.0 * bm], 1), torch.cat([an, am], 0))
    torch.testing.assert_close(w, w0 + 0.5 * bn @ an, rtol=1e-5, atol=1e-5)
