"""The asyncio twin of valora.client.ValoraClient, over a grpc.aio channel.

    from valora.aio import AsyncValoraClient
    async with AsyncValoraClient("127.0.0.1:50051", api_key="...") as c:
        r = await c.infer("what digit is this?", images=[png_bytes], adapter="adapters/digits@prod")
        async for delta in c.infer_stream("describe it", images=[png_bytes]):
            print(delta)  # text deltas, then the final InferResult

The same constructor options, results, typed errors (valora.errors) and retry policy as the
synchronous client (valora.client's module-level helpers are shared, not copied): UNAVAILABLE and
a full queue's RESOURCE_EXHAUSTED with RetryInfo are retried, waiting with asyncio.sleep; a stream
only before its first message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path

import grpc

from valora.client import (
    AdapterVersion,
    InferResult,
    _adapter_name,
    _channel_credentials,
    _channel_options,
    _input,
    _metadata,
    _request,
    _retry_delay,
    _stream_out,
)
from valora_protos.v1 import admin_service_pb2 as admin_pb
from valora_protos.v1 import admin_service_pb2_grpc as admin_grpc
from valora_protos.v1 import inference_service_pb2 as inf_pb
from valora_protos.v1 import inference_service_pb2_grpc as inf_grpc
from valora_protos.v1 import resources_pb2

__all__ = ["AsyncValoraClient"]


class AsyncValoraClient:
    def __init__(
        self,
        address: str,
        api_key: str | None = None,
        admin_key: str | None = None,
        timeout_s: float = 120.0,
        retries: int = 3,
        max_message_bytes: int = 64 << 20,
        internal_token: str = "",
        tls: bool = False,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
    ):
        """The options of ValoraClient (which see). Make it inside the event loop that uses it
        (a grpc.aio channel belongs to one loop)."""
        options = _channel_options(max_message_bytes)
        credentials = _channel_credentials(tls, tls_ca, tls_cert, tls_key)
        interceptors = None
        if internal_token:
            from valora.internal_token import token_interceptors  # services only

            interceptors = token_interceptors(internal_token)
        if credentials is not None:
            self._channel = grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        self._inference = inf_grpc.InferenceServiceStub(self._channel)
        self._admin = admin_grpc.AdminServiceStub(self._channel)
        self._api_key, self._admin_key = api_key, admin_key
        self.timeout_s, self.retries = timeout_s, retries

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncValoraClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, fn, request, key):
        """`await fn(request)`, retried as ValoraClient._retrying retries; typed errors."""
        for attempt in range(self.retries + 1):
            try:
                return await fn(request, timeout=self.timeout_s, metadata=_metadata(key))
            except grpc.RpcError as raw:
                await asyncio.sleep(_retry_delay(raw, attempt, self.retries))
        raise AssertionError("unreachable")

    # -- inference -----------------------------------------------------------------------------

    async def infer(
        self,
        prompt: str = "",
        images: Iterable[bytes | str | Path] = (),
        *,
        adapter: str | None = None,
        task: str | None = None,
        label: bool = False,
        max_new_tokens: int = 0,
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        seed: int = 0,
        stop: Iterable[str] = (),
        request_id: str = "",
        min_p: float = 0.0,
        raw_prompt: bool = False,
        logprobs: bool = False,
        top_logprobs: int = 0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        prompt_token_ids: Iterable[int] = (),
        adapter_release_fraction: float = 0.0,
        adapter_release_rule: str = "",
    ) -> InferResult:
        """One request's result; the parameters of ValoraClient.infer."""
        req = _request(
            inf_pb.InferRequest,
            _input(
                prompt,
                images,
                adapter,
                task,
                label,
                max_new_tokens,
                temperature,
                top_p,
                top_k,
                seed,
                stop,
                min_p,
                raw_prompt,
                logprobs,
                top_logprobs,
                (presence_penalty, frequency_penalty, repetition_penalty),
                logit_bias,
                prompt_token_ids,
                adapter_release_fraction,
                adapter_release_rule,
            ),
            request_id,
        )
        return InferResult.from_pb((await self._call(self._inference.Infer, req, self._api_key)).result)

    async def infer_stream(
        self,
        prompt: str = "",
        images: Iterable[bytes | str | Path] = (),
        *,
        adapter: str | None = None,
        task: str | None = None,
        max_new_tokens: int = 0,
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        seed: int = 0,
        stop: Iterable[str] = (),
        request_id: str = "",
        min_p: float = 0.0,
        raw_prompt: bool = False,
        logprobs: bool = False,
        top_logprobs: int = 0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        prompt_token_ids: Iterable[int] = (),
        adapter_release_fraction: float = 0.0,
        adapter_release_rule: str = "",
    ) -> AsyncIterator[str | InferResult]:
        """Yields text deltas, then the final InferResult. Retried like `infer` until its first
        message; after that an error is raised (the output may have been seen). Leaving the loop
        early cancels the call."""
        req = _request(
            inf_pb.InferStreamRequest,
            _input(
                prompt,
                images,
                adapter,
                task,
                False,
                max_new_tokens,
                temperature,
                top_p,
                top_k,
                seed,
                stop,
                min_p,
                raw_prompt,
                logprobs,
                top_logprobs,
                (presence_penalty, frequency_penalty, repetition_penalty),
                logit_bias,
                prompt_token_ids,
                adapter_release_fraction,
                adapter_release_rule,
            ),
            request_id,
        )
        for attempt in range(self.retries + 1):
            started = False
            call = self._inference.InferStream(req, timeout=self.timeout_s, metadata=_metadata(self._api_key))
            try:
                async for msg in call:
                    started = True
                    for out in _stream_out(msg):
                        yield out
                return
            except grpc.RpcError as raw:
                delay = _retry_delay(raw, attempt, self.retries, started)
            finally:
                call.cancel()  # a no-op once the call ended; ends it when the caller stopped reading
            await asyncio.sleep(delay)

    # -- admin ---------------------------------------------------------------------------------

    async def list_adapters(self, page_size: int = 100) -> list[resources_pb2.Adapter]:
        """Every adapter (all pages)."""
        out, token = [], ""
        while True:
            r = await self._call(
                self._admin.ListAdapters,
                admin_pb.ListAdaptersRequest(page_size=page_size, page_token=token),
                self._admin_key,
            )
            out.extend(r.adapters)
            token = r.next_page_token
            if not token:
                return out

    async def get_adapter(self, name: str) -> resources_pb2.Adapter:
        """`name` is "adapters/{adapter}" or just "{adapter}"."""
        return (
            await self._call(
                self._admin.GetAdapter, admin_pb.GetAdapterRequest(name=_adapter_name(name)), self._admin_key
            )
        ).adapter

    async def list_versions(self, adapter: str, page_size: int = 100) -> list[AdapterVersion]:
        """Every version of the adapter (all pages)."""
        out, token, parent = [], "", _adapter_name(adapter)
        while True:
            r = await self._call(
                self._admin.ListAdapterVersions,
                admin_pb.ListAdapterVersionsRequest(parent=parent, page_size=page_size, page_token=token),
                self._admin_key,
            )
            out.extend(AdapterVersion.from_pb(v) for v in r.versions)
            token = r.next_page_token
            if not token:
                return out

    async def cluster_status(self) -> admin_pb.GetClusterStatusResponse:
        return await self._call(self._admin.GetClusterStatus, admin_pb.GetClusterStatusRequest(), self._admin_key)
