"""The worker's settings (every field also VALORA_<FIELD>), validated at start-up, the engine's
config (EngineConfig) and what the engine and the kernels are built from them: the one place a
worker knob is declared (its EngineConfig field of the same name takes it, engine_config).
Importing this module loads no torch (`valora up --set` checks worker settings with it); what
builds the engine imports it."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from pydantic import Field, ValidationInfo, field_validator

from services.common import metrics
from services.common.config import MAX_NEW_TOKENS_LIMIT, ServiceSettings
from services.worker.tiny_model import DEFAULT_TINY_MODEL_PATH

if TYPE_CHECKING:
    from services.worker.tensor_parallel import TPGroup

log = structlog.get_logger()


@dataclasses.dataclass
class EngineConfig:
    """What one engine is built from (engine.Engine); a worker fills it from its settings
    (engine_config), tests and benchmarks directly."""

    model_path: Path
    device: str = "cpu"
    dtype: str = "float32"
    max_batch_size: int = 8
    max_waiting: int = 256
    default_max_new_tokens: int = 64
    max_new_tokens_limit: int = MAX_NEW_TOKENS_LIMIT
    device_slots: int = 4
    # Host bytes of loaded adapters (LRU; 0: unbounded): a load drops least recently used ones
    # that no request holds and that are not merged (a later request loads them again).
    host_adapter_bytes: int = 16 << 30
    max_rank: int = 256
    max_prefills_per_step: int = 2  # requests prefilled together (one forward) per step
    max_prefill_tokens: int = 8192  # tokens (rows packed) per prefill forward; a longer context: chunks
    prefill_fill_padding: bool = False  # queued pieces into the tokens a forward pads to its graph bucket
    mixed_steps: bool = True  # the running rows' decode step rides in a step's prefill forward (mixed_step.py)
    switch_strategy: str = "pristine"  # or "delta" (see switcher.py)
    on_adapter_swap: object = None  # callable("in" | "out"), for metrics
    # The paged KV pool (kv_cache.py): tokens per block; its size in bytes (0: on CUDA what keeps
    # this process within gpu_memory_fraction of the device's memory less kv_reserve_bytes; on the
    # CPU 256 MiB); the longest context a sequence may reach (0: the model's max positions).
    kv_block_size: int = 16
    kv_cache_bytes: int = 0
    gpu_memory_fraction: float = 0.9
    kv_reserve_bytes: int = 4 << 30
    max_model_len: int = 0
    use_atmm: bool = True  # the ATMM CUDA kernel where it runs (CUDA, bf16/fp16, built extension)
    # Spare weight rows per projection for the step's LoRA A^T: the base GEMM then computes x·A too
    # and ATMM runs only its expand (atmm_backend.py, "folded"); 0 = off. Costs rows x in_features
    # per projection and layer (7B, 512: ~0.85 GB).
    lora_fold_rows: int = 512
    fused_layers: bool = True  # decoder layers on the fused elementwise ops (fused_layers.py); False: HF's, for A/B
    image_cache_bytes: int = 256 * 1024 * 1024  # vision features kept by content hash (0: no cache)
    load_format: str = "auto"  # "dummy": random weights of the directory's architecture (model.load_model)
    # Decode steps as CUDA graphs (decode_graphs.py): "auto" = on CUDA; "off" (or "static") = the
    # same step without capture.
    decode_graphs: str = "auto"
    # The packed prefill forward as CUDA graphs keyed by its token bucket (prefill_graphs.py):
    # "auto" = on CUDA; "static" = the same padded forward without capture; "off" = unpadded, eager.
    prefill_graphs: str = "auto"
    vision_graphs: bool = True  # the vision tower as a CUDA graph per image grid (vision_tower.py), on CUDA
    # Pipelined decode: while the device runs a decode step fed by the previous step's
    # tokens (device to device), the host processes the previous step's tokens (decoder.py).
    pipeline_decode: bool = True
    # Tensor parallelism: this rank's TPGroup (tensor_parallel.init_tp_group, made by the process
    # that starts the ranks); None or world size 1: one process, no communication.
    tp: TPGroup | None = None
    step_trace: str = ""  # a file: one JSON line per step, where its time went (step_trace.py); "": off

    def __post_init__(self) -> None:
        """ValueError naming the field for a value no engine can be built with (WorkerSettings
        checks the same for a worker's environment; this catches tests' and tools' configs)."""
        for name in ("dtype", "load_format", "decode_graphs", "prefill_graphs", "switch_strategy"):
            if getattr(self, name) not in _CHOICES[name]:
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of {', '.join(_CHOICES[name])}")
        if not 8 <= self.kv_block_size <= 256 or self.kv_block_size & (self.kv_block_size - 1):
            raise ValueError(f"kv_block_size {self.kv_block_size} is not a power of two in 8..256")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"gpu_memory_fraction {self.gpu_memory_fraction} is not in (0, 1]")
        if self.lora_fold_rows < 0:
            raise ValueError("lora_fold_rows must be >= 0")
        if self.max_prefills_per_step < 1 or self.max_prefill_tokens < 1:
            raise ValueError("max_prefills_per_step and max_prefill_tokens must be positive")


class WorkerSettings(ServiceSettings):
    """Worker settings; every field is also VALORA_<FIELD> (e.g. VALORA_MODEL_PATH)."""

    model_path: str = Field(
        str(DEFAULT_TINY_MODEL_PATH),
        description="Local model directory (an HF checkpoint of a family in "
        "services/worker/architectures.py; any other is refused). Never downloaded.",
    )
    build_tiny_model: bool = Field(True, description="Build the tiny Qwen2-VL into model_path when it is missing.")
    adapter_store_address: str = Field("", description="host:port of the adapter store (FetchAdapter).")
    adapter_cache_dir: str = Field("~/.cache/valora/adapters", description="Disk cache of bundles by sha256.")
    adapter_cache_bytes: int = Field(
        32 << 30,
        ge=0,
        description="Bytes the disk cache may hold; the least "
        "recently used bundles are deleted past it (0: unbounded).",
    )
    host_adapter_bytes: int = Field(
        16 << 30,
        ge=0,
        description="Host memory of loaded adapters; a load drops "
        "the least recently used idle ones past it (0: unbounded).",
    )
    device: str = Field("cpu", description="Torch device: cpu, cuda or cuda:N.")
    dtype: str = Field(
        "float32",
        description="Model dtype: float32, bfloat16 or float16 (aliases fp32, bf16, "
        "fp16). CUDA workers in bfloat16/float16 build the kernels extension at start-up.",
    )
    load_format: str = Field(
        "auto",
        description="auto: the model directory's weights; dummy: random weights of "
        "its architecture (config.json only), for benchmarks at full-size shapes.",
    )
    max_batch_size: int = Field(8, ge=1, description="Most sequences running (prefill + decode) at once.")
    max_waiting: int = Field(256, ge=0, description="Most requests queued on this worker; past it RESOURCE_EXHAUSTED.")
    max_prefills_per_step: int = Field(
        2, ge=1, description="Waiting requests prefilled together (one batched forward) per engine step."
    )
    max_prefill_tokens: int = Field(
        8192,
        ge=1,
        description="Tokens one step prefills (its pieces packed without "
        "padding): whole prompts, then a chunk of the next one; a longer prompt takes "
        "several steps, the running requests decoding between them.",
    )
    prefill_fill_padding: bool = Field(
        False,
        description="Fill the tokens a prefill forward pads to its graph "
        "bucket with pieces of the next queued requests (chunks where they do not "
        "fit; at most max_prefills_per_step rows): work the padding would waste.",
    )
    mixed_steps: bool = Field(
        True,
        description="A step that prefills runs the running requests' decode step "
        "in the same forward (one token each beside the prefill pieces) instead of a "
        "decode forward of its own: one pass over the weights per step.",
    )
    decode_graphs: str = Field(
        "auto",
        description="Decode steps as CUDA graphs keyed by the padded batch "
        "size: auto (on CUDA) or off (static, the same step without capture).",
    )
    prefill_graphs: str = Field(
        "auto",
        description="The packed prefill forward as CUDA graphs keyed by its "
        "token count padded to a bucket: auto (on CUDA), static (padded, no capture) "
        "or off (unpadded, eager).",
    )
    vision_graphs: bool = Field(
        True,
        description="On CUDA, the vision tower replayed from a CUDA graph per "
        "image grid (t, h, w) after its first two items (services/worker/vision_tower.py).",
    )
    kv_block_size: int = Field(16, ge=8, le=256, description="Tokens per block of the paged KV cache (a power of two).")
    kv_cache_bytes: int = Field(
        0,
        ge=0,
        description="Bytes of the paged KV pool, allocated at start-up; 0: on "
        "CUDA what keeps the worker within gpu_memory_fraction of the device's memory "
        "(less kv_reserve_bytes), on the CPU 256 MiB.",
    )
    gpu_memory_fraction: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Share of the device's memory this worker "
        "may use (weights, KV pool, activations); workers sharing a GPU split it.",
    )
    kv_reserve_bytes: int = Field(
        4 << 30,
        ge=0,
        description="Device bytes left out of the KV pool for activations, CUDA graphs and adapters loaded later.",
    )
    max_model_len: int = Field(
        0, ge=0, description="Longest context (prompt + new tokens) a request may reach; 0: the model's max positions."
    )
    pipeline_decode: bool = Field(
        True,
        description="Pipelined decode: launch a greedy decode step from the "
        "previous step's tokens on the device, then process those on the host while it "
        "runs (needs the static/graph decode step; false: strictly serial steps).",
    )
    default_max_new_tokens: int = Field(64, ge=1, description="max_new_tokens when a request leaves it 0.")
    max_new_tokens_limit: int = Field(
        MAX_NEW_TOKENS_LIMIT,
        ge=1,
        description="Largest max_new_tokens accepted (the gateway's limit has the same default).",
    )
    device_slots: int = Field(4, ge=1, description="Adapters resident on the device at once (LRU).")
    max_rank: int = Field(256, ge=1, description="Largest LoRA rank accepted.")
    switch_strategy: str = Field(
        "pristine",
        description="Merge/switch strategy: pristine (exact, keeps a copy "
        "of the targeted base weights) or delta (one-pass switch, periodic resync).",
    )
    use_atmm: bool = Field(True, description="Run the multi-LoRA term on the ATMM CUDA kernel where it can.")
    fused_layers: bool = Field(
        True,
        description="Decoder layers on valora's fused ops (RMSNorm, rotary, SiLU·up "
        "kernels; q|k|v and gate|up as one linear each); false: HF's layers.",
    )
    lora_fold_rows: int = Field(
        512,
        ge=0,
        description="Spare weight rows per projection that hold the step's "
        "LoRA A^T, so one GEMM gives y and x·A (ATMM runs only its expand); 0 = off.",
    )
    image_cache_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="Device bytes of vision features kept "
        "by image content hash (LRU); a repeated image skips the vision encoder. 0 = off.",
    )
    step_trace: str = Field(
        "",
        description="A file the engine appends one JSON line per step to: its queues, "
        "rows and each phase's host and device time (services/worker/step_trace.py); for "
        "profiling. Empty: off.",
    )
    worker_name: str = Field("", description="Name reported in results and status (default host:port).")
    engine_stall_s: float = Field(
        300.0,
        ge=0,
        description="Seconds without an engine step after which health "
        "is NOT_SERVING until the engine steps again (a hung device); 0: not watched.",
    )
    drain_delay_s: float = Field(
        2.0,
        ge=0,
        description="On SIGTERM, seconds of NOT_SERVING (GetWorkerStatus "
        "healthy=false) before new RPCs are refused: longer than the scheduler's status "
        "poll, so it stops placing requests here before the server closes.",
    )
    advertise_address: str = Field("", description="Address reported in WorkerStatus (default host:port).")
    scheduler_address: str = Field(
        "",
        description="host:port of the scheduler to register with (under "
        "advertise_address: set it when host is 0.0.0.0) and heartbeat; retried with "
        "backoff until it answers. Empty: no registration (static worker_addresses).",
    )
    heartbeat_s: float = Field(
        2.0,
        gt=0,
        description="Seconds between heartbeats to the scheduler (at most a "
        "third of the scheduler's worker_ttl_s is used).",
    )
    preprocess_processes: int = Field(
        0,
        ge=0,
        description="Processes decoding images and running the processor "
        "(services/worker/preprocess.py): on the worker's own threads that work holds "
        "the GIL against the engine loop. 0: on the worker's threads.",
    )
    tp_size: int = Field(
        1,
        ge=1,
        description="Tensor-parallel ranks (devices) of this worker: this process is "
        "rank 0 and serves; it spawns ranks 1..N-1 (device cuda → rank i on cuda:i, cpu → cpu). "
        "Must divide the model's attention heads, KV heads and intermediate size.",
    )
    tp_port: int = Field(
        0, ge=0, le=65535, description="Loopback port of the tensor-parallel group's rendezvous (0: a free one)."
    )
    tp_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Tensor-parallel group timeout: the longest a rank waits "
        "in a collective (start-up, a step) for the others before failing.",
    )

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        kind, _, index = value.strip().lower().partition(":")
        if (kind == "cpu" and not index) or (kind == "cuda" and (not index or index.isdigit())):
            return value.strip().lower()
        raise ValueError(f"VALORA_DEVICE={value!r}: must be cpu, cuda or cuda:N")

    @field_validator("dtype", mode="before")
    @classmethod
    def _known_dtype(cls, value: object) -> object:
        return _choice("dtype", value, _DTYPE_ALIASES)

    @field_validator("kv_block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"VALORA_KV_BLOCK_SIZE={value}: must be a power of two")
        return value

    @field_validator("load_format", "decode_graphs", "prefill_graphs", "switch_strategy", mode="before")
    @classmethod
    def _known_choice(cls, value: object, info: ValidationInfo) -> object:
        return _choice(info.field_name, value, {c: c for c in _CHOICES[info.field_name]})


_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
_CHOICES = {
    "dtype": ("float32", "bfloat16", "float16"),
    "load_format": ("auto", "dummy"),
    "decode_graphs": ("auto", "static", "off"),
    "prefill_graphs": ("auto", "static", "off"),
    "switch_strategy": ("pristine", "delta"),
}


def _choice(name: str, value: object, accepted: dict[str, str]) -> object:
    """One of a setting's values (case-insensitive; `accepted` maps spellings to the value)."""
    if not isinstance(value, str):
        return value  # pydantic's type error
    got = accepted.get(value.strip().lower())
    if got is None:
        raise ValueError(f"VALORA_{name.upper()}={value!r}: must be one of {', '.join(_CHOICES[name])}")
    return got


def check_tp_size(settings: WorkerSettings, model_path: Path) -> None:
    """ValueError naming VALORA_TP_SIZE unless the model's family may be served tensor parallel
    and its heads, KV heads and intermediate size split over tp_size ranks."""
    if settings.tp_size == 1:
        return
    from transformers import AutoConfig

    from services.worker.architectures import architecture_of, check_tensor_parallel
    from services.worker.tensor_parallel import TPGroup  # torch
    from services.worker.tp_sharding import check_divisible  # torch

    config = AutoConfig.from_pretrained(model_path)
    try:
        check_tensor_parallel(architecture_of(model_path), settings.tp_size)
        check_divisible(getattr(config, "text_config", config), TPGroup(world_size=settings.tp_size))
    except ValueError as exc:
        raise ValueError(f"VALORA_TP_SIZE={settings.tp_size}: {exc}") from None


# EngineConfig fields the worker fills itself: the path (a str setting), the metrics callback, the
# tensor-parallel group (a live process group, made per rank from VALORA_TP_SIZE by tp_ranks.py).
NOT_SETTINGS = frozenset({"model_path", "on_adapter_swap", "tp"})


def engine_config(settings: WorkerSettings, worker_name: str = "") -> EngineConfig:
    """The engine's config: every other EngineConfig field is the setting of the same name (one
    name per knob; tests/unit/test_worker_settings.py checks each has a setting and its default)."""
    knobs = {f.name: getattr(settings, f.name) for f in dataclasses.fields(EngineConfig) if f.name not in NOT_SETTINGS}
    return EngineConfig(
        on_adapter_swap=lambda direction: metrics.ADAPTER_SWAPS.labels(worker_name, direction).inc(),
        model_path=Path(settings.model_path).expanduser(),
        **knobs,
    )


def prepare_kernels(settings: WorkerSettings) -> bool | None:
    """CUDA bf16/fp16 workers build (or load from the cache) the kernels extension at start-up, for
    the ATMM op and the switcher alike, whatever use_atmm says, so the first merge does not pay for
    a JIT build mid-serving. None: nothing to do (CPU or fp32; nothing CUDA is imported); else
    whether the extension is available (False: the torch reference paths)."""
    if not settings.device.startswith("cuda") or settings.dtype not in ("bfloat16", "float16"):
        return None
    from kernels.atmm import extension  # CUDA workers only

    t0 = time.perf_counter()
    available = extension() is not None
    ms = round((time.perf_counter() - t0) * 1e3, 1)
    (log.info if available else log.warning)("kernels_extension", available=available, load_ms=ms)
    return available
