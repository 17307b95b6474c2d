"""Brief pretraining of a base model on real images, so adapters start from a model that knows
something (a stand-in for a pretrained LMM on CPU).

The whole model (vision tower + language model + LM head) is trained for a few hundred steps to
answer one question about upright digits in text, through the LM head, the way it is served:
`chat_text("Which digit is this?")` -> "<digit><|im_end|>" (teacher-forced, loss on both tokens).
Only the `digit` task's train split is used; the other tasks (rotated/inverted digits, parity,
counting, colour) are what adapters must add. The result is a normal Qwen2-VL directory (weights,
config, tokenizer, processor files copied from the source) that workers load like any model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.nn import functional as F

from services.generator.datasets import build_task
from services.generator.model import IMAGE_PAD, chat_text

PROVENANCE_FILE = "valora_pretrain.json"  # how this base was made; the generator records it
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json",
    "preprocessor_config.json",
    "special_tokens_map.json",
)


def pretrain(
    model_path: Path | str,
    out: Path | str,
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    task: str = "digit",
    progress: Callable[[int, int, float], None] | None = None,
) -> dict[str, float]:
    """Trains a copy of the model at `model_path` and writes it to `out`; returns
    {"val_accuracy": first-token accuracy of the text answer on the task's val split}."""
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    src, out = Path(model_path).expanduser(), Path(out).expanduser()
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(src), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(src))
    improc = Qwen2VLImageProcessorPil.from_pretrained(str(src))
    data = build_task(task)
    answer_ids = []
    for label in data.labels:
        ids = tok(label, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"label {label!r} is {len(ids)} tokens; pretraining needs one-token answers")
        answer_ids.append(ids[0])
    answer_ids = torch.tensor(answer_ids)
    end_id = tok.convert_tokens_to_ids("<|im_end|>")

    def pixels(images):
        px = improc(images=list(images), return_tensors="pt")
        thw = px["image_grid_thw"]
        per = int(thw[0].prod())
        return px["pixel_values"].float().view(len(images), per, -1), thw[0]

    pv_train, grid = pixels(data.images["train"])
    pv_val, _ = pixels(data.images["val"])
    n_tokens = int(grid.prod()) // (improc.merge_size**2)
    prompt_ids = torch.tensor(
        tok(chat_text(data.prompt).replace(IMAGE_PAD, IMAGE_PAD * n_tokens), add_special_tokens=False)["input_ids"]
    )
    y_train = torch.as_tensor(data.targets["train"])
    y_val = torch.as_tensor(data.targets["val"])

    def forward(pv, y_or_none):
        b = pv.shape[0]
        ids = prompt_ids[None].expand(b, -1)
        if y_or_none is not None:  # teacher forcing: prompt + answer token
            ids = torch.cat([ids, answer_ids[y_or_none][:, None]], dim=1)
        mm = (ids == model.config.image_token_id).int()
        out = model(
            input_ids=ids,
            pixel_values=pv.reshape(-1, pv.shape[-1]),
            image_grid_thw=grid[None].repeat(b, 1),
            mm_token_type_ids=mm,
        )
        return out.logits

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    rng = np.random.default_rng(seed)
    model.train()
    for step in range(steps):
        idx = torch.as_tensor(rng.choice(len(y_train), size=batch_size, replace=False))
        logits = forward(pv_train[idx], y_train[idx])
        ans = answer_ids[y_train[idx]]
        loss = F.cross_entropy(logits[:, -2], ans) + F.cross_entropy(logits[:, -1], torch.full_like(ans, end_id))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if progress is not None:
            progress(step + 1, steps, float(loss.detach()))
    model.eval()
    with torch.no_grad():
        pred = torch.cat([forward(pv_val[i : i + 128], None)[:, -1].argmax(-1) for i in range(0, len(y_val), 128)])
    acc = float((pred == answer_ids[y_val]).float().mean())

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp))
    for name in COPIED_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, tmp / name)
    record = {
        "source": src.name,
        "task": task,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "val_accuracy": round(acc, 4),
    }
    (tmp / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {"val_accuracy": acc}
