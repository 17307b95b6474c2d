"""Datasets a user brings (services/generator/user_datasets.py): an image folder and JSONL,
written here with PIL; every validation error names the file (and line), and the splits are
stratified, disjoint and deterministic."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from services.generator.user_datasets import (
    MIN_PER_LABEL,
    MIN_TEXT_IMAGES,
    DatasetError,
    load_dataset,
    pack_dataset,
    task_id_of,
    unpack_dataset,
)

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30)}


def _image(path: Path, colour, i: int, size=(20, 14)) -> Path:
    """A distinct image (a pixel differs per i, so no two files have the same bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", size, colour)
    img.putpixel((i % size[0], i // size[0] % size[1]), (i * 7 % 256, 255, i * 13 % 256))
    img.save(path)
    return path


def image_folder(root: Path, per_label: int = 8, labels=("red", "blue", "green")) -> Path:
    for lab in labels:
        for i in range(per_label):
            _image(root / lab / f"{i:02d}.png", COLOURS[lab], i + 100 * list(COLOURS).index(lab))
    return root


def jsonl_dataset(root: Path, per_label: int = 8, task: str | None = None, extra: list[dict] = ()) -> Path:
    lines = []
    for k, lab in enumerate(("red", "blue")):
        for i in range(per_label):
            rel = f"imgs/{lab}-{i}.png"
            _image(root / rel, COLOURS[lab], i + 100 * k)
            rec = {"id": f"{lab}-{i}", "image": rel, "question": "What colour is it?", "label": lab}
            if task:
                rec["task"] = task
            lines.append(rec)
    lines.extend(extra)
    path = root / "colours.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def _problems(exc_info) -> list[str]:
    return exc_info.value.problems


def test_image_folder_is_one_task_with_stratified_deterministic_splits(tmp_path):
    root = image_folder(tmp_path / "My Colours")
    (root / "prompt.txt").write_text("Which colour fills the image?\n")
    tasks = load_dataset(root)
    assert list(tasks) == ["my-colours"]
    d = tasks["my-colours"]
    assert d.prompt == "Which colour fills the image?"
    assert d.labels == ("blue", "green", "red")
    assert [d.size(s) for s in ("train", "val", "test")] == [3 * 5, 3 * 2, 3 * 1]  # 8 per label: 5/2/1
    for s in ("train", "val", "test"):
        assert set(d.targets[s].tolist()) == {0, 1, 2}
        assert all(img.mode == "RGB" and img.size == (56, 56) for img in d.images[s])
        # each image's colour is its label's: the labels went with the right files
        for img, y in zip(d.images[s], d.targets[s]):
            assert img.getpixel((30, 30)) == COLOURS[d.labels[y]]
    again = load_dataset(root)["my-colours"]
    for s in ("train", "val", "test"):
        assert np.array_equal(again.targets[s], d.targets[s])
        assert [i.tobytes() for i in again.images[s]] == [i.tobytes() for i in d.images[s]]
    pixels = {s: {i.tobytes() for i in d.images[s]} for s in ("train", "val", "test")}
    assert not (pixels["train"] & pixels["test"]) and not (pixels["val"] & pixels["test"])
    assert load_dataset(root, limit=2)["my-colours"].size("train") == 2


def test_jsonl_tasks_labels_and_the_default_task_name(tmp_path):
    path = jsonl_dataset(tmp_path)
    tasks = load_dataset(path)
    assert list(tasks) == ["colours"]
    d = tasks["colours"]
    assert d.prompt == "What colour is it?" and d.labels == ("blue", "red")
    assert [d.size(s) for s in ("train", "val", "test")] == [10, 4, 2]
    for img, y in zip(d.images["test"], d.targets["test"]):
        assert img.getpixel((30, 30)) == COLOURS[d.labels[y]]
    assert list(load_dataset(jsonl_dataset(tmp_path / "b", task="paint"))) == ["paint"]


def test_task_ids_from_names():
    assert task_id_of("My Colours") == "my-colours"
    assert task_id_of("2024_pets") == "d-2024-pets"
    assert task_id_of("__") == "d"


def test_missing_directory_and_missing_image_name_the_path_and_line(tmp_path):
    with pytest.raises(DatasetError) as e:
        load_dataset(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(e.value)
    path = jsonl_dataset(
        tmp_path, extra=[{"id": "x", "image": "imgs/gone.png", "question": "What colour is it?", "label": "red"}]
    )
    with pytest.raises(DatasetError) as e:
        load_dataset(path)
    assert _problems(e) == [f"{path}:17: image 'imgs/gone.png' not found"]


def test_unreadable_image_is_named(tmp_path):
    root = image_folder(tmp_path / "c")
    bad = root / "red" / "broken.png"
    bad.write_bytes(b"\x89PNG not really")
    with pytest.raises(DatasetError) as e:
        load_dataset(root)
    assert len(_problems(e)) == 1 and _problems(e)[0].startswith(f"{bad}: unreadable image")


def test_empty_class_folder_is_named(tmp_path):
    root = image_folder(tmp_path / "c")
    (root / "purple").mkdir()
    (root / "purple" / "notes.txt").write_text("todo")
    with pytest.raises(DatasetError) as e:
        load_dataset(root)
    assert len(_problems(e)) == 1
    assert _problems(e)[0].startswith(f"{root / 'purple'}: label 'purple' has no images (1 other files)")


def test_too_few_examples_for_the_split_names_the_label(tmp_path):
    root = image_folder(tmp_path / "c", labels=("red", "blue"))
    for p in sorted((root / "blue").iterdir())[MIN_PER_LABEL - 1 :]:
        p.unlink()
    with pytest.raises(DatasetError) as e:
        load_dataset(root)
    assert _problems(e) == [
        f"{root / 'blue'}: label 'blue' has {MIN_PER_LABEL - 1} examples; each label needs at "
        f"least {MIN_PER_LABEL} for the 60/20/20 train/val/test split"
    ]
    with pytest.raises(DatasetError) as e:
        load_dataset(image_folder(tmp_path / "one", labels=("red",)))
    assert "1 label ('red'); a task needs at least 2" in str(e.value)


def test_duplicate_ids_and_duplicate_images_are_named(tmp_path):
    path = jsonl_dataset(
        tmp_path,
        extra=[
            {"id": "red-3", "image": "imgs/red-3.png", "question": "What colour is it?", "label": "red"},
            {"id": "again", "image": "imgs/red-2.png", "question": "What colour is it?", "label": "blue"},
        ],
    )
    with pytest.raises(DatasetError) as e:
        load_dataset(path)
    assert _problems(e) == [
        f"{path}:17: duplicate id 'red-3' (first on line 4)",
        f"{path}:18: the same image as {path}:3 (label 'red' there, 'blue' here); drop one",
    ]
    root = image_folder(tmp_path / "c")
    (root / "blue" / "copy.png").write_bytes((root / "red" / "01.png").read_bytes())
    with pytest.raises(DatasetError) as e:
        load_dataset(root)
    assert _problems(e) == [
        f"{root / 'red' / '01.png'}: the same image as {root / 'blue' / 'copy.png'} "
        "(label 'blue' there, 'red' here); drop one"
    ]


def test_malformed_lines_are_each_named_and_all_reported(tmp_path):
    path = jsonl_dataset(
        tmp_path,
        extra=[
            "not json",
            {"image": "imgs/red-1.png", "label": "red"},
            {"image": "/etc/passwd", "question": "What colour is it?", "label": "red", "id": "abs"},
            {"image": "../x.png", "question": "What colour is it?", "label": "red", "id": "up"},
            {"image": "imgs/red-1.png", "question": "Which colour?", "label": "red", "id": "q"},
            {"image": "imgs/red-1.png", "question": "What colour is it?", "label": "red", "task": "Bad Task"},
        ],
    )
    path.write_text(path.read_text().replace('"not json"', "not json"))
    with pytest.raises(DatasetError) as e:
        load_dataset(path)
    got = _problems(e)
    assert [p.split(": ", 1)[0] for p in got] == [f"{path}:{n}" for n in range(17, 23)]
    assert "not JSON" in got[0] and "missing 'question'" in got[1]
    assert "must be a path inside" in got[2] and "must be a path inside" in got[3]
    assert "differs from line 1's 'What colour is it?'" in got[4] and "must match" in got[5]


def text_dataset(root: Path, n_images: int = 10, extra: list[dict] = ()) -> Path:
    """A JSONL text task "shapes": each image asked two questions (its colour, its size)."""
    lines = []
    for i in range(n_images):
        lab = ("red", "blue", "green")[i % 3]
        rel = f"imgs/{lab}-{i}.png"
        _image(root / rel, COLOURS[lab], i + 300)
        lines.append({"id": f"c{i:02d}", "image": rel, "question": "What colour is it?", "answer": f"{lab}."})
        lines.append({"id": f"s{i:02d}", "image": rel, "question": "How big is it?", "answer": "The Small one"})
    lines.extend(extra)
    path = root / "shapes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_answer_records_make_a_text_task_split_by_image(tmp_path):
    from services.generator.datasets import TEXT

    path = text_dataset(tmp_path)
    d = load_dataset(path)["shapes"]
    assert d.kind == TEXT and d.labels == ("The Small one", "blue.", "green.", "red.")  # answers, as written
    assert d.prompt in ("What colour is it?", "How big is it?")
    sizes = [d.size(s) for s in ("train", "val", "test")]
    assert sizes == [12, 4, 4]  # 10 images (6/2/2), two questions each
    seen = {}
    for s in ("train", "val", "test"):
        assert len(d.questions[s]) == d.size(s)
        for i, (img, q, a) in enumerate(zip(d.images[s], d.questions[s], d.answers(s))):
            assert d.question(s, i) == q
            if q == "What colour is it?":  # each answer went with its own image
                assert COLOURS[a.rstrip(".")] == img.getpixel((30, 30))
            else:
                assert a == "The Small one"
            key = img.tobytes()
            assert seen.setdefault(key, s) == s  # an image's questions all land in one split
    again = load_dataset(path)["shapes"]
    assert all(again.questions[s] == d.questions[s] and again.answers(s) == d.answers(s) for s in d.questions)


def test_text_task_records_are_checked_and_every_problem_named(tmp_path):
    path = text_dataset(
        tmp_path,
        extra=[
            {"id": "e1", "image": "imgs/red-0.png", "question": "Why?", "answer": "  "},
            {"id": "e2", "image": "imgs/red-0.png", "question": "Why?", "answer": "The."},
            {"id": "e3", "image": "imgs/red-0.png", "question": "Why?", "answer": "x" * 65},
            {"id": "e4", "image": "imgs/red-0.png", "question": "Why?", "answer": ["red"]},
            {"id": "e5", "image": "imgs/red-0.png", "question": "What colour is it?", "label": "red"},
            {"id": "e6", "image": "imgs/red-0.png", "question": "what colour is it", "answer": "red"},
        ],
    )
    with pytest.raises(DatasetError) as e:
        load_dataset(path)
    got = _problems(e)
    assert [p.split(": ", 1)[0] for p in got] == [f"{path}:{n}" for n in range(21, 27)]
    assert '"answer" must be a non-empty string' in got[0]
    assert "empty once normalised" in got[1] and "at most 64" in got[2]
    assert '"answer" must be a non-empty string' in got[3]
    assert 'mixes "label" with line 1\'s "answer"' in got[4]
    assert f"the same image and question as {path}:1 (answer 'red.' there, 'red' here)" in got[5]


def test_a_text_task_needs_enough_images(tmp_path):
    path = text_dataset(tmp_path, n_images=MIN_TEXT_IMAGES - 1)
    with pytest.raises(DatasetError) as e:
        load_dataset(path)
    assert _problems(e) == [
        f"{path} (task 'shapes'): {MIN_TEXT_IMAGES - 1} distinct images; a text task needs "
        f"at least {MIN_TEXT_IMAGES} for the 60/20/20 train/val/test split (by image)"
    ]
    load_dataset(text_dataset(tmp_path / "ok", n_images=MIN_TEXT_IMAGES))  # enough: 3/1/1


def test_pack_and_unpack_round_trip_both_layouts(tmp_path):
    folder = image_folder(tmp_path / "colours")
    jsonl = jsonl_dataset(tmp_path / "j")
    (tmp_path / "j" / "imgs" / "unused.png").write_bytes(b"not packed")
    for src in (folder, jsonl):
        data = pack_dataset(src)
        dest = tmp_path / f"unpacked-{src.name}"
        dest.mkdir()
        found = unpack_dataset(data, dest)
        assert found.name == src.name
        a, b = load_dataset(src), load_dataset(found)
        assert list(a) == list(b)
        for t in a:
            assert [i.tobytes() for i in a[t].images["test"]] == [i.tobytes() for i in b[t].images["test"]]
        archive = tmp_path / f"{src.name}.tar.gz"
        archive.write_bytes(data)
        assert list(load_dataset(archive)) == list(a)
    assert not (tmp_path / "unpacked-colours.jsonl" / "imgs" / "unused.png").exists()


def test_an_archive_member_outside_the_archive_is_refused(tmp_path):
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("../evil.txt")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    dest = tmp_path / "d"
    dest.mkdir()
    with pytest.raises(DatasetError) as e:
        unpack_dataset(buf.getvalue(), dest, source="upload")
    assert _problems(e) == ["upload: member '../evil.txt' is not a plain file inside the archive"]
    assert not (tmp_path / "evil.txt").exists()


def test_an_archive_too_large_unpacked_is_refused_before_writing(tmp_path):
    data = pack_dataset(image_folder(tmp_path / "colours"))
    for kw in (dict(max_bytes=1000), dict(max_files=10)):
        dest = tmp_path / f"d{len(kw)}-{next(iter(kw))}"
        dest.mkdir()
        with pytest.raises(DatasetError) as e:
            unpack_dataset(data, dest, source="upload", **kw)
        assert _problems(e)[0].startswith("upload: the archive holds 24 files,")
        assert list(dest.iterdir()) == []
    dest = tmp_path / "ok"
    dest.mkdir()
    assert unpack_dataset(data, dest, max_files=24).name == "colours"


def test_packing_is_deterministic_across_file_times_and_clocks(tmp_path, monkeypatch):
    import os
    import time

    for src in (image_folder(tmp_path / "colours"), jsonl_dataset(tmp_path / "j")):
        first = pack_dataset(src)
        for p in [src, *src.parent.rglob("*")]:
            os.utime(p, (1_000_000, 1_000_000))
        later = time.time() + 3600
        monkeypatch.setattr(time, "time", lambda: later)
        assert pack_dataset(src) == first
        monkeypatch.undo()


class _Uploads:
    """A client's upload_dataset, recording what was sent."""

    def __init__(self):
        self.sent: list[bytes] = []

    def upload_dataset(self, archive: bytes):
        import hashlib
        from types import SimpleNamespace

        self.sent.append(archive)
        return SimpleNamespace(name=f"datasets/{hashlib.sha256(archive).hexdigest()}")


def test_upload_for_job_orders_sources_and_sends_archives_as_they_are(tmp_path):
    import hashlib

    from services.generator.user_datasets import upload_for_job

    path = jsonl_dataset(
        tmp_path / "j",
        extra=[
            {"image": f"imgs/red-{i}.png", "question": "Is it red?", "label": "yes", "task": "isred", "id": f"r{i}"}
            for i in range(5)
        ]
        + [
            {"image": f"imgs/blue-{i}.png", "question": "Is it red?", "label": "no", "task": "isred", "id": f"b{i}"}
            for i in range(5)
        ],
    )
    client = _Uploads()
    sources = upload_for_job(client, path, [("digit", 0.9), ("isred", 0.7)], threshold=0.4)
    name = f"datasets/{hashlib.sha256(client.sent[0]).hexdigest()}"
    assert sources == [("digit", 0.9, ""), ("isred", 0.7, name), ("colours", 0.4, name)]
    archive = tmp_path / "j.tar.gz"
    archive.write_bytes(client.sent[0])
    assert upload_for_job(client, archive, [], threshold=0.5) == [("colours", 0.5, name), ("isred", 0.5, name)]
    assert client.sent[1] == client.sent[0]  # the archive itself, not a re-pack
    (tmp_path / "j" / "imgs" / "red-0.png").unlink()
    with pytest.raises(DatasetError):
        upload_for_job(client, path, [], threshold=0.5)
    assert len(client.sent) == 2  # nothing sent for a bad dataset
