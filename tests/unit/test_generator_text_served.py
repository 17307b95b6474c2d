"""Served = offline for a text task: an adapter generated for real for the built-in text task
square-colour (no heads: a plain LoRA) is loaded into the worker engine, and a TEXT request
(the task's question, greedy, the generator's max_new_tokens) for every test image must be
answered with the generator's own decoded answer (`StrategyResult.predictions`, what the
manifest keeps), unmerged and merged. Both sides run the same fp32 math, so nothing short of
equal text is expected."""

from __future__ import annotations

import hashlib
import io

import pytest

torch = pytest.importorskip("torch")

N = 12  # test images (split cap)
NAME = "adapters/text-0/versions/1"


@pytest.fixture(scope="module")
def generated(model_path):
    from services.generator import pipeline
    from services.generator.datasets import build_tasks
    from services.generator.model import BaseModel
    from services.generator.training import TorchTrainer, TrainConfig

    torch.manual_seed(0)
    tasks = build_tasks(["square-colour"], limit=N)
    base = BaseModel.load(model_path, rank=4, lora_alpha=8.0)
    trainer = TorchTrainer(base, tasks, TrainConfig(epochs=1, batch_size=8, lr=1e-2))
    result, fusion = pipeline.greedy(trainer, ["square-colour"], {"square-colour": 0.0}, "text")
    [bundle] = pipeline.bundles_of(fusion, tasks, 4, 8.0, "text", base_model=str(model_path))
    return tasks, result, bundle, pipeline.text_budgets(trainer, ["square-colour"])["square-colour"]


@pytest.fixture(scope="module")
def engine(model_path, generated):
    from services.worker.engine import Engine, EngineConfig
    from services.worker.testing import TEST_KV_BYTES

    _, _, bundle, _ = generated
    assert bundle.heads == {}
    eng = Engine(EngineConfig(model_path=model_path, device="cpu", max_batch_size=8, kv_cache_bytes=TEST_KV_BYTES))
    eng.start()
    assert eng.load_adapter_bytes(
        NAME, hashlib.sha256(bundle.data).hexdigest(), bundle.data, bundle.config_json, bundle.heads
    )
    yield eng
    eng.stop()


@pytest.mark.parametrize("mode", ["unmerged", "merged"])
def test_served_answer_of_every_test_image_is_the_generators(engine, generated, mode):
    from services.common.modes import Mode
    from services.worker.processor import decode_image
    from services.worker.requests import WorkRequest

    tasks, result, _, budget = generated
    data = tasks["square-colour"]
    want = Mode.UNMERGED if mode == "unmerged" else Mode.MERGED
    engine.set_mode(want, None if want == Mode.UNMERGED else NAME)
    try:
        served, modes = [], set()
        for i, img in enumerate(data.images["test"]):
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            _, r = engine.generate(
                WorkRequest(
                    f"sq-{i}",
                    data.question("test", i),
                    [decode_image(buf.getvalue())],
                    adapter=NAME,
                    max_new_tokens=budget,
                )
            )
            served.append(r.text)
            modes.add(r.mode)
        assert modes == {want}
        assert served == result.predictions["square-colour"]
        # the check has teeth: the base model alone answers otherwise
        _, plain = engine.generate(
            WorkRequest("sq-base", data.question("test", 0), [decode_image(buf.getvalue())], max_new_tokens=budget)
        )
        assert plain.text != served[-1]
    finally:
        engine.set_mode(Mode.UNMERGED)
