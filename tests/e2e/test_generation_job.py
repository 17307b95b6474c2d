"""A generation job end to end with tiny settings: a real cluster (store, worker, scheduler,
gateway as processes) and a runner process (`python -m services.generator serve`); `valora
generate --wait` creates the job through the gateway and polls it with a progress bar; the job
ends SUCCEEDED and its result names a READY adapter version and a task that points at it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from valora.cli import app
from valora.client import ValoraClient
from valora_protos.v1 import resources_pb2 as res

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_path, shared_cluster):
    """(home of the runner's log, the model, the e2e suite's shared cluster: tests/e2e/conftest.py)
    with a runner process started for this module."""
    home = tmp_path_factory.mktemp("valora-gen")
    model, c = model_path, shared_cluster
    store = next(p for p in c.processes if p.service == "adapter_store")
    env = {
        **os.environ,
        "VALORA_ADAPTER_STORE_ADDRESS": f"127.0.0.1:{store.port}",
        "VALORA_ADMIN_ADDRESS": c.gateway,
        "VALORA_POLL_S": "0.2",
        "VALORA_RUNNER_NAME": "e2e-runner",
        "VALORA_LOG_JSON": "false",
        "VALORA_INTERNAL_TOKEN": c.internal_token,
    }
    with open(home / "runner.log", "w") as log:
        runner = subprocess.Popen(
            [sys.executable, "-m", "services.generator", "serve"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    yield home, model, c
    runner.terminate()
    try:
        runner.wait(15)
    except subprocess.TimeoutExpired:
        runner.kill()


def test_generate_wait_registers_a_ready_adapter_and_task(cluster):
    home, model, c = cluster
    result = CliRunner().invoke(
        app,
        [
            "generate",
            "--source",
            "parity:0.0",
            "--epochs",
            "1",
            "--rank",
            "4",
            "--limit",
            "24",
            "--job-id",
            "gen-e2e",
            "--base-model",
            str(model),
            "--address",
            c.gateway,
            "--wait",
            "--poll-s",
            "0.2",
        ],
    )
    assert result.exit_code == 0, result.output + repr(result.exception) + (home / "runner.log").read_text()
    assert "generationJobs/gen-e2e" in result.output and "SUCCEEDED" in result.output

    with ValoraClient(c.gateway) as client:
        job = client.get_generation_job("gen-e2e")
        assert job.state == res.GENERATION_JOB_STATE_SUCCEEDED and job.progress == 1.0 and not job.error
        assert [s.task for s in job.sources] == ["parity"] and job.base_model == str(model)
        [version] = job.result.adapter_versions
        assert version == "adapters/gen-e2e-0/versions/1"
        [served] = [v for v in client.list_versions("gen-e2e-0") if v.name == version]
        assert served.state == "ready" and served.heads == {"parity": ["even", "odd"]}
        [task] = job.result.tasks
        assert task.task == "tasks/gen-e2e-parity" and task.adapter_version == version
        assert 0.0 <= task.measured_accuracy <= 1.0
        registered = client.get_task(task.task)
        assert registered.adapter == version and registered.head == "parity"
        assert abs(registered.measured_accuracy - task.measured_accuracy) < 1e-6
        assert [j.name for j in client.list_generation_jobs()] == ["generationJobs/gen-e2e"]


def test_generate_on_a_dataset_uploads_it_through_the_gateway(cluster, tmp_path):
    """`valora generate --dataset`: the image folder travels as an upload through the gateway to
    the store, the runner process fetches it with the internal token and trains on it."""
    from tests.unit.test_generator_user_datasets import image_folder

    home, model, c = cluster
    root = image_folder(tmp_path / "swatches", per_label=6)
    result = CliRunner().invoke(
        app,
        [
            "generate",
            "--dataset",
            str(root),
            "--threshold",
            "0.0",
            "--epochs",
            "1",
            "--rank",
            "4",
            "--job-id",
            "gen-data",
            "--base-model",
            str(model),
            "--address",
            c.gateway,
            "--wait",
            "--poll-s",
            "0.2",
        ],
    )
    assert result.exit_code == 0, result.output + repr(result.exception) + (home / "runner.log").read_text()
    with ValoraClient(c.gateway) as client:
        job = client.get_generation_job("gen-data")
        assert job.state == res.GENERATION_JOB_STATE_SUCCEEDED and not job.error
        [source] = job.sources
        assert source.task == "swatches" and source.dataset.startswith("datasets/")
        [version] = job.result.adapter_versions
        [served] = [v for v in client.list_versions("gen-data-0") if v.name == version]
        assert served.state == "ready" and served.heads == {"swatches": ["blue", "green", "red"]}
        assert client.get_task("gen-data-swatches").adapter == version
