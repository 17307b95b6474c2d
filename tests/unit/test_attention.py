"""Decode attention with KV groups stacked as query length equals HF's SDPA path (repeat_kv);
other calls go to HF's path unchanged; the engine's model uses it, the vision tower does not."""

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from services.worker.attention import NAME, grouped_decode_attention, use_grouped_decode_attention
from services.worker.model import ensure_tiny_model, load_model


class _Attn(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def test_grouped_decode_attention_equals_hf_sdpa():
    g = torch.Generator().manual_seed(0)
    for b, kv_heads, groups, d, cache in [(3, 2, 2, 32, 20), (5, 4, 7, 64, 37), (1, 1, 8, 16, 5)]:
        mod = _Attn(groups)
        q = torch.randn(b, kv_heads * groups, 1, d, generator=g)
        k, v = torch.randn(2, b, kv_heads, cache, d, generator=g)
        mask = torch.rand(b, 1, 1, cache, generator=g) > 0.4
        mask[:, :, :, cache - 1] = True
        want, _ = sdpa_attention_forward(mod, q, k, v, mask, scaling=d**-0.5)
        got, _ = grouped_decode_attention(mod, q, k, v, mask, scaling=d**-0.5)
        assert got.shape == want.shape == (b, 1, kv_heads * groups, d)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # prefill (several query tokens) and maskless calls take HF's path, bit for bit
        q2 = torch.randn(b, kv_heads * groups, 4, d, generator=g)
        assert torch.equal(
            grouped_decode_attention(mod, q2, k, v, None)[0], sdpa_attention_forward(mod, q2, k, v, None)[0]
        )


def test_engine_text_model_uses_it_vision_keeps_sdpa(tmp_path):
    model = load_model(ensure_tiny_model(tmp_path / "tiny"))
    use_grouped_decode_attention(model.config.text_config)
    assert model.model.language_model.layers[0].self_attn.config._attn_implementation == NAME
    assert model.model.visual.config._attn_implementation != NAME
