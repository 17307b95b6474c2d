"""The prefill's vision path launches without waiting on the device (tiny Qwen2-VL on CUDA): a
device sync there idles the GPU while the host prepares the next launch (HF reads the grid and
every vision block's segment lengths back from the device; blocking host-to-device copies wait for
the queued vision tower). Checked with torch's sync debug mode once the vision tower's graphs of
the grids are captured, and the features against HF's own device-grid path and the eager tower."""

from __future__ import annotations

import queue

import pytest
import torch

from services.worker.engine import Engine, EngineConfig
from services.worker.requests import Failed, Finished, WorkRequest
from services.worker.testing import TEST_KV_BYTES, random_adapter_bundle, random_image

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def test_vision_embeds_launch_without_device_syncs_and_match_hf(model_path):
    eng = Engine(
        EngineConfig(
            model_path=model_path, device="cuda", dtype="bfloat16", max_batch_size=4, kv_cache_bytes=TEST_KV_BYTES
        )
    )
    try:
        reqs = [
            WorkRequest(f"r{i}", "Describe the image.", [random_image(i, size=s)], max_new_tokens=2)
            for i, s in enumerate((84, 84, 112))
        ]  # grids 6x6, 6x6, 8x8 (the tiny processor's cap)
        preps = [eng.prepare(r) for r in reqs]
        batch = [(p.inputs["input_ids"], p.inputs, p.vision) for p in preps]
        # the vision tower's graphs of this batch captured first (two 6x6 images together, one 8x8;
        # a capture synchronizes, once a key)
        with torch.inference_mode():
            for seed in (10, 20):
                warm = [
                    eng.prepare(WorkRequest(f"w{seed}{i}", "x", [random_image(seed + i, size=s)]))
                    for i, s in enumerate((84, 84, 112))
                ]
                eng.vision.embed_batch([(p.inputs["input_ids"], p.inputs, p.vision) for p in warm])
        assert eng.vision.tower.captures == 2 and set(eng.vision.tower.entries) == {((1, 6, 6), 2), ((1, 8, 8), 1)}
        replays = eng.vision.tower.replays
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.inference_mode():
                embeds = eng.vision.embed_batch(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        inner = eng.model.model
        for p, got in zip(preps, embeds):
            pixels = p.inputs["pixel_values"].cuda()
            grid = p.inputs["image_grid_thw"].cuda()  # HF's path: grid on the device
            with torch.no_grad():
                want_feats = torch.cat(inner.get_image_features(pixels, grid).pooler_output)
            ids = p.inputs["input_ids"].cuda()
            mask = (ids == eng.model.config.image_token_id)[0]
            assert mask.sum().item() == want_feats.shape[0]
            torch.testing.assert_close(got[0][mask], want_feats.to(got.dtype), rtol=2e-2, atol=2e-2)
            with torch.inference_mode():  # a replayed graph computes what the eager tower does
                grid = tuple(p.vision[0].grid)
                eager = eng.vision.tower._forward(pixels, grid, 1, eng.vision.tower._entry(grid, 1))
            # (the graph's attention may be cuDNN's where it measured faster: bf16 noise apart)
            torch.testing.assert_close(got[0][mask], eager.to(got.dtype), rtol=3e-2, atol=3e-2)
            with torch.no_grad():
                text = inner.get_input_embeddings()(ids)[0][~mask]
            assert torch.equal(got[0][~mask], text)
        assert eng.vision.tower.replays - replays == 2  # the batch: its two 6x6 images in one replay
        assert all(
            e.attention in ("flash", "cudnn") and e.replay_ms
            for e in eng.vision.tower.entries.values()
            if e.graph is not None
        )
    finally:
        eng.stop()


def test_cuda_engine_turns_cudnn_sdpa_off(model_path):
    """cuDNN's SDPA costs ~1.4 ms of host time a call at every query length it has not seen (a
    new prefill width nearly every step): a CUDA engine runs with that backend off."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    eng = Engine(
        EngineConfig(
            model_path=model_path, device="cuda", dtype="bfloat16", max_batch_size=2, kv_cache_bytes=TEST_KV_BYTES
        )
    )
    eng.start()
    try:
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        _, result = eng.generate(WorkRequest("r", "Describe the image.", [random_image(0, size=224)], max_new_tokens=2))
        assert result.output_tokens == 2
    finally:
        eng.stop()


def test_prefill_graphs_replay_atmm_and_agree_with_eager_prefill(model_path):
    """The packed prefill forward replayed from its token bucket's CUDA graph (prefill_graphs.py),
    LoRA on ATMM inside it, answers like the unpadded eager forward: waves of the same two-row
    composition (one bucket, one LoRA launch key): warm-up, capture, then replays; bf16 greedy
    tokens may flip at near-ties where padding changes a GEMM's shape."""
    a, b = "adapters/alpha/versions/1", "adapters/beta/versions/1"
    tokens, engines = {}, {}
    for mode in ("off", "auto"):
        eng = Engine(
            EngineConfig(
                model_path=model_path,
                device="cuda",
                dtype="bfloat16",
                max_batch_size=4,
                max_prefills_per_step=2,
                device_slots=3,
                kv_cache_bytes=TEST_KV_BYTES,
                prefill_graphs=mode,
            )
        )
        eng.eos_ids = set()
        eng.start()
        try:
            for i, name in enumerate((a, b)):
                bundle = random_adapter_bundle(model_path, rank=8 * (i + 1), lora_alpha=8, seed=i + 1)
                assert eng.load_adapter_bytes(name, bundle.sha256, bundle.data, bundle.config_json)
            for wave in range(4):
                reqs = [
                    WorkRequest(
                        f"w{wave}-{name}",
                        "Describe the image." + " more" * wave,
                        [random_image(wave + i, size=84)],
                        adapter=name,
                        max_new_tokens=6,
                    )
                    for i, name in enumerate((a, b))
                ]
                sinks: dict[str, queue.Queue] = {}
                with eng._wake:  # one step admits and prefills both
                    for r in reqs:
                        sinks[r.request_id] = queue.Queue()
                        eng.submit(eng.prepare(r), sinks[r.request_id].put)
                for rid, q in sinks.items():
                    while not isinstance(ev := q.get(timeout=120), (Finished, Failed)):
                        pass
                    assert isinstance(ev, Finished), ev
                    tokens.setdefault(mode, {})[rid] = ev.result.token_ids
            engines[mode] = eng.runner.prefill_graphs
        finally:
            eng.stop()
    g = engines["auto"]
    assert g.captures >= 1 and g.replays >= 2 and g.capture_failures == 0
    assert g.eager_steps == 0 and g.reference_steps == 0 and g.padding_tokens > 0
    assert engines["off"].captures == 0 and engines["off"].padding_tokens == 0
    same = sum(x == y for rid in tokens["off"] for x, y in zip(tokens["off"][rid], tokens["auto"][rid]))
    assert same / sum(len(v) for v in tokens["off"].values()) >= 0.9
