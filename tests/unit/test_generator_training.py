"""Train a tiny adapter for real, export it, and check the bundle reproduces the trained model.

The reference applies the bundle with nothing but torch and the bundle's own words: every
targeted linear layer computes y = base(x) + (lora_alpha / r) * x A^T B^T, the whole Qwen2-VL
runs from pixel values, and head logits = W h + b over the final-norm hidden state of the last
prompt token. It shares no code with the generator's training path (which runs on cached image
features through its own LoRA modules).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    if not (REPO / "services" / "worker" / "tiny_model.py").exists():
        pytest.skip("the worker's tiny model builder is not in this checkout")
    path = tmp_path_factory.mktemp("tiny") / "qwen2-vl"
    subprocess.run(
        [sys.executable, "-m", "services.worker.tiny_model", str(path)],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=120,
    )
    return path


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    from services.generator.datasets import build_tasks
    from services.generator.model import BaseModel
    from services.generator.training import TorchTrainer, TrainConfig

    torch.manual_seed(0)
    tasks = build_tasks(["digit", "count"], limit=32)
    base = BaseModel.load(tiny_model_dir, rank=4, lora_alpha=8.0)
    trainer = TorchTrainer(base, tasks, TrainConfig(epochs=2, batch_size=16, lr=3e-3, head_only_steps=30))
    state = trainer.fuse(trainer.empty(), ["digit", "count"])
    return tasks, base, trainer, state


def _reference_head_logits(
    model_dir: Path, bundle: bytes | None, config_json: str, images, prompt: str, head: str
) -> torch.Tensor:
    from safetensors.numpy import load
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = Qwen2VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    improc = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
    tensors = {k: torch.from_numpy(v.copy()) for k, v in load(bundle).items()} if bundle else {}
    cfg = json.loads(config_json)
    scale = cfg["lora_alpha"] / cfg["r"]
    hooked = 0
    for name, module in model.named_modules():
        a = tensors.get(f"base_model.model.{name}.lora_A.weight")
        if a is None:
            continue
        b = tensors[f"base_model.model.{name}.lora_B.weight"]
        module.register_forward_hook(lambda m, inp, out, a=a, b=b: out + scale * (inp[0] @ a.T) @ b.T)
        hooked += 1
    if bundle:
        assert hooked == 7 * model.config.text_config.num_hidden_layers

    px = improc(images=list(images), return_tensors="pt")
    n_image_tokens = int(px["image_grid_thw"][0].prod()) // 4  # merge_size 2 x 2
    text = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
        + "<|image_pad|>" * n_image_tokens
        + f"<|vision_end|>{prompt}<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]] * len(images))
    mm = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        h = model.model(
            input_ids=ids, pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"], mm_token_type_ids=mm
        ).last_hidden_state[:, -1]
        if not tensors:
            return h
        return h @ tensors[f"heads.{head}.weight"].T + tensors[f"heads.{head}.bias"]


def test_exported_bundle_reproduces_trained_head_logits(tiny_model_dir, trained):
    from services.common.adapter_format import BaseModelShapes, validate_bundle
    from services.generator.bundle import export_bundle

    tasks, base, trainer, state = trained
    bundle = export_bundle("fused-0", state, {t: d.labels for t, d in tasks.items()}, rank=4, lora_alpha=8.0)
    shapes = BaseModelShapes.from_config(json.loads((tiny_model_dir / "config.json").read_text()))
    info = validate_bundle(bundle.data, bundle.config_json, shapes, max_rank=64)
    assert info.rank == 4 and info.lora_alpha == 8.0 and set(info.heads) == {"digit", "count"}
    assert info.heads == {"digit": 10, "count": 5}
    assert bundle.heads == {"digit": list(tasks["digit"].labels), "count": list(tasks["count"].labels)}
    # Training moved every B away from its zero init (the adapter is not a no-op).
    assert all(float(b.abs().max()) > 0 for _, b in state.lora.values())

    for task in ("digit", "count"):
        images = tasks[task].images["val"][:6]
        trained_logits = trainer.logits(state, task, "val")[:6]
        ref = _reference_head_logits(tiny_model_dir, bundle.data, bundle.config_json, images, tasks[task].prompt, task)
        torch.testing.assert_close(ref, trained_logits, atol=2e-4, rtol=1e-4)
        # ...and the LoRA part matters: the base model with the same head gives other logits.
        h0 = _reference_head_logits(tiny_model_dir, None, bundle.config_json, images, tasks[task].prompt, task)
        w, b = state.heads[task]
        assert float((h0 @ w.T + b - trained_logits).abs().max()) > 1e-2


def test_fuse_does_not_modify_its_input_state(trained):
    _, _, trainer, state = trained
    before = {k: (a.clone(), b.clone()) for k, (a, b) in state.lora.items()}
    heads_before = {t: (w.clone(), b.clone()) for t, (w, b) in state.heads.items()}
    trainer.config = type(trainer.config)(epochs=1, batch_size=16, lr=3e-3, head_only_steps=10)
    new = trainer.fuse(state, ["digit"])
    for k, (a, b) in state.lora.items():
        assert torch.equal(a, before[k][0]) and torch.equal(b, before[k][1])
    for t, (w, b) in state.heads.items():
        assert torch.equal(w, heads_before[t][0]) and torch.equal(b, heads_before[t][1])
    assert any(not torch.equal(new.lora[k][1], before[k][1]) for k in before)
    assert set(new.heads) == {"digit", "count"}  # a held head survives a fusion that does not train it


def test_validate_reports_accuracy_per_task(trained):
    _, _, trainer, state = trained
    acc = trainer.validate(state, ["digit", "count"], "test")
    assert set(acc) == {"digit", "count"} and all(0.0 <= v <= 1.0 for v in acc.values())
    _, base_acc = trainer.head_only("count")
    assert set(base_acc) == {"val", "test"}


def test_pretrained_base_is_a_loadable_model_directory(tiny_model_dir, tmp_path):
    from services.generator.model import BaseModel
    from services.generator.pretrain import pretrain

    out = tmp_path / "demo"
    result = pretrain(tiny_model_dir, out, steps=2, batch_size=4)
    assert 0.0 <= result["val_accuracy"] <= 1.0
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    base = BaseModel.load(out, rank=2)
    # The weights changed (it trained), and the processor/tokenizer travel with it.
    before = BaseModel.load(tiny_model_dir, rank=2)
    w0 = before.model.model.language_model.layers[0].mlp.up_proj.base.weight
    w1 = base.model.model.language_model.layers[0].mlp.up_proj.base.weight
    assert not torch.equal(w0, w1)
    assert base.image_processor.merge_size == 2


def test_bfloat16_training_keeps_float32_lora_and_host_results(tiny_model_dir, trained):
    """The GPU path's precision on the CPU: frozen weights and activations in bfloat16, LoRA
    factors float32 parameters that learn (B leaves zero), heads and read-back weights float32 on
    the host, bundles that validate, and accuracy near the float32 run's on the same tasks."""
    from services.common.adapter_format import BaseModelShapes, validate_bundle
    from services.generator.bundle import export_bundle
    from services.generator.model import BaseModel, training_device
    from services.generator.training import TorchTrainer, TrainConfig

    tasks, _, fp32_trainer, fp32_state = trained
    torch.manual_seed(0)
    base = BaseModel.load(tiny_model_dir, rank=4, lora_alpha=8.0, **training_device("cpu", "bfloat16"))
    assert base.model.lm_head.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in base.lora_parameters())
    trainer = TorchTrainer(base, tasks, TrainConfig(epochs=2, batch_size=16, lr=3e-3, head_only_steps=30))
    state = trainer.fuse(trainer.empty(), ["digit", "count"])
    a, b = state.lora[(0, "q_proj")]
    assert a.dtype == b.dtype == torch.float32 and a.device.type == "cpu" and float(b.abs().sum()) > 0
    w, bias = state.heads["digit"]
    assert w.dtype == bias.dtype == torch.float32
    shapes = BaseModelShapes.from_config(json.loads((tiny_model_dir / "config.json").read_text()))
    bundle = export_bundle("bf16-0", state, {t: d.labels for t, d in tasks.items()}, rank=4, lora_alpha=8.0)
    validate_bundle(bundle.data, bundle.config_json, shapes, max_rank=64)
    bf16 = trainer.validate(state, ["digit", "count"], "test")
    fp32 = fp32_trainer.validate(fp32_state, ["digit", "count"], "test")
    for t in ("digit", "count"):
        assert abs(bf16[t] - fp32[t]) <= 0.25, (t, bf16, fp32)


@pytest.mark.parametrize(
    "device, dtype, match",
    [("tpu", "float32", "device"), ("cpu", "float16", "dtype"), ("cuda:7", "bfloat16", "CUDA")],
)
def test_a_training_device_this_machine_cannot_use_is_refused_by_name(device, dtype, match, monkeypatch):
    from services.generator.model import training_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=match):
        training_device(device, dtype)
