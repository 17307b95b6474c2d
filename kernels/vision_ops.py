"""The vision tower's elementwise ops in one Triton kernel each (services/worker/vision_tower.py).

Profiled on the H200 (bench/results/step-profile-4ad17d1-auto.json), a 448 + 644 px pair spends
~19 ms in Qwen2-VL's vision tower, of which GEMMs are ~7 ms and attention ~3.6: most of the rest
is two ops that HF writes as chains of small torch kernels, each reading and writing the whole
activation again:

    rotary_vision_(qkv, cos, sin)  in place on q and k of the qkv projection (n, 3, heads, d):
                                   x = x·cos + rotate_half(x)·sin in fp32, rounded back once
                                   (HF's apply_rotary_pos_emb_vision: a copy to fp32, the halves
                                   swapped, 2 products, a sum and a copy back, for q and k)
    quick_gelu(x)                  x·sigmoid(1.702·x) (HF's QuickGELUActivation: 3 kernels,
                                   each rounding to x's dtype; the kernel rounds where they do)

Each has its torch reference (HF's expression), which CPU machines run; the kernels compute in
fp32 registers with the references' roundings, so they agree to fp32 contraction (an FMA where
torch rounds a product first): a few bf16 ulps at most, never a different formula.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines
    triton = None
    tl = None

ROPE_TOKENS = 8  # tokens a program (the heads of q and k unrolled inside)
GELU_BLOCK = 2048


def available(device) -> bool:
    """Whether the Triton kernels can run on `device`: triton importable and the device CUDA."""
    return triton is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()


def rotary_vision_reference_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place on qkv[:, 0] (q) and qkv[:, 1] (k) of qkv (n, 3, heads, d); cos, sin (p, d) fp32,
    token t taking row t % p (the items of one grid share their angles): HF's
    apply_rotary_pos_emb_vision."""
    qk = qkv[:, :2].float()
    half = qk.shape[-1] // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    reps = qkv.shape[0] // cos.shape[0]
    c, s = cos.float().repeat(reps, 1)[:, None, None], sin.float().repeat(reps, 1)[:, None, None]
    qkv[:, :2] = ((qk * c) + (rotated * s)).to(qkv.dtype)


def quick_gelu_reference(x: torch.Tensor) -> torch.Tensor:
    """HF's QuickGELUActivation."""
    return x * torch.sigmoid(1.702 * x)


if triton is not None:

    @triton.jit
    def _rotary_vision(
        x_ptr,
        cos_ptr,
        sin_ptr,
        n,
        period,
        stride_t,
        stride_w,
        stride_h,
        stride_c,
        HEADS: tl.constexpr,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        j = tl.arange(0, HALF_PAD)
        mask = (t < n)[:, None] & (j < HALF)[None, :]
        t64 = t.to(tl.int64)[:, None]
        angle = (t % period).to(tl.int64)[:, None]
        cs = cos_ptr + angle * stride_c + j[None, :]
        sn = sin_ptr + angle * stride_c + j[None, :]
        c1 = tl.load(cs, mask=mask, other=0.0)
        c2 = tl.load(cs + HALF, mask=mask, other=0.0)
        s1 = tl.load(sn, mask=mask, other=0.0)
        s2 = tl.load(sn + HALF, mask=mask, other=0.0)
        row = x_ptr + t64 * stride_t + j[None, :]
        for w in tl.static_range(2):  # q, k
            for h in tl.static_range(HEADS):
                p = row + w * stride_w + h * stride_h
                x1 = tl.load(p, mask=mask, other=0.0).to(tl.float32)
                x2 = tl.load(p + HALF, mask=mask, other=0.0).to(tl.float32)
                # rotate_half(x) = (-x2, x1)
                tl.store(p, (x1 * c1 - x2 * s1).to(x_ptr.dtype.element_ty), mask=mask)
                tl.store(p + HALF, (x2 * c2 + x1 * s2).to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _quick_gelu(x_ptr, out_ptr, numel, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < numel
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
        dt = x.dtype
        xf = x.to(tl.float32)
        scaled = (xf * 1.702).to(dt).to(tl.float32)  # each of HF's 3 ops rounds to x's dtype
        gate = tl.sigmoid(scaled).to(dt).to(tl.float32)
        tl.store(out_ptr + offs, (xf * gate).to(dt), mask=m)


def rotary_vision_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: q and k of qkv (n, 3, heads, d), last dim contiguous; cos, sin (p, d) fp32
    contiguous, p dividing n (token t takes row t % p). The Triton kernel on CUDA, else the
    reference."""
    n, three, heads, d = qkv.shape
    if three != 3 or d % 2 or cos.shape != sin.shape or cos.shape[1] != d or n % cos.shape[0]:
        raise ValueError(
            f"qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}: want "
            "(n, 3, heads, d) and (p, d) for both, p dividing n"
        )
    if (
        not available(qkv.device)
        or qkv.stride(-1) != 1
        or cos.dtype != torch.float32
        or not cos.is_contiguous()
        or not sin.is_contiguous()
    ):
        rotary_vision_reference_(qkv, cos, sin)
        return
    half = d // 2
    _rotary_vision[(triton.cdiv(n, ROPE_TOKENS),)](
        qkv,
        cos,
        sin,
        n,
        cos.shape[0],
        qkv.stride(0),
        qkv.stride(1),
        qkv.stride(2),
        cos.stride(0),
        HEADS=heads,
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        BLOCK_T=ROPE_TOKENS,
        num_warps=4,
    )


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x·sigmoid(1.702·x), a new tensor: the Triton kernel on CUDA (bf16/fp16/fp32), else the reference."""
    if not available(x.device) or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return quick_gelu_reference(x)
    x = x.contiguous()
    out = torch.empty_like(x)
    _quick_gelu[(triton.cdiv(x.numel(), GELU_BLOCK),)](x, out, x.numel(), BLOCK=GELU_BLOCK, num_warps=8)
    return out
