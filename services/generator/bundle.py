"""Export a generated adapter as a valora bundle (services/common/adapter_format.py layout).

Tensors: `lora_key(layer, module, "A"|"B")` for every LoRA slot (A (r, in), B (out, r), float32)
and `heads.{task}.weight` (labels, hidden) / `heads.{task}.bias` (labels,) for each head task. A
text task (datasets.TEXT) has no tensors of its own: it is served by the LoRA alone, as plain
generation, so an adapter of text tasks only is a plain PEFT LoRA with no heads. The config is
PEFT's adapter_config.json with r and lora_alpha such that lora_alpha / r is the scale used in
training.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save

from services.common.adapter_format import lora_key
from services.generator.training import AdapterState


@dataclass(frozen=True)
class Bundle:
    """What `ValoraClient.upload_adapter_version` takes: bytes, config JSON, heads' labels; and
    `tasks`, every task the adapter serves in fusion order (head tasks and text tasks; empty: its
    heads')."""

    name: str
    data: bytes
    config_json: str
    heads: dict[str, list[str]]
    tasks: tuple[str, ...] = ()

    @property
    def served_tasks(self) -> tuple[str, ...]:
        return self.tasks or tuple(self.heads)

    def write(self, out_dir: Path) -> Path:
        d = Path(out_dir) / self.name
        d.mkdir(parents=True, exist_ok=True)
        (d / "adapter_model.safetensors").write_bytes(self.data)
        (d / "adapter_config.json").write_text(self.config_json)
        (d / "heads.json").write_text(json.dumps(self.heads, indent=2))
        return d


def export_bundle(
    name: str,
    state: AdapterState,
    labels: dict[str, tuple[str, ...]],
    rank: int,
    lora_alpha: float,
    base_model: str = "",
) -> Bundle:
    tensors: dict[str, np.ndarray] = {}
    modules: list[str] = []
    for (layer, module), (a, b) in sorted(state.lora.items()):
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"layer {layer} {module}: rank {a.shape[0]}, expected {rank}")
        tensors[lora_key(layer, module, "A")] = a.detach().float().contiguous().numpy()
        tensors[lora_key(layer, module, "B")] = b.detach().float().contiguous().numpy()
        if module not in modules:
            modules.append(module)
    heads: dict[str, list[str]] = {}
    for task, (w, bias) in state.heads.items():
        tensors[f"heads.{task}.weight"] = w.detach().float().contiguous().numpy()
        tensors[f"heads.{task}.bias"] = bias.detach().float().contiguous().numpy()
        heads[task] = list(labels[task])
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": float(lora_alpha),
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": modules,
        "base_model_name_or_path": base_model,
    }
    return Bundle(
        name, save(tensors, metadata={"format": "valora-adapter"}), json.dumps(config), heads, tuple(state.tasks)
    )
