"""Worker settings: every operator knob of EngineConfig is a VALORA_* setting, parsed from the
environment and validated at start-up; CUDA bf16/fp16 workers build the kernels extension at
start-up, CPU workers never touch it."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

import kernels.atmm
import kernels.build
from services.worker import startup
from services.worker.engine import EngineConfig
from services.worker.model import ensure_tiny_model
from services.worker.config import NOT_SETTINGS, WorkerSettings, engine_config, prepare_kernels
from services.worker.server import create_server

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("VALORA_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_every_engine_knob_is_a_setting_with_the_engine_default(clean_env):
    defaults = WorkerSettings()
    for f in dataclasses.fields(EngineConfig):
        if f.name in NOT_SETTINGS:
            continue
        assert f.name in WorkerSettings.model_fields, f"EngineConfig.{f.name} has no VALORA_{f.name.upper()}"
        assert getattr(defaults, f.name) == f.default, f.name


def test_gateway_and_workers_share_one_max_new_tokens_limit(clean_env):
    """A request within the gateway's limit is within every default worker's (it once passed the
    gateway's 4096 and failed the worker's 1024, naming the worker's internal field)."""
    from services.gateway.config import GatewaySettings

    assert GatewaySettings().max_new_tokens_limit == WorkerSettings().max_new_tokens_limit == 4096


def test_settings_from_the_environment_reach_the_engine_config(clean_env):
    env = {
        "VALORA_DEVICE": "cuda:1",
        "VALORA_DTYPE": "bf16",
        "VALORA_MAX_PREFILLS_PER_STEP": "4",
        "VALORA_MAX_PREFILL_TOKENS": "2048",
        "VALORA_DECODE_GRAPHS": "off",
        "VALORA_LOAD_FORMAT": "dummy",
        "VALORA_KV_BLOCK_SIZE": "32",
        "VALORA_IMAGE_CACHE_BYTES": "0",
        "VALORA_SWITCH_STRATEGY": "delta",
        "VALORA_USE_ATMM": "false",
        "VALORA_DEVICE_SLOTS": "2",
        "VALORA_MAX_BATCH_SIZE": "32",
        "VALORA_MODEL_PATH": "~/models/qwen2-vl-7b",
        "VALORA_FUSED_LAYERS": "false",
    }
    for k, v in env.items():
        clean_env.setenv(k, v)
    cfg = engine_config(WorkerSettings())
    assert (
        cfg.device,
        cfg.dtype,
        cfg.max_prefills_per_step,
        cfg.max_prefill_tokens,
        cfg.decode_graphs,
        cfg.load_format,
        cfg.kv_block_size,
        cfg.image_cache_bytes,
        cfg.switch_strategy,
        cfg.use_atmm,
        cfg.device_slots,
        cfg.max_batch_size,
        cfg.fused_layers,
    ) == ("cuda:1", "bfloat16", 4, 2048, "off", "dummy", 32, 0, "delta", False, 2, 32, False)
    assert cfg.model_path == Path("~/models/qwen2-vl-7b").expanduser()


@pytest.mark.parametrize(
    "value, expected", [("FP16", "float16"), ("half", "float16"), ("fp32", "float32"), ("bfloat16", "bfloat16")]
)
def test_dtype_aliases(clean_env, value, expected):
    clean_env.setenv("VALORA_DTYPE", value)
    assert WorkerSettings().dtype == expected


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("VALORA_DECODE_GRAPHS", "on", "VALORA_DECODE_GRAPHS='on': must be one of auto, static, off"),
        ("VALORA_LOAD_FORMAT", "safetensors", "VALORA_LOAD_FORMAT='safetensors': must be one of auto, dummy"),
        ("VALORA_SWITCH_STRATEGY", "fast", "must be one of pristine, delta"),
        ("VALORA_DTYPE", "int8", "must be one of float32, bfloat16, float16"),
        ("VALORA_DEVICE", "mps", "VALORA_DEVICE='mps': must be cpu, cuda or cuda:N"),
        ("VALORA_DEVICE", "cuda:x", "must be cpu, cuda or cuda:N"),
        ("VALORA_MAX_PREFILLS_PER_STEP", "0", "greater than or equal to 1"),
        ("VALORA_MAX_PREFILL_TOKENS", "-5", "greater than or equal to 1"),
        ("VALORA_MAX_PREFILL_TOKENS", "lots", "valid integer"),
        ("VALORA_KV_BLOCK_SIZE", "4", "greater than or equal to 8"),
        ("VALORA_KV_BLOCK_SIZE", "24", "VALORA_KV_BLOCK_SIZE=24: must be a power of two"),
        ("VALORA_GPU_MEMORY_FRACTION", "1.5", "less than or equal to 1"),
        ("VALORA_IMAGE_CACHE_BYTES", "-1", "greater than or equal to 0"),
        ("VALORA_DEVICE_SLOTS", "0", "greater than or equal to 1"),
        ("VALORA_MAX_BATCH_SIZE", "0", "greater than or equal to 1"),
        ("VALORA_USE_ATMM", "maybe", "valid boolean"),
        ("VALORA_TP_SIZE", "0", "greater than or equal to 1"),
        ("VALORA_TP_PORT", "70000", "less than or equal to 65535"),
    ],
)
def test_invalid_values_are_refused(clean_env, name, value, message):
    clean_env.setenv(name, value)
    with pytest.raises(ValidationError) as e:
        WorkerSettings()
    assert message in str(e.value)
    assert name.removeprefix("VALORA_").lower() in str(e.value)  # the field is named


def test_worker_process_exits_with_the_error_at_start_up(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VALORA_")}
    env.update(VALORA_DECODE_GRAPHS="sometimes", VALORA_MODEL_PATH=str(tmp_path / "none"))
    proc = subprocess.run(
        [sys.executable, "-m", "services.worker"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert "VALORA_DECODE_GRAPHS='sometimes': must be one of auto, static, off" in proc.stderr


@pytest.fixture
def extension_calls(monkeypatch):
    calls = []

    def fake(result):
        def extension():
            calls.append(result)
            return result

        monkeypatch.setattr(kernels.atmm, "extension", extension)

    def refuse(*args, **kwargs):
        raise AssertionError("the kernels extension must not be built here")

    monkeypatch.setattr(kernels.build, "load_extension", refuse)
    monkeypatch.setattr(kernels.atmm, "load_extension", refuse)
    fake(None)
    return calls, fake


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), ("cpu", "bfloat16"), ("cuda", "float32")])
def test_cpu_and_fp32_workers_leave_the_extension_alone(clean_env, extension_calls, device, dtype):
    calls, _ = extension_calls
    assert prepare_kernels(WorkerSettings(device=device, dtype=dtype)) is None
    assert calls == []


@pytest.mark.parametrize("use_atmm", [True, False])
@pytest.mark.parametrize("device, dtype", [("cuda", "bfloat16"), ("cuda:1", "float16")])
def test_cuda_workers_build_the_extension_once_whatever_use_atmm(clean_env, extension_calls, device, dtype, use_atmm):
    calls, fake = extension_calls
    fake(object())
    assert prepare_kernels(WorkerSettings(device=device, dtype=dtype, use_atmm=use_atmm)) is True
    assert len(calls) == 1
    fake(None)  # no nvcc / headers: logged, the worker still starts (torch reference paths)
    assert prepare_kernels(WorkerSettings(device=device, dtype=dtype, use_atmm=use_atmm)) is False


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_cpu_worker_start_up_never_touches_the_extension(tmp_path, clean_env, extension_calls, monkeypatch):
    calls, _ = extension_calls
    prepared = []
    real = startup.prepare_kernels
    monkeypatch.setattr(startup, "prepare_kernels", lambda s: prepared.append(real(s)))
    model = ensure_tiny_model(tmp_path / "tiny-qwen2-vl")
    worker = await create_server(
        WorkerSettings(
            model_path=str(model),
            port=0,
            build_tiny_model=False,
            adapter_cache_dir=str(tmp_path / "cache"),
            drain_delay_s=0,
        )
    )
    await worker.start()
    try:
        assert worker.servicer.engine is not None and worker.servicer.engine.alive
        assert prepared == [None]  # start-up asked, and the CPU worker did nothing
        assert calls == []
    finally:
        await worker.stop(0)


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (10, 0)])
def test_a_gpu_other_than_hopper_never_builds_and_takes_the_reference_paths(clean_env, monkeypatch, capability):
    """An A100 (sm_80), an L40S (sm_89) or a Blackwell GPU (sm_100): the extension's sm_90a code
    would load and fail at its first launch, so it is never built there; the ATMM backend is off
    (the torch multi-LoRA reference), the layer ops take their references, one warning names the
    GPU — and a Hopper answer builds as before."""
    import torch

    from services.worker.atmm_backend import AtmmBackend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(kernels.build, "nvcc_path", lambda: "/usr/bin/nvcc")
    built = []
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kw: built.append(kw) or object())
    monkeypatch.setattr(kernels.atmm, "_ext_failed", False)
    assert kernels.build.unsupported_gpu() == capability
    assert kernels.build.load_extension() is None and kernels.atmm.extension() is None
    assert prepare_kernels(WorkerSettings(device="cuda", dtype="bfloat16")) is False
    assert not AtmmBackend.available(torch.device("cuda"), torch.bfloat16)
    assert built == []  # no build was attempted
    # a Hopper answer: the extension is built (here a stub build) as before
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(kernels.atmm, "_ext_failed", False)
    monkeypatch.setattr(kernels.atmm, "load_extension", lambda: built.append("built") or object())
    assert kernels.build.unsupported_gpu() is None
    assert kernels.atmm.extension() is not None and built == ["built"]
