"""A tiny but real Qwen2-VL, built locally with a fixed seed (no downloads).

`ensure_tiny_model(path)` writes a `Qwen2VLForConditionalGeneration` (2 text layers, hidden 128,
2 vision blocks), a byte-level BPE tokenizer trained on a small built-in corpus with Qwen2-VL's
special tokens, and a `Qwen2VLProcessor` using the PIL image processor (56x56 -> 4 image
tokens, 112x112 -> 16). Everything loads back with `from_pretrained(path)` /
`AutoProcessor.from_pretrained(path)`. Run as `python -m services.worker.tiny_model PATH`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

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
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112

# Qwen2-VL's chat template (default system turn, images as vision_start/pad/end).
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


def _build_tokenizer():
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
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=32768,
    )
    fast.padding_side = "left"
    return fast


def build_tiny_model(seed: int = 0):
    """Returns (model, processor) built in memory; deterministic for a given seed."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from services.worker.processor import ImageQwen2VLProcessor

    tokenizer = _build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = ((len(tokenizer) + 63) // 64) * 64
    text_config = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision_config = dict(
        depth=2, embed_dim=64, hidden_size=128, num_heads=4, mlp_ratio=2, in_channels=3,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
    )
    config = Qwen2VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.bos_token_id = ids["<|endoftext|>"]
    model.generation_config.do_sample = False

    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    # Qwen2-VL's own video processor needs torchvision (not importable here); we serve images.
    processor = ImageQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                      chat_template=CHAT_TEMPLATE)
    return model, processor


def ensure_tiny_model(path: Path | str) -> Path:
    """Builds the tiny model into `path` unless `path/config.json` already exists; returns the path."""
    path = Path(path).expanduser()
    if (path / "config.json").exists():
        return path
    model, processor = build_tiny_model()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))  # unique per builder
    try:
        processor.save_pretrained(tmp)
        model.save_pretrained(tmp)
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
    print(ensure_tiny_model(target))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
