"""Fetching adapter bundles from the adapter store, with a disk cache keyed by sha256.

`AdapterFetcher.fetch(version, sha256)` returns the bundle bytes, its adapter_config.json and
the task heads' labels. Bytes are verified against the expected hash (and the store's
metadata) before use; a verified bundle is cached as `{sha256}.safetensors` + `{sha256}.json`
so a restarted worker loads it without the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.common.channels import open_channel
from services.common.errors import InvalidAdapter, WorkerUnavailable, from_rpc_error
from valora_protos.internal.v1 import adapter_store_service_pb2 as store_pb
from valora_protos.internal.v1 import adapter_store_service_pb2_grpc as store_grpc


@dataclass
class FetchedBundle:
    version: str
    sha256: str
    data: bytes
    config_json: str
    head_labels: dict[str, list[str]] = field(default_factory=dict)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class AdapterFetcher:
    def __init__(
        self,
        store_address: str,
        cache_dir: Path | str,
        channel_options=None,
        tracer_provider=None,
        credentials=None,
        token: str = "",
        cache_bytes: int = 0,
    ) -> None:
        """`cache_bytes`: what the disk cache may hold (least recently used bundles deleted past
        it; 0: unbounded)."""
        self.store_address = store_address
        self.cache_bytes = cache_bytes
        self._token = token  # the store's internal token (internal_auth.py)
        self._credentials = credentials  # grpc.ChannelCredentials for TLS to the store, or None
        self._tracer_provider = tracer_provider
        self.cache_dir = Path(cache_dir).expanduser()
        self._options = channel_options or []
        self._channel: grpc.aio.Channel | None = None

    def _stub(self) -> store_grpc.AdapterStoreServiceStub:
        if not self.store_address:
            raise WorkerUnavailable(
                "this worker has no adapter store configured (VALORA_ADAPTER_STORE_ADDRESS)", reason="NO_ADAPTER_STORE"
            )
        if self._channel is None:
            self._channel = open_channel(
                self.store_address,
                self._options,
                self._tracer_provider,
                credentials=self._credentials,
                token=self._token,
            )
        return store_grpc.AdapterStoreServiceStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    # -- disk cache ----------------------------------------------------------------------------
    def _paths(self, sha: str) -> tuple[Path, Path]:
        return self.cache_dir / f"{sha}.safetensors", self.cache_dir / f"{sha}.json"

    def _read_cache(self, version: str, sha: str) -> FetchedBundle | None:
        if not sha:
            return None
        blob, meta = self._paths(sha)
        try:
            data = blob.read_bytes()
            info = json.loads(meta.read_text())
        except (OSError, ValueError):
            return None
        if _sha(data) != sha:  # corrupted on disk: refetch
            return None
        with contextlib.suppress(OSError):
            os.utime(blob)  # its mtime orders the cache's eviction (atime is often not kept)
        return FetchedBundle(version, sha, data, info.get("adapter_config_json", ""), info.get("head_labels", {}))

    def _write_cache(self, b: FetchedBundle) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        blob, meta = self._paths(b.sha256)
        for path, payload in (
            (blob, b.data),
            (meta, json.dumps({"adapter_config_json": b.config_json, "head_labels": b.head_labels}).encode()),
        ):
            tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
            tmp.write_bytes(payload)
            tmp.replace(path)
        self._trim_cache(keep=blob)

    def _trim_cache(self, keep: Path) -> None:
        """Deletes the least recently used bundles (blob + metadata) until the cache holds at
        most cache_bytes; never `keep` (the one just written). Another worker sharing the folder
        may delete the same files: a missing file is no error."""
        if self.cache_bytes <= 0:
            return
        blobs = []
        for p in self.cache_dir.glob("*.safetensors"):
            with contextlib.suppress(OSError):
                st = p.stat()
                blobs.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in blobs)
        for _, size, p in sorted(blobs):
            if total <= self.cache_bytes:
                break
            if p == keep:
                continue
            for path in (p, p.with_suffix(".json")):
                with contextlib.suppress(OSError):
                    path.unlink()
            total -= size

    # -- fetch ------------------------------------------------------------------------------------
    async def fetch(self, version: str, sha256: str = "") -> FetchedBundle:
        loop = asyncio.get_running_loop()
        cached = await loop.run_in_executor(None, self._read_cache, version, sha256)
        if cached is not None:
            return cached
        meta = None
        chunks: list[bytes] = []
        try:
            async for part in self._stub().FetchAdapter(store_pb.FetchAdapterRequest(version=version)):
                if part.HasField("metadata"):
                    meta = part.metadata
                else:
                    chunks.append(part.chunk)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from err
        if meta is None:
            raise WorkerUnavailable(f"adapter store sent no metadata for {version}", reason="BAD_STORE_REPLY")
        data = b"".join(chunks)
        got = await loop.run_in_executor(None, _sha, data)
        for expected in {sha256, meta.version.sha256} - {""}:
            if got != expected:
                raise InvalidAdapter(
                    f"bundle of {version} has sha256 {got}, expected {expected}", reason="HASH_MISMATCH"
                )
        bundle = FetchedBundle(
            version, got, data, meta.adapter_config_json, {h.name: list(h.labels) for h in meta.version.heads}
        )
        await loop.run_in_executor(None, self._write_cache, bundle)
        return bundle

    async def get_tile_table(
        self, gpu_name: str, gpu_arch: str, dtype: str, timeout_s: float | None = None
    ) -> store_pb.TileTable | None:
        """The store's ATMM tile table for this GPU/arch/dtype, or None when it has none."""
        try:
            reply = await self._stub().GetTileTable(
                store_pb.GetTileTableRequest(gpu_name=gpu_name, gpu_arch=gpu_arch, dtype=dtype), timeout=timeout_s
            )
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise from_rpc_error(err) from err
        return reply.table
