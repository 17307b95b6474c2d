"""Paged decode attention: one query token per row against a paged KV pool, split-KV, graph-capturable.

    out[i, h] = softmax(scale * q[i, h] . K_i^T) V_i        (softmax in fp32, out in q's dtype)

where K_i, V_i are row i's first `seq_lens[i]` tokens of one layer's pool, read page by page:
token t of row i lives at `k_cache[block_tables[i, t // block_size], t % block_size]`. GQA: query
head h reads KV head h // group (group = H // KVH, `repeat_kv`'s order).

Shapes (B rows, H query heads, KVH KV heads, D head dim):

    q             (B, H, D)                          bf16 / fp16 / fp32, last dim contiguous; D <= 256
                                                     (padded to a power of two >= 16 in the kernel)
    k/v_cache     (num_blocks, block_size, KVH, D)   q's dtype; block_size a power of two in 8..256
    block_tables  (B, max_blocks) int32              row i's pages in order; slots past the row's
                                                     length are never read (any value)
    seq_lens      (B,) int32, on q's device          tokens of row i INCLUDING the new one already
                                                     written into the cache; 0 gives a zero row
    out           (B, H, D) q's dtype (optional)
    scale         float (None: D ** -0.5, as SDPA)

`paged_decode_attention` runs the Triton kernels on CUDA when triton imports, else the torch
reference. The Triton path never reads seq_lens or block_tables on the host: its grids depend on
(B, KVH, num_splits) only, so one CUDA graph captured per padded batch size replays correctly
after the tables' contents change (longer or shorter rows, other pages). The caller guarantees
seq_lens[i] <= max_blocks * block_size and valid page ids for the tokens in use (not checked:
that would need a host read).

Split-KV ("flash-decoding"): grid (B, KVH, S). A program owns all `group` query heads of one KV
head (a (GROUP_PAD, D_PAD) q tile, GROUP_PAD = next power of two >= max(group, 16) so tl.dot
applies; extra heads masked) and split s of the row's runtime length: tokens [s * chunk,
min((s + 1) * chunk, len)) with chunk = cdiv(cdiv(len, S), TILE) * TILE computed in the kernel.
It walks its range TILE tokens at a time (page ids gathered per token from block_tables), scores
with tl.dot, online softmax in fp32 (exp2 domain), and writes a partial out (B, H, S, D) fp32 and
its log-sum-exp (B, H, S) fp32 into a workspace; a second kernel combines the S partials into out.
With S == 1 the first kernel writes out directly (no workspace, one launch). Splits with an empty
range write lse = -inf and a zero partial. The workspace is allocated per call (torch's caching
allocator; inside graph capture it comes from the graph's pool): B * H * S * (D + 1) * 4 bytes.

Precision: scores and softmax in fp32; for bf16/fp16 the probabilities are rounded to the input
dtype before P.V (as flash attention does), fp32 inputs use IEEE dots (no TF32). Each new
(dtype, D, group, block_size, num_splits == 1) combination JIT-compiles on its first call: call
once eagerly before capturing a graph (the engine's warm-up step).

Triton is optional (CPU machines have none): importing this module never fails.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines
    triton = None
    tl = None

TARGET_PROGRAMS = 2 * 132  # ~2 programs per H200 SM
MAX_SPLITS = 16
TILE = 64  # tokens per inner iteration (several pages)
BLOCK_SIZES = tuple(1 << i for i in range(3, 9))  # 8..256
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256  # padded to a power of two >= 16 inside the kernel


def available(device) -> bool:
    """Whether the Triton kernels can run on `device`: triton importable and the device CUDA."""
    return triton is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()


def default_num_splits(batch: int, kv_heads: int) -> int:
    """S from shapes only (so a captured graph stays valid for any lengths): enough programs to
    fill ~2 per SM of an H200, clamp(ceil(264 / (B * KVH)), 1, 16)."""
    return max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // max(1, batch * kv_heads))))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _check(q, k_cache, v_cache, block_tables, seq_lens, out, rows: int | None = None) -> tuple[int, int, int, int, int]:
    """Host-side checks of shapes, dtypes, devices and strides (metadata only, no device sync);
    returns (rows, H, KVH, D, block_size). `rows`: how many rows block_tables and seq_lens have
    (None: q.shape[0], one query token a row; kernels.paged_prefill passes R); out is q's shape."""
    if q.dim() != 3:
        raise ValueError(f"q must be (tokens, H, D), got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be (num_blocks, block_size, KVH, D), got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    _, h, d = q.shape
    b = q.shape[0] if rows is None else rows
    _, bs, kvh, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head dim of q ({d}) and of the cache ({dk}) differ")
    if kvh == 0 or h % kvh:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({kvh})")
    if bs not in BLOCK_SIZES:
        raise ValueError(f"block_size must be a power of two in 8..256, got {bs}")
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(
            f"q, k_cache, v_cache must share one dtype of {DTYPES}, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != b:
        raise ValueError(
            f"block_tables must be (rows={b}, max_blocks) int32, got {tuple(block_tables.shape)} {block_tables.dtype}"
        )
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (b,):
        raise ValueError(f"seq_lens must be (rows={b},) int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables, "seq_lens": seq_lens}
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must be q's {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
        tensors["out"] = out
    for name, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    for name in ("q", "k_cache", "v_cache", "out"):
        t = tensors.get(name)
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous (stride 1), got strides {t.stride()}")
    if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:
        raise ValueError(f"block_tables' rows must be contiguous, got strides {block_tables.stride()}")
    return b, h, kvh, d, bs


def paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """The semantics in pure torch (any device; reads seq_lens on the host): per row, gather its
    tokens from its pages, expand KV heads to query heads, fp32 softmax attention. Rows of length 0
    are zero."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, None)
    b, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    group = h // kvh
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros(b, h, d, dtype=q.dtype, device=q.device)
    for i, n in enumerate(seq_lens.tolist()):
        if n <= 0:
            continue
        pages = block_tables[i, : -(-n // bs)].long()
        k = k_cache[pages].reshape(-1, kvh, d)[:n].float().repeat_interleave(group, dim=1)  # (n, H, D)
        v = v_cache[pages].reshape(-1, kvh, d)[:n].float().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out


if triton is not None:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """a @ b with fp32 accumulation; IEEE: full fp32 products (no TF32) for fp32 inputs."""
        if IEEE:
            c = tl.dot(a, b, input_precision="ieee")
        else:
            c = tl.dot(a, b)
        return c

    @triton.jit
    def _softmax_step(acc, l_i, m_i, qk, v, IEEE: tl.constexpr):
        """One online-softmax step over a tile: scores qk (M, N) in the log2 domain (-inf where
        masked; each row's max over qk and m_i finite), values v (N, D). P is rounded to v's dtype
        before P.V. Returns the rescaled accumulator (M, D), row sums and row maxima."""
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        return acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE), l_i, m_new

    @triton.jit
    def _paged_decode_split(
        q_ptr,
        k_ptr,
        v_ptr,
        bt_ptr,
        lens_ptr,
        po_ptr,
        lse_ptr,
        out_ptr,
        stride_qb,
        stride_qh,
        stride_kn,
        stride_kt,
        stride_kh,
        stride_vn,
        stride_vt,
        stride_vh,
        stride_bt,
        stride_ob,
        stride_oh,
        qk_scale,
        H,
        D,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,
        DIRECT: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        n_split = tl.num_programs(2)
        length = tl.load(lens_ptr + b)
        chunk = tl.cdiv(tl.cdiv(length, n_split), TILE) * TILE
        start = s * chunk
        end = tl.minimum(start + chunk, length)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        heads = kvh * GROUP + g
        gmask = g < GROUP
        dmask = d < D
        b64 = b.to(tl.int64)
        q = tl.load(
            q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=gmask[:, None] & dmask[None, :],
            other=0.0,
        )

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        tok = tl.arange(0, TILE)
        row_bt = bt_ptr + b64 * stride_bt
        for t0 in range(start, end, TILE):
            t = t0 + tok
            tmask = t < end
            page = tl.load(row_bt + t // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
            slot = t % BLOCK_SIZE
            lmask = tmask[:, None] & dmask[None, :]
            k = tl.load(
                k_ptr + page[:, None] * stride_kn + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                mask=lmask,
                other=0.0,
            )
            v = tl.load(
                v_ptr + page[:, None] * stride_vn + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                mask=lmask,
                other=0.0,
            )
            qk = tl.where(tmask[None, :], _dot(q, tl.trans(k), IEEE) * qk_scale, float("-inf"))  # log2 domain
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, IEEE)  # finite max: token t0 is in range

        nonempty = l_i > 0.0
        o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        omask = gmask[:, None] & dmask[None, :]
        if DIRECT:  # one split: the result itself
            tl.store(
                out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=omask,
            )
        else:
            row = (b64 * H + heads) * n_split + s  # (B, H, S) index
            tl.store(po_ptr + row[:, None] * D + d[None, :], o, mask=omask)
            tl.store(
                lse_ptr + row,
                tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf")),
                mask=gmask,
            )

    @triton.jit
    def _paged_decode_reduce(
        po_ptr, lse_ptr, out_ptr, stride_ob, stride_oh, H, S, D, S_PAD: tl.constexpr, D_PAD: tl.constexpr
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, S_PAD)
        d = tl.arange(0, D_PAD)
        smask = sp < S
        row = (b.to(tl.int64) * H + h) * S + sp
        lse = tl.load(lse_ptr + row, mask=smask, other=float("-inf"))
        m = tl.max(lse, axis=0)
        w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # 0 for empty splits
        den = tl.sum(w, axis=0)
        po = tl.load(po_ptr + row[:, None] * D + d[None, :], mask=smask[:, None] & (d[None, :] < D), other=0.0)
        o = tl.sum(po * w[:, None], axis=0) / tl.where(den > 0.0, den, 1.0)
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < D)


def paged_decode_attention_triton(
    q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, num_splits=None, tile=TILE, num_warps=4
):
    """The Triton path of `paged_decode_attention` on any tensors triton accepts (CUDA; CPU tensors
    under TRITON_INTERPRET=1). `tile`: tokens per inner iteration (power of two >= 16)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    b, h, kvh, d, bs = _check(q, k_cache, v_cache, block_tables, seq_lens, out)
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 16, got {tile}")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} > {MAX_HEAD_DIM} (the kernel keeps a (group, D) accumulator in registers)")
    s = default_num_splits(b, kvh) if num_splits is None else int(num_splits)
    if s < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if out is None:
        out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    if b == 0 or h == 0:
        return out
    group = h // kvh
    group_pad = _pow2(max(group, 16))
    d_pad = _pow2(max(d, 16))
    direct = s == 1
    if direct:
        po = lse = out  # unused
    else:
        po = torch.empty(b, h, s, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
    qk_scale = (d**-0.5 if scale is None else float(scale)) * math.log2(math.e)
    _paged_decode_split[(b, kvh, s)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        po,
        lse,
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
        h,
        d,
        GROUP=group,
        GROUP_PAD=group_pad,
        D_PAD=d_pad,
        BLOCK_SIZE=bs,
        TILE=tile,
        DIRECT=direct,
        IEEE=q.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=2,
    )
    if not direct:
        _paged_decode_reduce[(b, h)](
            po, lse, out, out.stride(0), out.stride(1), h, s, d, S_PAD=_pow2(s), D_PAD=d_pad, num_warps=4
        )
    return out


def paged_decode_attention(
    q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, num_splits=None
) -> torch.Tensor:
    """Decode attention of one query token per row against a paged KV pool (module doc: semantics,
    shapes, graph safety). Triton kernels on CUDA when triton imports, else the torch reference
    (`num_splits` is then ignored). `num_splits` None: `default_num_splits(B, KVH)`. Returns out
    (B, H, D) in q's dtype (`out` when given)."""
    if available(q.device):
        return paged_decode_attention_triton(
            q, k_cache, v_cache, block_tables, seq_lens, scale, out=out, num_splits=num_splits
        )
    ref = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale)
    if out is None:
        return ref
    _check(q, k_cache, v_cache, block_tables, seq_lens, out)
    return out.copy_(ref)


def self_check(device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int) -> str | None:
    """Runs the Triton kernels once on random inputs of a model's attention shape and compares
    them with the reference: None when they agree, else why not (the caller then serves on the
    reference, without CUDA graphs). A worker calls it at start-up, so a GPU or triton version the
    kernels were never run on fails there, once, and not in every decode step."""
    if not available(device):
        return "triton or CUDA is not available"
    g = torch.Generator(device="cpu").manual_seed(0)
    b, blocks = 3, 12

    def run():
        q = torch.randn(b, heads, head_dim, generator=g).to(device, dtype)
        k, v = random_pool(g, blocks, block_size, kv_heads, head_dim, device, dtype)
        tables = torch.randperm(blocks, generator=g).view(b, blocks // b).to(device, torch.int32)
        lens = torch.tensor([1, block_size + 3, blocks // b * block_size], dtype=torch.int32, device=device)
        return (
            paged_decode_attention_triton(q, k, v, tables, lens, None),
            paged_decode_attention_reference(q, k, v, tables, lens, None),
        )

    return compare_with_reference(run, dtype)


def random_pool(
    g: torch.Generator, blocks: int, block_size: int, kv_heads: int, head_dim: int, device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keys and values (blocks, block_size, kv_heads, head_dim) from the CPU generator `g`,
    strided as one layer of the engine's block-major pool (services/worker/kv_cache.KVPool: a block
    holds every layer's keys and values), so a self check meets the strides the engine passes."""
    storage = torch.randn((blocks, 2, 2, block_size, kv_heads, head_dim), generator=g).to(device, dtype)
    return storage[:, 1, 0], storage[:, 1, 1]


def compare_with_reference(run, dtype: torch.dtype) -> str | None:
    """The verdict of a self check: `run()` returns (the kernel's output, the reference's); None
    when they agree within the dtype's tolerance, else why not (a build or launch failure raised
    inside `run` is the answer too)."""
    try:
        got, want = run()
    except Exception as exc:  # a build or launch failure is the answer
        return f"{type(exc).__name__}: {exc}"[:500]
    err = float((got.float() - want.float()).abs().max())
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    return None if err <= tol else f"max error {err:.3g} over {tol}"


__all__ = [
    "available",
    "default_num_splits",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_decode_attention_triton",
    "self_check",
]
