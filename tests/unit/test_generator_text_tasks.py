"""Text tasks (VQA-style answers, datasets.TEXT): normalised exact match; teacher-forced answer
logits and the answer-only loss from cached image features equal the whole Qwen2-VL run from
pixels (HF's own loss with the prompt's labels at -100); greedy decoding equals HF `generate`
(what a worker answers a TEXT request with at temperature 0); and a text task is fused by the
greedy algorithm beside a head task, its exact-match accuracy deciding rollbacks."""

from __future__ import annotations

import pytest

from services.generator.answers import exact_match, exact_match_accuracy, normalize_answer


def test_answers_are_normalised_as_squad_does():
    assert normalize_answer("  The Red   square. ") == "red square"
    assert normalize_answer("An apple, a day!") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles are whole words only
    assert exact_match("Yellow!", "yellow") and not exact_match("dark red", "red")
    assert exact_match_accuracy(["red", "A blue", "green"], ["red", "blue", "red"]) == pytest.approx(2 / 3)
    assert exact_match_accuracy([], []) == 0.0
    with pytest.raises(ValueError):
        exact_match_accuracy(["red"], [])


torch = pytest.importorskip("torch")

N = 16  # images per split


@pytest.fixture(scope="module")
def trainer(model_path):
    from services.generator.datasets import build_tasks
    from services.generator.model import BaseModel
    from services.generator.training import TorchTrainer, TrainConfig

    torch.manual_seed(0)
    tasks = build_tasks(["square-colour", "count"], limit=N)
    base = BaseModel.load(model_path, rank=4, lora_alpha=8.0)
    return TorchTrainer(base, tasks, TrainConfig(epochs=1, batch_size=8, lr=5e-3, head_only_steps=20))


@pytest.fixture(scope="module")
def trained(trainer):
    return trainer.fuse(trainer.empty(), ["square-colour"])


def _hf_inputs(trainer, images, prompt, answers):
    """Token ids of chat prompt + answer tokens, pixel values, grid, and HF labels (-100 but on answers)."""
    from services.generator.model import IMAGE_PAD, chat_text

    base = trainer.base
    px = base.image_processor(images=list(images), return_tensors="pt")
    n_img = int(px["image_grid_thw"][0].prod()) // 4
    prompt_ids = base.tokenizer(chat_text(prompt).replace(IMAGE_PAD, IMAGE_PAD * n_img), add_special_tokens=False)[
        "input_ids"
    ]
    ids = torch.tensor([prompt_ids + a for a in answers])
    labels = ids.clone()
    labels[:, : len(prompt_ids)] = -100
    return ids, px, labels


def test_answer_loss_from_cached_features_is_hfs_loss_on_answer_tokens_only(trainer, trained):
    task = "square-colour"
    data = trainer.tasks[task]
    base = trainer.base
    base.load_lora(trained.lora)
    idx = torch.tensor([0, 3, 5])  # the same answer length (one colour word) keeps HF's batch unpadded
    ys = trainer.targets(task, "train")[idx].tolist()
    lengths = {len(trainer.answer_ids(task)[y]) for y in ys}
    if len(lengths) != 1:
        idx = torch.tensor([i for i, y in enumerate(trainer.targets(task, "train").tolist()) if y == ys[0]][:3])
        ys = trainer.targets(task, "train")[idx].tolist()
    answers = [trainer.answer_ids(task)[y] for y in ys]
    assert all(a[-1] == base.tokenizer.convert_tokens_to_ids("<|im_end|>") for a in answers)
    with torch.no_grad():
        ours = trainer.text_loss(task, data.prompt, idx)
        ids, px, labels = _hf_inputs(trainer, [data.images["train"][i] for i in idx.tolist()], data.prompt, answers)
        mm = (ids == base.model.config.image_token_id).int()
        out = base.model(
            input_ids=ids,
            pixel_values=px["pixel_values"],
            image_grid_thw=px["image_grid_thw"],
            mm_token_type_ids=mm,
            labels=labels,
        )
    torch.testing.assert_close(ours, out.loss, atol=1e-4, rtol=1e-4)
    # the prompt carries no loss: the same answers after another prompt give another loss...
    # ...but what is averaged is only the answer tokens: HF's loss with prompt labels kept differs
    with torch.no_grad():
        unmasked = base.model(
            input_ids=ids,
            pixel_values=px["pixel_values"],
            image_grid_thw=px["image_grid_thw"],
            mm_token_type_ids=mm,
            labels=ids,
        ).loss
    assert abs(float(unmasked) - float(ours)) > 1e-3


def test_greedy_answers_are_hf_generate_with_the_adapter(trainer, trained):
    task = "square-colour"
    data = trainer.tasks[task]
    base = trainer.base
    ours = trainer.answers(trained, task, "val")[:4]
    budget = trainer.max_new_tokens(task)
    base.load_lora(trained.lora)
    want = []
    for img in data.images["val"][:4]:
        ids, px, _ = _hf_inputs(trainer, [img], data.prompt, [[]])
        mm = (ids == base.model.config.image_token_id).int()
        with torch.no_grad():
            gen = base.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                pixel_values=px["pixel_values"],
                image_grid_thw=px["image_grid_thw"],
                mm_token_type_ids=mm,
                max_new_tokens=budget,
                do_sample=False,
                eos_token_id=sorted(base.stop_ids()),
                pad_token_id=sorted(base.stop_ids())[0],
            )
        new = gen[0, ids.shape[1] :].tolist()
        cut = next((i for i, t in enumerate(new) if t in base.stop_ids()), len(new))
        want.append(base.tokenizer.decode(new[:cut], skip_special_tokens=True))
    assert ours == want


def test_a_text_task_is_fused_beside_a_head_task_by_exact_match(trainer):
    from services.generator import pipeline

    result, fusion = pipeline.greedy(trainer, ["count", "square-colour"], {"count": 0.0, "square-colour": 0.0}, "t")
    [adapter] = fusion.adapters
    assert adapter.tasks == ["count", "square-colour"]
    assert set(adapter.state.heads) == {"count"} and adapter.state.text == ("square-colour",)
    preds = result.predictions["square-colour"]
    assert len(preds) == N and all(isinstance(p, str) for p in preds)
    truth = trainer.tasks["square-colour"].answers("test")
    assert result.tasks["square-colour"]["accuracy"] == round(exact_match_accuracy(preds, truth), 4)
    [bundle] = pipeline.bundles_of(fusion, trainer.tasks, 4, 8.0, "t")
    assert list(bundle.heads) == ["count"] and bundle.served_tasks == ("count", "square-colour")
    assert pipeline.text_budgets(trainer, ["count", "square-colour"]) == {
        "square-colour": trainer.max_new_tokens("square-colour")
    }

    # a threshold the text task cannot meet rolls its fusion back and leaves it alone
    result, fusion = pipeline.greedy(trainer, ["count", "square-colour"], {"count": 0.0, "square-colour": 1.01}, "t")
    assert [a.tasks for a in fusion.adapters] == [["count"], ["square-colour"]]
    assert [s.decision for s in fusion.steps] == ["new_adapter", "rolled_back", "below_threshold_alone"]
    assert fusion.steps[1].failing == ("square-colour",)
    [b0, b1] = pipeline.bundles_of(fusion, trainer.tasks, 4, 8.0, "t")
    assert b1.heads == {} and b1.served_tasks == ("square-colour",)  # a plain LoRA: served as text
