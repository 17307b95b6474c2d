"""Pure-torch references of the kernel ops: the semantics every CUDA kernel must match.

Multi-LoRA (ATMM's contract): tokens are sorted into contiguous segments, one adapter slot
per segment; for each segment s with slot k = seg_slots[s] (k < 0: no LoRA),

    y[seg_starts[s]:seg_starts[s+1]] += scales[k] * (x[seg] @ A[k]) @ B[k]

with A[k]: (in_features, r_k), B[k]: (r_k, out_features), ranks exact per slot (no padding),
accumulated in fp32 and rounded once into y's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class SegmentPlan:
    """Token segments of one engine step, built once per step and shared by every layer.

    seg_starts: S+1 token offsets (first 0, last = number of tokens); seg_slots: S adapter
    slots, -1 for tokens without LoRA. Host lists for the reference; kernels keep device copies.
    """

    seg_starts: list[int]
    seg_slots: list[int]

    @classmethod
    def from_token_slots(cls, token_slots: Sequence[int]) -> "SegmentPlan":
        """Plan for tokens already grouped by slot (equal slots adjacent)."""
        starts, slots = [0], []
        for i, slot in enumerate(token_slots):
            if not slots or slot != slots[-1]:
                if slots:
                    starts.append(i)
                slots.append(slot)
        starts.append(len(token_slots))
        if not slots:
            starts = [0, 0][:1]
        return cls(starts, slots)

    @property
    def num_tokens(self) -> int:
        return self.seg_starts[-1]


def multi_lora_reference_(
    y: torch.Tensor,
    x: torch.Tensor,
    plan: SegmentPlan,
    a: Sequence[torch.Tensor | None],
    b: Sequence[torch.Tensor | None],
    scales: Sequence[float],
) -> torch.Tensor:
    """In place: y[seg] += scales[k] * (x[seg] @ a[k]) @ b[k] for every segment (see module doc)."""
    if x.shape[0] != plan.num_tokens or y.shape[0] != plan.num_tokens:
        raise ValueError(f"plan covers {plan.num_tokens} tokens, x has {x.shape[0]}, y has {y.shape[0]}")
    for s, k in enumerate(plan.seg_slots):
        if k < 0:
            continue
        lo, hi = plan.seg_starts[s], plan.seg_starts[s + 1]
        if hi == lo:
            continue
        delta = (x[lo:hi].float() @ a[k].float()) @ b[k].float()
        y[lo:hi] = (y[lo:hi].float() + scales[k] * delta).to(y.dtype)
    return y


def lora_expand_reference_(
    y: torch.Tensor,
    xa: torch.Tensor,
    cols: Sequence[int],
    plan: SegmentPlan,
    b: Sequence[torch.Tensor | None],
    scales: Sequence[float],
) -> torch.Tensor:
    """In place: y[seg] += scales[k] * xa[seg, cols[k]:cols[k] + r_k] @ b[k] (r_k = b[k].shape[0]),
    the expand half of `multi_lora_reference_` on x·A computed elsewhere."""
    if xa.shape[0] != plan.num_tokens or y.shape[0] != plan.num_tokens:
        raise ValueError(f"plan covers {plan.num_tokens} tokens, xa has {xa.shape[0]}, y has {y.shape[0]}")
    for s, k in enumerate(plan.seg_slots):
        lo, hi = plan.seg_starts[s], plan.seg_starts[s + 1]
        if k < 0 or hi == lo:
            continue
        r = b[k].shape[0]
        delta = xa[lo:hi, cols[k] : cols[k] + r].float() @ b[k].float()
        y[lo:hi] = (y[lo:hi].float() + scales[k] * delta).to(y.dtype)
    return y


def switch_reference_(
    w: torch.Tensor, b_cat: torch.Tensor, a_cat: torch.Tensor, src: torch.Tensor | None = None
) -> torch.Tensor:
    """W = src + B_cat @ A_cat (src defaults to W: in place), fp32 accumulate, one rounding (the
    switcher's one-pass merge/unmerge/switch; with src = a pristine copy W0, the one-pass merge).

    W: (out, in); B_cat: (out, R); A_cat: (R, in). Unmerge m and merge n in one pass with
    B_cat = [s_n*B_n, -s_m*B_m], A_cat = [A_n; A_m] (PEFT layout: B (out, r), A (r, in)).
    """
    base = w if src is None else src
    w.copy_((base.float() + b_cat.float() @ a_cat.float()).to(w.dtype))
    return w


# -- decoder-layer elementwise ops (kernels/csrc/layer_ops.cu): HF Qwen2/Qwen2-VL's own expressions,
# so a layer built on these equals the HF layer exactly on CPU; the CUDA kernels round where these do.


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2RMSNorm: w * (x / rms(x)) computed in fp32, normalised value rounded to x's dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotary_reference_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place x = x·cos + rotate_half(x)·sin for q (tokens, q_heads, d) and k (tokens, k_heads, d);
    cos, sin (tokens, d) broadcast over heads (HF's apply_rotary_pos_emb)."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    for x in (q, k):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_((x * c) + (rotated * s))


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Qwen2MLP's act_fn(gate) * up for act_fn = SiLU."""
    return torch.nn.functional.silu(gate) * up
