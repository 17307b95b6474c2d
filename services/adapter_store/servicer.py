"""gRPC handlers: valora.v1.AdminService (registry part) and
valora.internal.v1.AdapterStoreService. They parse names, convert protobuf at the edge and run
the registry's blocking work in the store's executor."""

from __future__ import annotations

import asyncio
import functools
import mmap
import re
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from concurrent.futures import Executor
from datetime import timedelta
from typing import TypeVar

import grpc

from valora_protos.internal.v1 import adapter_store_service_pb2 as store_pb
from valora_protos.internal.v1 import adapter_store_service_pb2_grpc as store_grpc
from valora_protos.v1 import admin_service_pb2 as admin_pb
from valora_protos.v1 import admin_service_pb2_grpc as admin_grpc

from services.common import names
from services.common.errors import (
    FailedPrecondition,
    FieldViolation,
    NotFound,
    ValoraError,
    WorkerUnavailable,
    invalid_field,
)

from services.adapter_store import convert
from services.adapter_store.domain import PageRequest
from services.adapter_store.blobs import BlobIntegrityError
from services.adapter_store.jobs import GenerationJobs, parse_dataset_name, parse_job_name
from services.adapter_store.registry import Registry
from services.adapter_store.tile_tables import TileTables
from services.adapter_store.validation import BundleChecker

R = TypeVar("R")


class _Blocking:
    def __init__(self, executor: Executor, timeout_s: float = 60.0) -> None:
        """`timeout_s`: the longest a call waits for the database or blob store; past it the call
        is UNAVAILABLE (a black-holed backend holds its thread until the link breaks or answers)."""
        self._executor = executor
        self._timeout_s = timeout_s

    async def run(self, fn: Callable[..., R], *args, **kwargs) -> R:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(
                loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs)), self._timeout_s
            )
        except TimeoutError:
            raise WorkerUnavailable(
                f"storage backend did not answer within {self._timeout_s:g} s; retry",
                reason="BACKEND_TIMEOUT",
                retry_after_s=1.0,
            ) from None
        except Exception as exc:
            if _backend_down(exc):  # an outage of Postgres or S3 is UNAVAILABLE, not a bug (INTERNAL)
                raise WorkerUnavailable(
                    f"storage backend unavailable ({type(exc).__name__}); retry",
                    reason="BACKEND_UNAVAILABLE",
                    retry_after_s=1.0,
                ) from exc
            raise


def _backend_down(exc: BaseException) -> bool:
    """A lost/refused database or blob-store connection (not a bad query, not a domain error)."""
    from sqlalchemy import exc as sa_exc
    from urllib3 import exceptions as http_exc

    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated or isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)):
            return True
        return _lost_connection_underneath(exc.orig)
    return isinstance(exc, (http_exc.HTTPError, ConnectionError, TimeoutError))


def _lost_connection_underneath(error: BaseException | None) -> bool:
    """Whether a driver error was raised while handling a lost connection. SQLAlchemy's psycopg
    ping restores autocommit in a `finally`: when the link died mid-command, that raises
    ProgrammingError ("can't change 'autocommit' now: connection in transaction status ACTIVE")
    over the OperationalError that says what happened, which stays in the exception's context."""
    import psycopg

    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, (psycopg.OperationalError, psycopg.InterfaceError)):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


class AdminServicer(admin_grpc.AdminServiceServicer, _Blocking):
    def __init__(
        self,
        registry: Registry,
        checker: BundleChecker,
        executor: Executor,
        spool_dir: str = "",
        jobs: GenerationJobs | None = None,
        timeout_s: float = 60.0,
        max_dataset_bytes: int = 1 << 30,
    ) -> None:
        _Blocking.__init__(self, executor, timeout_s)
        self.registry = registry
        self.jobs = jobs or GenerationJobs(registry.sessions)
        self.checker = checker
        self.spool_dir = spool_dir
        self.max_dataset_bytes = max_dataset_bytes

    # adapters
    async def CreateAdapter(self, request, context):
        adapter_id = names.check_id(request.adapter_id, "adapter_id")
        a = await self.run(self.registry.create_adapter, adapter_id, request.description, request.request_id or None)
        return admin_pb.CreateAdapterResponse(adapter=convert.adapter_to_pb(a))

    async def GetAdapter(self, request, context):
        a = await self.run(self.registry.get_adapter, names.parse_adapter_name(request.name))
        return admin_pb.GetAdapterResponse(adapter=convert.adapter_to_pb(a))

    async def ListAdapters(self, request, context):
        page = await self.run(self.registry.list_adapters, PageRequest.parse(request.page_size, request.page_token))
        return admin_pb.ListAdaptersResponse(
            adapters=[convert.adapter_to_pb(a) for a in page.items], next_page_token=page.next_page_token
        )

    async def DeleteAdapter(self, request, context):
        await self.run(self.registry.delete_adapter, names.parse_adapter_name(request.name), request.etag)
        return admin_pb.DeleteAdapterResponse()

    # versions
    async def UploadAdapterVersion(self, request_iterator, context):
        """Metadata first, then chunks spooled to a temp file (never all in memory) under the
        size limit; validation and registration read it through mmap in the executor."""
        done = []

        async def metadata(msg):
            req = convert.upload_from_pb(msg)
            if req.request_id and req.sha256:  # a retry that names its bytes needs no bytes
                found = await self.run(self.registry.find_upload, req.request_id)
                if found is not None and (found.adapter_id, found.sha256) == (req.adapter_id, req.sha256):
                    done.append(found)
                    return None
            return req

        req, spool, size = await self._spooled(request_iterator, metadata, self.checker.check_size, "valora-upload-")
        if spool is None:
            return admin_pb.UploadAdapterVersionResponse(version=convert.version_to_pb(done[0]))
        try:
            version = await self.run(self._register_spooled, req, spool, size)
        finally:
            await self.run(spool.close)
        return admin_pb.UploadAdapterVersionResponse(version=convert.version_to_pb(version))

    async def _spooled(self, request_iterator, metadata, check_size, prefix: str):
        """An upload stream read: its first message must carry the metadata, which
        `await metadata(msg.metadata)` turns into what the caller needs — or None when the caller
        answers without the bytes (the rest of the stream is drained: returns (None, None, 0));
        then its chunks go to a temp file, never all in memory, `check_size(bytes so far)`
        raising once there are too many. Returns (metadata's value, the spool, its size); the
        caller closes the spool. On an error the stream is drained (a ValoraError) and the spool
        closed."""
        head, spool, size = None, None, 0
        try:
            async for msg in request_iterator:
                try:
                    part = msg.WhichOneof("part")
                    if spool is None:
                        if part != "metadata":
                            raise invalid_field("metadata", "the first message must carry the metadata")
                        head = await metadata(msg.metadata)
                        if head is None:
                            await _drain(request_iterator)
                            return None, None, 0
                        spool = await self.run(tempfile.TemporaryFile, prefix=prefix, dir=self.spool_dir or None)
                    elif part == "chunk":
                        size += len(msg.chunk)
                        check_size(size)
                        await self.run(spool.write, msg.chunk)
                    else:
                        raise invalid_field("metadata", "sent more than once")
                except ValoraError:
                    await _drain(request_iterator)
                    raise
            if spool is None:
                raise invalid_field("metadata", "the stream carried no metadata")
        except BaseException:
            if spool is not None:
                await self.run(spool.close)
            raise
        return head, spool, size

    def _register_spooled(self, req, spool, size: int):
        spool.flush()
        if size == 0:
            return self.registry.register(req, self.checker.check(req, b""), self.checker.base_model, b"")
        with mmap.mmap(spool.fileno(), 0, access=mmap.ACCESS_READ) as view:
            bundle = self.checker.check(req, view)
        spool.seek(0)
        return self.registry.register(req, bundle, self.checker.base_model, spool)

    async def GetAdapterVersion(self, request, context):
        v = await self.run(self.registry.get_version, *names.parse_version_name(request.name))
        return admin_pb.GetAdapterVersionResponse(version=convert.version_to_pb(v))

    async def ListAdapterVersions(self, request, context):
        adapter_id = names.parse_adapter_name(request.parent, "parent")
        page = await self.run(
            self.registry.list_versions, adapter_id, PageRequest.parse(request.page_size, request.page_token)
        )
        return admin_pb.ListAdapterVersionsResponse(
            versions=[convert.version_to_pb(v) for v in page.items], next_page_token=page.next_page_token
        )

    async def DeleteAdapterVersion(self, request, context):
        await self.run(self.registry.delete_version, *names.parse_version_name(request.name))
        return admin_pb.DeleteAdapterVersionResponse()

    # aliases
    async def SetAlias(self, request, context):
        adapter_id = names.parse_adapter_name(request.adapter, "adapter")
        alias = names.check_id(request.alias, "alias")
        target_adapter, version = names.parse_version_name(request.version, "version")
        if target_adapter != adapter_id:
            raise invalid_field("version", f"{request.version!r} is not a version of {request.adapter!r}")
        a = await self.run(self.registry.set_alias, adapter_id, alias, version, request.etag)
        return admin_pb.SetAliasResponse(
            alias=a.alias, version=names.version_name(a.adapter_id, a.version), etag=a.etag
        )

    async def DeleteAlias(self, request, context):
        adapter_id = names.parse_adapter_name(request.adapter, "adapter")
        await self.run(self.registry.delete_alias, adapter_id, names.check_id(request.alias, "alias"))
        return admin_pb.DeleteAliasResponse()

    # tasks
    async def CreateTask(self, request, context):
        t = await self.run(self.registry.create_task, convert.task_from_pb(request.task_id, request.task))
        return admin_pb.CreateTaskResponse(task=convert.task_to_pb(t))

    async def GetTask(self, request, context):
        t = await self.run(self.registry.get_task, names.parse_task_name(request.name, "name"))
        return admin_pb.GetTaskResponse(task=convert.task_to_pb(t))

    async def ListTasks(self, request, context):
        page = await self.run(self.registry.list_tasks, PageRequest.parse(request.page_size, request.page_token))
        return admin_pb.ListTasksResponse(
            tasks=[convert.task_to_pb(t) for t in page.items], next_page_token=page.next_page_token
        )

    async def UpdateTask(self, request, context):
        task_id, changes = convert.task_update_from_pb(request)
        t = await self.run(self.registry.update_task, task_id, changes, request.etag)
        return admin_pb.UpdateTaskResponse(task=convert.task_to_pb(t))

    async def DeleteTask(self, request, context):
        await self.run(self.registry.delete_task, names.parse_task_name(request.name, "name"))
        return admin_pb.DeleteTaskResponse()

    async def GetClusterStatus(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "cluster status is served by the gateway")

    # generation jobs
    async def CreateGenerationJob(self, request, context):
        spec = convert.job_spec_from_pb(request.job_id, request.job)
        if len(request.request_id) > 128:
            raise invalid_field("request_id", "at most 128 characters")
        for i, src in enumerate(spec.sources):
            if src.dataset:
                try:
                    await self.run(self.registry.get_dataset, parse_dataset_name(src.dataset))
                except NotFound as exc:
                    raise FailedPrecondition(
                        f"job.sources[{i}].dataset: {exc.message}",
                        reason=exc.reason,
                        field_violations=[FieldViolation(f"job.sources[{i}].dataset", exc.message)],
                    ) from None
        j = await self.run(self.jobs.create, request.job_id, spec, request.request_id or None)
        return admin_pb.CreateGenerationJobResponse(job=convert.job_to_pb(j))

    async def GetGenerationJob(self, request, context):
        j = await self.run(self.jobs.get, parse_job_name(request.name))
        return admin_pb.GetGenerationJobResponse(job=convert.job_to_pb(j))

    async def ListGenerationJobs(self, request, context):
        page = await self.run(self.jobs.list, PageRequest.parse(request.page_size, request.page_token))
        return admin_pb.ListGenerationJobsResponse(
            jobs=[convert.job_to_pb(j) for j in page.items], next_page_token=page.next_page_token
        )

    async def CancelGenerationJob(self, request, context):
        j = await self.run(self.jobs.cancel, parse_job_name(request.name))
        return admin_pb.CancelGenerationJobResponse(job=convert.job_to_pb(j))

    async def UploadDataset(self, request_iterator, context):
        """Metadata (the sha256) first, then chunks spooled to a temp file under max_dataset_bytes;
        the archive must be a .tar[.gz] or .zip (what is inside is the runner's to validate)."""

        async def metadata(msg):
            if not re.fullmatch(r"[0-9a-f]{64}", msg.sha256):
                raise invalid_field("metadata.sha256", "must be the archive's hex sha256 (lowercase)")
            return msg.sha256

        def check_size(size: int) -> None:
            if size > self.max_dataset_bytes:
                raise invalid_field(
                    "chunk",
                    f"the dataset is larger than {self.max_dataset_bytes} bytes (the store's max_dataset_bytes)",
                    reason="DATASET_TOO_LARGE",
                )

        sha256, spool, size = await self._spooled(request_iterator, metadata, check_size, "valora-dataset-")
        try:
            d = await self.run(self._put_spooled_dataset, sha256, spool, size)
        finally:
            await self.run(spool.close)
        return admin_pb.UploadDatasetResponse(dataset=convert.dataset_to_pb(d))

    def _put_spooled_dataset(self, sha256: str, spool, size: int):
        spool.flush()
        spool.seek(0)
        is_zip = zipfile.is_zipfile(spool)
        spool.seek(0)
        if not is_zip:
            try:
                with tarfile.open(fileobj=spool, mode="r:*") as tar:
                    tar.next()
            except (tarfile.TarError, EOFError, OSError):
                raise invalid_field(
                    "chunk", "the dataset must be a .tar, .tar.gz or .zip archive", reason="DATASET_NOT_AN_ARCHIVE"
                ) from None
        spool.seek(0)
        try:
            return self.registry.put_dataset(sha256, spool, size)
        except BlobIntegrityError:
            raise invalid_field("metadata.sha256", "the bytes received do not hash to it") from None


class AdapterStoreServicer(store_grpc.AdapterStoreServiceServicer, _Blocking):
    def __init__(
        self,
        registry: Registry,
        executor: Executor,
        chunk_bytes: int,
        jobs: GenerationJobs | None = None,
        tile_tables: TileTables | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        _Blocking.__init__(self, executor, timeout_s)
        self.registry = registry
        self.chunk_bytes = chunk_bytes
        self.jobs = jobs or GenerationJobs(registry.sessions)
        self.tile_tables = tile_tables or TileTables(registry.sessions)

    async def PutTileTable(self, request, context):
        t = await self.run(self.tile_tables.put, request.gpu_name, request.gpu_arch, request.dtype, request.table_json)
        return store_pb.PutTileTableResponse(table=convert.tile_table_to_pb(t))

    async def GetTileTable(self, request, context):
        t = await self.run(self.tile_tables.get, request.gpu_name, request.gpu_arch, request.dtype)
        return store_pb.GetTileTableResponse(table=convert.tile_table_to_pb(t))

    async def ClaimGenerationJob(self, request, context):
        if len(request.runner) > 128:
            raise invalid_field("runner", "at most 128 characters")
        c = await self.run(self.jobs.claim, request.runner or "runner")
        if c is None:
            return store_pb.ClaimGenerationJobResponse()
        out = store_pb.ClaimGenerationJobResponse(
            job=convert.job_to_pb(c.job), lease_id=c.lease_id, attempt=c.attempt, max_attempts=c.max_attempts
        )
        out.lease_duration.FromTimedelta(timedelta(seconds=c.lease_s))
        return out

    async def UpdateGenerationJob(self, request, context):
        result = convert.job_result_from_pb(request.result) if request.HasField("result") else None
        j = await self.run(
            self.jobs.update,
            parse_job_name(request.name),
            request.lease_id,
            convert.job_state_from_pb(request.state),
            request.progress,
            request.message,
            result,
            request.error,
        )
        return store_pb.UpdateGenerationJobResponse(job=convert.job_to_pb(j))

    async def FetchDataset(self, request, context):
        chunks = await self.run(self.registry.open_dataset, parse_dataset_name(request.name))
        async for chunk in self._rechunked(chunks):
            yield store_pb.FetchDatasetResponse(chunk=chunk)

    async def ResolveReference(self, request, context):
        r = await self.run(self.registry.resolve, request.reference)
        return store_pb.ResolveReferenceResponse(
            version=convert.version_to_pb(r.version), task=convert.task_to_pb(r.task) if r.task else None
        )

    async def FetchAdapter(self, request, context):
        adapter_id, version = names.parse_version_name(request.version, "version")
        v, chunks = await self.run(self.registry.open_ready, adapter_id, version)
        yield store_pb.FetchAdapterResponse(
            metadata=store_pb.FetchAdapterMetadata(
                version=convert.version_to_pb(v), adapter_config_json=v.adapter_config_json
            )
        )
        async for chunk in self._rechunked(chunks):
            yield store_pb.FetchAdapterResponse(chunk=chunk)

    async def _rechunked(self, chunks):
        """The blob's byte pieces (a blocking iterator, read on the store's threads) as messages of
        chunk_bytes each, the last shorter; the iterator closed however the stream ends."""
        buf = bytearray()
        sentinel = object()
        try:
            while True:
                piece = await self.run(next, chunks, sentinel)
                if piece is sentinel:
                    break
                buf += piece
                while len(buf) >= self.chunk_bytes:
                    yield bytes(buf[: self.chunk_bytes])
                    del buf[: self.chunk_bytes]
            if buf:
                yield bytes(buf)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                await self.run(close)


async def _drain(request_iterator, limit_bytes: int = 16 << 20) -> None:
    """Reads what the client still sends (up to `limit_bytes`) before answering early. A client
    (or the gateway relaying one) whose stream is answered mid-send sees grpc core's INTERNAL
    "Internal error from Core" instead of our status; past the limit we answer anyway."""
    seen = 0
    try:
        async for msg in request_iterator:
            seen += msg.ByteSize()
            if seen > limit_bytes:
                return
    except Exception:  # the client went away: nothing left to drain
        return
