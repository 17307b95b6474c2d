"""Test helpers shared by unit and e2e tests: random images, random PEFT-layout adapter bundles for a model,
a PEFT directory writer (for `peft.PeftModel.from_pretrained` references), and an in-memory
AdapterStoreService that serves bundles over gRPC.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

from services.common.adapter_format import TARGET_MODULES, BaseModelShapes, lora_key
from services.common.errors import AdapterNotFound

# The KV pool of a test's CUDA engine. Left to size itself, an engine takes most of the free device
# memory, and the next engine of the same process (a stopped one still holds its pool) gets one block.
TEST_KV_BYTES = 256 << 20


def random_image(seed: int, size: int = 56):
    """A deterministic random RGB PIL image (size x size)."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


@dataclass(frozen=True)
class AdapterBundle:
    """A bundle as the store holds it: safetensors bytes + PEFT adapter_config.json."""

    data: bytes
    config_json: str
    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    heads: dict[str, list[str]] = field(default_factory=dict)  # head name -> labels

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def _model_config(model: dict | str | Path) -> dict:
    if isinstance(model, dict):
        return model
    p = Path(model).expanduser()
    return json.loads((p / "config.json" if p.is_dir() else p).read_text())


def peft_config_json(rank: int, lora_alpha: float, target_modules, base_model: str = "") -> str:
    return json.dumps(
        {
            "peft_type": "LORA",
            "task_type": None,
            "r": rank,
            "lora_alpha": lora_alpha,
            "target_modules": list(target_modules),
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": True,
            "base_model_name_or_path": base_model,
            "inference_mode": True,
        }
    )


def random_adapter_bundle(
    model: dict | str | Path,
    rank: int = 4,
    lora_alpha: float = 8.0,
    seed: int = 0,
    target_modules: tuple[str, ...] = TARGET_MODULES,
    heads: dict[str, list[str]] | None = None,
    std: float = 0.1,
    dtype: torch.dtype = torch.float32,
) -> AdapterBundle:
    """Random LoRA weights (B non-zero, so the adapter changes outputs) for every layer of the
    model's language model; `heads` adds task heads {name: labels}. Deterministic per seed."""
    shapes = BaseModelShapes.from_config(_model_config(model))
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shapes.num_layers):
        for module in target_modules:
            fin, fout = shapes.features[module]
            tensors[lora_key(layer, module, "A")] = (torch.randn(rank, fin, generator=g) * std).to(dtype)
            tensors[lora_key(layer, module, "B")] = (torch.randn(fout, rank, generator=g) * std).to(dtype)
    for name, labels in (heads or {}).items():
        tensors[f"heads.{name}.weight"] = (torch.randn(len(labels), shapes.hidden_size, generator=g)).to(dtype)
        tensors[f"heads.{name}.bias"] = (torch.randn(len(labels), generator=g) * 0.1).to(dtype)
    data = save_safetensors(tensors)
    return AdapterBundle(
        data=data,
        config_json=peft_config_json(rank, lora_alpha, target_modules),
        rank=rank,
        lora_alpha=lora_alpha,
        target_modules=tuple(target_modules),
        heads=dict(heads or {}),
    )


def write_peft_dir(bundle: AdapterBundle, directory: str | Path) -> Path:
    """adapter_model.safetensors (LoRA tensors only) + adapter_config.json, for PeftModel.from_pretrained.

    The config's target_modules is a regex over the language model's decoder layers: PEFT matches a
    list of names by suffix, so the bundle's names also wrapped the vision towers' modules of those
    names (LLaVA's CLIP q/k/v_proj, Qwen2.5-VL's gate/up/down_proj), zero LoRA terms the HF + PEFT
    reference computed on every image (engine_bench's peer timings included) that valora's adapters,
    the language model's only, do not have."""
    from safetensors.torch import load as load_safetensors

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v for k, v in load_safetensors(bundle.data).items() if not k.startswith("heads.")}
    (d / "adapter_model.safetensors").write_bytes(save_safetensors(tensors))
    config = json.loads(bundle.config_json)
    modules = "|".join(re.escape(m) for m in config["target_modules"])
    config["target_modules"] = rf"(.*\.)?language_model\.layers\.\d+\.(self_attn|mlp)\.({modules})"
    (d / "adapter_config.json").write_text(json.dumps(config))
    return d


class InMemoryAdapterStore:
    """An AdapterStoreService servicer over a dict {version name: AdapterBundle} (tests only).

    `register(server)` adds it to a grpc.aio server; FetchAdapter streams metadata then chunks.
    """

    def __init__(self, bundles: dict[str, AdapterBundle] | None = None, chunk_bytes: int = 64 * 1024) -> None:
        self.bundles = dict(bundles or {})
        self.chunk_bytes = chunk_bytes
        self.fetches = 0

    def version_pb(self, name: str):
        from valora_protos.v1 import resources_pb2

        b = self.bundles[name]
        return resources_pb2.AdapterVersion(
            name=name,
            sha256=b.sha256,
            rank=b.rank,
            lora_alpha=b.lora_alpha,
            target_modules=list(b.target_modules),
            size_bytes=len(b.data),
            heads=[resources_pb2.TaskHead(name=h, labels=labels) for h, labels in b.heads.items()],
        )

    def register(self, server) -> list[str]:
        from valora_protos.internal.v1 import adapter_store_service_pb2 as pb
        from valora_protos.internal.v1 import adapter_store_service_pb2_grpc as pb_grpc

        store = self

        class _Servicer(pb_grpc.AdapterStoreServiceServicer):
            async def ResolveReference(self, request, context):
                if request.reference not in store.bundles:
                    raise AdapterNotFound(f"{request.reference} not found")
                return pb.ResolveReferenceResponse(version=store.version_pb(request.reference))

            async def FetchAdapter(self, request, context):
                if request.version not in store.bundles:
                    raise AdapterNotFound(f"{request.version} not found", reason="ADAPTER_NOT_FOUND")
                store.fetches += 1
                b = store.bundles[request.version]
                yield pb.FetchAdapterResponse(
                    metadata=pb.FetchAdapterMetadata(
                        version=store.version_pb(request.version), adapter_config_json=b.config_json
                    )
                )
                for i in range(0, len(b.data), store.chunk_bytes):
                    yield pb.FetchAdapterResponse(chunk=b.data[i : i + store.chunk_bytes])

        pb_grpc.add_AdapterStoreServiceServicer_to_server(_Servicer(), server)
        return [pb.DESCRIPTOR.services_by_name["AdapterStoreService"].full_name]


def load_random_adapters(engine, model_path, names) -> None:
    """Loads a random adapter under each name into `engine` (the i-th: rank 4·(i+1), seed i+1)."""
    for i, name in enumerate(names):
        b = random_adapter_bundle(model_path, rank=4 * (i + 1), lora_alpha=8, seed=i + 1)
        engine.load_adapter_bytes(name, b.sha256, b.data, b.config_json)


@contextlib.asynccontextmanager
async def serve_worker(settings, store: InMemoryAdapterStore):
    """A worker server (`services.worker.server.create_server(settings)`) fetching its adapters
    from `store`, served on loopback first; yields (worker service, its aio channel). The worker is
    stopped on the way out unless the test stopped it."""
    import grpc  # the engine tests import this module without the services

    from services.common.server import build_service
    from services.worker.server import create_server

    store_service = build_service("store", settings, store.register)
    await store_service.start()
    settings.adapter_store_address = f"127.0.0.1:{store_service.port}"
    worker = await create_server(settings)
    await worker.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")
    try:
        yield worker, channel
    finally:
        await channel.close()
        if not worker.stopping:
            await worker.stop(0)
        await store_service.stop(0)
