"""Served = offline, image by image: a small adapter generated for real (greedy fusion of two
tasks on the tiny Qwen2-VL, CPU fp32) and exported, then loaded into the worker engine and asked
a LABEL request for every test image (PNG bytes, as a client sends them). Each served label must
be the generator's own prediction for that image (`StrategyResult.predictions`, what the
manifest keeps and `valora demo` checks), and its probabilities the generator's softmax, in the
unmerged mode and with the adapter merged into the base weights. Both sides compute the serving
contract of services/generator/__init__.py with the same fp32 math, so nothing short of exact
label equality is expected; a served accuracy that differs from the generator's on the same
images is a serving defect, not noise.
"""

from __future__ import annotations

import hashlib
import io

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

N = 24  # test images per task (split cap)
NAME = "adapters/served-0/versions/1"


@pytest.fixture(scope="module")
def generated(model_path):
    from services.generator import pipeline
    from services.generator.datasets import build_tasks
    from services.generator.model import BaseModel
    from services.generator.training import TorchTrainer, TrainConfig

    torch.manual_seed(0)
    tasks = build_tasks(["digit", "count"], limit=N)
    base = BaseModel.load(model_path, rank=4, lora_alpha=8.0)
    trainer = TorchTrainer(base, tasks, TrainConfig(epochs=1, batch_size=8, lr=3e-3, head_only_steps=30))
    result, fusion = pipeline.greedy(trainer, ["digit", "count"], {"digit": 0.0, "count": 0.0}, "served")
    [bundle] = pipeline.bundles_of(fusion, tasks, 4, 8.0, "served", base_model=str(model_path))
    [adapter] = fusion.adapters
    probs = {t: torch.softmax(trainer.logits(adapter.state, t, "test"), -1) for t in ("digit", "count")}
    return tasks, result, bundle, probs


@pytest.fixture(scope="module")
def engine(model_path, generated):
    from services.worker.engine import Engine, EngineConfig
    from services.worker.testing import TEST_KV_BYTES

    _, _, bundle, _ = generated
    eng = Engine(EngineConfig(model_path=model_path, device="cpu", max_batch_size=8, kv_cache_bytes=TEST_KV_BYTES))
    eng.start()
    assert eng.load_adapter_bytes(
        NAME, hashlib.sha256(bundle.data).hexdigest(), bundle.data, bundle.config_json, bundle.heads
    )
    yield eng
    eng.stop()


def _served(engine, tasks, task: str):
    """(labels, probabilities in label order, modes) the engine answers for every test image of `task`."""
    from services.worker.processor import decode_image
    from services.worker.requests import OutputKind, WorkRequest

    data = tasks[task]
    labels, probs, modes = [], [], set()
    for i, img in enumerate(data.images["test"]):
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        _, r = engine.generate(
            WorkRequest(
                f"{task}-{i}",
                data.prompt,
                [decode_image(buf.getvalue())],
                adapter=NAME,
                output_kind=OutputKind.LABEL,
                head=task,
            )
        )
        scores = dict(r.scores)
        labels.append(r.label)
        probs.append([scores[label] for label in data.labels])
        modes.add(r.mode)
    return labels, torch.tensor(probs), modes


@pytest.mark.parametrize("mode", ["unmerged", "merged"])
def test_served_label_of_every_test_image_is_the_generators_prediction(engine, generated, mode):
    from services.common.modes import Mode

    tasks, result, _, offline_probs = generated
    want = Mode.UNMERGED if mode == "unmerged" else Mode.MERGED
    engine.set_mode(want, None if want == Mode.UNMERGED else NAME)
    try:
        for task in ("digit", "count"):
            labels, probs, modes = _served(engine, tasks, task)
            assert modes == {want}
            assert len(labels) == len(result.predictions[task]) == N
            assert labels == result.predictions[task], task
            torch.testing.assert_close(probs, offline_probs[task], atol=1e-4, rtol=0)
        # the check has teeth: the adapter's predictions are not one constant label
        assert len(set(result.predictions["digit"])) > 1
    finally:
        engine.set_mode(Mode.UNMERGED)
