"""The vision tower's Triton kernels (kernels/vision_ops.py) against their torch references on fresh
random inputs at the 7B tower's shapes (16 heads of 80, 1280-wide MLP x 4) and odd ones."""

from __future__ import annotations

import pytest
import torch

from kernels import vision_ops

pytestmark = pytest.mark.gpu
if not vision_ops.available("cuda"):
    pytest.skip("needs CUDA and triton", allow_module_level=True)


@pytest.mark.parametrize("items,p,heads,d", [(1, 2116, 16, 80), (3, 1024, 16, 80), (2, 37, 3, 12)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_vision_kernel_matches_reference(items, p, heads, d, dtype):
    g = torch.Generator(device="cuda").manual_seed(items * p)
    qkv = torch.randn(items * p, 3, heads, d, device="cuda", generator=g).to(dtype)
    angles = torch.randn(p, d // 2, device="cuda", generator=g) * 10
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().contiguous(), emb.sin().contiguous()
    want = qkv.clone()
    vision_ops.rotary_vision_reference_(want, cos, sin)
    v = qkv[:, 2].clone()
    vision_ops.rotary_vision_(qkv, cos, sin)
    assert torch.equal(qkv[:, 2], v)
    # fp32 math either way; the kernel may contract a product into an FMA: a bf16 ulp at most
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(qkv, want, **tol)
    if dtype != torch.float32:  # rounded to bf16, the fp32 differences mostly vanish
        assert (qkv == want).float().mean().item() > 0.999


@pytest.mark.parametrize("shape", [(2116, 5120), (33, 7)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quick_gelu_kernel_matches_reference(shape, dtype):
    x = (torch.randn(shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5)) * 4).to(dtype)
    got, want = vision_ops.quick_gelu(x), vision_ops.quick_gelu_reference(x)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    if dtype != torch.float32:
        assert (got == want).float().mean().item() > 0.99
