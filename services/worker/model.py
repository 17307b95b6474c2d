"""The model a worker serves: loading it (weights + processor) and turning requests into inputs.

Import `build_inputs` from here (the e2e test's reference does); importing this module also
registers the image-only Qwen2-VL processor, so `AutoProcessor.from_pretrained(model_dir)`
loads the tiny model's processor.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, GenerationConfig, PreTrainedModel

from services.worker.architectures import architecture_of
from services.worker.processor import ImageQwen2VLProcessor, build_inputs, chat_text, load_processor
from services.worker.tiny_model import DEFAULT_TINY_MODEL_PATH, ensure_shape_model, ensure_tiny_model

__all__ = [
    "DEFAULT_TINY_MODEL_PATH",
    "LOAD_FORMATS",
    "ImageQwen2VLProcessor",
    "build_inputs",
    "chat_text",
    "ensure_shape_model",
    "ensure_tiny_model",
    "load_model",
    "load_processor",
    "load_sharded_model",
]


LOAD_FORMATS = ("auto", "dummy")


def load_model(
    path: Path | str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    load_format: str = "auto",
    seed: int = 0,
) -> PreTrainedModel:
    """The model of a local directory, of one of the served families (architectures.py; any
    other is refused). `load_format="dummy"` ignores any weight files and builds the directory's
    architecture with random weights (fixed seed) directly on `device` — for benchmarks and tests
    at full-size shapes without a checkpoint (as vLLM's dummy format)."""
    path = Path(path).expanduser()
    cls = architecture_of(path).hf_model
    if load_format == "auto":
        model = cls.from_pretrained(str(path), dtype=dtype)
        return model.to(device).eval()
    if load_format != "dummy":
        raise ValueError(f"load_format {load_format!r} is not one of {LOAD_FORMATS}")
    config = AutoConfig.from_pretrained(str(path))
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls._from_config(config, dtype=dtype)
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    return model.eval()


class _Checkpoint(Mapping):
    """A directory's safetensors weights by the MODEL's parameter names (transformers' own
    checkpoint-key renamings applied), each tensor read from its file when asked for."""

    def __init__(self, path: Path, model: nn.Module) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key

        transforms = get_model_conversion_mapping(model)
        if any(isinstance(t, WeightConverter) for t in transforms):  # tensors merged/split on load
            raise NotImplementedError(f"{type(model).__name__}'s checkpoint format needs converters")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        meta = model.state_dict()
        self._files = [safe_open(str(f), "pt") for f in files]  # headers parsed once; tensors read on demand
        self._where: dict[str, tuple[int, str]] = {}
        for i, st in enumerate(self._files):
            for key in st.keys():
                name, _ = rename_source_key(key, transforms, [], model.base_model_prefix, meta)
                self._where[name] = (i, key)

    def __getitem__(self, name: str) -> torch.Tensor:
        i, key = self._where[name]
        return self._files[i].get_tensor(key)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_sharded_model(path: Path | str, device: str | torch.device, dtype: torch.dtype, tp, runtime=None):
    """A tensor-parallel rank's model from a checkpoint directory without ever holding the whole
    model: built on the meta device, sharded (`tp_sharding.shard_model_`), materialised on
    `device`, then filled tensor by tensor from the safetensors files (one full tensor in host
    memory at a time, sliced to the rank's part). Returns (model, shard_model_'s LoRA layers)."""
    from services.worker.tp_sharding import load_full_state_dict_, shard_model_

    path = Path(path).expanduser()
    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = architecture_of(path).hf_model._from_config(config, dtype=dtype)
    checkpoint = _Checkpoint(path, model)
    layers = shard_model_(model, tp, runtime)
    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():  # non-persistent buffers (rotary inv_freq): recomputed by HF's init
            if module._non_persistent_buffers_set:
                model._init_weights(module)
    load_full_state_dict_(model, checkpoint, tp)
    model.tie_weights()
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    return model.eval(), layers
