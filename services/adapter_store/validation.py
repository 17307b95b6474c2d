"""Checks an uploaded bundle before anything is written: safetensors only (a pickle is never
unpickled — no torch.load, no pickle), size and header limits, tensor names/shapes against the
base model, rank limit, dtype, declared heads, and the client's sha256."""

from __future__ import annotations

import hashlib
import json
import struct
import re
from dataclasses import dataclass
from pathlib import Path

import structlog

from services.common.adapter_format import BaseModelShapes, BundleInfo, validate_bundle
from services.common.errors import FailedPrecondition, InvalidAdapter, invalid_field

from services.adapter_store.domain import Head

log = structlog.get_logger()
_HEX = re.compile(r"^[0-9a-f]{64}$")
_PICKLE_PROTO = b"\x80"
_ZIP_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class UploadRequest:
    """The metadata message of an upload, already parsed."""

    adapter_id: str
    adapter_config_json: str
    sha256: str  # expected hex digest, "" when the client sent none
    request_id: str | None
    heads: tuple[Head, ...]


@dataclass(frozen=True)
class CheckedBundle:
    sha256: str
    size: int
    info: BundleInfo
    heads: tuple[Head, ...]  # every head of the bundle, with labels


def normalize_sha256(value: str) -> str:
    value = (value or "").strip().lower()
    if value and not _HEX.fullmatch(value):
        raise invalid_field("metadata.sha256", "must be 64 hex digits")
    return value


class BundleChecker:
    """Holds the base model's shapes and the limits; `check()` is pure CPU work (run it in an
    executor)."""

    def __init__(
        self,
        shapes: BaseModelShapes | None,
        base_model: str,
        max_rank: int,
        max_header_bytes: int,
        max_bundle_bytes: int,
    ) -> None:
        self.shapes = shapes
        self.base_model = base_model
        self.max_rank = max_rank
        self.max_header_bytes = max_header_bytes
        self.max_bundle_bytes = max_bundle_bytes

    @classmethod
    def from_settings(cls, settings) -> "BundleChecker":
        shapes = None
        base_model = settings.base_model
        if settings.model_path:
            path = Path(settings.model_path)
            config_path = path / "config.json" if path.is_dir() or not path.suffix else path
            try:
                shapes = BaseModelShapes.from_config(json.loads(config_path.read_text()))
            except (OSError, ValueError, KeyError) as exc:
                raise RuntimeError(
                    f"VALORA_MODEL_PATH={settings.model_path}: cannot read the base model's "
                    f"shapes from {config_path}: {exc!r}"
                ) from exc
            base_model = base_model or (path.name if path.is_dir() else path.parent.name)
        return cls(shapes, base_model, settings.max_rank, settings.max_header_bytes, settings.max_bundle_bytes)

    def check_size(self, size: int) -> None:
        if size > self.max_bundle_bytes:
            raise InvalidAdapter(
                f"bundle is over the {self.max_bundle_bytes}-byte size limit", reason="BUNDLE_TOO_LARGE"
            )

    def check(self, req: UploadRequest, data: bytes | bytearray) -> CheckedBundle:
        if self.shapes is None:
            raise FailedPrecondition(
                "the store has no base model to check uploads against (set VALORA_MODEL_PATH)", reason="NO_BASE_MODEL"
            )
        self.check_size(len(data))
        if not data:
            raise InvalidAdapter("bundle is empty", reason="NOT_SAFETENSORS")
        _reject_non_safetensors(data)
        info = validate_bundle(data, req.adapter_config_json, self.shapes, self.max_rank, self.max_header_bytes)
        if info.ignored:  # the worker's parse_bundle leaves them out the same way, saying so again
            log.warning(
                "adapter_vision_lora_ignored",
                adapter=req.adapter_id,
                modules=list(info.ignored),
                why="valora applies LoRA to the language model only",
            )
        digest = hashlib.sha256(data).hexdigest()
        if req.sha256 and req.sha256 != digest:
            raise InvalidAdapter(
                f"sha256 mismatch: metadata says {req.sha256}, the bytes hash to {digest}", reason="CHECKSUM_MISMATCH"
            )
        return CheckedBundle(digest, len(data), info, _merge_heads(req.heads, info.heads))


def _reject_non_safetensors(data: bytes | bytearray) -> None:
    """A safetensors file is an 8-byte little-endian length then a JSON object. Pickles and
    PyTorch zip checkpoints are named as such (and never loaded). The length prefix is checked
    first: a real header length may well start with byte 0x80, pickle's PROTO opcode."""
    if len(data) >= 9:
        (n,) = struct.unpack("<Q", bytes(data[:8]))
        if 8 + n <= len(data) and data[8:9] == b"{":
            return
    if data[:1] == _PICKLE_PROTO or data[:4] == _ZIP_MAGIC:
        raise InvalidAdapter(
            "bundle is a pickle / PyTorch checkpoint, not safetensors; pickles are never loaded",
            reason="NOT_SAFETENSORS",
        )
    raise InvalidAdapter(
        "bundle is not a safetensors file (no JSON header after the length prefix)", reason="NOT_SAFETENSORS"
    )


def _merge_heads(declared: tuple[Head, ...], in_bundle: dict[str, int]) -> tuple[Head, ...]:
    """Declared heads must exist in the bundle with as many labels as the head has rows. Heads
    the metadata does not describe keep numbered labels "0".."n-1"."""
    seen: set[str] = set()
    out: list[Head] = []
    for i, head in enumerate(declared):
        if head.name in seen:
            raise invalid_field(f"metadata.heads[{i}].name", f"head {head.name!r} declared twice")
        seen.add(head.name)
        if head.name not in in_bundle:
            raise InvalidAdapter(
                f"head {head.name!r} is declared but the bundle has no heads.{head.name}.weight",
                reason="HEAD_MISSING",
                field_violations=[],
            )
        if len(head.labels) != in_bundle[head.name]:
            raise InvalidAdapter(
                f"head {head.name!r}: {len(head.labels)} labels declared, the bundle's head has "
                f"{in_bundle[head.name]} outputs",
                reason="HEAD_LABELS_MISMATCH",
            )
        out.append(head)
    for name in sorted(in_bundle.keys() - seen):
        out.append(Head(name, tuple(str(i) for i in range(in_bundle[name]))))
    return tuple(out)
