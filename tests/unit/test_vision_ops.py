"""The vision tower's fused ops' references (kernels/vision_ops.py) are HF's own expressions: equal
to transformers' apply_rotary_pos_emb_vision and QuickGELUActivation on fresh random inputs,
items of one grid sharing their angles."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import QuickGELUActivation
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

from kernels.vision_ops import quick_gelu, rotary_vision_


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("items", [1, 3])
def test_rotary_vision_is_hfs(dtype, items):
    g = torch.Generator().manual_seed(items)
    p, heads, d = 36, 4, 20
    qkv = torch.randn(items * p, 3, heads, d, generator=g).to(dtype)
    angles = torch.randn(p, d // 2, generator=g) * 3
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos(), emb.sin()
    want_q, want_k = apply_rotary_pos_emb_vision(qkv[:, 0], qkv[:, 1], cos.repeat(items, 1), sin.repeat(items, 1))
    v = qkv[:, 2].clone()
    rotary_vision_(qkv, cos, sin)
    assert torch.equal(qkv[:, 0], want_q) and torch.equal(qkv[:, 1], want_k) and torch.equal(qkv[:, 2], v)


@pytest.mark.parametrize("shapes", [((12, 3, 2, 4), (5, 4)), ((12, 2, 2, 4), (6, 4)), ((12, 3, 2, 4), (6, 2))])
def test_rotary_vision_refuses_shapes_it_cannot_rotate(shapes):
    qkv, angles = shapes  # angles not tiling the tokens, no v, angles of another head dim
    with pytest.raises(ValueError):
        rotary_vision_(torch.zeros(qkv), torch.zeros(angles), torch.zeros(angles))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quick_gelu_is_hfs(dtype):
    x = (torch.randn(7, 33, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    assert torch.equal(quick_gelu(x), QuickGELUActivation()(x))
