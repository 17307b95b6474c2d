"""The language model sharded over a tensor-parallel group (tensor_parallel.TPGroup) with
S-LoRA's LoRA partitioning.

Every rank holds 1/world_size of each decoder layer and runs the same forward on the same inputs
(Megatron-LM's layout, two all-reduces per layer):

    q/k/v_proj, gate/up_proj   column-parallel: output features sharded (W rows, bias too).
                               Rank r owns query heads [r·H/w, (r+1)·H/w) and KV heads
                               [r·KV/w, (r+1)·KV/w) — the same GQA groups, so attention (and the
                               rank's KV cache, local KV heads only) runs locally, no communication.
    o_proj, down_proj          row-parallel: input features sharded (W columns). Each rank's
                               x_shard·W_shard^T is a partial sum; ONE all-reduce per layer block
                               (attention, MLP) makes the full output; a bias is added after it.

LoRA follows the base weight it rides on (S-LoRA §5, "tensor parallelism"), in the multi-LoRA
op's layout A (in, r), B (r, out):

    column-parallel  A replicated (x·A computed in full on every rank; r is tiny), B sharded on
                     out like W: the rank's (x·A)·B_shard is exactly its slice of the output.
                     No extra communication.
    row-parallel     A sharded on in like W, B replicated: x_shard·A_shard·B is a partial sum
                     of the LoRA term, added into the base layer's partial output BEFORE the
                     layer's single all-reduce — the LoRA term rides on the base all-reduce,
                     no extra collective (also for the ATMM kernel, which adds into y in place).

`ColumnParallelLoraLinear` / `RowParallelLoraLinear` are `LoraLinear` subclasses: the step plan
(`StepLora`: segments, per-segment adapters, the deLoRA `MixtureEntry` terms) and the op
(`multi_lora_reference_` or the ATMM backend) are unchanged — an entry just hands out the
rank's sharded tensors, because the adapter was sharded with `shard_adapter` (a `MixtureEntry`
concatenates sharded factors along r, which keeps their sharding). The switcher (merged /
mixture modes) also works unchanged on the sharded weights: W_shard += s·(A·B)_shard, since
the slice of B·A is B_shard·A (column) or B·A_shard (row).

Embedding and lm_head stay REPLICATED on every rank (not vocab-parallel): after the last
all-reduce every rank holds the full hidden states, computes the same logits and (with the same
inputs) the same tokens. That costs one extra copy of the two vocab matrices per rank (2 × 1.5
GB at a 13B shape in bf16) and redundant lm_head work on the last tokens only; a vocab-parallel
lm_head (column-parallel + all-gather of the logits) is the next step if memory gets tight. The
vision tower is not sharded: every rank runs it over the pixels rank 0 broadcasts (vision.py).

Entry points: `shard_model_(model, tp)` shards a full model in place (every rank built the same
weights, e.g. the same seed or the same checkpoint) and installs the TP LoRA layers;
`shard_state_dict(sd, tp)` slices a full state dict; `load_full_state_dict_(model, sd, tp)`
copies a full checkpoint's slices into an already sharded model (`model.load_sharded_model`: a
rank loads only its shard of a checkpoint; load_format "dummy" still builds the whole random
model on every rank first); `shard_adapter(weights, tp)` shards an adapter (each rank parses it
at full shape and keeps its shard in its pool); `local_features(shapes, tp)` gives the per-rank
projection shapes (for the ATMM backend's tables). The stats report a rank's own KV memory (its
KV heads only).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch
from torch import nn

from services.common.adapter_format import TARGET_MODULES, BaseModelShapes, module_parent
from services.worker.adapter_weights import AdapterWeights
from services.worker.architectures import language_model
from services.worker.lora import LayerModule, LoraLinear, LoraRuntime
from services.worker.tensor_parallel import TPGroup

COLUMN_MODULES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_MODULES = ("o_proj", "down_proj")
assert set(COLUMN_MODULES) | set(ROW_MODULES) == set(TARGET_MODULES)


class ColumnParallelLoraLinear(LoraLinear):
    """Output features sharded; base and LoRA (A full, B sharded) computed locally: the forward
    is LoraLinear's, only the tensors are shards."""

    def __init__(self, base: nn.Linear, key: LayerModule, runtime: LoraRuntime, tp: TPGroup) -> None:
        super().__init__(base, key, runtime)
        self.tp = tp


class RowParallelLoraLinear(LoraLinear):
    """Input features sharded: partial base output + partial LoRA term (A sharded, B full), then
    the layer's one all-reduce, then the bias (held here, added once)."""

    def __init__(
        self, base: nn.Linear, key: LayerModule, runtime: LoraRuntime, tp: TPGroup, bias: nn.Parameter | None = None
    ) -> None:
        super().__init__(base, key, runtime)
        self.tp = tp
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # x_shard·W_shard^T += per segment s·(x_shard·A_shard)·B
        if not y.is_contiguous():
            y = y.contiguous()
        self.tp.all_reduce_(y)
        return y if self.bias is None else y + self.bias


TP_LAYERS = (ColumnParallelLoraLinear, RowParallelLoraLinear)


def _text_model(model: nn.Module) -> nn.Module:
    """The text model (decoder layers) of a ForConditionalGeneration, its base model or itself."""
    if hasattr(model, "layers"):
        return model
    if hasattr(model, "language_model"):
        return model.language_model
    return language_model(model)


def check_divisible(config, tp: TPGroup) -> None:
    """ValueError unless the text config's heads, KV heads and intermediate size split over tp."""
    tp.part(config.num_attention_heads, "attention heads")
    tp.part(
        config.num_key_value_heads or config.num_attention_heads,
        "KV heads (replicating KV heads across ranks is not supported)",
    )
    tp.part(config.intermediate_size, "intermediate_size")


def _shard_linear_(lin: nn.Linear, module: str, tp: TPGroup) -> nn.Parameter | None:
    """Slices lin's weight (and bias) in place; returns a row-parallel layer's bias, detached from lin."""

    def param(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
        return nn.Parameter(t, requires_grad=like.requires_grad)

    w = lin.weight
    if module in COLUMN_MODULES:
        lin.weight = param(tp.narrow(w.data, 0), w)
        if lin.bias is not None:
            lin.bias = param(tp.narrow(lin.bias.data, 0), lin.bias)
        lin.out_features = lin.weight.shape[0]
        return None
    lin.weight = param(tp.narrow(w.data, 1), w)
    lin.in_features = lin.weight.shape[1]
    bias, lin.bias = lin.bias, None
    return bias


def shard_model_(model: nn.Module, tp: TPGroup, runtime: LoraRuntime | None = None) -> dict[LayerModule, LoraLinear]:
    """Shards a full model's decoder layers in place for (tp.rank, tp.world_size) and installs the
    TP LoRA layers on every LoRA-targetable projection; returns them by (layer, module) like
    `install_lora` (the switcher and the ATMM backend take that dict). Use it INSTEAD of
    `install_lora` on a TP worker, or after it: projections that are already LoraLinears are
    unwrapped and their runtime reused (a plain LoraLinear has no all-reduce: a row-parallel
    projection under it would return partial sums). `runtime`: the LoraRuntime every layer shares
    (default: install_lora's, else a new one). World size 1: the same model with TP layers that
    communicate nothing. Every rank must hold the same full weights before the call."""
    text = _text_model(model)
    if any(isinstance(m, TP_LAYERS) for m in text.modules()):
        raise ValueError("model is already sharded")
    config = text.config
    check_divisible(config, tp)
    wrapped: dict[LayerModule, LoraLinear] = {}
    for i, layer in enumerate(text.layers):
        attn = layer.self_attn
        for module in TARGET_MODULES:
            parent = getattr(layer, module_parent(module))
            lin = getattr(parent, module)
            rt = runtime
            if isinstance(lin, LoraLinear):
                rt = rt or lin.runtime
                lin = lin.base
            rt = rt or LoraRuntime()
            runtime = rt  # one runtime for the whole model
            bias = _shard_linear_(lin, module, tp)
            if module in COLUMN_MODULES:
                new = ColumnParallelLoraLinear(lin, (i, module), rt, tp)
            else:
                new = RowParallelLoraLinear(lin, (i, module), rt, tp, bias)
            setattr(parent, module, new)
            wrapped[(i, module)] = new
        # Local head counts (the forward reshapes with -1 heads; GQA groups per rank are unchanged).
        attn.num_heads = config.num_attention_heads // tp.world_size
        attn.num_key_value_heads = (config.num_key_value_heads or config.num_attention_heads) // tp.world_size
    return wrapped


# -- state dicts ---------------------------------------------------------------------------------

_PROJ = re.compile(r"layers\.\d+\.(?:self_attn|mlp)\.(?P<module>[a-z_]+_proj)\.(?:base\.)?(?P<what>weight|bias)$")


def _shard_dim(name: str) -> int | None:
    """Dimension along which a decoder-projection tensor is sharded (None: replicated or not ours)."""
    m = _PROJ.search(name)
    if m is None:  # the vision tower's blocks are named blocks.N.attn.qkv / mlp.fc1: never matched
        return None
    module, what = m["module"], m["what"]
    if module in COLUMN_MODULES:
        return 0
    if module in ROW_MODULES:
        return 1 if what == "weight" else None
    return None


def shard_state_dict(state_dict: Mapping[str, torch.Tensor], tp: TPGroup) -> dict[str, torch.Tensor]:
    """The rank's slices of a full state dict (names kept): language-model projection weights and
    biases sharded as `shard_model_` shards them, everything else (vision tower, embeddings,
    norms, lm_head, row-parallel biases) as is. Accepts HF names and the `.base.` names of a
    LoRA-wrapped model; text-model-only names (`layers.N...`) too."""
    out = {}
    for name, t in state_dict.items():
        dim = _shard_dim(name)
        out[name] = t if dim is None else tp.narrow(t, dim)
    return out


def load_full_state_dict_(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], tp: TPGroup, strict: bool = True
) -> None:
    """Copies a FULL checkpoint's slices into a model already sharded by `shard_model_` (names of
    the unwrapped HF model; the TP layers' `.base.` is mapped, a row-parallel bias found under
    the projection's `.bias`)."""
    missing = []
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            src = name.replace(".base.", ".")
            if src not in state_dict:
                if name in state_dict:
                    src = name
                else:
                    missing.append(name)
                    continue
            full = state_dict[src]
            dim = _shard_dim(src)
            part = full if dim is None else tp.narrow(full, dim)
            if part.shape != t.shape:
                raise ValueError(
                    f"{name}: the checkpoint's shard is {tuple(part.shape)}, the model holds {tuple(t.shape)}"
                )
            t.copy_(part)
    # Non-persistent buffers (rotary inv_freq) are not in a state dict.
    persistent = set(model.state_dict())
    missing = [n for n in missing if n in persistent]
    if strict and missing:
        raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


# -- adapters ----------------------------------------------------------------------------------


def shard_lora(module: str, a: torch.Tensor, b: torch.Tensor, tp: TPGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's (A (in, r), B (r, out)) for this rank: column-parallel → (A, B[:, shard]),
    row-parallel → (A[shard, :], B)."""
    if module in COLUMN_MODULES:
        return a, tp.narrow(b, 1)
    if module in ROW_MODULES:
        return tp.narrow(a, 0), b
    raise ValueError(f"unknown module {module!r}")


def shard_lora_dicts(
    a: Mapping[LayerModule, torch.Tensor], b: Mapping[LayerModule, torch.Tensor], tp: TPGroup
) -> tuple[dict, dict]:
    out_a, out_b = {}, {}
    for key in a:
        out_a[key], out_b[key] = shard_lora(key[1], a[key], b[key], tp)
    return out_a, out_b


def shard_adapter(weights: AdapterWeights, tp: TPGroup) -> AdapterWeights:
    """The rank's copy of an adapter (validated at full shape by `parse_bundle` first); task heads
    read the replicated hidden state and stay whole. Put it in the rank's AdapterPool as usual."""
    a, b = shard_lora_dicts(weights.a, weights.b, tp)
    return dataclasses.replace(weights, a=a, b=b)


def local_features(shapes: BaseModelShapes, tp: TPGroup) -> dict[str, tuple[int, int]]:
    """Per-rank (in, out) of each projection: what the rank's ATMM tables must hold."""
    out = {}
    for module, (fin, fout) in shapes.features.items():
        if module in COLUMN_MODULES:
            out[module] = (fin, tp.part(fout, module)[1])
        else:
            out[module] = (tp.part(fin, module)[1], fout)
    return out


__all__ = [
    "COLUMN_MODULES",
    "ROW_MODULES",
    "ColumnParallelLoraLinear",
    "RowParallelLoraLinear",
    "check_divisible",
    "load_full_state_dict_",
    "local_features",
    "shard_adapter",
    "shard_lora",
    "shard_lora_dicts",
    "shard_model_",
    "shard_state_dict",
]
