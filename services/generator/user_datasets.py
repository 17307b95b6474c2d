"""Datasets a user brings: an image folder or a JSONL file, validated, split like the built-ins.

Two layouts (`load_dataset` tells them apart; a .zip or .tar[.gz] archive of either is unpacked first):

    image folder   PATH/<label>/<image>: one sub-folder per label, any number of images in each
                   (.png .jpg .jpeg .bmp .gif .webp); one task named after the folder (lowercased,
                   other characters -> "-"); its prompt is PATH/prompt.txt, else DEFAULT_PROMPT.
    JSONL          one JSON object per line: {"image": path relative to the file, "question": text,
                   "label": text} with optional "id" (unique in the file) and "task" (an id,
                   [a-z][a-z0-9-]{0,62}; default: the file's stem), so one file may hold several
                   tasks. A record with "answer" (text) instead of "label" belongs to a text task
                   (VQA-style, datasets.TEXT): trained on the answer's tokens, no head, scored by
                   normalised exact match of the generated answer (answers.py). One task holds
                   records of one kind.

A label task is trained and served with one prompt (the head reads the last prompt token), so
every record of a JSONL label task must ask the same question. A text task's records may each
ask their own question, and one image may carry several questions (never the same one twice);
its answers must be short (at most MAX_ANSWER_CHARS characters) and not empty once normalised
(an answer of only articles or punctuation could never be matched). A text task is split by
image (an image's questions all fall in one split), 60/20/20 from the same fixed seed, and
needs at least MIN_TEXT_IMAGES images.

Validation collects every problem before failing (`DatasetError.problems`, each "file[:line]:
what"): a missing path or image, an image PIL cannot decode, a label folder without images,
a duplicate id (JSONL) or the same image bytes twice (which would put one image in two splits,
or under two labels), fewer than two labels, and fewer than MIN_PER_LABEL examples of a label
(the split gives every label at least one train, val and test example).

Images are converted to RGB and resized to image_size x image_size (bicubic), as the built-in
tasks are 56x56: the trainer encodes a task's images at one size, and a served request must
send the image resized the same way to get the accuracy measured here. Splits are stratified
60/20/20 per label, from a fixed seed and the examples sorted by id, so loading twice gives the
same splits.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import shutil
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from services.generator.answers import normalize_answer
from services.generator.datasets import DEFAULT_IMAGE_SIZE, SPLIT_FRACTIONS, SPLIT_SEED, SPLITS, TEXT, TaskData

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
DEFAULT_PROMPT = "What does this image show?"
MIN_PER_LABEL = 5  # 3 train, 1 val, 1 test
MIN_TEXT_IMAGES = 5  # a text task's distinct images: 3 train, 1 val, 1 test
MAX_ANSWER_CHARS = 64  # a text task's answers are short (exact match, a few generated tokens)
TASK_ID = re.compile(r"[a-z][a-z0-9-]{0,62}")
MAX_PROBLEMS_SHOWN = 20
MAX_UNPACKED_BYTES = 8 << 30  # an archive a job names is unpacked on the runner: bounded
MAX_UNPACKED_FILES = 1_000_000


class DatasetError(ValueError):
    """A dataset that cannot be used; `problems` lists each as "file[:line]: what"."""

    def __init__(self, source: str, problems: list[str]):
        self.source, self.problems = source, problems
        shown = problems[:MAX_PROBLEMS_SHOWN]
        more = len(problems) - len(shown)
        super().__init__(
            f"dataset {source}: {len(problems)} problem{'s' if len(problems) != 1 else ''}\n  "
            + "\n  ".join(shown)
            + (f"\n  ... and {more} more" if more else "")
        )


@dataclass
class _Example:
    id: str
    where: str  # "file" or "file:line", for messages
    image: Path
    label: str  # a text task's: the answer text
    question: str = ""


def task_id_of(name: str) -> str:
    """A folder or file name as a task id: lowercased, runs of other characters -> "-"."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if not slug or not slug[0].isalpha():
        slug = f"d-{slug}".rstrip("-")
    return slug[:63].rstrip("-")


def _read_image(path: Path, where: str, problems: list[str]) -> bytes | None:
    """The file's bytes if PIL can decode them as an image, else None with a problem noted."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        problems.append(f"{where}: cannot read image {path.name}: {exc.strerror or exc}")
        return None
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
    except Exception as exc:  # whatever PIL raises, the file is no usable image
        problems.append(f"{where}: unreadable image ({type(exc).__name__}: {exc})")
        return None
    return data


def _check_examples(
    examples: list[_Example], source: str, problems: list[str], label_where: dict[str, str]
) -> dict[str, bytes]:
    """Reads every image (noting unreadable ones and repeated bytes) and checks the label counts.
    Returns {example id: image bytes} for the readable ones."""
    data: dict[str, bytes] = {}
    seen: dict[str, _Example] = {}
    for ex in examples:
        raw = _read_image(ex.image, ex.where, problems)
        if raw is None:
            continue
        digest = hashlib.sha256(raw).hexdigest()
        if digest in seen:
            first = seen[digest]
            what = "the same label" if first.label == ex.label else f"label {first.label!r} there, {ex.label!r} here"
            problems.append(f"{ex.where}: the same image as {first.where} ({what}); drop one")
        else:
            seen[digest] = ex
        data[ex.id] = raw
    counts: dict[str, int] = {}
    for ex in examples:
        counts[ex.label] = counts.get(ex.label, 0) + 1
    if len(counts) < 2:
        problems.append(
            f"{source}: {len(counts)} label{'s' if len(counts) != 1 else ''} "
            f"({', '.join(map(repr, counts)) or 'none'}); a task needs at least 2"
        )
    for label, n in sorted(counts.items()):
        if 0 < n < MIN_PER_LABEL:
            plural = "s" if n != 1 else ""
            problems.append(
                f"{label_where.get(label, source)}: label {label!r} has {n} example{plural}; "
                f"each label needs at least {MIN_PER_LABEL} for the 60/20/20 train/val/test split"
            )
    return data


def _check_text_examples(examples: list[_Example], source: str, problems: list[str]) -> dict[str, bytes]:
    """A text task's checks: readable images, no (image, question) twice, enough images.
    Returns {example id: image bytes}."""
    data: dict[str, bytes] = {}
    seen: dict[tuple[str, str], _Example] = {}
    images: set[str] = set()
    for ex in examples:
        raw = _read_image(ex.image, ex.where, problems)
        if raw is None:
            continue
        digest = hashlib.sha256(raw).hexdigest()
        key = (digest, normalize_answer(ex.question))
        if key in seen:
            first = seen[key]
            what = "the same answer" if first.label == ex.label else f"answer {first.label!r} there, {ex.label!r} here"
            problems.append(f"{ex.where}: the same image and question as {first.where} ({what}); drop one")
        else:
            seen[key] = ex
        images.add(digest)
        data[ex.id] = raw
    if len(images) < MIN_TEXT_IMAGES and len(data) == len(examples):
        problems.append(
            f"{source}: {len(images)} distinct image{'s' if len(images) != 1 else ''}; a text task "
            f"needs at least {MIN_TEXT_IMAGES} for the 60/20/20 train/val/test split (by image)"
        )
    return data


def _text_task_data(
    name: str, examples: list[_Example], data: dict[str, bytes], image_size: int, seed: int, limit: int | None
) -> TaskData:
    """A text task split by image: every question about one image lands in the same split."""
    answers = tuple(sorted({ex.label for ex in examples}))
    index = {a: i for i, a in enumerate(answers)}
    groups: dict[str, list[_Example]] = {}
    for ex in sorted(examples, key=lambda e: e.id):
        groups.setdefault(hashlib.sha256(data[ex.id]).hexdigest(), []).append(ex)
    ordered = sorted(groups.values(), key=lambda g: g[0].id)
    perm = np.random.default_rng(seed).permutation(len(ordered))
    n = len(ordered)
    a = min(max(1, int(round(n * SPLIT_FRACTIONS[0]))), n - 2)
    b = min(max(1, int(round(n * SPLIT_FRACTIONS[1]))), n - a - 1)
    images, targets, questions = {}, {}, {}
    for split, idx in zip(SPLITS, (perm[:a], perm[a : a + b], perm[a + b :])):
        chosen = sorted((ex for i in idx for ex in ordered[i]), key=lambda e: e.id)[:limit]
        images[split] = [_render(data[ex.id], image_size) for ex in chosen]
        targets[split] = np.array([index[ex.label] for ex in chosen], dtype=np.int64)
        questions[split] = [ex.question for ex in chosen]
    asked: dict[str, int] = {}
    for ex in examples:
        asked[ex.question] = asked.get(ex.question, 0) + 1
    prompt = max(sorted(asked), key=lambda q: asked[q])  # the most asked (the served default)
    return TaskData(
        name=name, prompt=prompt, labels=answers, images=images, targets=targets, kind=TEXT, questions=questions
    )


def _task_data(
    name: str,
    prompt: str,
    examples: list[_Example],
    data: dict[str, bytes],
    image_size: int,
    seed: int,
    limit: int | None,
) -> TaskData:
    labels = tuple(sorted({ex.label for ex in examples}))
    index = {lab: i for i, lab in enumerate(labels)}
    by_label: dict[str, list[_Example]] = {lab: [] for lab in labels}
    for ex in sorted(examples, key=lambda e: e.id):
        by_label[ex.label].append(ex)
    parts: dict[str, list[_Example]] = {s: [] for s in SPLITS}
    rng = np.random.default_rng(seed)
    for lab in labels:
        group = by_label[lab]
        perm = rng.permutation(len(group))
        a = max(1, int(round(len(group) * SPLIT_FRACTIONS[0])))
        b = max(1, int(round(len(group) * SPLIT_FRACTIONS[1])))
        a = min(a, len(group) - 2)  # leave at least one for val and test (MIN_PER_LABEL >= 3)
        b = min(b, len(group) - a - 1)
        for split, idx in zip(SPLITS, (perm[:a], perm[a : a + b], perm[a + b :])):
            parts[split].extend(group[i] for i in idx)
    images, targets = {}, {}
    for split in SPLITS:
        chosen = sorted(parts[split], key=lambda e: e.id)[:limit]
        images[split] = [_render(data[ex.id], image_size) for ex in chosen]
        targets[split] = np.array([index[ex.label] for ex in chosen], dtype=np.int64)
    return TaskData(name=name, prompt=prompt, labels=labels, images=images, targets=targets)


def _render(raw: bytes, size: int) -> Image.Image:
    with Image.open(io.BytesIO(raw)) as img:
        return img.convert("RGB").resize((size, size), Image.BICUBIC)


def load_image_folder(
    root: Path,
    image_size: int = DEFAULT_IMAGE_SIZE,
    seed: int = SPLIT_SEED,
    limit: int | None = None,
    name: str | None = None,
) -> dict[str, TaskData]:
    """PATH/<label>/<image> as one task {name: TaskData}; raises DatasetError."""
    root = Path(root)
    problems: list[str] = []
    if not root.is_dir():
        raise DatasetError(str(root), [f"{root}: no such directory"])
    examples: list[_Example] = []
    label_where: dict[str, str] = {}
    subdirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    for d in subdirs:
        label_where[d.name] = str(d)
        files = sorted(p for p in d.iterdir() if p.is_file() and not p.name.startswith("."))
        images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
        if not images:
            others = f" ({len(files)} other files)" if files else ""
            problems.append(
                f"{d}: label {d.name!r} has no images{others}; remove the folder or add images "
                f"({' '.join(IMAGE_SUFFIXES)})"
            )
        examples.extend(_Example(f"{d.name}/{p.name}", str(p), p, d.name) for p in images)
    if not subdirs:
        problems.append(f"{root}: no label sub-folders (expected {root}/<label>/<image>)")
    else:
        data = _check_examples(examples, str(root), problems, label_where)
    if problems:
        raise DatasetError(str(root), problems)
    prompt_file = root / "prompt.txt"
    prompt = prompt_file.read_text().strip() if prompt_file.is_file() else DEFAULT_PROMPT
    task = name or task_id_of(root.name)
    return {task: _task_data(task, prompt or DEFAULT_PROMPT, examples, data, image_size, seed, limit)}


def _resolve(base: Path, rel: str) -> Path | None:
    """`rel` inside `base`, or None when it is absolute or leaves `base` (never read outside)."""
    if not rel or Path(rel).is_absolute():
        return None
    path = (base / rel).resolve()
    return path if path.is_relative_to(base.resolve()) else None


def load_jsonl(
    path: Path, image_size: int = DEFAULT_IMAGE_SIZE, seed: int = SPLIT_SEED, limit: int | None = None
) -> dict[str, TaskData]:
    """A JSONL file's tasks {task: TaskData}: label tasks and text (answer) tasks; raises DatasetError."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(str(path), [f"{path}: no such file"])
    problems: list[str] = []
    default_task = task_id_of(path.stem)
    ids: dict[str, int] = {}
    tasks: dict[str, list[_Example]] = {}
    kinds: dict[str, tuple[str, int]] = {}  # task -> ("label" | "answer", first line)
    prompts: dict[str, tuple[str, int]] = {}  # label task -> (question, first line)
    label_where: dict[str, dict[str, str]] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        where = f"{path}:{n}"
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{where}: not JSON ({exc.msg} at column {exc.colno})")
            continue
        if not isinstance(rec, dict):
            problems.append(f"{where}: expected a JSON object, got {type(rec).__name__}")
            continue
        bad = [k for k in ("image", "question") if not isinstance(rec.get(k), str) or not rec.get(k).strip()]
        if bad:
            problems.append(f"{where}: missing {' and '.join(map(repr, bad))} (a non-empty string)")
            continue
        has_label, has_answer = "label" in rec, "answer" in rec
        if has_label == has_answer:
            problems.append(f'{where}: give exactly one of "label" (a label task) and "answer" (a text task)')
            continue
        kind = "answer" if has_answer else "label"
        value = rec[kind]
        if not isinstance(value, (str, int)) or isinstance(value, bool) or not str(value).strip():
            problems.append(f'{where}: "{kind}" must be a non-empty string, got {value!r}')
            continue
        value = " ".join(str(value).split()) if has_answer else str(value).strip()
        if has_answer and not normalize_answer(value):
            problems.append(
                f"{where}: answer {value!r} is empty once normalised (lowercase, no punctuation, "
                "no articles): exact match could never score it"
            )
            continue
        if has_answer and len(value) > MAX_ANSWER_CHARS:
            problems.append(
                f"{where}: answer of {len(value)} characters; a text task's answers are short "
                f"(at most {MAX_ANSWER_CHARS}), scored by exact match"
            )
            continue
        task = rec.get("task", default_task)
        if not isinstance(task, str) or not TASK_ID.fullmatch(task):
            problems.append(f"{where}: task {task!r} must match {TASK_ID.pattern}")
            continue
        first_kind = kinds.setdefault(task, (kind, n))
        if first_kind[0] != kind:
            problems.append(
                f'{where}: task {task!r} mixes "{kind}" with line {first_kind[1]}\'s '
                f'"{first_kind[0]}"; a task is a label task or a text task (split it with "task")'
            )
            continue
        rid = rec.get("id", f"line-{n:08d}")
        if not isinstance(rid, (str, int)) or isinstance(rid, bool):
            problems.append(f'{where}: "id" must be a string or a number, got {rid!r}')
            continue
        rid = str(rid)
        if rid in ids:
            problems.append(f"{where}: duplicate id {rid!r} (first on line {ids[rid]})")
            continue
        ids[rid] = n
        question = rec["question"].strip()
        if not has_answer:
            first = prompts.setdefault(task, (question, n))
            if first[0] != question:
                problems.append(
                    f"{where}: question {question!r} differs from line {first[1]}'s {first[0]!r}; a "
                    "label task is trained and served with one prompt (split it into tasks with "
                    '"task", or give "answer"s: a text task may ask any question)'
                )
                continue
        image = _resolve(path.parent, rec["image"])
        if image is None:
            problems.append(f"{where}: image {rec['image']!r} must be a path inside {path.parent} (relative)")
            continue
        if not image.is_file():
            problems.append(f"{where}: image {rec['image']!r} not found")
            continue
        tasks.setdefault(task, []).append(_Example(rid, where, image, value, question))
        if not has_answer:
            label_where.setdefault(task, {}).setdefault(value, f"{where} (task {task!r})")
    if not tasks and not problems:
        problems.append(f"{path}: no records")
    data: dict[str, dict[str, bytes]] = {}
    for task, examples in tasks.items():
        if kinds[task][0] == "answer":
            data[task] = _check_text_examples(examples, f"{path} (task {task!r})", problems)
        else:
            data[task] = _check_examples(examples, f"{path} (task {task!r})", problems, label_where[task])
    if problems:
        raise DatasetError(str(path), problems)
    return {
        t: (
            _text_task_data(t, ex, data[t], image_size, seed, limit)
            if kinds[t][0] == "answer"
            else _task_data(t, prompts[t][0], ex, data[t], image_size, seed, limit)
        )
        for t, ex in tasks.items()
    }


def load_dataset(
    path: Path | str, image_size: int = DEFAULT_IMAGE_SIZE, seed: int = SPLIT_SEED, limit: int | None = None
) -> dict[str, TaskData]:
    """An image folder, a .jsonl file, or a .zip/.tar/.tar.gz archive of one (`pack_dataset`'s):
    {task: TaskData}. `limit` caps each split's size. Raises DatasetError."""
    path = Path(path).expanduser()
    if path.is_file() and _is_archive(path):
        with tempfile.TemporaryDirectory(prefix="valora-dataset-") as tmp:
            return load_dataset(unpack_dataset(path.read_bytes(), Path(tmp), source=str(path)), image_size, seed, limit)
    if path.suffix.lower() == ".jsonl" or path.is_file():
        return load_jsonl(path, image_size, seed, limit)
    return load_image_folder(path, image_size, seed, limit)


def _is_archive(path: Path) -> bool:
    return zipfile.is_zipfile(path) or tarfile.is_tarfile(path)


def _normalised(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """No times, owners or modes of the packing machine in the archive: the same dataset packs to
    the same bytes, so to the same `datasets/{sha256}`."""
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    info.mode = 0o644 if info.isfile() else 0o755
    return info


def pack_dataset(path: Path | str) -> bytes:
    """A dataset as one .tar.gz (what a generation job references, uploaded through the store):
    an image folder whole under its own name, or a JSONL file with the images it names.
    Deterministic: the same files give the same bytes, whenever and by whomever packed."""
    path = Path(path).expanduser()
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        if path.is_dir():
            for p in sorted(path.rglob("*")):
                if p.is_file():
                    tar.add(
                        p, arcname=f"{path.name}/{p.relative_to(path).as_posix()}", recursive=False, filter=_normalised
                    )
        elif path.is_file():
            tar.add(path, arcname=path.name, filter=_normalised)
            added: set[str] = set()
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    rel = json.loads(line).get("image")
                except (json.JSONDecodeError, AttributeError):
                    continue  # load_dataset names the line
                image = _resolve(path.parent, rel) if isinstance(rel, str) else None
                if image is not None and image.is_file():
                    arc = image.relative_to(path.parent.resolve()).as_posix()
                    if arc not in added:
                        added.add(arc)
                        tar.add(image, arcname=arc, recursive=False, filter=_normalised)
        else:
            raise DatasetError(str(path), [f"{path}: no such file or directory"])
    return buf.getvalue()


def unpack_dataset(
    data: bytes,
    dest: Path,
    source: str = "archive",
    max_bytes: int = MAX_UNPACKED_BYTES,
    max_files: int = MAX_UNPACKED_FILES,
) -> Path:
    """Extracts an archive of a dataset into `dest` (plain files and folders only, nothing outside
    `dest`, at most `max_files` files and `max_bytes` bytes in all, checked on the sizes the
    archive declares before anything is written) and returns the dataset in it: the one .jsonl
    at its top, else its one top folder (an image folder), else `dest` itself."""
    dest = Path(dest)
    problems: list[str] = []
    raw = io.BytesIO(data)

    def check_sizes(sizes: list[int]) -> None:
        if len(sizes) > max_files or sum(sizes) > max_bytes:
            raise DatasetError(
                source,
                [
                    f"{source}: the archive holds {len(sizes)} files, {sum(sizes)} bytes "
                    f"unpacked; at most {max_files} files and {max_bytes} bytes are unpacked"
                ],
            )

    try:
        if zipfile.is_zipfile(raw):
            with zipfile.ZipFile(raw) as z:
                check_sizes([i.file_size for i in z.infolist() if not i.is_dir()])
                for info in z.infolist():
                    if _resolve(dest, info.filename) is None:
                        problems.append(f"{source}: member {info.filename!r} leaves the archive")
                    elif not info.is_dir():
                        target = dest / info.filename
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(z.read(info))
        else:
            raw.seek(0)
            with tarfile.open(fileobj=raw, mode="r:*") as tar:
                check_sizes([m.size for m in tar.getmembers() if m.isfile()])
                for m in tar.getmembers():
                    if _resolve(dest, m.name) is None or not (m.isfile() or m.isdir()):
                        problems.append(f"{source}: member {m.name!r} is not a plain file inside the archive")
                    elif m.isfile():
                        target = dest / m.name
                        target.parent.mkdir(parents=True, exist_ok=True)
                        with tar.extractfile(m) as f, target.open("wb") as out:
                            shutil.copyfileobj(f, out)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as exc:
        problems.append(f"{source}: not a readable .zip or .tar[.gz] archive ({exc})")
    if problems:
        raise DatasetError(source, problems)
    top = [p for p in dest.iterdir() if not p.name.startswith(".")]
    jsonl = [p for p in top if p.is_file() and p.suffix.lower() == ".jsonl"]
    if len(jsonl) == 1:
        return jsonl[0]
    if len(jsonl) > 1:
        names = ", ".join(p.name for p in jsonl)
        raise DatasetError(source, [f"{source}: {len(jsonl)} .jsonl files at the top ({names}); pack one"])
    dirs = [p for p in top if p.is_dir()]
    return dirs[0] if len(dirs) == 1 and not [p for p in top if p.is_file()] else dest


def tasks_for(
    order: list[str] | tuple[str, ...], datasets=(), limit: int | None = None, image_size: int = DEFAULT_IMAGE_SIZE
) -> tuple[list[str], dict[str, TaskData], dict[str, str]]:
    """The tasks of a generation run: every dataset's tasks (`load_dataset`) and the built-in
    tasks `order` names. Fusion order is `order` when given (it must name every dataset task it
    wants; a dataset task it leaves out is not generated), else the datasets' tasks in the order
    given, else the built-in default order. Returns (order, {task: TaskData}, {task: dataset}).
    Raises DatasetError for a bad dataset, ValueError for unknown or clashing task names."""
    from services.generator.datasets import DEFAULT_TASKS, TASKS, build_task

    loaded: dict[str, TaskData] = {}
    where: dict[str, str] = {}
    for ds in datasets:
        for name, data in load_dataset(ds, image_size=image_size, limit=limit).items():
            if name in TASKS:
                raise ValueError(
                    f"dataset {ds}: task {name!r} is a built-in task's name; rename it "
                    '(the folder, the file, or the records\' "task")'
                )
            if name in loaded:
                raise ValueError(f"dataset {ds}: task {name!r} is also in dataset {where[name]}")
            loaded[name], where[name] = data, str(ds)
    names = list(order) or list(loaded) or list(DEFAULT_TASKS)
    unknown = [t for t in names if t not in TASKS and t not in loaded]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; built-in: {sorted(TASKS)}; from the datasets: {sorted(loaded)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a task is named twice in the order {names}")
    tasks = {t: loaded[t] if t in loaded else build_task(t, image_size=image_size, limit=limit) for t in names}
    return names, tasks, {t: where[t] for t in names if t in where}


def upload_for_job(
    client, path: Path | str, sources: list[tuple[str, float]], threshold: float
) -> list[tuple[str, float, str]]:
    """What `valora generate --dataset PATH` sends: validates the dataset here (DatasetError,
    before any byte is sent), uploads it through the store (`client.upload_dataset`: a
    .tar.gz, `pack_dataset`; an archive is sent as it is) and returns the job's sources: the
    given (task, threshold) ones in their order, a dataset task among them tagged with the
    dataset, then the dataset's other tasks with `threshold`."""
    path = Path(path).expanduser()
    tasks = load_dataset(path)
    archive = path.read_bytes() if path.is_file() and _is_archive(path) else pack_dataset(path)
    name = client.upload_dataset(archive).name
    given = {t for t, _ in sources}
    return [(t, a, name if t in tasks else "") for t, a in sources] + [
        (t, threshold, name) for t in tasks if t not in given
    ]
