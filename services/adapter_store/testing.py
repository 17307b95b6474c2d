"""Test support for the store and for anyone who needs real bundles without torch: a tiny base
model config, a safetensors bundle writer, and a store running on a background event loop
(tests talk to it over a real channel). Not imported by the server."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import grpc
import numpy as np

from valora_protos.internal.v1 import adapter_store_service_pb2_grpc as store_grpc
from valora_protos.v1 import admin_service_pb2 as admin_pb
from valora_protos.v1 import admin_service_pb2_grpc as admin_grpc
from valora_protos.v1 import resources_pb2 as res_pb

from services.common.adapter_format import BaseModelShapes, lora_key
from services.common.testing import ServiceThread

from services.adapter_store.config import StoreSettings

TINY_CONFIG = {
    "model_type": "qwen2_vl",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
}

_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8}


def write_tiny_model(path: str | Path, config: dict | None = None) -> Path:
    """A model directory holding only config.json (all the store reads)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or TINY_CONFIG))
    return path


def safetensors_bytes(tensors: dict[str, tuple[str, list[int]]], seed: int = 0, header_pad: int = 0) -> bytes:
    """A safetensors file: name -> (dtype, shape), filled with seeded random values (finite floats
    for the float dtypes, random bytes for the others)."""
    rng = random.Random(seed)
    header: dict = {}
    body = []
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = _DTYPE_BYTES[dtype]
        count = 1
        for d in shape:
            count *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n * count]}
        offset += n * count
        body.append(_random_values(rng, dtype, count) if dtype in ("F32", "F16", "BF16") else rng.randbytes(n * count))
    raw = json.dumps(header).encode()
    raw += b" " * (header_pad + (-len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(body)


def _random_values(rng: random.Random, dtype: str, count: int) -> bytes:
    values = np.random.default_rng(rng.getrandbits(32)).standard_normal(count).astype(np.float32)
    if dtype == "F16":
        return values.astype(np.float16).tobytes()
    if dtype == "BF16":
        return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return values.tobytes()


def make_bundle(
    rank: int = 4,
    modules: tuple[str, ...] = ("q_proj", "v_proj"),
    heads: dict[str, int] | None = None,
    dtype: str = "F32",
    config: dict | None = None,
    seed: int = 0,
    header_pad: int = 0,
) -> bytes:
    """A valid PEFT-layout LoRA bundle for the base model `config` (default TINY_CONFIG)."""
    shapes = BaseModelShapes.from_config(config or TINY_CONFIG)
    tensors: dict[str, tuple[str, list[int]]] = {}
    for layer in range(shapes.num_layers):
        for module in modules:
            fin, fout = shapes.features[module]
            tensors[lora_key(layer, module, "A")] = (dtype, [rank, fin])
            tensors[lora_key(layer, module, "B")] = (dtype, [fout, rank])
    for name, labels in (heads or {}).items():
        tensors[f"heads.{name}.weight"] = (dtype, [labels, shapes.hidden_size])
        tensors[f"heads.{name}.bias"] = (dtype, [labels])
    return safetensors_bytes(tensors, seed, header_pad)


def adapter_config(rank: int = 4, alpha: float = 8.0, modules: tuple[str, ...] = ("q_proj", "v_proj")) -> str:
    return json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules)})


def upload_messages(
    parent: str,
    data: bytes,
    config_json: str | None = None,
    sha256: str = "",
    request_id: str = "",
    heads: dict[str, list[str]] | None = None,
    chunk: int = 64 * 1024,
):
    """The UploadAdapterVersion request stream for `data`."""
    yield admin_pb.UploadAdapterVersionRequest(
        metadata=admin_pb.UploadAdapterVersionMetadata(
            parent=parent,
            adapter_config_json=config_json if config_json is not None else adapter_config(),
            sha256=sha256,
            request_id=request_id,
            heads=[res_pb.TaskHead(name=k, labels=v) for k, v in (heads or {}).items()],
        )
    )
    for i in range(0, len(data), chunk):
        yield admin_pb.UploadAdapterVersionRequest(chunk=data[i : i + chunk])


class RunningStore(ServiceThread):
    """The store's gRPC server on its own event loop thread; `admin` and `store` are sync stubs
    over a real channel."""

    def __init__(self, settings: StoreSettings) -> None:
        from services.adapter_store.server import create_server

        super().__init__(create_server, settings, "store")
        self.channel = grpc.insecure_channel(self.address)
        self.admin = admin_grpc.AdminServiceStub(self.channel)
        self.store = store_grpc.AdapterStoreServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        super().close()
