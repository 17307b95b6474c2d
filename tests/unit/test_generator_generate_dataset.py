"""`python -m services.generator generate --dataset`: one real (tiny) run on an image folder a
user brings, one on a JSONL text task (answers, no head), and the refusals a bad dataset gets
before any training."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")

from services.generator.__main__ import app
from tests.unit.test_generator_user_datasets import image_folder, jsonl_dataset, text_dataset


def _generate(model_path, out, *args):
    return CliRunner().invoke(
        app,
        [
            "generate",
            "--model-path",
            str(model_path),
            "--out",
            str(out),
            "--rank",
            "2",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--threads",
            "1",
            *args,
        ],
    )


def test_generate_on_an_image_folder(model_path, tmp_path):
    from services.generator.pipeline import held_out_images, load_generated

    root = image_folder(tmp_path / "swatches", per_label=6)
    out = tmp_path / "gen"
    result = _generate(model_path, out, "--dataset", str(root), "--threshold", "swatches=0.1", "--prefix", "sw")
    assert result.exit_code == 0, result.output
    manifest, bundles, greedy = load_generated(out)
    assert manifest["order"] == ["swatches"] and manifest["datasets"] == {"swatches": str(root)}
    assert manifest["thresholds"] == {"swatches": 0.1}
    assert [b.name for b in bundles] == ["sw-0"] and list(bundles[0].heads) == ["swatches"]
    assert json.loads((out / "sw-0" / "heads.json").read_text())["swatches"] == ["blue", "green", "red"]
    # the test split the generator measured: 1 image per label (6 per label: 4/1/1), rebuilt from
    # the dataset for the served check in the order of the manifest's predictions
    pngs, truth = held_out_images("swatches", manifest["limit"], manifest["datasets"]["swatches"])
    assert sorted(truth) == ["blue", "green", "red"]
    preds = manifest["test_predictions"]["swatches"]
    assert len(preds) == len(pngs) == 3 and set(preds) <= {"blue", "green", "red"}
    accuracy = sum(p == t for p, t in zip(preds, truth)) / 3
    assert greedy.tasks["swatches"]["accuracy"] == round(accuracy, 4)


def test_a_bad_dataset_is_refused_before_training_with_its_location(model_path, tmp_path):
    root = image_folder(tmp_path / "swatches")
    (root / "red" / "00.png").write_bytes(b"garbage")
    result = _generate("/no/such/model", tmp_path / "gen", "--dataset", str(root))
    assert result.exit_code == 2
    assert str(root / "red" / "00.png") in result.output.replace("\n", "") and "unreadable image" in result.output
    assert not (tmp_path / "gen").exists()


def test_generate_on_a_jsonl_text_task(model_path, tmp_path):
    from services.generator.answers import exact_match_accuracy
    from services.generator.pipeline import held_out_task, load_generated

    path = text_dataset(tmp_path / "ds", n_images=5)
    out = tmp_path / "gen"
    result = _generate(model_path, out, "--dataset", str(path), "--threshold", "shapes=0.0", "--prefix", "tx")
    assert result.exit_code == 0, result.output
    manifest, bundles, greedy = load_generated(out)
    assert manifest["kinds"] == {"shapes": "text"} and manifest["max_new_tokens"]["shapes"] >= 3
    assert [b.name for b in bundles] == ["tx-0"] and bundles[0].heads == {}  # no head: a plain LoRA
    assert bundles[0].served_tasks == ("shapes",)
    assert json.loads((out / "tx-0" / "heads.json").read_text()) == {}
    # the test split's answers, decoded, scored against the references by normalised exact match
    data = held_out_task("shapes", manifest["limit"], manifest["datasets"]["shapes"])
    preds = manifest["test_predictions"]["shapes"]
    assert len(preds) == data.size("test") == 2  # one image (of 5: 3/1/1), two questions
    assert greedy.tasks["shapes"]["accuracy"] == round(exact_match_accuracy(preds, data.answers("test")), 4)


def test_an_empty_answer_is_refused_with_its_line(tmp_path):
    path = text_dataset(tmp_path, extra=[{"image": "imgs/red-0.png", "question": "What is it?", "answer": ""}])
    result = _generate("/no/such/model", tmp_path / "gen", "--dataset", str(path))
    assert result.exit_code == 2
    assert '"answer" must be a non-empty string' in result.output and f"{path.name}:21" in result.output.replace(
        "\n", ""
    )
    assert not (tmp_path / "gen").exists()


def test_dataset_task_names_may_not_shadow_built_in_tasks(tmp_path):
    path = jsonl_dataset(tmp_path, task="digit")
    result = _generate("/no/such/model", tmp_path / "gen", "--dataset", str(path))
    assert result.exit_code == 2 and "built-in task" in result.output
