"""Decoder-layer elementwise ops: RMSNorm (+ fused residual add), rotary embedding, SiLU·up.

On CUDA with the extension built these run one kernel each (kernels/csrc/layer_ops.cu) where the
HF layer runs 5-10 small torch kernels; elsewhere the torch references of `kernels.reference`
(HF's own expressions). Tensors are (tokens, features) or (..., features) with unit stride along
features; outputs are new tensors except for `rotary_`, which works in place.
"""

from __future__ import annotations

import torch

from kernels.atmm import extension
from kernels.reference import rms_norm_reference, rotary_reference_, silu_mul_reference

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _ext(*tensors: torch.Tensor):
    """The extension when every tensor is a CUDA tensor of a supported dtype, else None."""
    if not all(t.is_cuda and t.dtype in DTYPES for t in tensors):
        return None
    return extension()


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ext = _ext(x, weight)
    if ext is None or weight.dtype != x.dtype:
        return rms_norm_reference(x, weight, eps)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    ext.rms_norm(_rows(out), _rows(x), weight.contiguous(), eps)
    return out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) — the residual stream and the next sublayer's input."""
    ext = _ext(x, delta, weight)
    if ext is None or not (weight.dtype == x.dtype == delta.dtype) or x.shape != delta.shape:
        total = x + delta
        return total, rms_norm_reference(total, weight, eps)
    total = torch.empty_like(x, memory_format=torch.contiguous_format)
    out = torch.empty_like(total)
    ext.rms_norm(_rows(out), _rows(x), weight.contiguous(), eps, _rows(delta), _rows(total))
    return total, out


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place on q (tokens, q_heads, d), k (tokens, k_heads, d); cos, sin (tokens, d)."""
    ext = _ext(q, k, cos, sin)
    if ext is None or not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        rotary_reference_(q, k, cos, sin)
        return
    ext.rotary_(q, k, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    ext = _ext(gate, up)
    if ext is None or gate.dtype != up.dtype or gate.shape != up.shape:
        return silu_mul_reference(gate, up)
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    ext.silu_mul(_rows(out), _rows(gate), _rows(up))
    return out
