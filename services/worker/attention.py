"""The language model's attention: HF's SDPA path, except decode steps.

A decode step over the paged KV cache (kv_cache.py) passes `paged_decode` (block tables and
context lengths), a prefill chunk after cached tokens `paged_prefill` (chunked prefill,
`kernels.paged_prefill`): the query attends to the layer's pool through the block tables
(`kernels.paged_attention`: a split-KV Triton kernel on CUDA, its torch reference elsewhere or
when the engine's start-up check of the kernel failed).

With a mask, HF's SDPA path copies the KV cache to every query head (`repeat_kv`) before calling
the kernel — for a 7B model with 7 query heads per KV head that is ~7x the cache written and read
again, every layer, every decode step. For one query token per row the heads of a KV group can
instead be stacked as the query *length*: q (b, kv_heads, group, d) against k, v (b, kv_heads,
cache, d) is plain attention (no GQA), with the row's mask broadcast over the group. Same math,
fp32 softmax inside the kernel, no copy. Prefill (several tokens, no mask) keeps HF's path.

On CUDA the engine turns torch's cuDNN SDPA backend off (`use_shape_free_sdpa`): with it on,
a prefill at a width SDPA has not seen costs ~40 ms of host time over the 7B's 28 layers (1.4 ms
a call, 0.02 ms once the width repeats; off: 0.02 ms at new widths too,
bench/results/prefill-host-561cd42.json), and a served prefill has a new width almost every
step: a 7B worker spent 27% of its engine thread there. Flash attention, chosen next, has no
per-shape cost; the vision tower's fixed-size images lose ~25 µs a layer
(bench/results/prefill-host-829c321-vision.json).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kernels.paged_attention import paged_decode_attention, paged_decode_attention_reference
from kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_reference

NAME = "valora_sdpa"
NAME_MASKLESS = "valora_sdpa_maskless"


def grouped_decode_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling=None,
    is_causal=None,
    paged_decode=None,
    paged_prefill=None,
    **kwargs,
):
    if paged_decode is not None:  # key, value: the layer's pool (PagedLayer.update)
        b, heads, _, d = query.shape
        attend = paged_decode_attention if paged_decode.kernel else paged_decode_attention_reference
        out = attend(query.reshape(b, heads, d), key, value, paged_decode.block_tables, paged_decode.seq_lens, scaling)
        return out.view(b, 1, heads, d), None
    if paged_prefill is not None:  # a prefill chunk after cached tokens, packed as one row (1, H, T, d)
        _, heads, t, d = query.shape
        attend = paged_prefill_attention if paged_prefill.kernel else paged_prefill_attention_reference
        out = attend(
            query[0].transpose(0, 1),
            key,
            value,
            paged_prefill.block_tables,
            paged_prefill.cu_q,
            paged_prefill.seq_lens,
            scaling,
        )
        return out.view(1, t, heads, d), None
    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or attention_mask is None or groups == 1 or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    b, heads, _, d = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(b, kv_heads, groups, d)  # head j reads KV head j // groups (repeat_kv's order)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
    return out.reshape(b, heads, 1, d).transpose(1, 2).contiguous(), None


def use_shape_free_sdpa(device) -> bool:
    """Turns torch's cuDNN SDPA backend off for this process when `device` is CUDA (module doc:
    its per-shape host cost); True when it did."""
    if torch.device(device).type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def use_grouped_decode_attention(text_config, masks: bool = True) -> None:
    """Registers the attention function (once; masks are built as for SDPA) and selects it for the
    model's text config. `masks=False` selects it under NAME_MASKLESS, registered without a mask
    function, so HF builds no mask for it: for a language model that makes its causal mask of any
    `attention_mask` it is given (Llama's; the engine's paged forwards need none,
    architectures.Architecture.mask_mapping)."""
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, grouped_decode_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
    if NAME_MASKLESS not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME_MASKLESS, grouped_decode_attention)
    text_config._attn_implementation = NAME if masks else NAME_MASKLESS
