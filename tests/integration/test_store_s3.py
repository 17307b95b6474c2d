"""S3BlobStore against a real S3 protocol server (moto_server on loopback) via minio."""

from __future__ import annotations

import hashlib
import uuid

import pytest

from services.adapter_store.blobs import BlobIntegrityError, S3BlobStore, blob_key

pytestmark = pytest.mark.integration


@pytest.fixture
def s3_store(s3_server):
    return S3BlobStore(
        s3_server.endpoint,
        f"valora-{uuid.uuid4().hex[:12]}",
        s3_server.access_key,
        s3_server.secret_key,
        secure=False,
        part_size=5 * 1024 * 1024,
    )


def test_bucket_is_created_and_small_blob_roundtrips(s3_store, s3_server):
    assert s3_store.client.bucket_exists(s3_store.bucket)
    again = S3BlobStore(s3_server.endpoint, s3_store.bucket, s3_server.access_key, s3_server.secret_key)
    assert again.bucket == s3_store.bucket  # existing bucket is fine
    data = b"lora" * 1000
    sha = hashlib.sha256(data).hexdigest()
    s3_store.put(sha, data, len(data))
    assert s3_store.read_all(sha) == data
    info = s3_store.stat(sha)
    assert info.size == len(data)
    stat = s3_store.client.stat_object(s3_store.bucket, blob_key(sha))
    assert stat.metadata.get("x-amz-meta-sha256") == sha
    assert [b.sha256 for b in s3_store.list()] == [sha]
    s3_store.delete(sha)
    assert s3_store.stat(sha) is None and list(s3_store.list()) == []
    with pytest.raises(FileNotFoundError):
        s3_store.open(sha)


def test_multipart_upload(s3_store):
    data = hashlib.sha256(b"seed").digest() * (6 * 1024 * 1024 // 32 + 7)  # > one 5 MiB part
    sha = hashlib.sha256(data).hexdigest()
    s3_store.put(sha, memoryview(data), len(data))
    assert s3_store.stat(sha).size == len(data)
    assert hashlib.sha256(s3_store.read_all(sha)).hexdigest() == sha


def test_wrong_bytes_are_rejected(s3_store):
    with pytest.raises(BlobIntegrityError):
        s3_store.put("0" * 64, b"not these bytes", 15)
    assert list(s3_store.list()) == []
