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
    a: list[torch.Tensor]        # (h_in, r_k)
    b: list[torch.Tensor]        # (r_k, h_out)
    scales: list[float]
    token_slots: list[int]       # grouped, ascending, -1 last
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
# Punica-style segmented SGMV in Triton: shrink (split-K, fp32 atomics) + expand, padded rank R.
try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines
    triton = None

if triton is not None:
    @triton.jit
    def _sgmv_shrink(x_ptr, a_ptr, xa_ptr, tile_slot, tile_row0, tile_rows, h_in, k_per_split,
                     R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0)
        ks = tl.program_id(1)
        slot = tl.load(tile_slot + t)
        row0 = tl.load(tile_row0 + t)
        nrows = tl.load(tile_rows + t)
        rm = tl.arange(0, BLOCK_M)
        rr = tl.arange(0, R)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        k_lo = ks * k_per_split
        a_base = a_ptr + slot.to(tl.int64) * h_in * R
        for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
            kk = k0 + rk
            xm = (rm[:, None] < nrows) & (kk[None, :] < h_in)
            xb = tl.load(x_ptr + (row0 + rm[:, None]).to(tl.int64) * h_in + kk[None, :], mask=xm, other=0.0)
            ab = tl.load(a_base + kk[:, None] * R + rr[None, :], mask=kk[:, None] < h_in, other=0.0)
            acc += tl.dot(xb, ab)
        tl.atomic_add(xa_ptr + (row0 + rm[:, None]) * R + rr[None, :], acc, mask=rm[:, None] < nrows)

    @triton.jit
    def _sgmv_expand(xa_ptr, b_ptr, y_ptr, tile_slot, tile_row0, tile_rows, h_out,
                     R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        t = tl.program_id(0)
        nb = tl.program_id(1)
        slot = tl.load(tile_slot + t)
        row0 = tl.load(tile_row0 + t)
        nrows = tl.load(tile_rows + t)
        rm = tl.arange(0, BLOCK_M)
        rr = tl.arange(0, R)
        rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        xa = tl.load(xa_ptr + (row0 + rm[:, None]) * R + rr[None, :], mask=rm[:, None] < nrows, other=0.0)
        bb = tl.load(b_ptr + slot.to(tl.int64) * R * h_out + rr[:, None] * h_out + rn[None, :],
                     mask=rn[None, :] < h_out, other=0.0)
        d = tl.dot(xa.to(bb.dtype), bb)
        m = (rm[:, None] < nrows) & (rn[None, :] < h_out)
        yp = y_ptr + (row0 + rm[:, None]).to(tl.int64) * h_out + rn[None, :]
        yv = tl.load(yp, mask=m, other=0.0)
        tl.store(yp, (yv.to(tl.float32) + d).to(yv.dtype), mask=m)


def make_triton_sgmv(c: Case, block_m: int = 16, block_k: int = 64, block_n: int = 128, splits: int | None = None):
    if triton is None:
        raise RuntimeError("triton is not installed")
    R = max(16, 1 << (c.rmax - 1).bit_length())
    A, B = c.stacks(R)
    segs = _segments(c.token_slots)
    ts, tr, tn = [], [], []
    for s, lo, hi in segs:
        for r0 in range(lo, hi, block_m):
            ts.append(s)
            tr.append(r0)
            tn.append(min(block_m, hi - r0))
    dev = A.device
    ts_, tr_, tn_ = (torch.tensor(v, device=dev, dtype=torch.int32) for v in (ts, tr, tn))
    T = len(c.token_slots)
    xa = torch.zeros(T, R, device=dev, dtype=torch.float32)
    if splits is None:
        splits = max(1, min(c.h_in // 256, -(-264 // len(ts))))
    k_per = -(-c.h_in // splits)
    k_per = -(-k_per // block_k) * block_k
    splits = -(-c.h_in // k_per)

    def fn(x, y):
        xa.zero_()
        _sgmv_shrink[(len(ts), splits)](x, A, xa, ts_, tr_, tn_, c.h_in, k_per, R=R, BLOCK_M=block_m,
                                        BLOCK_K=block_k)
        _sgmv_expand[(len(ts), triton.cdiv(c.h_out, block_n))](xa, B, y, ts_, tr_, tn_, c.h_out, R=R,
                                                             BLOCK_M=block_m, BLOCK_N=block_n)
    return fn


PEERS = {
    "triton_sgmv": make_triton_sgmv,
    "gather_bmm": make_gather_bmm,
    "padded_bmm": make_padded_bmm,
    "grouped_mm": make_grouped_mm,
    "loop": make_loop,
}
