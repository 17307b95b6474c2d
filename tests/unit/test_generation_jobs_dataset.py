"""A generation job on a user's dataset, through the admin API: `valora generate --dataset`
validates the dataset locally (a bad one is refused before a byte is sent), uploads it through
the store (AdminService.UploadDataset) and queues a job whose source names `datasets/{sha256}`,
never a path; the runner fetches it (AdapterStoreService.FetchDataset), trains on the tiny model
for real and registers the adapter and task; a job whose dataset is bad fails naming the file
inside the dataset, and one whose task is not in the dataset it names fails saying so. The
store's side of datasets: tests/unit/test_store_datasets.py."""

from __future__ import annotations

import hashlib

import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")

from services.adapter_store.config import StoreSettings
from services.adapter_store.testing import RunningStore
from services.generator.runner import Runner, RunnerSettings
from services.generator.user_datasets import pack_dataset
from tests.unit.test_generator_user_datasets import image_folder, jsonl_dataset, text_dataset
from valora import cli
from valora.client import ValoraClient
from valora_protos.v1 import admin_service_pb2 as admin_pb
from valora_protos.v1 import resources_pb2 as res


def _settings(tmp_path, model_path) -> StoreSettings:
    return StoreSettings(
        database_url=f"sqlite:///{tmp_path / 'd.db'}",
        blob_dir=str(tmp_path / "blobs"),
        model_path=str(model_path),
        gc_interval_s=0,
        port=0,
    )


@pytest.fixture
def rs(tmp_path, model_path):
    with RunningStore(_settings(tmp_path, model_path)) as store:
        yield store


def _generate(rs, model_path, *args):
    return CliRunner().invoke(
        cli.app,
        ["generate", "--address", rs.address, "--base-model", str(model_path), "--rank", "2", "--epochs", "1", *args],
    )


def _run_one(rs):
    r = Runner(RunnerSettings(adapter_store_address=rs.address, runner_name="t", poll_s=0.01, batch_size=8))
    try:
        return r.run_once()
    finally:
        r.close()


def test_valora_generate_on_a_dataset_queues_its_tasks_by_upload_name(rs, model_path, tmp_path):
    root = image_folder(tmp_path / "swatches", per_label=6)
    result = _generate(
        rs, model_path, "--dataset", str(root), "--threshold", "0.1", "--job-id", "mixed", "--source", "parity:0.2"
    )
    assert result.exit_code == 0, result.output
    job = rs.admin.GetGenerationJob(admin_pb.GetGenerationJobRequest(name="generationJobs/mixed")).job
    sha = hashlib.sha256(pack_dataset(root)).hexdigest()
    assert [(s.task, round(s.accuracy_threshold, 3), s.dataset) for s in job.sources] == [
        ("parity", 0.2, ""),
        ("swatches", 0.1, f"datasets/{sha}"),
    ]
    assert str(tmp_path) not in str(job)  # the job names the upload, never a path of the client's


def test_the_runner_trains_on_the_uploaded_dataset_and_registers_it(rs, model_path, tmp_path):
    root = image_folder(tmp_path / "swatches", per_label=6)
    result = _generate(rs, model_path, "--dataset", str(root), "--threshold", "0.1", "--job-id", "sw")
    assert result.exit_code == 0, result.output
    final = _run_one(rs)
    assert final is not None and final.state == res.GENERATION_JOB_STATE_SUCCEEDED, final
    assert [t.task for t in final.result.tasks] == ["tasks/sw-swatches"]
    assert list(final.result.adapter_versions) == ["adapters/sw-0/versions/1"]
    with ValoraClient(rs.address) as client:
        task = client.get_task("sw-swatches")
        version = client.get_version(task.adapter)
    assert task.adapter == "adapters/sw-0/versions/1" and task.head == "swatches"
    assert version.heads == {"swatches": ["blue", "green", "red"]}
    assert task.description.startswith("prompt: What does this image show?")


def test_a_text_task_job_registers_a_task_without_a_head(rs, model_path, tmp_path):
    path = text_dataset(tmp_path / "ds", n_images=5)
    result = _generate(rs, model_path, "--dataset", str(path), "--job-id", "tx")
    assert result.exit_code == 0, result.output
    final = _run_one(rs)
    assert final is not None and final.state == res.GENERATION_JOB_STATE_SUCCEEDED, final
    assert [t.task for t in final.result.tasks] == ["tasks/tx-shapes"]
    with ValoraClient(rs.address) as client:
        task = client.get_task("tx-shapes")
        version = client.get_version(task.adapter)
    assert task.head == "" and version.heads == {}  # served as TEXT generation with the adapter
    assert "text task: answer as TEXT, greedy, max_new_tokens" in task.description


def test_a_bad_dataset_is_refused_before_anything_is_uploaded(rs, model_path, tmp_path):
    path = jsonl_dataset(
        tmp_path, extra=[{"image": "imgs/red-1.png", "question": "What is it?", "answer": "a red square"}]
    )
    result = _generate(rs, model_path, "--dataset", str(path))
    assert result.exit_code == 2
    assert 'mixes "answer" with line 1\'s "label"' in result.output
    assert f"{path}:17" in result.output.replace("\n", "")
    from services.adapter_store.blobs import LocalBlobStore

    assert list(LocalBlobStore(tmp_path / "blobs").list()) == []
    with ValoraClient(rs.address) as client:
        assert client.list_generation_jobs() == []


def test_a_job_on_a_bad_dataset_fails_naming_the_file(rs, model_path, tmp_path):
    root = image_folder(tmp_path / "swatches")
    (root / "red" / "00.png").write_bytes(b"garbage")
    with ValoraClient(rs.address) as client:
        d = client.upload_dataset(pack_dataset(root))  # past the CLI's check: the runner checks again
        client.create_generation_job(str(model_path), [("swatches", 0.5, d.name)], job_id="bad")
    final = _run_one(rs)
    assert final.state == res.GENERATION_JOB_STATE_FAILED
    assert f"{d.name}:swatches/red/00.png: unreadable image" in final.error


def test_a_source_whose_task_is_not_in_its_dataset_fails_the_job(rs, model_path, tmp_path):
    root = image_folder(tmp_path / "swatches")
    with ValoraClient(rs.address) as client:
        d = client.upload_dataset(pack_dataset(root))
        client.create_generation_job(str(model_path), [("parity", 0.5, d.name)], job_id="wrong")
    final = _run_one(rs)
    assert final.state == res.GENERATION_JOB_STATE_FAILED
    assert f"task 'parity' is not in dataset {d.name}" in final.error
