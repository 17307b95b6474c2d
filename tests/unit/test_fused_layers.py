"""The decoder layers on the fused elementwise ops (services/worker/fused_layers.py) equal HF's own
layers exactly on CPU: a batched prefill with images and greedy decode steps give identical
logits before and after `install_fused_layers`, in fp32 and bf16 (the references round as HF)."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import rms_norm_reference, rotary_reference_, silu_mul_reference
from services.worker.fused_layers import install_fused_layers
from services.worker.model import build_inputs, load_model, load_processor
from services.worker.testing import random_image


def generate_logits(model, inputs, steps: int = 4) -> tuple[torch.Tensor, ...]:
    """Logits of the prompt's last position and of the greedy decode steps on the KV cache."""
    out = model.generate(
        **inputs, max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    return out.logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layers_equal_hf_layers(model_path, dtype):
    model = load_model(model_path, dtype=dtype)
    inputs = build_inputs(load_processor(model_path), [random_image(3), random_image(4)], "Compare the two images.")
    with torch.inference_mode():
        want = generate_logits(model, inputs)
        assert install_fused_layers(model) == len(model.model.language_model.layers)
        got = generate_logits(model, inputs)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_reference_ops_match_hf_modules():
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRMSNorm, apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    norm = Qwen2VLRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    norm.weight.data = torch.randn(64, generator=g).to(torch.bfloat16)
    assert torch.equal(rms_norm_reference(x, norm.weight, 1e-6), norm(x))
    q = torch.randn(5, 4, 16, generator=g).to(torch.bfloat16)  # (tokens, heads, d)
    k = torch.randn(5, 2, 16, generator=g).to(torch.bfloat16)
    cos = torch.randn(5, 16, generator=g).to(torch.bfloat16)
    sin = torch.randn(5, 16, generator=g).to(torch.bfloat16)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), cos, sin, unsqueeze_dim=0)
    rotary_reference_(q, k, cos, sin)
    assert torch.equal(q, want_q.transpose(0, 1)) and torch.equal(k, want_k.transpose(0, 1))
    gate, up = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    assert torch.equal(silu_mul_reference(gate, up), torch.nn.SiLU()(gate) * up)


def test_grouped_projections_equal_hf_layers(model_path):
    """q/k/v and gate/up as one linear each (lora.LoraGroup, the parts' weights views of the
    group's): the same logits as HF's layers, and a part's weight written in place (as the
    switcher does) reaches the group's GEMM."""
    from services.worker.lora import LoraRuntime, install_lora, install_lora_groups

    model = load_model(model_path)
    inputs = build_inputs(load_processor(model_path), [random_image(5)], "What is in the image?")
    with torch.inference_mode():
        want = generate_logits(model, inputs)
        runtime = LoraRuntime()
        layers = install_lora(model, runtime)
        groups = install_lora_groups(model, layers, runtime)
        install_fused_layers(model)
        assert len(groups) == 2 * len(model.model.language_model.layers)
        got = generate_logits(model, inputs)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert [w.argmax(-1) for w in want] == [g.argmax(-1) for g in got]
        group = groups[(0, "qkv_proj")]
        x = torch.randn(3, group.weight.shape[1])
        k_proj = model.model.language_model.layers[0].self_attn.k_proj
        k_proj.weight.add_(1.0)  # in place, like a merge
        _, k, _ = group(x)
        torch.testing.assert_close(k, k_proj(x))


def test_group_tensors_are_the_parts_side_by_side():
    from services.worker.lora import AdapterEntry, MixtureEntry, group_tensors

    g = torch.Generator().manual_seed(1)
    parts, sizes = ((0, "q_proj"), (0, "k_proj"), (0, "v_proj")), [24, 8, 8]

    def adapter(rank, skip=()):
        a = {k: torch.randn(16, rank, generator=g) for k in parts if k not in skip}
        return AdapterEntry(
            a, {k: torch.randn(rank, n, generator=g) for k, n in zip(parts, sizes) if k not in skip}, scale=0.5
        )

    x = torch.randn(5, 16, generator=g)
    for entry in (adapter(4), adapter(8, skip=[(0, "k_proj")]), MixtureEntry(adapter(4), adapter(8))):
        a, b, scale = group_tensors(entry, parts, sizes)
        got = scale * (x @ a) @ b
        cols = []
        for k, n in zip(parts, sizes):
            t = entry.tensors(k)
            cols.append(torch.zeros(5, n) if t is None else t[2] * (x @ t[0]) @ t[1])
        torch.testing.assert_close(got, torch.cat(cols, dim=1))
        assert group_tensors(entry, parts, sizes)[0] is a  # built once per entry
