"""`valora up`: worker device and dtype, one GPU per worker in turn (CUDA_VISIBLE_DEVICES), GPUs
counted without initialising CUDA in the CLI process. start_cluster is replaced: no processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from valora import cli, cluster as cluster_mod

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def started(monkeypatch):
    """The start_cluster calls of `valora up` (kwargs), with a fake cluster back."""
    for name in ("VALORA_DEVICE", "VALORA_DTYPE", "VALORA_TP_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    calls = []

    def fake_start(home, **kwargs):
        calls.append(kwargs)
        return cluster_mod.Cluster(
            home=str(home),
            processes=[
                cluster_mod.ProcessInfo("gateway", "gateway", 1, 50051, "gw.log", metrics_port=9000, http_port=8080)
            ],
        )

    monkeypatch.setattr(cluster_mod, "start_cluster", fake_start)
    return calls


def gpus(monkeypatch, ids):
    monkeypatch.setattr(cluster_mod, "visible_gpus", lambda: list(ids))


def up(tmp_path, *args):
    return CliRunner().invoke(cli.app, ["up", "--home", str(tmp_path), "--port", "0", "--http-port", "0", *args])


def test_cpu_by_default_and_no_gpu_lookup(tmp_path, started, monkeypatch):
    monkeypatch.setattr(cluster_mod, "visible_gpus", lambda: pytest.fail("counted GPUs for CPU workers"))
    result = up(tmp_path, "--workers", "2")
    assert result.exit_code == 0, result.output
    assert started[0]["worker_env"] == [{"VALORA_DEVICE": "cpu", "VALORA_DTYPE": "float32"}] * 2


def test_one_gpu_is_shared_by_every_worker(tmp_path, started, monkeypatch):
    gpus(monkeypatch, ["0"])
    result = up(tmp_path, "--device", "cuda", "--workers", "3")
    assert result.exit_code == 0, result.output
    assert (
        started[0]["worker_env"]
        == [  # each preallocates its KV pool from its share of the memory
            {
                "VALORA_DEVICE": "cuda",
                "VALORA_DTYPE": "bfloat16",
                "CUDA_VISIBLE_DEVICES": "0",
                "VALORA_GPU_MEMORY_FRACTION": "0.300",
            }
        ]
        * 3
    )
    assert "3 workers share 1 GPU" in result.output


def test_three_gpus_one_worker_each(tmp_path, started, monkeypatch):
    gpus(monkeypatch, ["0", "1", "2"])
    result = up(tmp_path, "--device", "cuda", "--workers", "3", "--dtype", "float16")
    assert result.exit_code == 0, result.output
    env = started[0]["worker_env"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in env] == ["0", "1", "2"]
    assert {(e["VALORA_DEVICE"], e["VALORA_DTYPE"]) for e in env} == {("cuda", "float16")}
    assert started[0]["workers"] == 3


def test_more_workers_than_gpus_wrap_around(tmp_path, started, monkeypatch):
    gpus(monkeypatch, ["0", "1", "2"])
    result = up(tmp_path, "--device", "cuda", "--workers", "4")
    assert result.exit_code == 0, result.output
    assert [e["CUDA_VISIBLE_DEVICES"] for e in started[0]["worker_env"]] == ["0", "1", "2", "0"]
    assert [e.get("VALORA_GPU_MEMORY_FRACTION") for e in started[0]["worker_env"]] == ["0.450", None, None, "0.450"]


def test_restricted_gpus_keep_their_ids(tmp_path, started, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the real visible_gpus
    result = up(tmp_path, "--device", "cuda", "--workers", "3")
    assert result.exit_code == 0, result.output
    assert [e["CUDA_VISIBLE_DEVICES"] for e in started[0]["worker_env"]] == ["2", "3", "2"]


def test_device_and_dtype_from_the_environment(tmp_path, started, monkeypatch):
    gpus(monkeypatch, ["0", "1"])
    monkeypatch.setenv("VALORA_DEVICE", "cuda")
    monkeypatch.setenv("VALORA_DTYPE", "float32")
    result = up(tmp_path, "--workers", "2")
    assert result.exit_code == 0, result.output
    assert [(e["CUDA_VISIBLE_DEVICES"], e["VALORA_DTYPE"]) for e in started[0]["worker_env"]] == [
        ("0", "float32"),
        ("1", "float32"),
    ]


def test_cuda_without_a_gpu_is_refused(tmp_path, started, monkeypatch):
    gpus(monkeypatch, [])
    result = up(tmp_path, "--device", "cuda")
    assert result.exit_code == 2
    assert "no GPU visible" in result.output
    assert started == []


@pytest.mark.parametrize("args", [["--device", "tpu"], ["--dtype", "int8"], ["--workers", "0"]])
def test_bad_options_are_refused(tmp_path, started, args):
    result = up(tmp_path, *args)
    assert result.exit_code == 2
    assert started == []


def test_help_documents_device_and_dtype():
    result = CliRunner().invoke(cli.app, ["up", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for text in ("--device", "cpu|cuda", "--dtype", "float32|bfloat16|float16", "CUDA_VISIBLE_DEVICES", "nvidia-smi"):
        assert text in result.output


# -- counting GPUs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "listed, ids",
    [
        ("0,1,2", ["0", "1", "2"]),
        (" 3 , 5", ["3", "5"]),
        ("", []),
        ("-1", []),
        ("1,-1,2", ["1"]),
        ("GPU-8c4e,GPU-77aa", ["GPU-8c4e", "GPU-77aa"]),
    ],
)
def test_visible_gpus_follow_cuda_visible_devices(monkeypatch, listed, ids):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran nvidia-smi"))
    assert cluster_mod.visible_gpus() == ids


def test_visible_gpus_from_nvidia_smi(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    listing = (
        "GPU 0: NVIDIA H200 (UUID: GPU-1)\nGPU 1: NVIDIA H200 (UUID: GPU-2)\n"
        "  MIG 1g.18gb     Device  0: (UUID: MIG-3)\nGPU 2: NVIDIA H200 (UUID: GPU-4)\n"
    )
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a[0], 0, listing, ""))
    assert cluster_mod.visible_gpus() == ["0", "1", "2"]


def test_visible_gpus_without_nvidia_smi_falls_back_to_torch(monkeypatch):
    import torch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cluster_mod.visible_gpus() == ["0", "1"]


def test_counting_listed_gpus_imports_no_torch():
    code = (
        "import sys; from valora import cluster, cli; "
        "assert cluster.visible_gpus() == ['0', '1']; assert 'torch' not in sys.modules, 'torch imported'"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_tensor_parallel_workers_take_blocks_of_gpus(tmp_path, started, monkeypatch):
    gpus(monkeypatch, ["0", "1", "2", "3"])
    result = up(tmp_path, "--device", "cuda", "--workers", "2", "--tp", "2")
    assert result.exit_code == 0, result.output
    env = started[0]["worker_env"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in env] == ["0,1", "2,3"]
    assert {e["VALORA_TP_SIZE"] for e in env} == {"2"}
    assert "GPU 0,1 | 2,3 (tensor parallel 2)" in result.output


def test_tensor_parallel_needs_enough_gpus(tmp_path, started, monkeypatch):
    gpus(monkeypatch, ["0"])
    result = up(tmp_path, "--device", "cuda", "--tp", "2")
    assert result.exit_code == 2 and "tensor-parallel size 2 needs 2 GPUs per worker, 1 visible" in result.output
    assert not started


def test_tensor_parallel_on_cpu_sets_only_the_size(tmp_path, started, monkeypatch):
    monkeypatch.setattr(cluster_mod, "visible_gpus", lambda: pytest.fail("counted GPUs for CPU workers"))
    result = up(tmp_path, "--tp", "2")
    assert result.exit_code == 0, result.output
    assert started[0]["worker_env"] == [{"VALORA_DEVICE": "cpu", "VALORA_DTYPE": "float32", "VALORA_TP_SIZE": "2"}]


def test_cluster_state_is_never_read_half_written(tmp_path):
    """`up` rewrites the state file as processes start while `status` (or a waiting test) reads
    it: a reader sees the previous or the next state, never an empty or partial file."""
    import threading

    procs = [cluster_mod.ProcessInfo("worker", f"worker-{i}", 100 + i, 6000 + i, f"w{i}.log") for i in range(200)]
    done, errors = threading.Event(), []

    def read():
        while not done.is_set():
            try:
                got = cluster_mod.Cluster.load(tmp_path)
                assert got is None or got.processes == procs[: len(got.processes)]
            except Exception as exc:  # collected for the assertion below
                errors.append(exc)
                return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for n in range(1, 201):
            cluster_mod.Cluster(home=str(tmp_path), processes=procs[:n]).save()
    finally:
        done.set()
        reader.join()
    assert not errors, errors[0]
    assert not list(tmp_path.glob(".*.tmp"))


def test_every_command_has_help_and_the_cli_a_version():
    # a help text with rich markup in it ([/versions/...]) made `valora infer --help` crash
    import typer

    def paths(cmd, prefix=()):  # every command and subcommand the CLI has, walked from its click tree
        yield prefix
        if hasattr(cmd, "commands"):  # a group
            for name, sub in cmd.commands.items():
                yield from paths(sub, (*prefix, name))

    runner = CliRunner()
    every = list(paths(typer.main.get_command(cli.app)))
    assert len(every) >= 10 and ("adapters", "register") in every and ("bench", "sched") in every
    assert {("adapters", c) for c in ("get", "delete", "versions", "alias", "unalias")} <= set(every)
    assert {("tasks", c) for c in ("list", "get", "create", "delete")} <= set(every)
    assert {("jobs", c) for c in ("list", "get", "cancel")} <= set(every)
    for path in every:
        result = runner.invoke(cli.app, [*path, "--help"])
        assert result.exit_code == 0 and "usage" in result.output.lower(), (path, result.output[-500:])
    result = runner.invoke(cli.app, ["--version"])
    assert result.exit_code == 0 and result.output.strip().startswith("valora ")


def test_status_names_the_mode():
    from valora.cli.status import _mode_name
    from valora_protos.v1 import types_pb2

    assert _mode_name(types_pb2.INFERENCE_MODE_MIXTURE) == "mixture"
    assert {_mode_name(v.number) for v in types_pb2.InferenceMode.DESCRIPTOR.values} >= {"merged", "unmerged"}


def test_the_cli_prints_a_failed_call_and_exits_with_its_code(capsys):
    from concurrent import futures

    import grpc

    from services.common.errors import FieldViolation, InvalidArgument
    from tests.unit.test_client_errors import Scripted
    from valora_protos.v1 import inference_service_pb2_grpc

    bad = InvalidArgument(
        "invalid request", reason="INVALID_ARGUMENT", field_violations=[FieldViolation("input.prompt", "too long")]
    )
    server = grpc.server(futures.ThreadPoolExecutor(2))
    inference_service_pb2_grpc.add_InferenceServiceServicer_to_server(Scripted([bad]), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        code = cli.main(["infer", "--prompt", "x", "--address", f"127.0.0.1:{port}"])
    finally:
        server.stop(0)
    out = capsys.readouterr().out
    assert code == cli.RPC_EXIT_BASE + grpc.StatusCode.INVALID_ARGUMENT.value[0] == 13
    assert "INVALID_ARGUMENT: invalid request (INVALID_ARGUMENT)" in out and "input.prompt: too long" in out
    assert "Traceback" not in out
