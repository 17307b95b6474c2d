"""What `valora demo` does with the adapters demo.py makes: registers them and one task per head,
builds and sends the mixed workload (task-head label requests and text requests, shuffled
together), and measures it: per task the served accuracy against the generator's own prediction
for every image, per target the latency. Plain data in and out; valora/cli/demo.py prints it.

A result of the workload is `(item, ms, InferResult, answer)`: the work item, its latency through
the gateway, the reply and the answer compared with the item's truth (the label, or the text).
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from valora.client import ValoraClient

Log = Callable[[str], None]

DEMO_TASK_PREFIX = "demo-"  # the demo's tasks are tasks/demo-{task}
DEMO_ALIAS = "demo"


def synthetic_images(n: int, seed: int) -> list[bytes]:
    """Small synthetic RGB images (PNG) so the demo needs no dataset."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def latency_row(target: str, mine: list[tuple[float, object]]) -> dict:
    lat = [ms for ms, _ in mine]
    return {
        "target": target,
        "n": len(mine),
        "modes": sorted({r.mode for _, r in mine}),
        "mean_ms": round(statistics.mean(lat), 1),
        "p50_ms": round(percentile(lat, 50), 1),
        "p99_ms": round(percentile(lat, 99), 1),
        "ttft_ms": round(statistics.mean(r.first_token_ms for _, r in mine), 1),
        "queue_ms": round(statistics.mean(r.queue_ms for _, r in mine), 1),
        "output_tokens": sum(r.output_tokens for _, r in mine),
    }


def register(client: ValoraClient, gen_dir: Path, log: Log = print) -> dict[str, dict]:
    """Registers the generated bundles and one task per head; safe to repeat.

    Uploads carry a request id derived from the bundle's sha256, so a repeat returns the version
    registered before (no new version); the alias `demo` points at it. A task that exists already
    is kept when it names the same version and head, and replaced otherwise (tasks/demo-* belong
    to the demo). Returns {task: {"task", "adapter", "version", "threshold", "accuracy"}}."""
    import grpc

    from services.generator.pipeline import load_generated

    _, bundles, result = load_generated(gen_dir)
    prompts = json.loads((gen_dir / "manifest.json").read_text())["prompts"]
    out: dict[str, dict] = {}
    for b in bundles:
        sha = hashlib.sha256(b.data).hexdigest()
        v = client.upload_adapter_version(
            b.name, b.data, b.config_json, heads=b.heads, request_id=f"valora-demo-{b.name}-{sha[:32]}"
        )
        client.set_alias(f"adapters/{b.name}", DEMO_ALIAS, v.name)
        log(f"adapter {v.name} (sha256 {v.sha256[:12]}, rank {v.rank}, heads {', '.join(b.heads)}) alias @{DEMO_ALIAS}")
        for head in b.heads:
            task_id = f"{DEMO_TASK_PREFIX}{head}"
            row = result.tasks[head]
            kwargs = dict(
                adapter=v.name,
                head=head,
                accuracy_threshold=row["threshold"],
                measured_accuracy=row["accuracy"],
                description=f"prompt: {prompts[head]} (valora demo; greedy-fused adapter)",
            )
            try:
                client.create_task(task_id, **kwargs)
                what = "created"
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                    raise
                name = f"tasks/{task_id}"
                have = client.get_task(name)
                if have.adapter == v.name and have.head == head:
                    what = "exists"
                else:
                    client.delete_task(name)
                    client.create_task(task_id, **kwargs)
                    what = f"replaced (was {have.adapter} head {have.head})"
            log(f"  task tasks/{task_id} -> {v.name} head {head}: {what}")
            out[head] = {
                "task": f"tasks/{task_id}",
                "adapter": f"adapters/{b.name}",
                "version": v.name,
                "threshold": row["threshold"],
                "accuracy": row["accuracy"],
            }
    return out


def mixed_workload(
    names: list[str],
    registered: dict[str, dict],
    manifest: dict,
    limit: int | None,
    per_task: int,
    text_requests: int,
    seed: int,
) -> tuple[list[dict], list[str]]:
    """The work items, shuffled by `seed`, and the text requests' targets (the base, then each
    adapter @demo): per task its held-out test images (the first `per_task`; 0: all) as label
    requests through tasks/demo-{task}, and `text_requests` "Which digit is this?" requests on
    held-out digit images spread over the text targets."""
    from services.generator.pipeline import held_out_images

    work: list[dict] = []
    for t in names:
        pngs, truth = held_out_images(t, limit)
        work += [
            {
                "kind": "label",
                "target": registered[t]["task"],
                "task": t,
                "prompt": manifest["prompts"][t],
                "image": png,
                "truth": y,
                "index": i,
            }
            for i, (png, y) in enumerate(zip(pngs[: per_task or None], truth))
        ]
    text_targets = ["base"] + [f"adapters/{a['name']}@{DEMO_ALIAS}" for a in manifest["adapters"]]
    if text_requests:
        pngs, truth = held_out_images("digit", text_requests)
        work += [
            {
                "kind": "text",
                "target": text_targets[i % len(text_targets)],
                "task": "digit",
                "prompt": "Which digit is this?",
                "image": pngs[i],
                "truth": truth[i],
            }
            for i in range(len(pngs))
        ]
    random.Random(seed).shuffle(work)
    return work, text_targets


def run_workload(client: ValoraClient, work: list[dict], concurrency: int, max_new_tokens: int) -> list[tuple]:
    """Sends every work item, `concurrency` at once; the results in the items' order."""

    def run(item: dict):
        t1 = time.perf_counter()
        if item["kind"] == "label":
            r = client.infer(item["prompt"], [item["image"]], task=item["target"], label=True)
            answer = r.label
        else:
            adapter = None if item["target"] == "base" else item["target"]
            r = client.infer(item["prompt"], [item["image"]], adapter=adapter, max_new_tokens=max_new_tokens)
            answer = r.text.strip()
        return item, (time.perf_counter() - t1) * 1000, r, answer

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(run, work))


def task_rows(names: list[str], results: list[tuple], registered: dict[str, dict], manifest: dict) -> list[dict]:
    """Per task: served accuracy on the generator's test images vs the threshold the fusion had to
    keep, and every served label vs the generator's prediction for the same image."""
    from services.generator.pipeline import agreement

    rows = []
    for t in names:
        mine = sorted(
            (
                (it["index"], ms, r, ans, it["truth"])
                for it, ms, r, ans in results
                if it["kind"] == "label" and it["task"] == t
            ),
            key=lambda row: row[0],
        )
        reg = registered[t]
        check = agreement(
            [ans for _, _, _, ans, _ in mine], [y for *_, y in mine], manifest["test_predictions"][t][: len(mine)]
        )
        rows.append(
            {
                "task": t,
                "target": reg["task"],
                "prompt": manifest["prompts"][t],
                "adapter": reg["version"],
                "n": check["n"],
                "served_accuracy": check["served_accuracy"],
                "interval_95": check["interval_95"],
                "generator_accuracy_same_images": check["offline_accuracy"],
                "agree": check["agree"],
                "generator_test_accuracy": reg["accuracy"],
                "test_split": len(manifest["test_predictions"][t]),
                "threshold": reg["threshold"],
                "meets_threshold": check["served_accuracy"] >= reg["threshold"],
                "single_task_val_accuracy": manifest["demo"]["single_task_accuracy"][t]["val"],
                **{
                    k: v
                    for k, v in latency_row(reg["task"], [(ms, r) for _, ms, r, _, _ in mine]).items()
                    if k.endswith("_ms")
                },
            }
        )
    return rows


def target_rows(targets: list[str], results: list[tuple]) -> list[dict]:
    """Per target (a task, the base, an adapter @demo): the latency of its requests in the mixed
    workload and the share answered correctly; text targets keep three sample answers."""
    rows = []
    for target in targets:
        mine = [(it, ms, r, ans) for it, ms, r, ans in results if it["target"] == target]
        row = {
            **latency_row(target, [(ms, r) for _, ms, r, _ in mine]),
            "kind": mine[0][0]["kind"],
            "correct": round(sum(ans == it["truth"] for it, _, _, ans in mine) / len(mine), 4),
        }
        if row["kind"] == "text":
            row["sample"] = [{"truth": it["truth"], "text": r.text} for it, _, r, _ in mine[:3]]
        rows.append(row)
    return rows
