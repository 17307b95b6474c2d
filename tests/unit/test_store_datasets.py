"""Datasets for generation jobs in the adapter store (AdminService.UploadDataset): an archive
stored as a blob under its sha256, named `datasets/{sha256}`; uploads that are not archives or
do not hash to their sha256 are refused, a job naming a dataset never uploaded (or a path) is
refused, and GC keeps a dataset while a PENDING or RUNNING job names it."""

from __future__ import annotations

import hashlib

import grpc
import pytest

pytest.importorskip("PIL")

from services.adapter_store.config import StoreSettings
from services.adapter_store.testing import RunningStore, write_tiny_model
from services.generator.user_datasets import pack_dataset
from tests.unit.test_generator_user_datasets import image_folder
from valora.client import ValoraClient
from valora_protos.v1 import admin_service_pb2 as admin_pb


def _settings(tmp_path) -> StoreSettings:
    return StoreSettings(
        database_url=f"sqlite:///{tmp_path / 'd.db'}",
        blob_dir=str(tmp_path / "blobs"),
        model_path=str(write_tiny_model(tmp_path / "tiny")),
        gc_interval_s=0,
        port=0,
    )


@pytest.fixture
def rs(tmp_path):
    with RunningStore(_settings(tmp_path)) as store:
        yield store


def _upload_parts(data: bytes, sha256: str | None = None):
    yield admin_pb.UploadDatasetRequest(
        metadata=admin_pb.UploadDatasetMetadata(
            sha256=sha256 if sha256 is not None else hashlib.sha256(data).hexdigest()
        )
    )
    for i in range(0, len(data), 1000):
        yield admin_pb.UploadDatasetRequest(chunk=data[i : i + 1000])


def test_the_store_checks_uploads_and_the_datasets_jobs_name(rs, tmp_path):
    data = pack_dataset(image_folder(tmp_path / "swatches"))
    with pytest.raises(grpc.RpcError) as e:
        rs.admin.UploadDataset(_upload_parts(data, sha256="0" * 64))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "do not hash" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        rs.admin.UploadDataset(_upload_parts(b"just some text, no archive"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "archive" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        rs.admin.UploadDataset(_upload_parts(data, sha256="../../etc"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    with ValoraClient(rs.address) as client:
        with pytest.raises(Exception) as exc:  # valora.errors.FailedPrecondition
            client.create_generation_job("/m", [("swatches", 0.5, "datasets/" + "a" * 64)])
        assert "DATASET_NOT_FOUND" in repr(exc.value) or "was not uploaded" in str(exc.value)
        with pytest.raises(Exception) as exc:
            client.create_generation_job("/m", [("swatches", 0.5, "/home/me/swatches")])
        assert "not a dataset name" in str(exc.value)
        d = client.upload_dataset(data)
        assert d.name == f"datasets/{hashlib.sha256(data).hexdigest()}" and d.size_bytes == len(data)
        assert client.upload_dataset(data).name == d.name  # the same bytes: the same dataset


def test_gc_keeps_a_dataset_while_a_job_names_it(rs, tmp_path):
    from services.adapter_store.server import build_registry

    data = pack_dataset(image_folder(tmp_path / "swatches"))
    registry = build_registry(_settings(tmp_path))  # the running store's database and blobs
    with ValoraClient(rs.address) as client:
        d = client.upload_dataset(data)
        job = client.create_generation_job("/m", [("swatches", 0.5, d.name)], job_id="keep")
        registry.gc(grace_s=0)
        assert registry.blobs.exists(d.sha256)  # a PENDING job names it
        client.cancel_generation_job(job.name)
        report = registry.gc(grace_s=0)
    assert not registry.blobs.exists(d.sha256)  # no live job names it, and it is past the grace period
    assert d.sha256 in report.blobs_removed
    registry.close()
