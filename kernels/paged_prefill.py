"""Paged prefill attention for chunked prefill: query tokens of several rows (varlen, packed) against a
paged KV pool, causal with each row's offset; decode rows (one query token) ride in the same launch.

Row i owns the query tokens q[cu_q[i]:cu_q[i+1]] (n_i of them) and a context of seq_lens[i] tokens
whose LAST n_i are the row's own query tokens (their keys and values already written into the
pool). Query token j of row i (0-based within the row) sits at position p = seq_lens[i] - n_i + j
and attends causally to positions 0..p:

    out[cu_q[i] + j, h] = softmax(scale * q[cu_q[i] + j, h] . K_i[:p+1]^T) V_i[:p+1]

(softmax in fp32, out in q's dtype) where token t of row i lives at
`k_cache[block_tables[i, t // block_size], t % block_size]`. GQA: query head h reads KV head
h // group (group = H // KVH, `repeat_kv`'s order). A row with n_i = 1 is a decode row: the same
as `kernels.paged_attention.paged_decode_attention` for it.

Shapes (T packed query tokens, R rows, H query heads, KVH KV heads, D head dim):

    q             (T, H, D)                          bf16 / fp16 / fp32, last dim contiguous; D <= 256
                                                     (padded to a power of two >= 16 in the kernel)
    k/v_cache     (num_blocks, block_size, KVH, D)   q's dtype; block_size a power of two in 8..256
    block_tables  (R, max_blocks) int32              row i's pages in order; slots past the row's
                                                     length are never read (any value)
    cu_q          (R + 1,) int32, on q's device      cumulative query counts, cu_q[0] = 0,
                                                     non-decreasing; n_i = 0 rows are allowed
    seq_lens      (R,) int32, on q's device          context of row i INCLUDING its n_i query tokens
                                                     (seq_lens[i] >= n_i)
    out           (T, H, D) q's dtype (optional)
    scale         float (None: D ** -0.5, as SDPA)

Tokens q[cu_q[R]:] belong to no row (padding): the kernel does not write their rows of out (kept
as they were; uninitialised when out is None), the reference leaves out's rows as given or zero.
The caller guarantees the shape contract (seq_lens[i] >= n_i, seq_lens[i] <= max_blocks *
block_size, valid page ids for the positions in use, cu_q[R] <= T): not checked, that would need
a host read.

Triton (FlashAttention-2 over pages). The grid depends on (T, R, KVH) only, never on the contents
of cu_q or seq_lens, so the launch needs no host read (and a CUDA graph captured for one (T, R)
replays correctly for any split of T into rows, any lengths and pages). Query tiles of BLOCK_Q
tokens: row i's tiles are numbered from cu_q[i] // BLOCK_Q + i on (at least cdiv(n_i, BLOCK_Q)
numbers apart), so grid (T // BLOCK_Q + R, KVH) covers every tile of every row; a program finds
its row by a binary search over cu_q and exits at once when its number is past the row's last
tile. Tile numbers are handed out from the last (the last row's last tile, the longest walk over
keys) down, so the short walks fill the end of the launch. A program owns one query tile x the
`group` query heads of one KV head, stacked into the M dimension of the dots (M index m = token
(m // group), head (m % group); BLOCK_Q = BLOCK_M // group, e.g. 18 tokens x 7 heads = 126 of
128 rows for Qwen2-VL-7B), so K and V are read once per
group, not once per query head. It walks the row's keys from position 0 to the tile's last
query position in TILE_N steps (page ids gathered per key from block_tables): first the keys
every query of the tile sees (no mask), then the diagonal part with the offset-causal mask;
scores with tl.dot, online softmax in fp32 (exp2 domain), P rounded to the input dtype before
P.V for bf16/fp16 (as flash attention does), IEEE dots for fp32 (no TF32), out written once.
No split over keys: a decode row is one program per KV head walking its whole context (for a
batch of decode rows only, `paged_decode_attention`'s split-KV kernel fills the GPU better).

Each (dtype, D, group, block_size, BLOCK_M, TILE_N) combination JIT-compiles on its first call.
Triton is optional (CPU machines have none): importing this module never fails.
"""

from __future__ import annotations

import math

import torch

from kernels.paged_attention import (
    MAX_HEAD_DIM,
    _check,
    _pow2,
    available,
    compare_with_reference,
    random_pool,
    tl,
    triton,
)

if triton is not None:
    from kernels.paged_attention import _dot, _softmax_step  # the decode kernel's jit helpers

REFERENCE_QUERY_CHUNK = 256  # query tokens per score matrix in the reference (bounds its memory)


def _check_prefill(q, k_cache, v_cache, block_tables, cu_q, seq_lens, out) -> tuple[int, int, int, int, int]:
    """`paged_attention._check` for R = block_tables' rows, plus cu_q's shape, dtype and device;
    returns (R, H, KVH, D, block_size). Metadata only, no device sync."""
    rows = block_tables.shape[0] if block_tables.dim() == 2 else -1
    if cu_q.dtype != torch.int32 or tuple(cu_q.shape) != (rows + 1,):
        raise ValueError(f"cu_q must be (R + 1 = {rows + 1},) int32, got {tuple(cu_q.shape)} {cu_q.dtype}")
    if cu_q.device != q.device:
        raise ValueError(f"cu_q is on {cu_q.device}, q on {q.device}")
    return _check(q, k_cache, v_cache, block_tables, seq_lens, out, rows=rows)


def default_config(dtype: torch.dtype, head_dim: int, group: int) -> dict:
    """(block_m, tile_n, num_warps, num_stages) by dtype and head dim: 128 stacked (token, head)
    rows x 64 keys for 16-bit inputs, 64 x 32 for fp32 (twice the bytes a tile), 64 rows past D 128;
    block_m at least the group (one token's heads)."""
    wide = dtype == torch.float32 or head_dim > 128
    block_m = max(64 if wide else 128, _pow2(group))
    return {
        "block_m": block_m,
        "tile_n": 32 if wide else 64,
        "num_warps": 8 if block_m >= 128 and head_dim >= 128 else 4,
        "num_stages": 2 if wide else 3,
    }


def paged_prefill_attention_reference(
    q, k_cache, v_cache, block_tables, cu_q, seq_lens, scale, out=None
) -> torch.Tensor:
    """The semantics in pure torch (any device; reads cu_q and seq_lens on the host): per row,
    gather its context from its pages, scores of its query tokens against it with the
    offset-causal mask, fp32 softmax, GQA by viewing the query heads as (KVH, group). Writes the
    rows' tokens of `out` (zeros elsewhere when out is None) and returns it."""
    r, h, kvh, d, bs = _check_prefill(q, k_cache, v_cache, block_tables, cu_q, seq_lens, out)
    group = h // kvh
    scale = d**-0.5 if scale is None else scale
    if out is None:
        out = torch.zeros_like(q)
    starts, lens = cu_q.tolist(), seq_lens.tolist()
    if starts[0] != 0 or any(b < a for a, b in zip(starts, starts[1:])) or starts[-1] > q.shape[0]:
        raise ValueError(f"cu_q must start at 0, not decrease and end at most at T = {q.shape[0]}, got {starts}")
    for i in range(r):
        a, n, length = starts[i], starts[i + 1] - starts[i], lens[i]
        if n == 0:
            continue
        if length < n:
            raise ValueError(f"row {i}: seq_lens {length} < its {n} query tokens")
        pages = block_tables[i, : -(-length // bs)].long()
        k = k_cache[pages].reshape(-1, kvh, d)[:length].float()  # (L, KVH, D)
        v = v_cache[pages].reshape(-1, kvh, d)[:length].float()
        keys = torch.arange(length, device=q.device)
        for j0 in range(0, n, REFERENCE_QUERY_CHUNK):
            j1 = min(n, j0 + REFERENCE_QUERY_CHUNK)
            qi = q[a + j0 : a + j1].float().view(j1 - j0, kvh, group, d)
            s = torch.einsum("nkgd,lkd->kgnl", qi, k) * scale
            pos = length - n + torch.arange(j0, j1, device=q.device)
            s = s.masked_fill(keys[None, :] > pos[:, None], float("-inf"))
            o = torch.einsum("kgnl,lkd->nkgd", torch.softmax(s, dim=-1), v)
            out[a + j0 : a + j1] = o.reshape(j1 - j0, h, d).to(q.dtype)
    return out


if triton is not None:

    @triton.jit
    def _attend_keys(
        acc,
        l_i,
        m_i,
        q,
        k_ptr,
        v_ptr,
        row_bt,
        t0,
        kv_end,
        q_pos,
        qk_scale,
        stride_kn,
        stride_kt,
        stride_vn,
        stride_vt,
        D,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        CAUSAL: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """One TILE_N step of the online softmax over keys t0.. of the row (k_ptr, v_ptr already at
        the KV head). CAUSAL: mask keys past each M row's position (and the loads past kv_end)."""
        t = t0 + tl.arange(0, TILE_N)
        d = tl.arange(0, D_PAD)
        if CAUSAL:
            tmask = t < kv_end
            page = tl.load(row_bt + t // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
            lmask = tmask[:, None] & (d < D)[None, :]
        else:  # every key of the tile is in the row: only the head dim's padding is masked
            page = tl.load(row_bt + t // BLOCK_SIZE).to(tl.int64)
            lmask = (t >= 0)[:, None] & (d < D)[None, :]
        slot = (t % BLOCK_SIZE)[:, None]
        k = tl.load(k_ptr + page[:, None] * stride_kn + slot * stride_kt + d[None, :], mask=lmask, other=0.0)
        v = tl.load(v_ptr + page[:, None] * stride_vn + slot * stride_vt + d[None, :], mask=lmask, other=0.0)
        qk = _dot(q, tl.trans(k), IEEE) * qk_scale  # log2 domain
        if CAUSAL:
            qk = tl.where(t[None, :] <= q_pos[:, None], qk, float("-inf"))
        return _softmax_step(acc, l_i, m_i, qk, v, IEEE)  # finite max: every M row sees a key by its first tile

    @triton.jit
    def _paged_prefill(
        q_ptr,
        k_ptr,
        v_ptr,
        bt_ptr,
        cu_ptr,
        lens_ptr,
        out_ptr,
        stride_qt,
        stride_qh,
        stride_kn,
        stride_kt,
        stride_kh,
        stride_vn,
        stride_vt,
        stride_vh,
        stride_bt,
        stride_ot,
        stride_oh,
        qk_scale,
        R,
        D,
        GROUP: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        pid = tl.num_programs(0) - 1 - tl.program_id(0)  # the last tiles (the longest walks) start first
        kvh = tl.program_id(1)
        # the row of tile number pid: the last i with cu_q[i] // BLOCK_Q + i <= pid (row 0 starts at 0)
        lo = pid * 0
        hi = lo + R - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            fits = tl.load(cu_ptr + mid) // BLOCK_Q + mid <= pid
            lo = tl.where(fits, mid, lo)
            hi = tl.where(fits, hi, mid - 1)
        row = lo
        q_begin = tl.load(cu_ptr + row)
        n = tl.load(cu_ptr + row + 1) - q_begin
        q0 = (pid - (q_begin // BLOCK_Q + row)) * BLOCK_Q  # the tile's first query token within the row
        if q0 >= n:
            return
        ctx = tl.load(lens_ptr + row) - n  # position of the row's first query token

        m = tl.arange(0, BLOCK_M)
        d = tl.arange(0, D_PAD)
        qi = q0 + m // GROUP
        heads = kvh * GROUP + m % GROUP
        valid = (m < BLOCK_Q * GROUP) & (qi < n)
        tok = (q_begin + qi).to(tl.int64)
        qmask = valid[:, None] & (d < D)[None, :]
        q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)

        kv_end = ctx + tl.minimum(q0 + BLOCK_Q, n)  # one past the tile's last query position
        q_pos = tl.where(valid, ctx + qi, kv_end - 1)  # padding M rows attend like the last query
        full_end = (ctx + q0 + 1) // TILE_N * TILE_N  # keys below: seen by every query of the tile
        row_bt = bt_ptr + row.to(tl.int64) * stride_bt
        k_head = k_ptr + kvh * stride_kh
        v_head = v_ptr + kvh * stride_vh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for t0 in range(0, full_end, TILE_N):
            acc, l_i, m_i = _attend_keys(
                acc,
                l_i,
                m_i,
                q,
                k_head,
                v_head,
                row_bt,
                t0,
                kv_end,
                q_pos,
                qk_scale,
                stride_kn,
                stride_kt,
                stride_vn,
                stride_vt,
                D,
                D_PAD,
                BLOCK_SIZE,
                TILE_N,
                False,
                IEEE,
            )
        for t0 in range(full_end, kv_end, TILE_N):
            acc, l_i, m_i = _attend_keys(
                acc,
                l_i,
                m_i,
                q,
                k_head,
                v_head,
                row_bt,
                t0,
                kv_end,
                q_pos,
                qk_scale,
                stride_kn,
                stride_kt,
                stride_vn,
                stride_vt,
                D,
                D_PAD,
                BLOCK_SIZE,
                TILE_N,
                True,
                IEEE,
            )
        o = acc / l_i[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=qmask,
        )


def paged_prefill_attention_triton(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_q,
    seq_lens,
    scale,
    out=None,
    block_m=None,
    tile_n=None,
    num_warps=None,
    num_stages=None,
) -> torch.Tensor:
    """The Triton path of `paged_prefill_attention` on any tensors triton accepts (CUDA; CPU tensors
    under TRITON_INTERPRET=1). block_m (stacked (token, head) rows a program, a power of two >=
    max(16, group)), tile_n (keys a step, a power of two >= 16), num_warps, num_stages: None takes
    `default_config`'s."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    r, h, kvh, d, bs = _check_prefill(q, k_cache, v_cache, block_tables, cu_q, seq_lens, out)
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} > {MAX_HEAD_DIM} (the kernel keeps a (BLOCK_M, D) accumulator in registers)")
    group = h // kvh
    cfg = default_config(q.dtype, d, group)
    cfg.update(
        {
            k: v
            for k, v in {"block_m": block_m, "tile_n": tile_n, "num_warps": num_warps, "num_stages": num_stages}.items()
            if v is not None
        }
    )
    bm, tn = cfg["block_m"], cfg["tile_n"]
    if bm < max(16, group) or bm & (bm - 1):
        raise ValueError(f"block_m must be a power of two >= max(16, group {group}), got {bm}")
    if tn < 16 or tn & (tn - 1):
        raise ValueError(f"tile_n must be a power of two >= 16, got {tn}")
    if out is None:
        out = torch.empty_like(q)
    t = q.shape[0]
    if t == 0 or r == 0 or h == 0:
        return out
    block_q = bm // group
    qk_scale = (d**-0.5 if scale is None else float(scale)) * math.log2(math.e)
    _paged_prefill[(t // block_q + r, kvh)](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_q,
        seq_lens,
        out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        qk_scale,
        r,
        d,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=bm,
        D_PAD=_pow2(max(d, 16)),
        BLOCK_SIZE=bs,
        TILE_N=tn,
        IEEE=q.dtype == torch.float32,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_q, seq_lens, scale, out=None) -> torch.Tensor:
    """Causal attention of the packed query tokens of R rows against a paged KV pool, each row's
    queries at the end of its context (module doc: semantics, shapes, what is not checked). The
    Triton kernel on CUDA when triton imports, else the torch reference. Returns out (T, H, D) in
    q's dtype (`out` when given)."""
    if available(q.device):
        return paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_q, seq_lens, scale, out=out)
    return paged_prefill_attention_reference(q, k_cache, v_cache, block_tables, cu_q, seq_lens, scale, out=out)


def self_check(device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int) -> str | None:
    """Runs the Triton kernel once on random inputs of a model's attention shape (a decode row, a
    chunk after a prefix, a chunk from position 0, over shuffled pages) and compares it with the
    reference: None when they agree, else why not (the caller then prefills on the reference). A
    worker calls it at start-up, like `paged_attention.self_check`."""
    if not available(device):
        return "triton or CUDA is not available"
    g = torch.Generator(device="cpu").manual_seed(0)
    blocks = 12
    n = [1, block_size + 5, 19]
    lens = [block_size + 3, 2 * block_size + 12, 19]

    def run():
        q = torch.randn(sum(n), heads, head_dim, generator=g).to(device, dtype)
        k, v = random_pool(g, blocks, block_size, kv_heads, head_dim, device, dtype)
        tables = torch.randperm(blocks, generator=g).view(3, blocks // 3).to(device, torch.int32)
        cu_q = torch.tensor([0, n[0], n[0] + n[1], sum(n)], dtype=torch.int32, device=device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        return (
            paged_prefill_attention_triton(q, k, v, tables, cu_q, seq_lens, None),
            paged_prefill_attention_reference(q, k, v, tables, cu_q, seq_lens, None),
        )

    return compare_with_reference(run, dtype)


__all__ = [
    "available",
    "default_config",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
    "paged_prefill_attention_triton",
    "self_check",
]
