"""The decoder-layer CUDA kernels (kernels/csrc/layer_ops.cu) vs their torch references on fresh
random inputs: every dtype, the vectorised and the scalar path (odd widths, misaligned views),
strided rows, the fused residual add in and out of place; and a whole fused decoder layer vs HF's
layer in bf16.

The kernels round where the references round, so rotary and SiLU·up must agree bit for bit
(bar expf's last bit) and RMSNorm to one unit in the last place (its sum runs in another order).
"""

import pytest
import torch

from kernels import layer_ops
from kernels.atmm import extension
from kernels.reference import rms_norm_reference, rotary_reference_, silu_mul_reference

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if extension() is None:
    pytest.skip("kernels extension not built", allow_module_level=True)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def ulps(dtype) -> float:
    """One unit in the last place, relative, at the bottom of a binade (the loosest case)."""
    return {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}[dtype]


# RMSNorm: the sum of squares runs in another order than torch's, which moves 1/rms by a few fp32
# ulps: that can flip the rounding of the normalised value (1 ulp), which the weight product then
# rounds again; in fp32 the few ulps show directly.
RMS_ULPS = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 16}


def assert_close_ulp(got, want, dtype, n=1.0):
    """|got - want| <= n ulp of want (relative), elementwise; plus a tiny absolute floor."""
    err = (got.float() - want.float()).abs()
    tol = n * ulps(dtype) * want.float().abs() + 1e-30
    bad = (err > tol).sum().item()
    assert bad == 0, f"{bad} of {got.numel()} elements off by more than {n} ulp (max err {err.max().item():.3g})"


def rand(shape, dtype, g, scale=1.0):
    return (torch.randn(shape, device="cuda", generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows,hidden,offset", [(1, 3584, 0), (16, 3584, 0), (4640, 3584, 0), (7, 100, 0), (5, 1536, 1)]
)
def test_rms_norm(dtype, rows, hidden, offset):
    g = torch.Generator(device="cuda").manual_seed(rows * 7 + hidden)
    base = rand((rows, hidden + offset), dtype, g, 3.0)
    x = base[:, offset:]  # offset 1: rows misaligned -> scalar path
    w = rand((hidden,), dtype, g)
    assert_close_ulp(layer_ops.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), dtype, RMS_ULPS[dtype])
    delta = rand((rows, hidden), dtype, g)
    total, normed = layer_ops.add_rms_norm(x, delta, w, 1e-6)
    want_total = x + delta
    assert torch.equal(total, want_total)
    assert_close_ulp(normed, rms_norm_reference(want_total, w, 1e-6), dtype, RMS_ULPS[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_in_place_sum(dtype):
    ext = extension()
    g = torch.Generator(device="cuda").manual_seed(3)
    x, delta, w = rand((9, 512), dtype, g), rand((9, 512), dtype, g), rand((512,), dtype, g)
    want_total = x + delta
    want = rms_norm_reference(want_total, w, 1e-5)
    out = torch.empty_like(x)
    ext.rms_norm(out, x, w, 1e-5, delta, x)  # the residual stream updated in place
    assert torch.equal(x, want_total)
    assert_close_ulp(out, want, dtype, RMS_ULPS[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens,q_heads,k_heads,d", [(16, 28, 4, 128), (4640, 28, 4, 128), (3, 2, 1, 16), (5, 3, 1, 6)]
)
def test_rotary(dtype, tokens, q_heads, k_heads, d):
    g = torch.Generator(device="cuda").manual_seed(tokens + d)
    qkv = rand((tokens, (q_heads + 2 * k_heads) * d), dtype, g)  # q and k as views of one row, like a fused qkv
    q = qkv[:, : q_heads * d].view(tokens, q_heads, d)
    k = qkv[:, q_heads * d : (q_heads + k_heads) * d].view(tokens, k_heads, d)
    angles = torch.rand((tokens, d // 2), device="cuda", generator=g) * 100
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    want_q, want_k = q.clone(), k.clone()
    rotary_reference_(want_q, want_k, cos, sin)
    before_v = qkv[:, (q_heads + k_heads) * d :].clone()
    layer_ops.rotary_(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (q_heads + k_heads) * d :], before_v)  # nothing written past k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(16, 18944), (4640, 18944), (3, 37)])
def test_silu_mul(dtype, rows, width):
    g = torch.Generator(device="cuda").manual_seed(rows + width)
    gate, up = rand((rows, width), dtype, g, 4.0), rand((rows, width), dtype, g)
    assert_close_ulp(layer_ops.silu_mul(gate, up), silu_mul_reference(gate, up), dtype, n=1.0)


def test_bad_input_raises():
    ext = extension()
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="w must be"):
        ext.rms_norm(torch.empty_like(x), x, torch.ones(32, device="cuda", dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="expected a bfloat16"):
        ext.silu_mul(x.double(), x.double(), x.double())


def test_fused_layer_close_to_hf_layer_bf16():
    from transformers import AutoConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLDecoderLayer, Qwen2VLRotaryEmbedding

    from services.worker.fused_layers import fused_layer_forward

    cfg = AutoConfig.for_model(
        "qwen2_vl",
        hidden_size=3584,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        num_hidden_layers=1,
    ).text_config
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = Qwen2VLDecoderLayer(cfg, 0).to("cuda", torch.bfloat16).eval()
    for p in layer.parameters():
        p.data.normal_(0, 0.02)
    x = torch.randn(2, 37, 3584, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(37, device="cuda").view(1, 1, -1).expand(3, 2, -1)
    cos_sin = Qwen2VLRotaryEmbedding(cfg).to("cuda")(x, pos)
    with torch.inference_mode():
        want = layer(x, position_embeddings=cos_sin)
        got = fused_layer_forward(layer, x, position_embeddings=cos_sin)
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel < 2e-3, rel
