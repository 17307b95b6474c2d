"""The engine's model: loaded (whole, dummy, or this tensor-parallel rank's shard), every target
projection LoRA-aware (lora.py), q/k/v and gate/up grouped over the fused decoder layers
(fused_layers.py), and the multi-LoRA term on ATMM where it runs (atmm_backend.py), with the
shrink folded into the base GEMMs (`lora_fold_rows` spare weight rows per projection)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from services.common.adapter_format import BaseModelShapes
from services.worker.architectures import architecture_of, check_tensor_parallel
from services.worker.atmm_backend import AtmmBackend
from services.worker.attention import use_grouped_decode_attention, use_shape_free_sdpa
from services.worker.fused_layers import install_fused_layers
from services.worker.lora import LoraRuntime, install_lora, install_lora_groups
from services.worker.model import load_model, load_sharded_model
from services.worker.tensor_parallel import TPGroup
from services.worker.tp_sharding import local_features, shard_model_

log = structlog.get_logger()


@dataclass
class LoraModel:
    model: torch.nn.Module
    runtime: LoraRuntime  # the step's LoRA plan and kernel backend, read by every LoRA layer
    lora_layers: dict  # (layer, module) -> its LoraLinear
    shapes: BaseModelShapes  # the full model's projection shapes (adapter validation)
    model_config: dict  # config.json
    eos_ids: set[int]


def load_lora_model(path: Path, config, device: torch.device, dtype: torch.dtype, tp: TPGroup | None) -> LoraModel:
    """`config`: the EngineConfig (load_format, fused_layers, use_atmm, lora_fold_rows)."""
    runtime = LoraRuntime()
    arch = architecture_of(path)
    check_tensor_parallel(arch, tp.world_size if tp is not None else 1)
    if tp is not None and config.load_format == "auto":  # the rank's shard, never the whole model
        model, lora_layers = load_sharded_model(path, device, dtype, tp, runtime)
    else:
        model = load_model(path, device, dtype, config.load_format)
        lora_layers = install_lora(model, runtime) if tp is None else shard_model_(model, tp, runtime)
    use_grouped_decode_attention(model.config.text_config, masks=arch.mask_mapping)
    if use_shape_free_sdpa(device):
        log.info("sdpa_backends", cudnn=False, why="per-shape host cost (services/worker/attention.py)")
    model_config = json.loads((path / "config.json").read_text())
    shapes = BaseModelShapes.from_config(model_config)
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
    eos_ids = set(eos) | {model.config.text_config.eos_token_id} - {None}
    features = shapes.features if tp is None else local_features(shapes, tp)
    groups = {}
    if config.fused_layers:  # its forward runs q/k/v and gate/up as one linear each (lora.LoraGroup)
        groups = install_lora_groups(model, lora_layers, runtime)
        install_fused_layers(model)
    if config.use_atmm and AtmmBackend.available(device, dtype):
        runtime.backend = AtmmBackend(
            {k: features[k[1]] for k in lora_layers}, device, dtype, groups={k: g.part_keys for k, g in groups.items()}
        )
        if config.lora_fold_rows > 0 and tp is None:  # the projections the forward calls
            in_groups = {k for g in groups.values() for k in g.part_keys}
            folded = {**groups, **{k: m for k, m in lora_layers.items() if k not in in_groups}}
            for m in folded.values():
                m.reserve_lora_rows(config.lora_fold_rows)
            runtime.backend.enable_fold(folded, config.lora_fold_rows)
    log.info("multi_lora_op", op="atmm" if runtime.backend is not None else "torch_reference")
    return LoraModel(model, runtime, lora_layers, shapes, model_config, eos_ids)
