"""Content-addressed bundle storage behind one interface: a local directory (embedded mode)
or an S3/MinIO bucket through the `minio` client. Keys are `blobs/sha256/<hex>`. All methods
block; callers on the event loop run them in an executor."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

_HEX = re.compile(r"^[0-9a-f]{64}$")
KEY_PREFIX = "blobs/sha256/"
READ_CHUNK = 1 << 20


class BlobIntegrityError(Exception):
    """The bytes stored do not hash to the key they were stored under."""


@dataclass(frozen=True)
class BlobInfo:
    sha256: str
    size: int
    modified: datetime  # naive UTC


def blob_key(sha256: str) -> str:
    if not _HEX.fullmatch(sha256):
        raise ValueError(f"not a hex sha256: {sha256!r}")
    return KEY_PREFIX + sha256


def _as_stream(data: bytes | bytearray | memoryview | BinaryIO) -> BinaryIO:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return io.BytesIO(data)
    return data


class BlobStore(ABC):
    """Blobs named by the sha256 of their bytes."""

    @abstractmethod
    def put(self, sha256: str, data: bytes | bytearray | memoryview | BinaryIO, size: int) -> None:
        """Store `size` bytes under `sha256`; raises BlobIntegrityError if they do not hash to it.
        Overwrites (refreshing the modification time, which GC's grace period relies on)."""

    @abstractmethod
    def open(self, sha256: str) -> Iterator[bytes]:
        """The blob's bytes in chunks; FileNotFoundError if absent."""

    @abstractmethod
    def stat(self, sha256: str) -> BlobInfo | None:
        """Size and modification time, or None when absent."""

    def exists(self, sha256: str) -> bool:
        return self.stat(sha256) is not None

    @abstractmethod
    def delete(self, sha256: str) -> None:
        """Remove the blob; absent blobs are fine."""

    @abstractmethod
    def list(self) -> Iterator[BlobInfo]:
        """Every blob in the store."""

    def read_all(self, sha256: str) -> bytes:
        return b"".join(self.open(sha256))

    @abstractmethod
    def ping(self) -> None:
        """Raises when the store cannot be reached (health checks)."""

    def remove_partial(self, older_than: datetime) -> int:
        """Remove leftovers of writes that died midway (older than `older_than`); returns how
        many. S3 keeps none visible (an unfinished multipart upload is not an object; a bucket
        lifecycle rule AbortIncompleteMultipartUpload reclaims its parts)."""
        return 0


class LocalBlobStore(BlobStore):
    """Files under `root/blobs/sha256/<hex>`, written to a temp file, hashed, then renamed."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.dir = self.root / KEY_PREFIX
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, sha256: str) -> Path:
        return self.root / blob_key(sha256)

    def ping(self) -> None:
        if not self.dir.is_dir():
            raise FileNotFoundError(f"blob directory {self.dir} is gone")

    def put(self, sha256, data, size):
        path = self._path(sha256)
        stream = _as_stream(data)
        digest = hashlib.sha256()
        written = 0
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                while chunk := stream.read(READ_CHUNK):
                    digest.update(chunk)
                    written += len(chunk)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            if written != size or digest.hexdigest() != sha256:
                raise BlobIntegrityError(
                    f"blob {sha256}: got {written} bytes hashing to {digest.hexdigest()}, expected {size}"
                )
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def open(self, sha256):
        path = self._path(sha256)
        f = path.open("rb")  # raises FileNotFoundError now, not at first iteration

        def chunks():
            with f:
                while chunk := f.read(READ_CHUNK):
                    yield chunk

        return chunks()

    def stat(self, sha256):
        try:
            st = self._path(sha256).stat()
        except FileNotFoundError:
            return None
        return BlobInfo(sha256, st.st_size, datetime.fromtimestamp(st.st_mtime, UTC).replace(tzinfo=None))

    def delete(self, sha256):
        self._path(sha256).unlink(missing_ok=True)

    def remove_partial(self, older_than):
        removed = 0
        for path in self.dir.glob(".tmp-*"):
            try:
                if datetime.fromtimestamp(path.stat().st_mtime, UTC).replace(tzinfo=None) < older_than:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed

    def list(self):
        for path in self.dir.iterdir():
            if _HEX.fullmatch(path.name):
                info = self.stat(path.name)
                if info is not None:
                    yield info


class S3BlobStore(BlobStore):
    """Objects `blobs/sha256/<hex>` in one bucket. Single-part uploads carry
    x-amz-checksum-sha256 so the server rejects corrupted bytes; multipart uploads (bundles
    over `part_size`) are signed per part and record the hex sha256 as object metadata."""

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        access_key: str,
        secret_key: str,
        secure: bool = False,
        region: str = "us-east-1",
        part_size: int = 16 * 1024 * 1024,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
    ) -> None:
        """Timeouts: a black-holed S3 endpoint fails a call after them (UNAVAILABLE) instead of
        holding it; urllib3 retries a failed request twice."""
        import urllib3
        from minio import Minio

        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s),
            maxsize=16,
            retries=urllib3.Retry(total=2, backoff_factor=0.2, status_forcelist=(500, 502, 503, 504)),
        )
        self.client = Minio(
            endpoint, access_key=access_key, secret_key=secret_key, secure=secure, region=region, http_client=http
        )
        self.bucket = bucket
        self.part_size = max(part_size, 5 * 1024 * 1024)
        if not self.client.bucket_exists(bucket):
            from minio.error import S3Error

            try:
                self.client.make_bucket(bucket)
            except S3Error as exc:  # created concurrently by another replica
                if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    def ping(self) -> None:
        if not self.client.bucket_exists(self.bucket):
            raise FileNotFoundError(f"bucket {self.bucket} is gone")

    def put(self, sha256, data, size):
        key = blob_key(sha256)
        metadata = {"x-amz-meta-sha256": sha256}
        if size <= self.part_size:
            stream = _as_stream(data)
            body = stream.read(size + 1)
            if len(body) != size or hashlib.sha256(body).hexdigest() != sha256:
                raise BlobIntegrityError(f"blob {sha256}: bytes do not match their size/hash")
            metadata["x-amz-checksum-sha256"] = base64.b64encode(bytes.fromhex(sha256)).decode()
            self.client.put_object(self.bucket, key, io.BytesIO(body), size, metadata=metadata)
            return
        stream = _HashingReader(_as_stream(data))
        self.client.put_object(
            self.bucket, key, stream, size, metadata=metadata, part_size=self.part_size, num_parallel_uploads=1
        )
        if stream.read_bytes != size or stream.hexdigest() != sha256:
            self.delete(sha256)
            raise BlobIntegrityError(f"blob {sha256}: bytes do not match their size/hash")

    def open(self, sha256):
        from minio.error import S3Error

        try:
            resp = self.client.get_object(self.bucket, blob_key(sha256))
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject"):
                raise FileNotFoundError(sha256) from exc
            raise

        def chunks():
            try:
                yield from resp.stream(READ_CHUNK)
            finally:
                resp.close()
                resp.release_conn()

        return chunks()

    def stat(self, sha256):
        from minio.error import S3Error

        try:
            obj = self.client.stat_object(self.bucket, blob_key(sha256))
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject", "ResourceNotFound"):
                return None
            raise
        return BlobInfo(sha256, obj.size, _naive_utc(obj.last_modified))

    def delete(self, sha256):
        self.client.remove_object(self.bucket, blob_key(sha256))

    def list(self):
        for obj in self.client.list_objects(self.bucket, prefix=KEY_PREFIX, recursive=True):
            name = obj.object_name.removeprefix(KEY_PREFIX)
            if _HEX.fullmatch(name):
                yield BlobInfo(name, obj.size, _naive_utc(obj.last_modified))


class _HashingReader:
    """A read() wrapper that hashes what passes through it."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self._digest = hashlib.sha256()
        self.read_bytes = 0

    def read(self, n: int = -1) -> bytes:
        chunk = self._stream.read(n)
        self._digest.update(chunk)
        self.read_bytes += len(chunk)
        return chunk

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def _naive_utc(value: datetime | None) -> datetime:
    if value is None:
        return datetime.now(UTC).replace(tzinfo=None)
    if value.tzinfo is not None:
        value = value.astimezone(UTC).replace(tzinfo=None)
    return value


def make_blob_store(settings) -> BlobStore:
    """S3 when `settings.s3_endpoint` is set, else a local directory `settings.blob_dir`."""
    if settings.s3_endpoint:
        return S3BlobStore(
            settings.s3_endpoint,
            settings.s3_bucket,
            settings.s3_access_key,
            settings.s3_secret_key,
            settings.s3_secure,
            settings.s3_region,
            settings.s3_part_size,
            settings.s3_connect_timeout_s,
            settings.s3_read_timeout_s,
        )
    return LocalBlobStore(settings.blob_dir)
