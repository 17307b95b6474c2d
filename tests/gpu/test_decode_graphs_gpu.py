"""Decode steps replayed from CUDA graphs answer like the eager decode (tiny Qwen2-VL on CUDA):
fp32 base requests token for token; bf16 with mixed adapters on ATMM inside the graph, close
(bf16 greedy tokens may flip at near-ties when the attention length differs)."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from services.worker.engine import Engine, EngineConfig
from services.worker.requests import Failed, Finished, WorkRequest
from services.worker.testing import TEST_KV_BYTES, random_adapter_bundle, random_image

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

A, B = "adapters/alpha/versions/1", "adapters/beta/versions/1"


def config(model_path, dtype: str, graphs: str, **kw) -> EngineConfig:
    return EngineConfig(
        model_path=model_path,
        device=kw.pop("device", "cuda"),
        dtype=dtype,
        decode_graphs=graphs,
        max_batch_size=8,
        max_prefills_per_step=8,
        device_slots=3,
        kv_cache_bytes=TEST_KV_BYTES,
        **kw,
    )


def run(model_path, dtype: str, graphs: str, adapters: list, **kw) -> tuple[dict, Engine]:
    """Greedy requests (one per entry of `adapters`), 24 tokens each, no EOS; `kw` to the config
    (a tensor-parallel group's rank 0: tp, device)."""
    eng = Engine(config(model_path, dtype, graphs, **kw))
    eng.eos_ids = set()
    eng.start()
    try:
        for i, name in enumerate((A, B)):
            b = random_adapter_bundle(model_path, rank=8 * (i + 1), lora_alpha=8, seed=i + 1)
            eng.load_adapter_bytes(name, b.sha256, b.data, b.config_json)
        reqs = [
            WorkRequest(f"r{i}", "Describe the image." + " more" * i, [random_image(i)], adapter=a, max_new_tokens=24)
            for i, a in enumerate(adapters)
        ]
        events: queue.Queue = queue.Queue()
        with eng._wake:
            for r in reqs:
                eng.submit(eng.prepare(r), events.put)
        out = {}
        while len(out) < len(reqs):
            ev = events.get(timeout=120)
            if isinstance(ev, Failed):
                raise ev.error
            if isinstance(ev, Finished):
                out[ev.result.request_id] = ev.result.token_ids
        return out, eng
    finally:
        eng.stop()


def test_fp32_base_decode_graphs_equal_eager(model_path):
    eager, _ = run(model_path, "float32", "off", [None] * 4)
    graphed, eng = run(model_path, "float32", "auto", [None] * 4)
    assert eng.graphs.captures >= 1 and eng.graphs.replays >= 10
    assert graphed == eager


def test_bf16_lora_decode_graphs_run_atmm_and_agree(model_path):
    adapters = [None, A, B, A, B, A]
    eager, _ = run(model_path, "bfloat16", "off", adapters)
    graphed, eng = run(model_path, "bfloat16", "auto", adapters)
    assert eng.runtime.backend is not None  # LoRA on ATMM, inside the graph
    assert eng.graphs.captures >= 1 and eng.graphs.replays >= 10
    assert eng.graphs.eager_steps == 0  # past each key's warm-up every step replayed
    assert eng.graphs.reference_steps == 0 and eng.graphs.capture_failures == 0
    same = sum(a == b for k in eager for a, b in zip(eager[k], graphed[k]))
    assert same / sum(len(v) for v in eager.values()) >= 0.9


def test_captures_survive_other_threads_calling_cuda(model_path):
    """A served worker's other threads (request preparation, adapter staging into pinned host
    memory) call CUDA while the engine thread captures: the capture is the engine thread's own,
    so neither it nor the other thread's work fails."""
    stop, errors, calls = threading.Event(), [], [0]

    def other_thread():
        stream = torch.cuda.Stream()
        while not stop.is_set():
            try:
                host = torch.empty(1 << 16, dtype=torch.float32, pin_memory=True)
                with torch.cuda.stream(stream):
                    host.to("cuda", non_blocking=True).sum()
                stream.synchronize()
                calls[0] += 1
            except Exception as exc:  # counted, asserted below
                errors.append(repr(exc))

    t = threading.Thread(target=other_thread, daemon=True)
    t.start()
    try:
        _, eng = run(model_path, "bfloat16", "auto", [None, A, B, A])
    finally:
        stop.set()
        t.join(timeout=10)
    assert calls[0] > 10 and not errors, errors[:3]
    assert eng.graphs.capture_failures == 0 and eng.graphs.captures >= 1 and eng.graphs.eager_steps == 0
