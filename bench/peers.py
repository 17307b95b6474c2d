"""Peer multi-LoRA implementations timed next to ATMM (same process, inputs and semantics).

Each `make_*` takes a `Case` and returns fn(x, y) that does y += s_k (x A_k) B_k in place for the
case's token->slot assignment (tokens grouped by slot, slot -1 last). Weights are prepared once
(padded stacks, scale folded into B) as each system would at adapter-load time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Case:
    a: list[torch.Tensor]  # (h_in, r_k)
    b: list[torch.Tensor]  # (r_k, h_out)
    scales: list[float]
    token_slots: list[int]  # grouped, ascending, -1 last
    h_in: int
    h_out: int

    @property
    def rmax(self) -> int:
        return max(t.shape[1] for t in self.a)

    def stacks(self, rpad: int | None = None):
        """Padded stacks A (N+1, h_in, R), B (N+1, R, h_out) with s folded into B; slot N = zeros."""
        r = rpad or self.rmax
        n = len(self.a)
        dev, dt = self.a[0].device, self.a[0].dtype
        A = torch.zeros(n + 1, self.h_in, r, device=dev, dtype=dt)
        B = torch.zeros(n + 1, r, self.h_out, device=dev, dtype=dt)
        for k in range(n):
            rk = self.a[k].shape[1]
            A[k, :, :rk] = self.a[k]
            B[k, :rk] = (self.b[k].float() * self.scales[k]).to(dt)
        return A, B


def make_gather_bmm(c: Case):
    A, B = c.stacks()
    n = len(c.a)
    idx = torch.tensor([s if s >= 0 else n for s in c.token_slots], device=A.device)

    def fn(x, y):
        xa = torch.bmm(x.unsqueeze(1), A.index_select(0, idx))
        y += torch.bmm(xa, B.index_select(0, idx)).squeeze(1)

    return fn


def _segments(slots):
    segs = []
    for i, s in enumerate(slots):
        if segs and segs[-1][0] == s:
            segs[-1][2] = i + 1
        else:
            segs.append([s, i, i + 1])
    return [(s, lo, hi) for s, lo, hi in segs if s >= 0]


def make_padded_bmm(c: Case):
    A, B = c.stacks()
    segs = _segments(c.token_slots)
    T = len(c.token_slots)
    lmax = max(hi - lo for _, lo, hi in segs)
    rows = torch.full((len(segs), lmax), T, dtype=torch.long)
    for i, (_, lo, hi) in enumerate(segs):
        rows[i, : hi - lo] = torch.arange(lo, hi)
    rows = rows.to(A.device)
    valid = (rows.flatten() < T).nonzero().squeeze(1)  # integer index: no host sync when captured
    dst = rows.flatten()[valid]
    sl = torch.tensor([s for s, _, _ in segs], device=A.device)
    Aseg, Bseg = A.index_select(0, sl), B.index_select(0, sl)
    xpad = torch.zeros(T + 1, c.h_in, device=A.device, dtype=A.dtype)

    def fn(x, y):
        xpad[:T] = x
        xs = xpad[rows]  # (S, Lmax, h_in)
        out = torch.bmm(torch.bmm(xs, Aseg), Bseg).flatten(0, 1).index_select(0, valid)
        y.index_add_(0, dst, out)

    return fn


def make_grouped_mm(c: Case):
    rpad = max(16, -(-c.rmax // 8) * 8)
    A, B = c.stacks(rpad)
    n = len(c.a)
    counts = [0] * n
    for s in c.token_slots:
        if s >= 0:
            counts[s] += 1
    offs = torch.tensor(counts, device=A.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    tl_ = int(offs[-1])
    A3, B3 = A[:n], B[:n]
    # the CUTLASS grouped path wants the second operand column-major per group
    A3t = A3.transpose(1, 2).contiguous().transpose(1, 2)
    B3t = B3.transpose(1, 2).contiguous().transpose(1, 2)

    def fn(x, y):
        xa = torch._grouped_mm(x[:tl_], A3t, offs=offs)
        y[:tl_] += torch._grouped_mm(xa, B3t, offs=offs)

    return fn


def make_loop(c: Case):
    segs = _segments(c.token_slots)

    def fn(x, y):
        for s, lo, hi in segs:
            y[lo:hi].addmm_(x[lo:hi] @ c.a[s], c.b[s], alpha=c.scales[s])

    return fn


# ---------------------------------------------------------------------------------------------
# Punica/vLLM-style segmented SGMV in Triton at one fixed default config (BLOCK_M 16, BLOCK_K 64,
# BLOCK_N 128, 4 warps, split-K for ~2 programs per SM), like vLLM's lora_shrink/lora_expand defaults.
# The kernels are ATMM's Triton backend (kernels/triton_sgmv.py, the one copy); ATMM itself may
# pick other Triton tiles per shape from its tile table.
def make_triton_sgmv(c: Case):
    from kernels import triton_sgmv  # triton is optional
    from kernels.atmm import AtmmPlan, lora_weights_from_lists
    from kernels.reference import SegmentPlan
    from kernels.tile_table import TileConfig

    if not triton_sgmv.available():
        raise RuntimeError("triton is not installed")
    w = lora_weights_from_lists(c.a, c.b, c.scales)
    p = SegmentPlan.from_token_slots(c.token_slots)
    plan = AtmmPlan(
        max_segments=max(64, len(p.seg_slots)), max_tokens=max(16, len(c.token_slots)), device=c.a[0].device
    ).update(p.seg_starts, p.seg_slots, w.ranks)
    bm, bk, stages, bme, bn, warps = triton_sgmv.DEFAULT_SHAPE
    split = triton_sgmv.default_split(c.h_in, plan.tiles[bm])
    cfg = TileConfig(bm, bk, stages, split, bme, bn, backend="triton", warps=warps)

    def fn(x, y):
        triton_sgmv.atmm_triton_(y, x, plan, w, cfg)

    fn.plan, fn.weights = plan, w  # keep alive
    return fn


PEERS = {
    "triton_sgmv": make_triton_sgmv,
    "gather_bmm": make_gather_bmm,
    "padded_bmm": make_padded_bmm,
    "grouped_mm": make_grouped_mm,
    "loop": make_loop,
}
