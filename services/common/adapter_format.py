"""The adapter bundle format, shared by the store (validation), workers (loading) and the CLI.

A bundle is one safetensors file in PEFT's layout plus PEFT's adapter_config.json:

    base_model.model.model.language_model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_A.weight  (r, in)
    base_model.model.model.language_model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_B.weight  (out, r)
    base_model.model.model.language_model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight
    heads.{name}.weight (num_labels, hidden)   heads.{name}.bias (num_labels,)   -- vision task heads

That is the layout PEFT writes under transformers 5 (and 4.52+). PEFT adapters saved under older
transformers name the language model where the model class had it then (`KEY_LAYOUTS`, by the base
model's `model_type`): Qwen2-VL and Qwen2.5-VL's `base_model.model.model.layers.{i}...`, LLaVA's
`base_model.model.language_model.model.layers.{i}...`; `validate_bundle` maps each to the layout
above (`BundleInfo.keys`), so the store's validation and the worker's loading read the same
tensors. LoRA weights of the vision tower or the projector (PEFT matches a list of target
names by suffix: `["q_proj", "v_proj"]` also wraps CLIP's q/v_proj) are ignored, as vLLM ignores
them, and named (`BundleInfo.ignored`) for the callers' warnings; any other tensor is refused
with the module names that do not exist in the served family's language model.

Scale is lora_alpha / r (PEFT's default), lora_alpha / sqrt(r) with `use_rslora`; DoRA and an
alpha_pattern of other alphas are refused. Torch-free: shapes come from the base model's
config.json, tensors' shapes from the safetensors header.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field

import numpy as np

from services.common.errors import InvalidAdapter

LM_PREFIX = "base_model.model.model.language_model.layers."
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
# A decoder layer's LoRA weight, after its layout's prefix ("...layers.").
_LORA_KEY = re.compile(
    r"^(?P<layer>[0-9]+)\.(?P<parent>[a-z_]+)\.(?P<module>[a-z_0-9]+)\.lora_(?P<which>[AB])\.weight$"
)
# What PEFT appends to a wrapped module's name in a saved tensor's (lora_A/B, DoRA's magnitude,
# embeddings' lora_embedding_A/B, a lora_B bias).
_PEFT_SUFFIX = re.compile(r"\.(?:lora_[A-Za-z_]+)(?:\.[A-Za-z_]+)?$")


@dataclass(frozen=True)
class KeyLayout:
    """Where a family's saved PEFT keys put its modules, in every layout transformers has had."""

    language_model: tuple[str, ...]  # prefixes of its decoder layers ("...layers."), LM_PREFIX first
    vision: tuple[str, ...] = ()  # prefixes of its vision tower and projector: LoRA there is ignored


_QWEN_VL_KEYS = KeyLayout(
    # transformers < 4.52: Qwen2VLForConditionalGeneration.model was the language model, .visual the tower
    language_model=(LM_PREFIX, "base_model.model.model.layers."),
    vision=("base_model.model.model.visual.", "base_model.model.visual."),
)
# The served families' layouts by config.json's model_type (services/worker/architectures.py lists
# the families; a test checks each has its entry here).
KEY_LAYOUTS: dict[str, KeyLayout] = {
    "qwen2_vl": _QWEN_VL_KEYS,
    "qwen2_5_vl": _QWEN_VL_KEYS,
    # transformers < 4.52: LlavaForConditionalGeneration.language_model was a LlamaForCausalLM, and
    # .vision_tower (CLIPVisionModel: .vision_model) and .multi_modal_projector its own attributes
    "llava": KeyLayout(
        language_model=(LM_PREFIX, "base_model.model.language_model.model.layers."),
        vision=(
            "base_model.model.model.vision_tower.",
            "base_model.model.vision_tower.",
            "base_model.model.model.multi_modal_projector.",
            "base_model.model.multi_modal_projector.",
        ),
    ),
}
DEFAULT_KEY_LAYOUT = KeyLayout(language_model=(LM_PREFIX,))
_HEAD_KEY = re.compile(r"^heads\.(?P<name>[a-z][a-z0-9_-]{0,62})\.(?P<part>weight|bias)$")
SAFETENSORS_DTYPES = {"F32", "F16", "BF16"}
# Bytes per element of every dtype the safetensors format defines (to check data_offsets).
_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def module_parent(module: str) -> str:
    return "self_attn" if module in ATTENTION_MODULES else "mlp"


def lora_key(layer: int, module: str, which: str) -> str:
    return f"{LM_PREFIX}{layer}.{module_parent(module)}.{module}.lora_{which}.weight"


@dataclass(frozen=True)
class BaseModelShapes:
    """In/out features of each LoRA-targetable projection of the language model."""

    num_layers: int
    hidden_size: int
    features: dict[str, tuple[int, int]]  # module -> (in_features, out_features)
    family: str = ""  # config.json's model_type ("": none given)

    @property
    def key_layout(self) -> KeyLayout:
        return KEY_LAYOUTS.get(self.family, DEFAULT_KEY_LAYOUT)

    @classmethod
    def from_config(cls, config: dict) -> "BaseModelShapes":
        text = config.get("text_config") or config
        h = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        kv = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or h // heads)
        inter = int(text["intermediate_size"])
        return cls(
            family=str(config.get("model_type") or ""),
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=h,
            features={
                "q_proj": (h, heads * head_dim),
                "k_proj": (h, kv * head_dim),
                "v_proj": (h, kv * head_dim),
                "o_proj": (heads * head_dim, h),
                "gate_proj": (h, inter),
                "up_proj": (h, inter),
                "down_proj": (inter, h),
            },
        )


@dataclass(frozen=True)
class BundleInfo:
    """What validation learned from a bundle: enough to register and to load it."""

    rank: int
    lora_alpha: float
    scale: float  # of B·A
    target_modules: tuple[str, ...]
    layers: tuple[int, ...]
    heads: dict[str, int]  # head name -> number of labels
    dtype: str
    # (layer, module, "A" | "B") -> the tensor's name in the bundle (its layout's)
    keys: dict[tuple[int, str, str], str] = field(default_factory=dict)
    # modules of the vision tower / projector whose LoRA weights were ignored (layer indices as N)
    ignored: tuple[str, ...] = ()


def read_safetensors_header(data: bytes, max_header_bytes: int = 1 << 20) -> dict:
    """Parse a safetensors header without loading tensors; rejects anything that is not one."""
    if len(data) < 8:
        raise InvalidAdapter(
            "bundle is not a safetensors file: shorter than its 8-byte header length", reason="NOT_SAFETENSORS"
        )
    (n,) = struct.unpack("<Q", data[:8])
    if n > max_header_bytes:
        raise InvalidAdapter(
            f"safetensors header is {n} bytes, over the {max_header_bytes}-byte limit", reason="HEADER_TOO_LARGE"
        )
    if 8 + n > len(data):
        raise InvalidAdapter("bundle is truncated: header runs past the end", reason="TRUNCATED")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidAdapter(
            f"bundle is not a safetensors file: header is not JSON ({exc})", reason="NOT_SAFETENSORS"
        ) from exc
    if not isinstance(header, dict):
        raise InvalidAdapter("bundle is not a safetensors file: header is not an object", reason="NOT_SAFETENSORS")
    body = len(data) - 8 - n
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(meta, dict) or "shape" not in meta or "data_offsets" not in meta:
            raise InvalidAdapter(f"tensor {name!r}: malformed header entry", reason="NOT_SAFETENSORS")
        shape, offsets, dtype = meta["shape"], meta["data_offsets"], meta.get("dtype")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise InvalidAdapter(
                f"tensor {name!r}: shape must be a list of non-negative integers", reason="NOT_SAFETENSORS"
            )
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
            raise InvalidAdapter(f"tensor {name!r}: data_offsets must be two integers", reason="NOT_SAFETENSORS")
        if not isinstance(dtype, str) or dtype not in _DTYPE_BYTES:
            raise InvalidAdapter(f"tensor {name!r}: unknown dtype", reason="BAD_DTYPE")
        start, end = offsets
        if not (0 <= start <= end <= body):
            raise InvalidAdapter(f"tensor {name!r}: data runs past the end of the file", reason="TRUNCATED")
        count = 1
        for d in shape:
            count *= d
        if end - start != count * _DTYPE_BYTES[dtype]:
            raise InvalidAdapter(
                f"tensor {name!r}: {end - start} data bytes for shape {shape} of {dtype}", reason="NOT_SAFETENSORS"
            )
    # The tensors' bytes tile the body exactly (the format's rule): no overlaps, holes or trailing bytes.
    at = 0
    for start, end in sorted(tuple(m["data_offsets"]) for k, m in header.items() if k != "__metadata__"):
        if start != at:
            raise InvalidAdapter(
                f"tensor data {'overlaps' if start < at else 'leaves a gap'} at byte {min(start, at)}",
                reason="NOT_SAFETENSORS",
            )
        at = end
    if at != body:
        raise InvalidAdapter(f"{body - at} bytes after the last tensor", reason="NOT_SAFETENSORS")
    return header


# Bit masks of the exponent of each float format: all ones is Inf or NaN.
_EXPONENT = {"F32": ("<u4", 0x7F800000), "F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80)}


def _all_finite(data: bytes, start: int, end: int, dtype: str) -> bool:
    """Whether bytes [start, end) of `data` hold no Inf or NaN of `dtype` (read in place; nothing
    keeps a view of `data` once this returns)."""
    kind, mask = _EXPONENT[dtype]
    bits = np.frombuffer(data, dtype=kind, count=(end - start) // np.dtype(kind).itemsize, offset=start)
    return not bool(np.any((bits & mask) == mask))


def validate_bundle(
    data: bytes, config_json: str, shapes: BaseModelShapes, max_rank: int, max_header_bytes: int = 1 << 20
) -> BundleInfo:
    """Check a bundle against the base model; raises InvalidAdapter naming what is wrong."""
    try:
        config = json.loads(config_json or "{}")
    except json.JSONDecodeError as exc:
        raise InvalidAdapter(f"adapter_config_json is not JSON: {exc}", reason="BAD_CONFIG") from exc
    if not isinstance(config, dict):
        raise InvalidAdapter("adapter_config_json must be a JSON object", reason="BAD_CONFIG")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if key in config and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9
        ):  # null too: "lora_alpha": null once raised TypeError
            raise InvalidAdapter(f"adapter_config_json: {key} must be a positive number", reason="BAD_CONFIG")
    header = read_safetensors_header(data, max_header_bytes)
    body = 8 + struct.unpack("<Q", data[:8])[0]  # where the tensors' bytes start
    ranks: set[int] = set()
    modules: set[str] = set()
    layers: set[int] = set()
    dtypes: set[str] = set()
    pairs: dict[tuple[int, str], set[str]] = {}
    heads: dict[str, dict[str, list[int]]] = {}
    keys: dict[tuple[int, str, str], str] = {}
    unknown: set[str] = set()
    ignored: set[str] = set()
    layout = shapes.key_layout
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtypes.add(meta.get("dtype"))
        start, end = meta["data_offsets"]
        if meta.get("dtype") in _EXPONENT and not _all_finite(data, body + start, body + end, meta["dtype"]):
            raise InvalidAdapter(f"tensor {name!r} holds NaN or Inf", reason="NOT_FINITE")
        shape = list(meta["shape"])
        if m := _HEAD_KEY.fullmatch(name):
            heads.setdefault(m["name"], {})[m["part"]] = shape
            continue
        if name.startswith(layout.vision):
            ignored.add(_module_name(name))
            continue
        prefix = next((p for p in layout.language_model if name.startswith(p)), None)
        m = _LORA_KEY.fullmatch(name[len(prefix) :]) if prefix is not None else None
        if not m:
            if prefix is not None and _LORA_KEY.fullmatch(_PEFT_SUFFIX.sub(".lora_A.weight", name[len(prefix) :])):
                raise InvalidAdapter(
                    f"tensor {name!r}: only LoRA's lora_A and lora_B weights are supported "
                    "(not DoRA's magnitude vectors nor LoRA biases)",
                    reason="UNKNOWN_TENSOR",
                )
            unknown.add(_module_name(name))
            continue
        layer, module, which = int(m["layer"]), m["module"], m["which"]
        if module not in shapes.features or m["parent"] != module_parent(module):
            unknown.add(_module_name(name))
            continue
        if layer >= shapes.num_layers:
            raise InvalidAdapter(
                f"tensor {name!r}: layer {layer} does not exist, the base model's language "
                f"model has {shapes.num_layers} layers",
                reason="UNKNOWN_TENSOR",
            )
        if (layer, module, which) in keys:
            raise InvalidAdapter(
                f"tensors {keys[(layer, module, which)]!r} and {name!r} are the same weight in two key layouts",
                reason="UNKNOWN_TENSOR",
            )
        keys[(layer, module, which)] = name
        fin, fout = shapes.features[module]
        if len(shape) != 2:
            raise InvalidAdapter(f"tensor {name!r}: expected 2 dimensions, got {shape}", reason="BAD_SHAPE")
        rank = shape[0] if which == "A" else shape[1]
        expected = [rank, fin] if which == "A" else [fout, rank]
        if shape != expected:
            raise InvalidAdapter(f"tensor {name!r}: shape {shape}, expected {expected}", reason="BAD_SHAPE")
        ranks.add(rank)
        modules.add(module)
        layers.add(layer)
        pairs.setdefault((layer, module), set()).add(which)
    if unknown:
        names = sorted(unknown)
        more = f" and {len(names) - 8} more" if len(names) > 8 else ""
        raise InvalidAdapter(
            f"target modules {names[:8]}{more} do not exist in the language model of the base model "
            f"({shapes.family or 'unknown family'}, {shapes.num_layers} layers): LoRA applies to "
            f"layers.N.self_attn.{{q,k,v,o}}_proj and layers.N.mlp.{{gate,up,down}}_proj",
            reason="UNKNOWN_TENSOR",
        )
    bad_dtypes = dtypes - SAFETENSORS_DTYPES
    if bad_dtypes:
        raise InvalidAdapter(
            f"dtypes {sorted(bad_dtypes)} not allowed; use one of {sorted(SAFETENSORS_DTYPES)}", reason="BAD_DTYPE"
        )
    if not pairs:
        also = f" (those of the vision tower, ignored: {sorted(ignored)[:4]})" if ignored else ""
        raise InvalidAdapter(f"bundle holds no LoRA weights of the language model{also}", reason="EMPTY_ADAPTER")
    unpaired = [f"layer {l} {mod}" for (l, mod), w in pairs.items() if w != {"A", "B"}]
    if unpaired:
        raise InvalidAdapter(f"lora_A without lora_B (or the reverse): {unpaired[:3]}", reason="BAD_SHAPE")
    if len(ranks) != 1:
        raise InvalidAdapter(f"mixed ranks {sorted(ranks)} inside one adapter", reason="BAD_SHAPE")
    rank = ranks.pop()
    if not 0 < rank <= max_rank:
        raise InvalidAdapter(f"rank {rank} is over the limit of {max_rank}", reason="RANK_TOO_LARGE")
    cfg_rank = config.get("r")
    if cfg_rank is not None and cfg_rank != rank:
        raise InvalidAdapter(f"adapter_config r={cfg_rank} but tensors have rank {rank}", reason="BAD_CONFIG")
    lora_alpha = float(config.get("lora_alpha", rank))
    if config.get("use_dora"):
        raise InvalidAdapter(
            "adapter_config_json: use_dora is not supported (DoRA rescales each weight; valora adds LoRA's B·A only)",
            reason="BAD_CONFIG",
        )
    alphas = config.get("alpha_pattern") or {}
    if not isinstance(alphas, dict) or any(v != lora_alpha for v in alphas.values()):
        raise InvalidAdapter(
            f"adapter_config_json: alpha_pattern {alphas!r} is not supported: one lora_alpha for every module",
            reason="BAD_CONFIG",
        )
    head_labels: dict[str, int] = {}
    for head, parts in heads.items():
        w = parts.get("weight")
        if w is None or len(w) != 2 or w[1] != shapes.hidden_size:
            raise InvalidAdapter(
                f"head {head!r}: weight must be (num_labels, {shapes.hidden_size})", reason="BAD_SHAPE"
            )
        b = parts.get("bias")
        if b is not None and b != [w[0]]:
            raise InvalidAdapter(f"head {head!r}: bias must be ({w[0]},)", reason="BAD_SHAPE")
        head_labels[head] = w[0]
    return BundleInfo(
        rank=rank,
        lora_alpha=lora_alpha,
        # PEFT's: lora_alpha / r, or rsLoRA's lora_alpha / sqrt(r)
        scale=lora_alpha / (rank**0.5 if config.get("use_rslora") else rank),
        target_modules=tuple(m for m in TARGET_MODULES if m in modules),
        layers=tuple(sorted(layers)),
        heads=head_labels,
        dtype=sorted(dtypes)[0],
        keys=keys,
        ignored=tuple(sorted(ignored)),
    )


def _module_name(tensor: str) -> str:
    """The module a saved tensor belongs to, as the model names it, layer indices as N:
    base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight -> model.visual.blocks.N.attn.qkv."""
    name = _PEFT_SUFFIX.sub("", tensor).removeprefix("base_model.model.")
    return re.sub(r"\.[0-9]+(?=\.|$)", ".N", name)


def make_random_bundle(
    shapes: BaseModelShapes,
    rank: int,
    seed: int,
    lora_alpha: float | None = None,
    target_modules: tuple[str, ...] = TARGET_MODULES,
    heads: dict[str, int] | None = None,
    gain: float = 1.0,
) -> tuple[bytes, str]:
    """A random adapter bundle for the given base model (demos and tests): (safetensors bytes,
    adapter_config_json). `gain` scales B so the adapter visibly changes the model's outputs
    (PEFT initialises B to zero, which would make a freshly created adapter a no-op)."""
    import numpy as np
    from safetensors.numpy import save

    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(shapes.num_layers):
        for module in target_modules:
            fin, fout = shapes.features[module]
            tensors[lora_key(layer, module, "A")] = (rng.standard_normal((rank, fin)) / np.sqrt(fin)).astype(np.float32)
            tensors[lora_key(layer, module, "B")] = (gain * rng.standard_normal((fout, rank)) / np.sqrt(rank)).astype(
                np.float32
            )
    for name, num_labels in (heads or {}).items():
        tensors[f"heads.{name}.weight"] = rng.standard_normal((num_labels, shapes.hidden_size)).astype(np.float32)
        tensors[f"heads.{name}.bias"] = np.zeros(num_labels, dtype=np.float32)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": float(lora_alpha if lora_alpha is not None else rank),
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(target_modules),
    }
    return save(tensors), json.dumps(config)
