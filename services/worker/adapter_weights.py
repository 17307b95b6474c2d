"""An adapter version's weights on a worker, and parsing them from a PEFT bundle.

A bundle (services/common/adapter_format.py) stores lora_A (r, in) and lora_B (out, r); we
transpose once at load into A (in, r), B (r, out), the multi-LoRA op's layout, at exact rank.
The host and device copies of them are the adapter pool's (adapter_pool.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog
import torch
from safetensors.torch import load as load_safetensors

from services.common.adapter_format import TARGET_MODULES, BaseModelShapes, validate_bundle

LayerModule = tuple[int, str]  # (layer index, module name e.g. "q_proj")
log = structlog.get_logger()


@dataclass
class AdapterWeights:
    """One adapter version in host memory, in the multi-LoRA op's layout."""

    name: str  # "adapters/{a}/versions/{v}"
    sha256: str
    rank: int
    scale: float  # lora_alpha / r (rsLoRA: / sqrt(r))
    a: dict[LayerModule, torch.Tensor]  # (in, r)
    b: dict[LayerModule, torch.Tensor]  # (r, out)
    heads: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    labels: dict[str, list[str]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))
        for w, b in self.heads.values():
            n += w.numel() * w.element_size() + (b.numel() * b.element_size() if b is not None else 0)
        return n

    def head_labels(self, head: str) -> list[str]:
        w, _ = self.heads[head]
        labels = self.labels.get(head) or []
        if len(labels) != w.shape[0]:
            labels = [f"label_{i}" for i in range(w.shape[0])]
        return labels


def parse_bundle(
    name: str,
    sha256: str,
    data: bytes,
    config_json: str,
    shapes: BaseModelShapes,
    max_rank: int = 256,
    head_labels: dict[str, list[str]] | None = None,
) -> AdapterWeights:
    """Validates a bundle against the base model and loads it (host memory, fp32 kept as stored).
    Its tensors are read by the names validation found them under (any key layout of the family,
    adapter_format.KEY_LAYOUTS); LoRA weights of the vision tower are left out, with a warning."""
    info = validate_bundle(data, config_json, shapes, max_rank)
    if info.ignored:
        log.warning(
            "adapter_vision_lora_ignored",
            adapter=name,
            modules=list(info.ignored),
            why="valora applies LoRA to the language model only",
        )
    tensors = load_safetensors(data)
    a: dict[LayerModule, torch.Tensor] = {}
    b: dict[LayerModule, torch.Tensor] = {}
    for layer in info.layers:  # in the order a bundle of LM_PREFIX's layout always had
        for module in TARGET_MODULES:
            if (layer, module, "A") in info.keys:
                a[(layer, module)] = tensors[info.keys[(layer, module, "A")]].t().contiguous()
                b[(layer, module)] = tensors[info.keys[(layer, module, "B")]].t().contiguous()
    heads = {}
    for head in info.heads:
        heads[head] = (tensors[f"heads.{head}.weight"], tensors.get(f"heads.{head}.bias"))
    return AdapterWeights(
        name=name,
        sha256=sha256,
        rank=info.rank,
        scale=info.scale,
        a=a,
        b=b,
        heads=heads,
        labels=dict(head_labels or {}),
    )
