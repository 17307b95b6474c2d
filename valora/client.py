"""Typed Python client for valora's public gRPC API.

    from valora.client import ValoraClient
    with ValoraClient("127.0.0.1:50051", api_key="...") as c:
        r = c.infer("what digit is this?", images=[png_bytes], adapter="adapters/digits@prod")
        print(r.text, r.mode)

Retries UNAVAILABLE (the status that promises nothing ran) and a full queue's RESOURCE_EXHAUSTED
with RetryInfo, after the server's delay or a jittered backoff; a stream only before its first
message. Failures raise valora.errors' typed exceptions (grpc.RpcError subclasses carrying the
status's reason, field violations and retry delay).

valora.aio.AsyncValoraClient is the grpc.aio twin; the module-level helpers below (channel
options and credentials, metadata, request building, the retry policy) serve both.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import field_mask_pb2

from valora import errors
from valora_protos.v1 import admin_service_pb2 as admin_pb
from valora_protos.v1 import admin_service_pb2_grpc as admin_grpc
from valora_protos.v1 import inference_service_pb2 as inf_pb
from valora_protos.v1 import inference_service_pb2_grpc as inf_grpc
from valora_protos.v1 import resources_pb2, types_pb2

UPLOAD_CHUNK = 1 << 20
MAX_RETRY_DELAY_S = 10.0  # the longest a retry waits on a server's RetryInfo


@dataclass
class TokenLogprob:
    """A generated token, its log-probability and (with top_logprobs) the most likely tokens at
    its position."""

    token_id: int
    token: str
    logprob: float
    bytes: bytes
    top: list["TokenLogprob"]

    @classmethod
    def from_pb(cls, t: types_pb2.TokenLogprob) -> "TokenLogprob":
        return cls(t.token_id, t.token, t.logprob, t.bytes, [cls.from_pb(a) for a in t.top_logprobs])


@dataclass
class InferResult:
    request_id: str
    text: str
    label: str
    scores: dict[str, float]
    finish_reason: str
    mode: str
    adapter_version: str
    worker: str
    image_tokens: int
    prompt_tokens: int
    output_tokens: int
    queue_ms: float
    first_token_ms: float
    total_ms: float
    logprobs: list[TokenLogprob]  # one per generated token when asked (infer(logprobs=True))

    @classmethod
    def from_pb(cls, r: inf_pb.InferResult) -> "InferResult":
        return cls(
            request_id=r.request_id,
            text=r.text,
            label=r.label,
            scores={s.label: s.score for s in r.scores},
            finish_reason=types_pb2.FinishReason.Name(r.finish_reason).removeprefix("FINISH_REASON_").lower(),
            mode=types_pb2.InferenceMode.Name(r.mode).removeprefix("INFERENCE_MODE_").lower(),
            adapter_version=r.adapter_version,
            worker=r.worker,
            image_tokens=r.usage.image_tokens,
            prompt_tokens=r.usage.prompt_tokens,
            output_tokens=r.usage.output_tokens,
            queue_ms=r.timing.queue_ms,
            first_token_ms=r.timing.first_token_ms,
            total_ms=r.timing.total_ms,
            logprobs=[TokenLogprob.from_pb(t) for t in r.logprobs],
        )


@dataclass
class AdapterVersion:
    name: str
    sha256: str
    rank: int
    state: str
    size_bytes: int
    heads: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def from_pb(cls, v: resources_pb2.AdapterVersion) -> "AdapterVersion":
        return cls(
            v.name,
            v.sha256,
            v.rank,
            resources_pb2.AdapterVersionState.Name(v.state).removeprefix("ADAPTER_VERSION_STATE_").lower(),
            v.size_bytes,
            {h.name: list(h.labels) for h in v.heads},
        )


def _image_pb(image: bytes | str | Path) -> types_pb2.Image:
    if isinstance(image, (str, Path)):
        path = Path(image)
        mime = {
            ".png": "image/png",
            ".jpg": "image/jpeg",
            ".jpeg": "image/jpeg",
            ".webp": "image/webp",
            ".bmp": "image/bmp",
        }.get(path.suffix.lower(), "")
        return types_pb2.Image(data=path.read_bytes(), mime_type=mime)
    return types_pb2.Image(data=image)


def _input(
    prompt: str,
    images: Iterable[bytes | str | Path],
    adapter: str | None,
    task: str | None,
    label: bool,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int,
    stop: Iterable[str],
    min_p: float = 0.0,
    raw_prompt: bool = False,
    logprobs: bool = False,
    top_logprobs: int = 0,
    penalties: tuple[float, float, float] = (0.0, 0.0, 0.0),
    logit_bias: Mapping[int, float] | None = None,
    prompt_token_ids: Iterable[int] = (),
    adapter_release_fraction: float = 0.0,
    adapter_release_rule: str = "",
) -> inf_pb.InferenceInput:
    inp = inf_pb.InferenceInput(
        prompt=prompt,
        images=[_image_pb(i) for i in images],
        raw_prompt=raw_prompt,
        output_kind=types_pb2.OUTPUT_KIND_LABEL if label else types_pb2.OUTPUT_KIND_TEXT,
        params=types_pb2.GenerationParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=list(stop),
            min_p=min_p,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            presence_penalty=penalties[0],
            frequency_penalty=penalties[1],
            repetition_penalty=penalties[2],
            logit_bias=logit_bias or {},
            adapter_release_fraction=adapter_release_fraction,
            adapter_release_rule=release_rule_value(adapter_release_rule),
        ),
    )
    inp.prompt_token_ids.extend(prompt_token_ids)
    inp.raw_prompt = raw_prompt or bool(inp.prompt_token_ids)  # token ids are a raw prompt
    if adapter:
        inp.adapter = adapter
    if task:
        inp.task = task
    return inp


_RULE_PREFIX = "ADAPTER_RELEASE_RULE_"


def release_rule_name(value: int) -> str:
    """An early adapter release rule (valora.v1.AdapterReleaseRule) by name: "sentence_end", or
    "none" for UNSPECIFIED."""
    name = types_pb2.AdapterReleaseRule.Name(value).removeprefix(_RULE_PREFIX).lower()
    return "none" if name == "unspecified" else name


RELEASE_RULES = tuple(release_rule_name(v) for v in types_pb2.AdapterReleaseRule.values())


def release_rule_value(name: str) -> int:
    """The proto value of a rule named as RELEASE_RULES does ("" too: none); ValueError naming them."""
    if name in ("", "none"):
        return types_pb2.ADAPTER_RELEASE_RULE_UNSPECIFIED
    if name not in RELEASE_RULES:
        raise ValueError(f"adapter_release_rule {name!r} is not one of {', '.join(RELEASE_RULES)}")
    return types_pb2.AdapterReleaseRule.Value(_RULE_PREFIX + name.upper())


def _request(kind, inp: inf_pb.InferenceInput, request_id: str):
    """An InferRequest or InferStreamRequest (`kind`) of `inp`, under a fresh request id when none is given."""
    return kind(input=inp, request_id=request_id or uuid.uuid4().hex)


def _stream_out(msg: inf_pb.InferStreamResponse) -> Iterator[str | InferResult]:
    """What a stream message gives the caller: its text delta, then its final result."""
    if msg.text_delta:
        yield msg.text_delta
    if msg.HasField("result"):
        yield InferResult.from_pb(msg.result)


def _adapter_name(name: str) -> str:
    return name if name.startswith("adapters/") else f"adapters/{name}"


def _metadata(key: str | None, request_id: str = "") -> list[tuple[str, str]]:
    md = [("authorization", f"Bearer {key}")] if key else []
    if request_id:
        md.append(("x-request-id", request_id))
    return md


def _channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", max_message_bytes), ("grpc.max_send_message_length", max_message_bytes)]


def _channel_credentials(
    tls: bool, tls_ca: str | Path | None, tls_cert: str | Path | None, tls_key: str | Path | None
) -> grpc.ChannelCredentials | None:
    """TLS credentials when `tls` or any tls_* is set (see ValoraClient); None: plaintext."""
    if not (tls or tls_ca or tls_cert or tls_key):
        return None
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("tls_cert and tls_key go together (mutual TLS)")

    def read(path):
        return Path(path).expanduser().read_bytes() if path else None

    return grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))


def _retryable(err: errors.ValoraRpcError) -> bool:
    return isinstance(err, errors.Unavailable) or (
        isinstance(err, errors.ResourceExhausted) and err.retry_after_s is not None
    )


def _backoff(err: errors.ValoraRpcError, attempt: int) -> float:
    if err.retry_after_s is not None:
        return min(err.retry_after_s, MAX_RETRY_DELAY_S)
    return random.uniform(0, min(0.2 * 2**attempt, 2.0))  # full jitter: retrying clients spread out


def _retry_delay(raw: grpc.RpcError, attempt: int, retries: int, started: bool = False) -> float:
    """How long to wait before retrying a failed `attempt` (0 .. `retries`); raises its typed error
    instead on the last attempt, once a stream has `started`, and for a status not to retry."""
    err = errors.from_rpc_error(raw)
    if started or attempt == retries or not _retryable(err):
        raise err from None
    return _backoff(err, attempt)


class ValoraClient:
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
        """`tls` (implied by any tls_*): TLS, the server verified against `tls_ca` (PEM file;
        default: the system roots); `tls_cert` + `tls_key`: this client's certificate (mutual
        TLS). `internal_token`: the cluster's internal token, for an adapter store's AdminService
        addressed directly (the generation runner); a gateway needs only the keys."""
        options = _channel_options(max_message_bytes)
        credentials = _channel_credentials(tls, tls_ca, tls_cert, tls_key)
        if credentials is not None:
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        if internal_token:
            from valora.internal_token import with_token  # services only

            self._channel = with_token(self._channel, internal_token)
        self._inference = inf_grpc.InferenceServiceStub(self._channel)
        self._admin = admin_grpc.AdminServiceStub(self._channel)
        self._api_key, self._admin_key = api_key, admin_key
        self.timeout_s, self.retries = timeout_s, retries

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "ValoraClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _retrying(self, call):
        """`call()` again on UNAVAILABLE, and on RESOURCE_EXHAUSTED that carries RetryInfo (a full
        queue), up to `retries` times: after the server's delay when it gave one, else after a
        jittered exponential backoff. Errors are valora.errors' typed ones."""
        for attempt in range(self.retries + 1):
            try:
                return call()
            except grpc.RpcError as raw:
                self._retry_or_raise(raw, attempt)
        raise AssertionError("unreachable")

    def _retry_or_raise(self, raw: grpc.RpcError, attempt: int, started: bool = False) -> None:
        """Raises the typed error of a failed `attempt`, or waits before the next one."""
        time.sleep(_retry_delay(raw, attempt, self.retries, started))

    def _call(self, fn, request, key):
        return self._retrying(lambda: fn(request, timeout=self.timeout_s, metadata=_metadata(key)))

    # -- inference -----------------------------------------------------------------------------

    def infer(
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
        """One request's result. `raw_prompt`: `prompt` is the model's whole input text (no chat
        template; then no images); `prompt_token_ids`: that input as token ids instead (no
        `prompt`; raw_prompt implied). `logprobs`: each generated token's log-probability in the
        result, with the `top_logprobs` (<= 20) most likely tokens at its position. Penalties as
        OpenAI's (presence, frequency) and vLLM's (repetition; 0 = off); `logit_bias` as OpenAI's
        (token id -> a bias in [-100, 100] added to its logit). `adapter_release_fraction`: early
        adapter release after that share of max_new_tokens, in [0, 1]; `adapter_release_rule`:
        "sentence_end" releases it after the answer's first sentence or line instead (the fraction
        then the least share before it counts). Neither set: the task's policy, if any, else never."""
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
        return InferResult.from_pb(self._call(self._inference.Infer, req, self._api_key).result)

    def infer_stream(
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
    ) -> Iterator[str | InferResult]:
        """Yields text deltas, then the final InferResult. Retried like `infer` until its first
        message; after that an error is raised (the output may have been seen)."""
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
            try:
                for msg in self._inference.InferStream(req, timeout=self.timeout_s, metadata=_metadata(self._api_key)):
                    started = True
                    yield from _stream_out(msg)
                return
            except grpc.RpcError as raw:
                self._retry_or_raise(raw, attempt, started)

    # -- admin ---------------------------------------------------------------------------------

    def create_adapter(self, adapter_id: str, description: str = "", request_id: str = "") -> str:
        r = self._call(
            self._admin.CreateAdapter,
            admin_pb.CreateAdapterRequest(adapter_id=adapter_id, description=description, request_id=request_id),
            self._admin_key,
        )
        return r.adapter.name

    def list_adapters(self, page_size: int = 100) -> list[resources_pb2.Adapter]:
        out, token = [], ""
        while True:
            r = self._call(
                self._admin.ListAdapters,
                admin_pb.ListAdaptersRequest(page_size=page_size, page_token=token),
                self._admin_key,
            )
            out.extend(r.adapters)
            token = r.next_page_token
            if not token:
                return out

    def get_adapter(self, name: str) -> resources_pb2.Adapter:
        """`name` is "adapters/{adapter}" or just "{adapter}"."""
        return self._call(
            self._admin.GetAdapter, admin_pb.GetAdapterRequest(name=_adapter_name(name)), self._admin_key
        ).adapter

    def delete_adapter(self, name: str, etag: str = "") -> None:
        """Retires every version and removes the adapter's aliases and name; FAILED_PRECONDITION
        while a task uses it. `etag` (get_adapter(...).etag): only if it has not changed since,
        else ABORTED (reason ETAG_MISMATCH)."""
        self._call(
            self._admin.DeleteAdapter,
            admin_pb.DeleteAdapterRequest(name=_adapter_name(name), etag=etag),
            self._admin_key,
        )

    def upload_adapter_version(
        self,
        adapter: str,
        bundle: bytes,
        adapter_config_json: str,
        heads: dict[str, list[str]] | None = None,
        request_id: str = "",
    ) -> AdapterVersion:
        """Registers a safetensors bundle under `adapters/{adapter}`; idempotent per request_id."""
        request_id = request_id or uuid.uuid4().hex
        import hashlib

        meta = admin_pb.UploadAdapterVersionMetadata(
            parent=adapter if adapter.startswith("adapters/") else f"adapters/{adapter}",
            adapter_config_json=adapter_config_json,
            sha256=hashlib.sha256(bundle).hexdigest(),
            request_id=request_id,
            heads=[resources_pb2.TaskHead(name=n, labels=labels) for n, labels in (heads or {}).items()],
        )

        def parts():
            yield admin_pb.UploadAdapterVersionRequest(metadata=meta)
            for i in range(0, len(bundle), UPLOAD_CHUNK):
                yield admin_pb.UploadAdapterVersionRequest(chunk=bundle[i : i + UPLOAD_CHUNK])

        r = self._retrying(
            lambda: self._admin.UploadAdapterVersion(
                parts(), timeout=self.timeout_s, metadata=_metadata(self._admin_key)
            )
        )
        return AdapterVersion.from_pb(r.version)

    def list_versions(self, adapter: str, page_size: int = 100) -> list[AdapterVersion]:
        """Every version of the adapter (all pages)."""
        out, token = [], ""
        parent = _adapter_name(adapter)
        while True:
            r = self._call(
                self._admin.ListAdapterVersions,
                admin_pb.ListAdapterVersionsRequest(parent=parent, page_size=page_size, page_token=token),
                self._admin_key,
            )
            out.extend(AdapterVersion.from_pb(v) for v in r.versions)
            token = r.next_page_token
            if not token:
                return out

    def get_version(self, name: str) -> AdapterVersion:
        """`name` is "adapters/{adapter}/versions/{version}" (or without "adapters/")."""
        return AdapterVersion.from_pb(
            self._call(
                self._admin.GetAdapterVersion,
                admin_pb.GetAdapterVersionRequest(name=_adapter_name(name)),
                self._admin_key,
            ).version
        )

    def delete_version(self, name: str) -> None:
        """Marks the version RETIRED; FAILED_PRECONDITION while an alias or task points at it."""
        self._call(
            self._admin.DeleteAdapterVersion,
            admin_pb.DeleteAdapterVersionRequest(name=_adapter_name(name)),
            self._admin_key,
        )

    def set_alias(self, adapter: str, alias: str, version: str, etag: str = "") -> str:
        r = self._call(
            self._admin.SetAlias,
            admin_pb.SetAliasRequest(adapter=adapter, alias=alias, version=version, etag=etag),
            self._admin_key,
        )
        return r.etag

    def delete_alias(self, adapter: str, alias: str) -> None:
        self._call(
            self._admin.DeleteAlias,
            admin_pb.DeleteAliasRequest(adapter=_adapter_name(adapter), alias=alias),
            self._admin_key,
        )

    def create_task(
        self,
        task_id: str,
        adapter: str,
        head: str = "",
        description: str = "",
        accuracy_threshold: float = 0.0,
        measured_accuracy: float = 0.0,
        slo_ms: float = 0.0,
        slo_class: str = "",
        adapter_release_fraction: float = 0.0,
        adapter_release_rule: str = "",
    ) -> resources_pb2.Task:
        """`slo_ms`: the latency objective of the task's requests (0: none); `slo_class`: the
        application it counts under (empty: the task's id); `adapter_release_fraction` and
        `adapter_release_rule` ("sentence_end"; "" or "none": no rule): the early adapter release
        of its requests that set none of their own (as infer's; 0 and no rule: off)."""
        r = self._call(
            self._admin.CreateTask,
            admin_pb.CreateTaskRequest(
                task_id=task_id,
                task=resources_pb2.Task(
                    adapter=adapter,
                    head=head,
                    description=description,
                    accuracy_threshold=accuracy_threshold,
                    measured_accuracy=measured_accuracy,
                    slo_ms=slo_ms,
                    slo_class=slo_class,
                    adapter_release_fraction=adapter_release_fraction,
                    adapter_release_rule=release_rule_value(adapter_release_rule),
                ),
            ),
            self._admin_key,
        )
        return r.task

    def get_task(self, name: str) -> resources_pb2.Task:
        """`name` is "tasks/{task}" or just "{task}"."""
        name = name if name.startswith("tasks/") else f"tasks/{name}"
        return self._call(self._admin.GetTask, admin_pb.GetTaskRequest(name=name), self._admin_key).task

    def update_task(
        self,
        name: str,
        *,
        description: str | None = None,
        slo_ms: float | None = None,
        slo_class: str | None = None,
        adapter_release_fraction: float | None = None,
        adapter_release_rule: str | None = None,
        etag: str = "",
    ) -> resources_pb2.Task:
        """Changes the fields given (the others stay as they are); returns the task as it is now.
        `slo_ms=0` alone clears the class too; `adapter_release_rule="none"` clears the rule (the
        fraction stays). `etag` (get_task(...).etag): only if the task has
        not changed since, else ABORTED (reason ETAG_MISMATCH). INVALID_ARGUMENT for bad values
        or no field given, NOT_FOUND for no such task."""
        name = name if name.startswith("tasks/") else f"tasks/{name}"
        task = resources_pb2.Task(name=name)
        rule = None if adapter_release_rule is None else release_rule_value(adapter_release_rule)
        paths = []
        for path, value in (
            ("description", description),
            ("slo_ms", slo_ms),
            ("slo_class", slo_class),
            ("adapter_release_fraction", adapter_release_fraction),
            ("adapter_release_rule", rule),
        ):
            if value is not None:
                setattr(task, path, value)
                paths.append(path)
        r = self._call(
            self._admin.UpdateTask,
            admin_pb.UpdateTaskRequest(task=task, update_mask=field_mask_pb2.FieldMask(paths=paths), etag=etag),
            self._admin_key,
        )
        return r.task

    def list_tasks(self, page_size: int = 100) -> list[resources_pb2.Task]:
        """Every task (all pages)."""
        out, token = [], ""
        while True:
            r = self._call(
                self._admin.ListTasks, admin_pb.ListTasksRequest(page_size=page_size, page_token=token), self._admin_key
            )
            out.extend(r.tasks)
            token = r.next_page_token
            if not token:
                return out

    def delete_task(self, name: str) -> None:
        name = name if name.startswith("tasks/") else f"tasks/{name}"
        self._call(self._admin.DeleteTask, admin_pb.DeleteTaskRequest(name=name), self._admin_key)

    # -- generation jobs -----------------------------------------------------------------------

    def create_generation_job(
        self,
        base_model: str,
        sources: dict[str, float] | Iterable[tuple[str, float] | tuple[str, float, str]],
        *,
        rank: int = 0,
        epochs: int = 0,
        adapter_prefix: str = "",
        split_limit: int = 0,
        job_id: str = "",
        request_id: str = "",
        fusion_order: str = "",
    ) -> resources_pb2.GenerationJob:
        """Queues accuracy-aware adapter generation: `sources` maps task -> accuracy threshold, in
        fusion order (`fusion_order` "probed": in an order the runner chooses from interference
        probes); a (task, threshold, "datasets/{sha256}") item names a task of a dataset
        uploaded with `upload_dataset`. Idempotent per request_id (one is made up when not given)."""
        items = sources.items() if isinstance(sources, dict) else sources
        job = resources_pb2.GenerationJob(
            base_model=base_model,
            rank=rank,
            epochs=epochs,
            adapter_prefix=adapter_prefix,
            split_limit=split_limit,
            fusion_order=fusion_order,
            sources=[
                resources_pb2.GenerationSource(
                    task=item[0], accuracy_threshold=item[1], dataset=item[2] if len(item) > 2 else ""
                )
                for item in items
            ],
        )
        r = self._call(
            self._admin.CreateGenerationJob,
            admin_pb.CreateGenerationJobRequest(job_id=job_id, job=job, request_id=request_id or uuid.uuid4().hex),
            self._admin_key,
        )
        return r.job

    def upload_dataset(self, archive: bytes) -> resources_pb2.Dataset:
        """Uploads a dataset archive (.tar[.gz] or .zip of an image folder or a JSONL file) for
        generation jobs; returns its `datasets/{sha256}` (the same bytes give the same name)."""
        import hashlib

        meta = admin_pb.UploadDatasetMetadata(sha256=hashlib.sha256(archive).hexdigest())

        def parts():
            yield admin_pb.UploadDatasetRequest(metadata=meta)
            for i in range(0, len(archive), UPLOAD_CHUNK):
                yield admin_pb.UploadDatasetRequest(chunk=archive[i : i + UPLOAD_CHUNK])

        r = self._retrying(
            lambda: self._admin.UploadDataset(parts(), timeout=self.timeout_s, metadata=_metadata(self._admin_key))
        )
        return r.dataset

    @staticmethod
    def _job_name(name: str) -> str:
        return name if name.startswith("generationJobs/") else f"generationJobs/{name}"

    def get_generation_job(self, name: str) -> resources_pb2.GenerationJob:
        """`name` is "generationJobs/{job}" or just "{job}"."""
        return self._call(
            self._admin.GetGenerationJob, admin_pb.GetGenerationJobRequest(name=self._job_name(name)), self._admin_key
        ).job

    def list_generation_jobs(self, page_size: int = 100) -> list[resources_pb2.GenerationJob]:
        out, token = [], ""
        while True:
            r = self._call(
                self._admin.ListGenerationJobs,
                admin_pb.ListGenerationJobsRequest(page_size=page_size, page_token=token),
                self._admin_key,
            )
            out.extend(r.jobs)
            token = r.next_page_token
            if not token:
                return out

    def cancel_generation_job(self, name: str) -> resources_pb2.GenerationJob:
        return self._call(
            self._admin.CancelGenerationJob,
            admin_pb.CancelGenerationJobRequest(name=self._job_name(name)),
            self._admin_key,
        ).job

    def cluster_status(self) -> admin_pb.GetClusterStatusResponse:
        return self._call(self._admin.GetClusterStatus, admin_pb.GetClusterStatusRequest(), self._admin_key)
