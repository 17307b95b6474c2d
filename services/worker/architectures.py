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
  model load as they are, in every key layout transformers has given the family (adapter_format's
  KEY_LAYOUTS, by `model_type`: transformers 4 had Qwen2-VL's LM under `model.`, LLaVA's under
  `language_model.model.`), their vision tower's LoRA weights ignored with a warning;
- the prefill's positions (3 axes a token, the engine's layout) come from `rope_positions`: for an
  M-RoPE family HF's own `model.model.get_rope_index`, given the processor outputs the family lists
  in `rope_inputs`; for a 1-D RoPE family (LLaVA's Llama) 0..n-1 a row on every axis, delta 0, and
  the graphs hand the language model one axis (`mrope`).

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
    # (LLaVA: HF's LlavaProcessor, which loads here as it is)
    processor_class: str
    # Whether vision_tower.VisionTower's forward (Qwen2-VL's tower math, a CUDA graph per grid) is
    # this family's tower; otherwise HF's own runs, eagerly (vision_tower.HFVisionTower).
    graphed_tower: bool
    # The processor outputs the family's get_rope_index takes besides the token ids and types
    # (model_runner.ModelRunner._inputs concatenates each over a batch's rows).
    rope_inputs: tuple[str, ...]
    # M-RoPE (Qwen2-VL's 3-axis positions from get_rope_index, a rope delta a row) or, False, plain
    # 1-D RoPE (Llama's: positions 0..n-1, position_ids (batch, tokens) for the language model).
    mrope: bool = True
    # Whether the language model takes `attention_mask` as a mapping of one mask per layer type
    # (Qwen2's: the graphs pass {type: None}). Llama's builds its causal mask from whatever it is
    # given, so the engine's attention is registered for it without a mask function and HF builds
    # none (its paged forwards read the pool through block tables: attention.py).
    mask_mapping: bool = True
    # Whether HF's get_image_features takes the images' grids (Qwen's patch rows) or pixel images
    # of one fixed size only (LLaVA's CLIP: one (C, H, W) row an image, vision.vision_items).
    tower_grids: bool = True
    # Whether tensor parallelism (tensor_parallel.py) is implemented and tested for the family;
    # a tp_size > 1 worker of another is refused at start-up (`check_tensor_parallel`).
    tensor_parallel: bool = True
    # The tiny model's shape (tiny_model.py, fixed seed): `text` and `vision` config fields of the
    # family's config class, and the processor's (min, max) pixels (LLaVA: its image size).
    tiny: dict = field(default_factory=dict)

    @property
    def hf_model(self):
        """The transformers model class."""
        import transformers  # the registry itself loads no torch

        return getattr(transformers, self.hf_class)

    @property
    def hf_config(self):
        """The transformers config class."""
        import transformers

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
        text=dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            mrope_section=[4, 6, 6],
        ),
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
        vision=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            out_hidden_size=128,
            hidden_act="silu",
            window_size=56,
            fullatt_block_indexes=[1],
            tokens_per_second=2,
        ),
        pixels=QWEN2_VL.tiny["pixels"],
    ),
)

# LLaVA-1.5: CLIP ViT (336 px, patch 14: 576 image tokens; the features of its second-last layer
# without the CLS token) + a 2-layer GELU projector + a Llama language model with 1-D RoPE; its
# processor is LlavaProcessor with a CLIPImageProcessor, its chat format "USER: <image>\n... ASSISTANT:"
# (llava.py). HF's own tower runs, eagerly; no videos, no tensor parallelism (refused).
LLAVA_1_5 = Architecture(
    name="llava-1.5",
    hf_class="LlavaForConditionalGeneration",
    model_type="llava",
    config_class="LlavaConfig",
    processor_class="LlavaProcessor",
    graphed_tower=False,
    rope_inputs=(),
    mrope=False,
    mask_mapping=False,
    tower_grids=False,
    tensor_parallel=False,
    tiny=dict(
        text=dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
        ),
        # 56 px images of 14 px patches: 16 image tokens (the CLS token dropped)
        vision=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            image_size=56,
            patch_size=14,
            projection_dim=64,
        ),
    ),
)

ARCHITECTURES: dict[str, Architecture] = {a.hf_class: a for a in (QWEN2_VL, QWEN2_5_VL, LLAVA_1_5)}


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


def check_tensor_parallel(arch: Architecture, world_size: int) -> None:
    """ValueError naming the family unless it may be served over `world_size` ranks."""
    if world_size > 1 and not arch.tensor_parallel:
        raise ValueError(
            f"tensor parallelism ({world_size} ranks) is not supported for {arch.name} "
            f"({arch.hf_class}); serve it on one device (tp_size 1)"
        )


def language_model(model):
    """The language model (embeddings, decoder layers, final norm) of a served model."""
    return model.model.language_model


def rope_positions(model, input_ids, mm_token_type_ids, attention_mask, **rope_inputs):
    """(positions (3, batch, width), rope deltas (batch,)) of right-padded rows (`attention_mask`
    1 on each row's tokens): HF's get_rope_index for an M-RoPE family; for a 1-D one each row's
    0..n-1 on all three axes (the graphs take one) and deltas 0."""
    if for_model(model).mrope:
        return model.model.get_rope_index(
            input_ids, mm_token_type_ids=mm_token_type_ids, attention_mask=attention_mask, **rope_inputs
        )
    import torch

    positions = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)
    return positions[None].expand(3, -1, -1), torch.zeros(input_ids.shape[0], dtype=torch.long)
