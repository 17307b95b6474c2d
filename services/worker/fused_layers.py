"""The language model's decoder layers on valora's fused elementwise ops (kernels.layer_ops).

HF's Qwen2-VL decoder layer runs ~40 kernels per layer besides its 7 projections: RMSNorm as
eight torch ops (twice), rotary embedding as ten, SiLU·up as two, residual adds. In a 16-row
decode step of a 7B model each is a ~2 µs graph node on ~0 bytes of work, ~2 ms per step over 28
layers — as much as half the weights' read time. `install_fused_layers(model)` rebinds every
decoder layer's forward to `fused_layer_forward`: the same computation, with

    input RMSNorm                      1 kernel   (rms_norm)
    rotary on q and k, in place        1 kernel   (rotary_, on (tokens, heads, d) views)
    residual add + post-attn RMSNorm   1 kernel   (add_rms_norm)
    SiLU(gate) · up                    1 kernel   (silu_mul)

Projections that share an input run as one where the engine grouped them (lora.LoraGroup:
`self_attn.qkv_proj`, `mlp.gate_up_proj`); otherwise the layer's own modules (LoraLinear,
tensor-parallel wrappers) run one by one. The KV cache and attention go through HF's
Cache.update and attention interface as before. On CPU the ops are HF's expressions, so the
layer is exactly the HF layer (tests compare them); on CUDA they round where HF rounds.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from transformers.models.qwen2_vl.modeling_qwen2_vl import eager_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kernels import layer_ops
from services.worker.lora import language_layers


def fused_layer_forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    use_cache=False,
    position_embeddings=None,
    **kwargs,
) -> torch.Tensor:
    """Qwen2VLDecoderLayer.forward on the fused ops (same arguments, same result); LlamaDecoderLayer's
    is the same computation (its attention has no sliding window)."""
    attn, mlp = self.self_attn, self.mlp
    b, s, _ = hidden_states.shape
    d = attn.head_dim
    x = layer_ops.rms_norm(hidden_states, self.input_layernorm.weight, self.input_layernorm.variance_epsilon)
    qkv = attn.qkv_proj(x) if hasattr(attn, "qkv_proj") else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
    q, k = qkv[0].view(b * s, -1, d), qkv[1].view(b * s, -1, d)  # column views of one output when grouped
    v = qkv[2].view(b, s, -1, d).transpose(1, 2)
    cos, sin = position_embeddings
    layer_ops.rotary_(q, k, cos.reshape(b * s, d), sin.reshape(b * s, d))
    q = q.view(b, s, -1, d).transpose(1, 2)
    k = k.view(b, s, -1, d).transpose(1, 2)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, attn.layer_idx)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
    out, _ = interface(
        attn,
        q,
        k,
        v,
        attention_mask,
        dropout=0.0,
        scaling=attn.scaling,
        sliding_window=getattr(attn, "sliding_window", None),
        position_ids=position_ids,
        **kwargs,
    )
    out = attn.o_proj(out.reshape(b, s, -1).contiguous())
    norm = self.post_attention_layernorm
    residual, x = layer_ops.add_rms_norm(hidden_states, out, norm.weight, norm.variance_epsilon)
    gate, up = mlp.gate_up_proj(x) if hasattr(mlp, "gate_up_proj") else (mlp.gate_proj(x), mlp.up_proj(x))
    return residual + mlp.down_proj(layer_ops.silu_mul(gate, up))


def install_fused_layers(model: nn.Module) -> int:
    """Rebinds the language model's decoder layers to `fused_layer_forward`; returns how many.
    Layers whose MLP activation is not SiLU (the only one the fused op implements) keep HF's."""
    n = 0
    for layer in language_layers(model):
        if getattr(layer.mlp.config, "hidden_act", "silu") != "silu" or layer.training:
            continue
        layer.forward = types.MethodType(fused_layer_forward, layer)
        n += 1
    return n
