"""The model families a worker serves: one entry per family, naming what the engine needs to
know of it beyond the HF model it loads, so family-specific choices are made here, not spread
over the engine as checks of the model's class.

A model directory's family is the first served class its config.json's `architectures` lists
(its `model_type` when it lists none); `architecture_of(path)` refuses any other at start-up,
naming the directory's architecture and the supported ones. What
every served family shares is not an entry's field:

- the language model is `model.model.language_model` (transformers 5's layout of every
  ForConditionalGeneration here: `language_model`); its decoder layers' LoRA projections are
  q/k/v/o_proj and gate/up/down_proj (`adapter_format.TARGET_MODULES`: the adapter format, the
  store's validation and the TP partitioning all name them), so PEFT adapters trained on the HF
  model load as they are;
- the M-RoPE positions come from HF's own `model.model.get_rope_index`, given the processor
  outputs the family lists in `rope_inputs`.

Importing this module loads neither torch nor transformers (config.py imports tiny_model, which
builds its configs from these entries); the classes are resolved by name when asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Architecture:
    name: str  # the family's name in logs and errors
    hf_class: str  # the transformers class, as config.json's `architectures` names it
    model_type: str  # config.json's `model_type`
    config_class: str  # the transformers config class tiny_model builds
    # valora's image-only processor class of the family (processor.py: the stock one's video
    # processor needs torchvision), saved with the tiny model and the fallback for a checkpoint's
    processor_class: str
    # Whether vision_tower.VisionTower's forward (Qwen2-VL's tower math, a CUDA graph per grid) is
    # this family's tower; otherwise HF's own runs, eagerly (vision_tower.HFVisionTower).
    graphed_tower: bool
    # The processor outputs the family's get_rope_index takes besides the token ids and types
    # (model_runner.ModelRunner._inputs concatenates each over a batch's rows).
    rope_inputs: tuple[str, ...]
    # The tiny model's shape (tiny_model.py, fixed seed): `text` and `vision` config fields of the
    # family's config class, and the processor's (min, max) pixels.
    tiny: dict = field(default_factory=dict)

    @property
    def hf_model(self):
        """The transformers model class."""
        import transformers  # noqa: PLC0415 - the registry itself loads no torch

        return getattr(transformers, self.hf_class)

    @property
    def hf_config(self):
        """The transformers config class."""
        import transformers  # noqa: PLC0415

        return getattr(transformers, self.config_class)


QWEN2_VL = Architecture(
    name="qwen2-vl",
    hf_class="Qwen2VLForConditionalGeneration",
    model_type="qwen2_vl",
    config_class="Qwen2VLConfig",
    processor_class="ImageQwen2VLProcessor",
    graphed_tower=True,
    rope_inputs=("image_grid_thw", "video_grid_thw"),
    tiny=dict(
        text=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, mrope_section=[4, 6, 6]),
        vision=dict(depth=2, embed_dim=64, hidden_size=128, num_heads=4, mlp_ratio=2),
        pixels=(56 * 56, 112 * 112),
    ),
)

# Qwen2-VL's language model (Qwen2 with M-RoPE) and processor; its vision tower has window
# attention (full attention in `fullatt_block_indexes` only), RMSNorm and a gated SiLU MLP, which
# VisionTower's forward does not compute. Its rope index spaces a video's temporal positions by
# `tokens_per_second` x the seconds a temporal patch spans (`second_per_grid_ts`; an image's by 1).
QWEN2_5_VL = Architecture(
    name="qwen2.5-vl",
    hf_class="Qwen2_5_VLForConditionalGeneration",
    model_type="qwen2_5_vl",
    config_class="Qwen2_5_VLConfig",
    processor_class="ImageQwen2_5_VLProcessor",
    graphed_tower=False,
    rope_inputs=("image_grid_thw", "video_grid_thw", "second_per_grid_ts"),
    tiny=dict(
        text=QWEN2_VL.tiny["text"],
        # windows of 2x2 merged tokens (56 px): a 112 px image has 4, an 84 px one 4 of 3 sizes
        vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
                    hidden_act="silu", window_size=56, fullatt_block_indexes=[1], tokens_per_second=2),
        pixels=QWEN2_VL.tiny["pixels"],
    ),
)

ARCHITECTURES: dict[str, Architecture] = {a.hf_class: a for a in (QWEN2_VL, QWEN2_5_VL)}


def supported() -> str:
    """The supported families, for error messages."""
    return ", ".join(f"{a.hf_class} ({a.name})" for a in ARCHITECTURES.values())


def by_name(name: str) -> Architecture:
    """The entry of a family name (`qwen2-vl`) or HF class name."""
    for a in ARCHITECTURES.values():
        if name in (a.name, a.hf_class):
            return a
    raise ValueError(f"unknown architecture {name!r}; supported: {supported()}")


def architecture_of(path: Path | str) -> Architecture:
    """The family of a model directory (its config.json); ValueError naming the directory's
    architecture and the supported ones for any other (the worker refuses it at start-up)."""
    path = Path(path).expanduser()
    config = json.loads((path / "config.json").read_text())
    names = config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if not names:
        for a in ARCHITECTURES.values():
            if config.get("model_type") == a.model_type:
                return a
    got = names[0] if names else config.get("model_type", "no architectures or model_type")
    raise ValueError(f"{path}: architecture {got!r} is not supported; supported: {supported()}")


def for_model(model) -> Architecture:
    """The entry of a loaded model (its class)."""
    name = type(model).__name__
    if name not in ARCHITECTURES:
        raise ValueError(f"model class {name!r} is not supported; supported: {supported()}")
    return ARCHITECTURES[name]


def language_model(model):
    """The language model (embeddings, decoder layers, final norm) of a served model."""
    return model.model.language_model
