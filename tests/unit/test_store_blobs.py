"""LocalBlobStore: content-addressed put/open/stat/list/delete and integrity checks."""

from __future__ import annotations

import hashlib
import io

import pytest

from services.adapter_store.blobs import BlobIntegrityError, LocalBlobStore, blob_key


def test_local_roundtrip(tmp_path):
    store = LocalBlobStore(tmp_path)
    data = bytes(range(256)) * 5000
    sha = hashlib.sha256(data).hexdigest()
    assert not store.exists(sha) and store.stat(sha) is None
    store.put(sha, io.BytesIO(data), len(data))
    assert (tmp_path / blob_key(sha)).is_file()
    assert store.read_all(sha) == data
    assert [(b.sha256, b.size) for b in store.list()] == [(sha, len(data))]
    store.put(sha, data, len(data))  # idempotent overwrite
    store.delete(sha)
    store.delete(sha)  # absent is fine
    assert list(store.list()) == []
    with pytest.raises(FileNotFoundError):
        store.open(sha)


def test_local_rejects_bytes_that_do_not_match_the_key(tmp_path):
    store = LocalBlobStore(tmp_path)
    with pytest.raises(BlobIntegrityError):
        store.put("0" * 64, b"hello", 5)
    with pytest.raises(ValueError):
        store.put("../../etc/passwd", b"x", 1)
    assert list(store.list()) == []
    assert [p.name for p in (tmp_path / "blobs/sha256").iterdir()] == []  # no temp file left


def test_local_partial_writes_are_swept(tmp_path):
    from datetime import timedelta

    from services.adapter_store.models import utcnow

    store = LocalBlobStore(tmp_path)
    leftover = tmp_path / "blobs/sha256/.tmp-dead"
    leftover.write_bytes(b"half a bundle")
    assert store.remove_partial(utcnow() - timedelta(hours=1)) == 0
    assert store.remove_partial(utcnow() + timedelta(seconds=5)) == 1
    assert not leftover.exists()
