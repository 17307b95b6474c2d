"""Model directories of the served families (architectures.py) built locally with a fixed seed
(no downloads).

`ensure_tiny_model(path)` writes a tiny but real `Qwen2VLForConditionalGeneration` (2 text layers,
hidden 128, 2 vision blocks: the family entry's `tiny` shape; `arch=` another family's), a
byte-level BPE tokenizer trained on a small built-in corpus with Qwen2-VL's special tokens, and
the family's image-only processor using the PIL image processor (56x56 -> 4 image tokens,
112x112 -> 16). Everything loads back with `from_pretrained(path)` /
`AutoProcessor.from_pretrained(path)`.

`ensure_shape_model(path, "qwen2-vl-7b")` writes the same tokenizer and processor (with Qwen2-VL's
own pixel bounds: 448x448 -> 256 image tokens) and the config of a full-size architecture, but no
weights: the worker loads it with `load_format="dummy"` (random weights on the device, like
vLLM's `--load-format dummy`), for benchmarks and GPU tests at the real shape.

A tiny LLaVA-1.5 (`arch="llava-1.5"`, llava.py) has the same trained BPE with Llama's special
tokens (`<s>` put before every text, `</s>` its end) and `<image>`, a CLIP tower of 56 px images
(16 image tokens) and LlavaProcessor with CLIP's image processing and llava-hf's chat template.

Run as `python -m services.worker.tiny_model PATH [ARCH]`: ARCH `tiny` (Qwen2-VL's tiny model),
a family's name for its tiny model (`qwen2.5-vl`, `llava-1.5`), or a full-size shape of SHAPES.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from services.worker.architectures import Architecture, by_name

DEFAULT_TINY_MODEL_PATH = Path("~/.cache/valora/tiny-qwen2-vl")

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
BPE_VOCAB_SIZE = 1000  # trained tokens (bytes + merges); specials come after

# Full-size architectures (random weights): text and vision dimensions of the released models.
SHAPES = {
    "qwen2-vl-7b": dict(
        family="qwen2-vl",
        text=dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=32768,
            mrope_section=[16, 24, 24],
        ),
        vision=dict(depth=32, embed_dim=1280, hidden_size=3584, num_heads=16, mlp_ratio=4),
        pixels=(56 * 56, 28 * 28 * 1280),  # Qwen2-VL's processor bounds
    ),
    # Issue 10's 13B shape for tensor parallelism: Llama-2-13B's decoder dimensions with Qwen2-VL's
    # vocabulary, M-RoPE and 7B vision tower (merging into the 5120-wide language model).
    "qwen2-vl-13b-like": dict(
        family="qwen2-vl",
        text=dict(
            vocab_size=152064,
            hidden_size=5120,
            intermediate_size=13824,
            num_hidden_layers=40,
            num_attention_heads=40,
            num_key_value_heads=40,
            max_position_embeddings=32768,
            mrope_section=[16, 24, 24],
        ),
        vision=dict(depth=32, embed_dim=1280, hidden_size=5120, num_heads=16, mlp_ratio=4),
        pixels=(56 * 56, 28 * 28 * 1280),
    ),
    "qwen2-vl-2b": dict(
        family="qwen2-vl",
        text=dict(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            mrope_section=[16, 24, 24],
        ),
        vision=dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4),
        pixels=(56 * 56, 28 * 28 * 1280),
    ),
    "qwen2.5-vl-7b": dict(
        family="qwen2.5-vl",
        text=dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=128000,
            mrope_section=[16, 24, 24],
        ),
        vision=dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=3584,
            hidden_act="silu",
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
            tokens_per_second=2,
        ),
        pixels=(56 * 56, 28 * 28 * 16384),  # Qwen2.5-VL's processor bounds
    ),
    # LLaVA-1.5-7B: Vicuna-7B (Llama-2-7B's decoder, 32000 tokens + <image> + <pad>, padded to 32064)
    # and CLIP ViT-L/14 at 336 px (576 image tokens).
    "llava-1.5-7b": dict(
        family="llava-1.5",
        text=dict(
            vocab_size=32064,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
        ),
        vision=dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            image_size=336,
            patch_size=14,
            projection_dim=768,
        ),
    ),
}

# Qwen2-VL's chat template (Qwen2.5-VL's is the same) (default system turn, images as vision_start/pad/end).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """\
You are a helpful assistant. Describe the image. What is in this picture? How many cars are there?
A photo of a red car parked on the street next to a tree. Two people are walking a dog in the park.
The traffic light is green. There are three bicycles and a bus. Is the person wearing a hat? Yes, no.
Count the objects in the scene. The cat sits on the table near the window. A yellow taxi drives by.
Classify the action: running, walking, sitting, standing, jumping, cycling, driving, eating.
The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000.
Answer the question about the video frame. What color is the truck? Blue. Where is the camera?
Ünïcödé téxt, 漢字, émojis 🚗🚲🐱 and punctuation: ,.;:!?'"()[]{}<>-_=+*/\\|@#$%^&~`
"""


def _build_tokenizer(
    specials: tuple[str, ...] = SPECIAL_TOKENS,
    eos: str = "<|im_end|>",
    pad: str = "<|endoftext|>",
    bos: str | None = None,
):
    """The byte-level BPE tokenizer trained on _CORPUS, with `specials` after the trained tokens
    (Qwen2-VL's by default); `bos`: a token put before every encoded text (Llama's `<s>`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.add_special_tokens(list(specials))
    if bos is not None:
        template = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
        tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        pad_token=pad,
        unk_token=None,
        bos_token=bos,
        model_max_length=32768,
    )
    fast.padding_side = "left"
    return fast


def _build_config(tokenizer, shape: dict, arch: Architecture):
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(shape["text"])
    mrope = text.pop("mrope_section")
    text.setdefault("vocab_size", ((len(tokenizer) + 63) // 64) * 64)
    text_config = dict(
        **text,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision_config = dict(**shape["vision"], in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    return arch.hf_config(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def _generation_config(tokenizer):
    from transformers import GenerationConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"],
        do_sample=False,
    )


def _build_processor(tokenizer, pixels: tuple[int, int], arch: Architecture):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from services.worker.processor import processor_class

    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=pixels[0], max_pixels=pixels[1], patch_size=14, temporal_patch_size=2, merge_size=2
    )
    # The stock video processor needs torchvision (not importable here): the family's image-only one.
    return processor_class(arch)(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def _family_files(shape: dict, family: Architecture):
    """(tokenizer, config, generation config, processor) of a family's model of `shape`."""
    if family.model_type == "llava":
        from services.worker import llava  # it imports torch

        tokenizer = _build_tokenizer(llava.SPECIAL_TOKENS, eos="</s>", pad="<pad>", bos="<s>")
        vision = shape["vision"]
        return (
            tokenizer,
            llava.tiny_config(tokenizer, shape, family),
            llava.tiny_generation_config(tokenizer),
            llava.tiny_processor(tokenizer, vision["image_size"], vision["patch_size"]),
        )
    tokenizer = _build_tokenizer()
    return (
        tokenizer,
        _build_config(tokenizer, shape, family),
        _generation_config(tokenizer),
        _build_processor(tokenizer, shape["pixels"], family),
    )


def build_tiny_model(seed: int = 0, arch: str = "qwen2-vl"):
    """Returns (model, processor) of the family `arch`'s tiny shape (architectures.py), built in
    memory; deterministic for a given seed."""
    import torch

    family = by_name(arch)
    _, config, generation_config, processor = _family_files(family.tiny, family)
    torch.manual_seed(seed)
    model = family.hf_model(config).eval()
    model.generation_config = generation_config
    return model, processor


def ensure_tiny_model(path: Path | str, arch: str = "qwen2-vl") -> Path:
    """Builds the tiny model of the family `arch` into `path` unless `path/config.json` already
    exists; returns the path."""

    def write(tmp: Path) -> None:
        model, processor = build_tiny_model(arch=arch)
        processor.save_pretrained(tmp)
        model.save_pretrained(tmp)

    return _write_atomically(Path(path).expanduser(), write)


def ensure_shape_model(path: Path | str, arch: str) -> Path:
    """Writes a weightless model directory of a full-size architecture (one of SHAPES) unless
    `path/config.json` exists: config + generation config + tokenizer + processor. Load it with
    the worker's `load_format="dummy"`."""
    if arch not in SHAPES:
        raise ValueError(f"unknown architecture {arch!r}; known: {sorted(SHAPES)}")

    shape = SHAPES[arch]
    family = by_name(shape["family"])

    def write(tmp: Path) -> None:
        _, config, generation_config, processor = _family_files(shape, family)
        config.save_pretrained(tmp)
        generation_config.save_pretrained(tmp)
        processor.save_pretrained(tmp)

    return _write_atomically(Path(path).expanduser(), write)


def _write_atomically(path: Path, write) -> Path:
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))  # unique per builder
    try:
        write(tmp)
        if path.exists() and not (path / "config.json").exists():
            shutil.rmtree(path, ignore_errors=True)  # a partial directory from a crashed build
        try:
            tmp.rename(path)  # atomic: readers see a complete model or none
        except OSError:
            if not (path / "config.json").exists():  # not a concurrent builder winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main(argv: list[str]) -> int:
    target = Path(argv[1]) if len(argv) > 1 else DEFAULT_TINY_MODEL_PATH
    arch = argv[2] if len(argv) > 2 else "tiny"
    if arch in SHAPES:
        print(ensure_shape_model(target, arch))
    else:
        print(ensure_tiny_model(target, "qwen2-vl" if arch == "tiny" else arch))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
