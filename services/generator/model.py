"""The base model as the generator sees it: a frozen Qwen2-VL with LoRA slots and task heads.

What a task head reads (the contract valora's workers implement too): the request's chat text
(default system turn, one user turn = image placeholder(s) + prompt, then `<|im_start|>assistant\\n`,
see `chat_text`), run through the full model with the adapter's LoRA applied to the language
model's q,k,v,o,gate,up,down projections (`y = W x + (lora_alpha/r) * B A x`), and the
*final-norm hidden state of the last prompt token* (`model.model(...).last_hidden_state[:, -1]`)
fed to `logits = heads.{name}.weight @ h + heads.{name}.bias`.

Training never changes the vision tower, so image features are computed once per image
(`encode_images`) and the language model runs on cached embeddings (`head_features`); a test
checks this equals the full model run on pixel values.

The model runs on `device` in `dtype` (a GPU in bfloat16 for real training; the CPU in float32 for
the tests): the frozen weights, cached features and activations take `dtype`, while the LoRA
factors stay float32 parameters on the device (master weights, cast to the activations' dtype in
the forward) and everything the caller keeps — LoRA weights read back, heads, hidden states fed to
heads — is float32; adapters read back (`read_lora`) are host tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from services.common.adapter_format import ATTENTION_MODULES, TARGET_MODULES

SYSTEM_PROMPT = "You are a helpful assistant."
VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"


def chat_text(prompt: str, num_images: int = 1) -> str:
    """Qwen2-VL's chat format for one user turn (images first, then the prompt) + assistant start;
    byte-for-byte the worker's request format."""
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{VISION_PLACEHOLDER * num_images}{prompt}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank term: y = base(x) + scale * (x A^T) B^T.

    A is (r, in) and B is (out, r), exactly the bundle's lora_A / lora_B tensors.
    `enabled=False` makes it the plain base layer."""

    def __init__(self, base: nn.Linear, rank: int, scale: float):
        super().__init__()
        self.base = base
        self.rank, self.scale = rank, scale
        self.lora_A = nn.Parameter(torch.zeros(rank, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.enabled:  # float32 factors, the activations' dtype for the product (bf16 training)
            y = y + self.scale * ((x @ self.lora_A.to(x.dtype).t()) @ self.lora_B.to(x.dtype).t())
        return y


def init_lora(rank: int, in_features: int, out_features: int, generator: torch.Generator):
    """PEFT's default init: A ~ kaiming-uniform(a=sqrt(5)), B = 0 (a new adapter is a no-op)."""
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform with a=sqrt(5) on a (r, in) matrix
    a = (torch.rand(rank, in_features, generator=generator) * 2 - 1) * bound
    return a, torch.zeros(out_features, rank)


@dataclass(frozen=True)
class PromptTemplate:
    """Token ids, image-token positions and M-RoPE position ids of one (prompt, image grid)."""

    input_ids: torch.Tensor  # (L,)
    image_positions: torch.Tensor  # (T,) indices of <|image_pad|> tokens
    position_ids: torch.Tensor  # (3, 1, L)
    mm_token_type_ids: torch.Tensor  # (L,) 1 at image tokens


TRAINING_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def training_device(device: str, dtype: str) -> dict:
    """BaseModel.load's device and dtype from their names; ValueError naming the bad one (a CUDA
    device this machine lacks, a dtype training does not take)."""
    if dtype not in TRAINING_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(TRAINING_DTYPES)}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r} is not cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA device here")
    return {"device": dev, "dtype": TRAINING_DTYPES[dtype]}


class BaseModel:
    """A frozen Qwen2-VL from a local path, with LoRA slots on the language model."""

    def __init__(
        self,
        model,
        tokenizer,
        image_processor,
        rank: int,
        lora_alpha: float,
        target_modules: tuple[str, ...] = TARGET_MODULES,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.device, self.dtype = torch.device(device), dtype
        self.model = model.eval().to(device=self.device, dtype=dtype)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.rank, self.lora_alpha = rank, float(lora_alpha)
        self.scale = self.lora_alpha / rank
        self.target_modules = tuple(m for m in TARGET_MODULES if m in target_modules)
        self.hidden_size = self.model.config.text_config.hidden_size
        self.lora: dict[tuple[int, str], LoRALinear] = {}
        for i, layer in enumerate(self.language_model.layers):
            for module in self.target_modules:
                parent = layer.self_attn if module in ATTENTION_MODULES else layer.mlp
                wrapped = LoRALinear(getattr(parent, module), rank, self.scale).to(self.device)
                setattr(parent, module, wrapped)
                self.lora[(i, module)] = wrapped
        self._templates: dict[tuple[str, tuple[int, ...]], PromptTemplate] = {}

    @classmethod
    def load(
        cls,
        path: Path | str,
        rank: int = 8,
        lora_alpha: float | None = None,
        target_modules: tuple[str, ...] = TARGET_MODULES,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> "BaseModel":
        from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        path = str(Path(path).expanduser())
        model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path)
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        return cls(
            model,
            tokenizer,
            image_processor,
            rank,
            lora_alpha if lora_alpha is not None else 2.0 * rank,
            target_modules,
            device,
            dtype,
        )

    @property
    def language_model(self):
        return self.model.model.language_model

    @property
    def num_layers(self) -> int:
        return len(self.language_model.layers)

    # -- LoRA state -------------------------------------------------------------------------

    def set_lora_enabled(self, enabled: bool) -> None:
        for m in self.lora.values():
            m.enabled = enabled

    def lora_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.lora.values() for p in (m.lora_A, m.lora_B)]

    def load_lora(self, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.no_grad():
            for key, m in self.lora.items():
                a, b = weights[key]
                m.lora_A.copy_(a)
                m.lora_B.copy_(b)

    def read_lora(self) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        return {
            k: (m.lora_A.detach().to("cpu", copy=True), m.lora_B.detach().to("cpu", copy=True))
            for k, m in self.lora.items()
        }

    def fresh_lora(self, seed: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        return {k: init_lora(self.rank, m.base.in_features, m.base.out_features, g) for k, m in self.lora.items()}

    # -- inputs ---------------------------------------------------------------------------

    def pixel_inputs(self, images) -> tuple[torch.Tensor, torch.Tensor]:
        """Images -> (pixel_values (sum patches, D), image_grid_thw (N, 3)) on the model's device,
        via the model's processor."""
        out = self.image_processor(images=list(images), return_tensors="pt")
        return out["pixel_values"].to(self.device, self.dtype), out["image_grid_thw"].to(self.device)

    @torch.no_grad()
    def encode_images(self, images, chunk: int = 256) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Vision-tower features of same-sized images: ((N, T, hidden), grid (t, h, w))."""
        feats, grid = [], None
        images = list(images)
        for i in range(0, len(images), chunk):
            pv, thw = self.pixel_inputs(images[i : i + chunk])
            if grid is None:
                grid = tuple(int(v) for v in thw[0])
            if not bool((thw == thw[0]).all()) or tuple(int(v) for v in thw[0]) != grid:
                raise ValueError("encode_images needs images of one size")
            out = self.model.model.get_image_features(pv, thw).pooler_output
            feats.extend(out)
        return torch.stack(feats), grid

    def template(self, prompt: str, grid: tuple[int, int, int]) -> PromptTemplate:
        key = (prompt, grid)
        if key not in self._templates:
            merge = self.image_processor.merge_size
            n_tokens = grid[0] * grid[1] * grid[2] // (merge * merge)
            text = chat_text(prompt, 1).replace(IMAGE_PAD, IMAGE_PAD * n_tokens)
            ids = torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
            image_id = self.model.config.image_token_id
            mm = (ids == image_id).int()
            if int(mm.sum()) != n_tokens:
                raise ValueError(f"prompt tokenised to {int(mm.sum())} image tokens, expected {n_tokens}")
            pos, _ = self.model.model.get_rope_index(
                ids[None], mm_token_type_ids=mm[None], image_grid_thw=torch.tensor([grid])
            )
            dev = self.device
            image_positions = torch.nonzero(mm).flatten()
            self._templates[key] = PromptTemplate(ids.to(dev), image_positions.to(dev), pos.to(dev), mm.to(dev))
        return self._templates[key]

    def head_features(self, template: PromptTemplate, image_features: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden state of the last prompt token, (B, hidden), from cached image
        features (B, T, hidden); runs the language model with whatever LoRA is loaded."""
        b = image_features.shape[0]
        embeds = self.language_model.embed_tokens(template.input_ids)[None].expand(b, -1, -1).clone()
        embeds[:, template.image_positions] = image_features.to(embeds.dtype)
        out = self.language_model(inputs_embeds=embeds, position_ids=template.position_ids.expand(-1, b, -1))
        return out.last_hidden_state[:, -1].float()

    def _embeds(self, template: PromptTemplate, image_features: torch.Tensor, answer_ids: torch.Tensor):
        """Embeddings and M-RoPE positions of prompt + image features + `answer_ids` (B, T): text
        after the prompt continues its positions (max + 1, + 2, ... on all three axes, as
        get_rope_index numbers text after an image)."""
        b, t = answer_ids.shape
        emb = self.language_model.embed_tokens
        embeds = emb(template.input_ids)[None].expand(b, -1, -1).clone()
        embeds[:, template.image_positions] = image_features.to(embeds.dtype)
        pos = template.position_ids.expand(-1, b, -1)
        if t:
            embeds = torch.cat([embeds, emb(answer_ids)], dim=1)
            start = int(template.position_ids.max()) + 1
            more = torch.arange(start, start + t, dtype=pos.dtype, device=pos.device)
            more = more.view(1, 1, t).expand(pos.shape[0], b, t)
            pos = torch.cat([pos, more], dim=-1)
        return embeds, pos

    def answer_logits(
        self, template: PromptTemplate, image_features: torch.Tensor, answer_ids: torch.Tensor
    ) -> torch.Tensor:
        """Teacher-forced LM logits (B, T, vocab) predicting each token of `answer_ids` (B, T):
        position k's logits are the model's next-token distribution after the prompt and the
        answer's first k tokens (the LM head over the final-norm hidden states)."""
        embeds, pos = self._embeds(template, image_features, answer_ids)
        h = self.language_model(inputs_embeds=embeds, position_ids=pos).last_hidden_state
        n = len(template.input_ids)
        return self.model.lm_head(h[:, n - 1 : n - 1 + answer_ids.shape[1]]).float()

    def stop_ids(self) -> set[int]:
        """Tokens that end a generated answer: <|im_end|> and the tokenizer's eos / pad."""
        ids = {
            self.tokenizer.convert_tokens_to_ids("<|im_end|>"),
            self.tokenizer.eos_token_id,
            self.tokenizer.pad_token_id,
        }
        return {int(i) for i in ids if i is not None and i >= 0}

    @torch.no_grad()
    def greedy_answers(self, template: PromptTemplate, image_features: torch.Tensor, max_new_tokens: int) -> list[str]:
        """Greedy decoding (argmax, no sampling) of up to `max_new_tokens` after the prompt, for
        each image; stops at a stop token (`stop_ids`); the decoded text without special tokens,
        what a worker answers a TEXT request with temperature 0."""
        b = image_features.shape[0]
        stops = torch.tensor(sorted(self.stop_ids()), device=self.device)
        out = torch.zeros(b, 0, dtype=torch.long, device=self.device)
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        for _ in range(max_new_tokens):
            embeds, pos = self._embeds(template, image_features, out)
            h = self.language_model(inputs_embeds=embeds, position_ids=pos).last_hidden_state[:, -1]
            nxt = self.model.lm_head(h).argmax(-1)
            nxt = torch.where(done, stops[0], nxt)
            out = torch.cat([out, nxt[:, None]], dim=1)
            done |= torch.isin(nxt, stops)
            if bool(done.all()):
                break
        stop_set = set(stops.tolist())
        texts = []
        for row in out.tolist():
            cut = next((i for i, tok in enumerate(row) if tok in stop_set), len(row))
            texts.append(self.tokenizer.decode(row[:cut], skip_special_tokens=True))
        return texts

    def full_head_features(self, images, prompt: str) -> torch.Tensor:
        """Same as head_features but through the whole model from pixels (the serving path)."""
        pv, thw = self.pixel_inputs(images)
        grid = tuple(int(v) for v in thw[0])
        t = self.template(prompt, grid)
        b = len(thw)
        out = self.model.model(
            input_ids=t.input_ids[None].expand(b, -1),
            pixel_values=pv,
            image_grid_thw=thw,
            mm_token_type_ids=t.mm_token_type_ids[None].expand(b, -1),
        )
        return out.last_hidden_state[:, -1].float()
