"""ATMM's Triton backend: Punica-style segmented SGMV shrink (split-K) + expand, driven by an AtmmPlan.

Same semantics as `kernels.atmm.atmm_` (y[seg] += s_k (x[seg] A_k) B_k, exact per-slot ranks, slot
-1 segments untouched). The kernels read everything per step from the device: the plan's `meta`
(segment count, starts, slots and the prefix count of BM-token tiles per segment, for BM in
`BT_MENU`) and the weights' pointer/rank/scale tables, so a launch does no host synchronisation
and can be captured in a CUDA graph and replayed for later plans written into the same buffers.
Both kernels loop over work items (grid-stride), so a replayed graph covers a plan with more
tiles than the captured one.

    shrink:  xa[T, R] (fp32, plan.workspace) = x[seg] @ A_k      grid (tiles, split_k)
    expand:  y[seg] += s_k * bf16(xa[seg]) @ B_k                   grid (tiles * ceil(h_out / BN))

R is the plan's rank stride rounded up to a power of two (>= 16); columns >= r_k are masked.
split_k > 1 accumulates with fp32 atomics into a zeroed workspace (one memset per call).

Alignment (ALIGNED, checked on the host by `aligned_launch`): A_k's row stride is the runtime rank
r_k and the A/B base pointers come from the device tables, so without hints Triton cannot prove
16-byte alignment and emits scalar 16-bit loads for A and B. When every A/B pointer is 16-byte
aligned (`LoraWeights.aligned16`), x/y/workspace too and h_in, h_out, r_k are multiples of 8 (r_k
always is), the kernels are specialised with `tl.multiple_of` hints (pointers 16 bytes, r_k 8)
so A rows and B rows load as 16-byte vectors; otherwise the same kernels run without hints.

Triton is optional (CPU machines have none): importing this module never fails; `available()`
says whether the kernels exist. `kernels.atmm` imports it only when a tile config names the
"triton" backend. The tile-table fields mean here: shrink_bt = shrink BLOCK_M, shrink_bk =
BLOCK_K, shrink_stages = num_stages, split_k, expand_bt = expand BLOCK_M, expand_bn = BLOCK_N,
warps = num_warps of both kernels.
"""

from __future__ import annotations

import math

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines
    triton = None
    tl = None

BT_MENU = (16, 32, 64, 128)  # token tiles the AtmmPlan counts (kernels.atmm.BT_MENU)
MAX_PROGRAMS = 132 * 16  # grid cap; the kernels loop over the remaining items
NUM_SMS = 132


def available() -> bool:
    return triton is not None


def rank_pad(rank_stride: int) -> int:
    """The kernels' rank width R: the rank stride rounded up to a power of two, at least 16."""
    return max(16, 1 << (max(1, rank_stride) - 1).bit_length())


def split_plan(h_in: int, split_k: int, block_k: int) -> tuple[int, int]:
    """(splits, K per split): K chunks are whole BLOCK_K multiples; splits never leave one empty."""
    split_k = max(1, split_k)
    k_per = -(-h_in // split_k)
    k_per = -(-k_per // block_k) * block_k
    return -(-h_in // k_per), k_per


def default_split(h_in: int, tiles: int) -> int:
    """Split-K of the fixed default config (the bench peer): about two programs per SM, K >= 256."""
    return max(1, min(h_in // 256, -(-2 * NUM_SMS // max(1, tiles))))


# (shrink BM, BK, stages, expand BM, BN, warps): the candidates the tile search times
TRITON_MENU = (
    (16, 64, 3, 16, 128, 4),  # the fixed default (vLLM/Punica-like), bench peer "triton_sgmv"
    (16, 128, 3, 16, 256, 4),
    (32, 64, 3, 32, 128, 4),
    (64, 64, 3, 64, 128, 4),
    (64, 64, 3, 64, 256, 8),
)
DEFAULT_SHAPE = TRITON_MENU[0]


def candidates(h_in: int, h_out: int, rank_stride: int, tokens: int, segments: int) -> list[tuple]:
    """Menu entries worth timing for one bucket (big token tiles only where segments are long)."""
    avg = tokens / max(1, segments)
    return [
        m
        for m in TRITON_MENU
        if m[0] <= max(16, 2 * avg) and m[3] <= max(16, 2 * avg) and m[4] <= max(64, h_out) and m[1] <= h_in
    ]


def split_candidates(h_in: int, block_k: int, tiles: int) -> list[int]:
    s0 = default_split(h_in, tiles)
    out = []
    for s in (max(1, s0 // 4), max(1, s0 // 2), s0, 2 * s0):
        if h_in // s >= block_k and s not in out:
            out.append(s)
    return out


if triton is not None:

    @triton.jit
    def _segment_of(meta_ptr, ends, t, seg_cap, pref_off, BM: tl.constexpr):
        # the segment j with prefix[j] <= t < prefix[j+1]: count segment ends (prefix[j+1]) <= t
        j = tl.sum((ends <= t).to(tl.int32), axis=0)
        first = tl.load(meta_ptr + pref_off + j)
        start = tl.load(meta_ptr + 1 + j)
        end = tl.load(meta_ptr + 2 + j)
        slot = tl.load(meta_ptr + 2 + seg_cap + j)
        row0 = start + (t - first) * BM
        return slot, row0, end - row0

    @triton.jit
    def _atmm_shrink(
        x_ptr,
        meta_ptr,
        a_ptrs,
        rank_tab,
        xa_ptr,
        h_in,
        k_per_split,
        seg_cap,
        pref_off,
        R: tl.constexpr,
        BM: tl.constexpr,
        BK: tl.constexpr,
        SEG_P2: tl.constexpr,
        ATOMIC: tl.constexpr,
        ALIGNED: tl.constexpr,
    ):
        pid = tl.program_id(0)
        npg = tl.num_programs(0)
        ks = tl.program_id(1)
        nseg = tl.load(meta_ptr)
        idx = tl.arange(0, SEG_P2)
        ends = tl.load(meta_ptr + pref_off + 1 + idx, mask=idx < nseg, other=2147483647)
        total = tl.load(meta_ptr + pref_off + nseg)
        rm = tl.arange(0, BM)
        rr = tl.arange(0, R)
        rk = tl.arange(0, BK)
        k_lo = ks * k_per_split
        for t in range(pid, total, npg):
            slot, row0, nrows = _segment_of(meta_ptr, ends, t, seg_cap, pref_off, BM)
            r_k = tl.load(rank_tab + slot)
            a_base = tl.load(a_ptrs + slot).to(tl.pointer_type(x_ptr.dtype.element_ty))
            if ALIGNED:  # host-checked: A 16-byte aligned, r_k (A's row stride) a multiple of 8
                r_k = tl.multiple_of(r_k, 8)
                a_base = tl.multiple_of(a_base, 16)
            rows = (row0 + rm).to(tl.int64)
            acc = tl.zeros((BM, R), dtype=tl.float32)
            for k0 in range(k_lo, k_lo + k_per_split, BK):
                kk = k0 + rk
                xb = tl.load(
                    x_ptr + rows[:, None] * h_in + kk[None, :],
                    mask=(rm[:, None] < nrows) & (kk[None, :] < h_in),
                    other=0.0,
                )
                ab = tl.load(
                    a_base + kk[:, None] * r_k + rr[None, :], mask=(kk[:, None] < h_in) & (rr[None, :] < r_k), other=0.0
                )
                acc += tl.dot(xb, ab)
            out = xa_ptr + rows[:, None] * R + rr[None, :]
            if ATOMIC:
                tl.atomic_add(out, acc, mask=rm[:, None] < nrows, sem="relaxed")
            else:
                tl.store(out, acc, mask=rm[:, None] < nrows)

    @triton.jit
    def _atmm_expand(
        xa_ptr,
        meta_ptr,
        b_ptrs,
        rank_tab,
        scale_tab,
        y_ptr,
        h_out,
        seg_cap,
        pref_off,
        R: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        SEG_P2: tl.constexpr,
        ALIGNED: tl.constexpr,
    ):
        pid = tl.program_id(0)
        npg = tl.num_programs(0)
        nseg = tl.load(meta_ptr)
        idx = tl.arange(0, SEG_P2)
        ends = tl.load(meta_ptr + pref_off + 1 + idx, mask=idx < nseg, other=2147483647)
        total = tl.load(meta_ptr + pref_off + nseg)
        ntn = tl.cdiv(h_out, BN)
        rm = tl.arange(0, BM)
        rr = tl.arange(0, R)
        for item in range(pid, total * ntn, npg):
            tn = item // total
            t = item - tn * total
            slot, row0, nrows = _segment_of(meta_ptr, ends, t, seg_cap, pref_off, BM)
            r_k = tl.load(rank_tab + slot)
            s_k = tl.load(scale_tab + slot)
            b_base = tl.load(b_ptrs + slot).to(tl.pointer_type(y_ptr.dtype.element_ty))
            if ALIGNED:  # host-checked: B 16-byte aligned, h_out (B's row stride) a multiple of 8
                b_base = tl.multiple_of(b_base, 16)
                h_out = tl.multiple_of(h_out, 8)
            rows = (row0 + rm).to(tl.int64)
            rn = tn * BN + tl.arange(0, BN)
            xa = tl.load(xa_ptr + rows[:, None] * R + rr[None, :], mask=rm[:, None] < nrows, other=0.0)
            bb = tl.load(
                b_base + rr[:, None] * h_out + rn[None, :], mask=(rr[:, None] < r_k) & (rn[None, :] < h_out), other=0.0
            )
            d = tl.dot(xa.to(bb.dtype), bb) * s_k
            m = (rm[:, None] < nrows) & (rn[None, :] < h_out)
            yp = y_ptr + rows[:, None] * h_out + rn[None, :]
            yv = tl.load(yp, mask=m, other=0.0)
            tl.store(yp, (yv.to(tl.float32) + d).to(yv.dtype), mask=m)


def _pref_off(seg_cap: int, bt: int) -> int:
    return 2 + 2 * seg_cap + BT_MENU.index(bt) * (seg_cap + 1)


def aligned_launch(y, x, weights, workspace) -> bool:
    """Whether the alignment hints hold for this call (host-side only, no device sync): every A/B
    pointer 16-byte aligned (tracked by LoraWeights when adapters are set), x/y/workspace 16-byte
    aligned, h_in and h_out multiples of 8 (row strides of x, B and y)."""
    return (
        weights.aligned16
        and weights.h_in % 8 == 0
        and weights.h_out % 8 == 0
        and all(t.data_ptr() % 16 == 0 for t in (x, y, workspace))
    )


def atmm_triton_(y, x, plan, weights, config):
    """y[seg] += s_k (x[seg] A_k) B_k with the Triton kernels and `config`'s tiles (see module doc).

    Shapes were checked by `kernels.atmm.atmm_`; x, y contiguous CUDA tensors of one dtype.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    if config.shrink_bt not in BT_MENU or config.expand_bt not in BT_MENU:
        raise ValueError(f"triton token tiles must be in {BT_MENU}, got {config}")
    tokens = plan.num_tokens
    h_in, h_out = weights.h_in, weights.h_out
    R = rank_pad(plan.rank_stride)
    cap = plan.seg_cap
    seg_p2 = max(16, 1 << (cap - 1).bit_length())
    splits, k_per = split_plan(h_in, config.split_k, config.shrink_bk)
    xa = plan.workspace[: tokens * R]
    aligned = aligned_launch(y, x, weights, xa)
    atomic = splits > 1
    if atomic:
        xa.zero_()
    warps = config.warps
    grid_s = (max(1, min(plan.tiles[config.shrink_bt], MAX_PROGRAMS)), splits)
    _atmm_shrink[grid_s](
        x,
        plan.meta,
        weights.a_ptrs,
        weights.rank_table,
        xa,
        h_in,
        k_per,
        cap,
        _pref_off(cap, config.shrink_bt),
        R=R,
        BM=config.shrink_bt,
        BK=config.shrink_bk,
        SEG_P2=seg_p2,
        ATOMIC=atomic,
        ALIGNED=aligned,
        num_warps=warps,
        num_stages=config.shrink_stages,
    )
    ntn = math.ceil(h_out / config.expand_bn)
    grid_e = (max(1, min(plan.tiles[config.expand_bt] * ntn, MAX_PROGRAMS)),)
    _atmm_expand[grid_e](
        xa,
        plan.meta,
        weights.b_ptrs,
        weights.rank_table,
        weights.scale_table,
        y,
        h_out,
        cap,
        _pref_off(cap, config.expand_bt),
        R=R,
        BM=config.expand_bt,
        BN=config.expand_bn,
        SEG_P2=seg_p2,
        ALIGNED=aligned,
        num_warps=warps,
        num_stages=2,
    )
    return y


__all__ = [
    "TRITON_MENU",
    "aligned_launch",
    "atmm_triton_",
    "available",
    "candidates",
    "default_split",
    "rank_pad",
    "split_candidates",
    "split_plan",
]
