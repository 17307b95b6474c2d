"""Early adapter release (LoRazor) per release policy on a real cluster (issue 23): accuracy change
and throughput gain, as LoRazor reports them (accuracy Δ, throughput ×, against no release).

A real cluster (adapter store, one worker, scheduler, gateway as processes on loopback gRPC, started
and stopped with valora.cluster as scale_bench's benches do) serves the text tasks of a generated
directory (`python -m services.generator generate` with text tasks: VQA-style answers in text,
adapters trained on them; --generated, or made here once and cached under --cache-dir: the
built-in square-colour task on the tiny model). Each setting of --settings becomes the tasks'
release policy (UpdateTask: `none`, a fraction, `sentence_end`, `sentence_end>=F`); requests name
the task and set nothing, so the gateway applies it. Per setting, two closed loops of
--concurrency requests in flight, each the task's held-out test images with their questions:

- answers: greedy at the generator's decoding budget (what it measured accuracy with; or
  --answer-tokens): the normalised exact match of the served answers
  (services/generator/answers.py) and the throughput as served (a released request whose base
  path does not end the answer runs to the budget);
- fixed: --fixed-tokens tokens a request, EOS banned (logit_bias), the same tokens under every
  policy: the throughput the LoRA work released saves.

Accuracy Δ is a setting's accuracy minus `none`'s; throughput × its output tokens/s (and req/s)
over `none`'s, the medians over --rounds rounds (settings interleaved in each). The worker's
release counters (valora:adapter_releases_total, adapter_released_tokens_total) give the share of
requests released and of tokens generated without the adapter. The scheduler runs `slora` unless
--policy says otherwise: every request unmerged, where a released row leaves the LoRA plan (a
merged adapter would make a released row add the −m deLoRA term instead). The workers' image
feature cache is off: every setting's requests encode the same images.

With --arch (random weights, on the GPU) there are no trained adapters: --random-adapters random
ones of --rank serve the fixed loop only (accuracy null), on random images.

    python -m bench.release_bench --test-images 48 --fixed-requests 32 --fixed-tokens 32  # CPU, tiny model
    python -m bench.release_bench --device cuda --arch qwen2-vl-7b --atmm --dtype bfloat16  # GPU, throughput only
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # `python bench/release_bench.py`: the repo root is not on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from rich.table import Table

from bench import scale_bench as sb
from bench.orchestration_bench import counter_totals
from services.generator.answers import exact_match_accuracy
from valora import cluster as cluster_mod
from valora.client import RELEASE_RULES, ValoraClient
from valora_protos.v1 import inference_service_pb2 as inf_pb
from valora_protos.v1 import types_pb2

console = sb.console
SETTINGS = "none,0.25,0.5,0.75,sentence_end"
GENERATE_TASK = "square-colour"  # the built-in text task generated when no --generated is given
RANDOM_QUESTION = "What colour is the square? Answer in one sentence, then describe the image."
RELEASE_COUNTERS = ("valora:adapter_releases_total", "valora:adapter_released_tokens_total")


# -- the policies -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """A release policy as a task carries it: a fraction and a rule ("none" or "sentence_end")."""

    fraction: float = 0.0
    rule: str = "none"

    @property
    def name(self) -> str:
        if self.rule == "none":
            return "none" if self.fraction == 0 else f"{self.fraction:g}"
        return self.rule + (f">={self.fraction:g}" if self.fraction else "")

    @classmethod
    def parse(cls, text: str) -> Setting:
        """`none`, a fraction in (0, 1], a rule, or `rule>=fraction` (valora tasks list's form)."""
        rule, _, least = text.partition(">=")
        if rule in RELEASE_RULES:
            return cls(float(least) if least else 0.0, rule)
        return cls(float(text))


def parse_settings(text: str) -> list[Setting]:
    try:
        out = [Setting.parse(t.strip()) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"settings: none, fractions, {', '.join(RELEASE_RULES[1:])}[>=F]") from None
    names = [s.name for s in out]
    if "none" not in names or len(set(names)) != len(names) or any(not 0 <= s.fraction <= 1 for s in out):
        raise argparse.ArgumentTypeError(f"distinct settings with none (the baseline), fractions in [0, 1]: {text!r}")
    return out


# -- the adapters and the requests --------------------------------------------------------------


def generate_key(args: argparse.Namespace, model: Path) -> str:
    """What a generated directory depends on (torch's thread count too: it splits CPU reductions)."""
    doc = {k: getattr(args, k) for k in ("gen_limit", "gen_epochs", "gen_lr", "rank", "seed", "gen_threads")}
    doc.update(task=GENERATE_TASK, model=str(model))
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:12]


def generated_dir(args: argparse.Namespace) -> Path:
    """--generated, or GENERATE_TASK's adapters generated once per settings (into a temporary
    directory renamed when complete) by `python -m services.generator generate` on --model (the
    tiny model by default)."""
    if args.generated is not None:
        return args.generated.expanduser().resolve()
    model = sb.resolve_model(args)
    out = args.cache_dir.expanduser().resolve() / f"gen-{generate_key(args, model)}"
    if (out / "manifest.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "services.generator",
        "generate",
        "--model-path",
        str(model),
        "--out",
        str(tmp),
        "--order",
        GENERATE_TASK,
        "--rank",
        str(args.rank),
        "--epochs",
        str(args.gen_epochs),
        "--lr",
        str(args.gen_lr),
        "--seed",
        str(args.seed),
        "--threads",
        str(args.gen_threads),
        "--prefix",
        "release",
    ] + (["--limit", str(args.gen_limit)] if args.gen_limit else [])
    with console.status(f"generating {GENERATE_TASK}'s adapter ({args.gen_epochs} epochs) -> {out}…"):
        run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"generation failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


@dataclass
class TextTask:
    """A served text task's held-out test examples: questions, PNGs, reference answers, the
    generator's own answers (its manifest's test predictions), budget."""

    name: str  # the task id
    questions: list[str]
    pngs: list[bytes]
    references: list[str]
    max_new_tokens: int
    offline: list[str] = dataclasses.field(default_factory=list)


def text_tasks(manifest: dict, test_images: int) -> list[TextTask]:
    """The generated directory's text tasks, each with its first `test_images` test examples (0:
    all), rebuilt as the generator split them (pipeline.held_out_images)."""
    from services.generator import pipeline
    from services.generator.datasets import TEXT

    out = []
    for task in manifest["order"]:
        if manifest["kinds"].get(task) != TEXT:
            continue
        data = pipeline.held_out_task(task, manifest.get("limit"), (manifest.get("datasets") or {}).get(task))
        pngs, references = pipeline.held_out_images(task, data=data)
        n = test_images or len(pngs)
        questions = [data.question("test", i) for i in range(len(pngs))][:n]
        offline = manifest.get("test_predictions", {}).get(task, [])[:n]
        out.append(TextTask(task, questions, pngs[:n], references[:n], manifest["max_new_tokens"][task], offline))
    if not out:
        raise SystemExit("the generated directory has no text task (its manifest's kinds)")
    return out


def random_tasks(n: int, test_images: int, image_size: int, seed: int) -> list[TextTask]:
    """--arch: `n` tasks on random adapters, `test_images` random images each, one question, no
    references (no accuracy)."""
    rng = np.random.default_rng(seed)
    return [
        TextTask(f"release-{i}", [RANDOM_QUESTION] * test_images, sb.random_pngs(test_images, image_size, rng), [], 0)
        for i in range(n)
    ]


def eos_ids(model: Path) -> set[int]:
    """The ids the worker stops at (lora_model.load_lora_model: the generation config's and the
    text config's eos_token_id)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model / name
        if path.exists():
            cfg = json.loads(path.read_text())
            for c in (cfg, cfg.get("text_config") or {}):
                eos = c.get("eos_token_id")
                ids |= set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()
    return ids


def examples(tasks: Sequence[TextTask], limit: int = 0) -> list[tuple[TextTask, int]]:
    """(task, test example) pairs, tasks interleaved; the first `limit` (0: all), cycling through
    them again when `limit` is larger."""
    rows = [(t, i) for i in range(max(len(t.pngs) for t in tasks)) for t in tasks if i < len(t.pngs)]
    return [rows[k % len(rows)] for k in range(limit)] if limit else rows


def task_requests(
    rows: Sequence[tuple[TextTask, int]], tag: str, max_new_tokens: int = 0, banned: Sequence[int] = ()
) -> list[inf_pb.InferRequest]:
    """The examples as TEXT requests naming their task, greedy, at the task's budget (or
    `max_new_tokens`), `banned` ids at -100 (logit_bias)."""
    return [
        inf_pb.InferRequest(
            request_id=f"{tag}-{k}",
            input=inf_pb.InferenceInput(
                prompt=t.questions[i],
                images=[types_pb2.Image(data=t.pngs[i])],
                task=f"tasks/{t.name}",
                output_kind=types_pb2.OUTPUT_KIND_TEXT,
                params=types_pb2.GenerationParams(
                    max_new_tokens=max_new_tokens or t.max_new_tokens, logit_bias={b: -100.0 for b in banned}
                ),
            ),
        )
        for k, (t, i) in enumerate(rows)
    ]


# -- one setting's runs -------------------------------------------------------------------------


def apply(gateway: str, tasks: Sequence[TextTask], setting: Setting) -> None:
    """The setting as every task's release policy (the gateway that served the update applies it
    to the next request at once)."""
    with ValoraClient(gateway) as client:
        for t in tasks:
            client.update_task(t.name, adapter_release_fraction=setting.fraction, adapter_release_rule=setting.rule)


def released(c: cluster_mod.Cluster) -> tuple[float, float]:
    """The worker's (requests released, tokens generated after a release) so far."""
    totals = [0.0, 0.0]
    for w in c.by_service("worker"):
        for k, name in enumerate(RELEASE_COUNTERS):
            totals[k] += sum(counter_totals(w.metrics_url, name, ()).values())
    return totals[0], totals[1]


def closed_loop(c: cluster_mod.Cluster, requests: list[inf_pb.InferRequest], args) -> dict:
    """The requests through the gateway, --concurrency in flight: scale_bench's summary, the
    release counts over the run and the answers by request id (a closed loop's outcomes come in
    the order they finish)."""
    before = released(c)
    outcomes = asyncio.run(sb.drive(c.gateway, requests, args.concurrency, 0.0, args.timeout_s, args.seed))
    after = released(c)
    s = sb.summarize(outcomes, workers=1, gpus=0)
    row = {k: s[k] for k in ("requests", "ok", "failed", "error_sample", "wall_s", "throughput_rps", "output_tokens")}
    row["tokens_per_s"] = s["tokens_per_s"]
    row["mean_ms"], row["p99_ms"], row["modes"] = s["mean_ms"], s["p99_ms"], s["modes"]
    row["released_share"] = round((after[0] - before[0]) / max(1, s["ok"]), 4)
    row["base_token_share"] = round((after[1] - before[1]) / max(1, s["output_tokens"]), 4)
    row["answers"] = {o.result.request_id: o.result.text for o in outcomes if o.result is not None}
    return row


def measure(c: cluster_mod.Cluster, tasks: Sequence[TextTask], setting: Setting, args, banned: Sequence[int]) -> dict:
    """One round of one setting: its answers run (trained tasks only) and its fixed run."""
    apply(c.gateway, tasks, setting)
    out: dict = {"answers": None, "fixed": None}
    if tasks[0].references:
        rows = examples(tasks)
        requests = task_requests(rows, f"{setting.name}-a", args.answer_tokens)
        out["answers"] = closed_loop(c, requests, args)
        texts = out["answers"].pop("answers")
        served: dict[str, list[str]] = {t.name: [] for t in tasks}
        for (t, _), req in zip(rows, requests, strict=True):
            served[t.name].append(texts.get(req.request_id, ""))  # a failed request: no answer, counted wrong
        out["answers"]["accuracy"] = {
            t.name: round(exact_match_accuracy(served[t.name], t.references), 4) for t in tasks
        }
        # the generator's own answers for the same images: without release, every one (the serving contract)
        out["answers"]["same_as_generator"] = {
            t.name: round(sum(a == b for a, b in zip(served[t.name], t.offline)) / len(t.offline), 4)
            for t in tasks
            if t.offline
        }
    if args.fixed_requests:
        fixed = task_requests(examples(tasks, args.fixed_requests), f"{setting.name}-f", args.fixed_tokens, banned)
        out["fixed"] = closed_loop(c, fixed, args)
        out["fixed"].pop("answers")
    return out


def summarize(setting: Setting, rounds: list[dict], baseline: dict | None) -> dict:
    """A setting's row: its rounds, their medians, accuracy Δ and throughput × against `baseline`
    (the `none` row; None: this is it)."""
    row: dict = {"setting": setting.name, "fraction": setting.fraction, "rule": setting.rule, "rounds": rounds}
    for run in ("answers", "fixed"):
        got = [r[run] for r in rounds if r[run] is not None]
        if not got:
            row[run] = None
            continue
        med = {k: round(statistics.median(g[k] for g in got), 3) for k in ("throughput_rps", "tokens_per_s")}
        med["released_share"], med["base_token_share"] = got[0]["released_share"], got[0]["base_token_share"]
        med["failed"] = sum(g["failed"] for g in got)
        if run == "answers":
            med["accuracy"], med["same_as_generator"] = got[0]["accuracy"], got[0]["same_as_generator"]
            med["accuracy_mean"] = round(statistics.fmean(got[0]["accuracy"].values()), 4)
        if baseline is not None and baseline.get(run):
            base = baseline[run]
            med["throughput_x"] = round(med["tokens_per_s"] / base["tokens_per_s"], 3) if base["tokens_per_s"] else None
            med["rps_x"] = round(med["throughput_rps"] / base["throughput_rps"], 3) if base["throughput_rps"] else None
            if run == "answers":
                med["accuracy_delta"] = round(med["accuracy_mean"] - base["accuracy_mean"], 4)
        row[run] = med
    return row


# -- options and main ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.release_bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sb.add_cluster_options(p)
    p.add_argument("--settings", type=parse_settings, default=parse_settings(SETTINGS), help="Release policies.")
    p.add_argument("--rounds", type=int, default=1, help="Rounds of every setting (interleaved); medians reported.")
    p.add_argument("--concurrency", type=int, default=-1, help="Closed loops: requests in flight (-1: 64 on cuda, 8).")
    p.add_argument("--test-images", type=int, default=0, help="Test examples per task (0: the whole test split).")
    p.add_argument(
        "--answer-tokens", type=int, default=0, help="Answers run: max_new_tokens (0: each task's generation budget)."
    )
    p.add_argument(
        "--fixed-requests", type=int, default=-1, help="Requests of the fixed run (0: none; -1: 512 on cuda, 64)."
    )
    p.add_argument(
        "--fixed-tokens", type=int, default=-1, help="Tokens of a fixed-run request, EOS banned (-1: 128 on cuda, 32)."
    )
    p.add_argument("--warmup", type=int, default=-1, help="Unmeasured requests first (-1: 2 x concurrency).")
    p.add_argument(
        "--generated", type=Path, default=None, help="A generated directory with text tasks (its base model served)."
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=Path("~/.cache/valora/release-bench"),
        help="Without --generated: where the generated adapters are kept, per generation settings.",
    )
    p.add_argument("--gen-limit", type=int, default=200, help="Generation: split cap (0: the whole splits).")
    p.add_argument("--gen-epochs", type=int, default=16, help="Generation: epochs.")
    p.add_argument("--gen-lr", type=float, default=1e-2, help="Generation: LoRA learning rate.")
    p.add_argument("--gen-threads", type=int, default=2, help="Generation: torch CPU threads.")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (generated or random adapters).")
    p.add_argument("--random-adapters", type=int, default=4, help="--arch: random adapters (tasks).")
    p.add_argument("--image-size", type=int, default=0, help="--arch: side of the random images; 0: 448.")
    p.add_argument("--max-batch-size", type=int, default=-1, help="VALORA_MAX_BATCH_SIZE (-1: 64 on cuda, default).")
    p.add_argument("--threads-per-worker", type=int, default=1, help="CPU worker's torch threads (0: torch's default).")
    sb.add_output_options(p, "release")
    args = p.parse_args(argv)
    sb.check_cluster_options(p, args)
    args.policy = args.policy or "slora"
    cuda = args.device == "cuda"
    for name, gpu, cpu in (("concurrency", 64, 8), ("fixed_requests", 512, 64), ("fixed_tokens", 128, 32)):
        if getattr(args, name) < 0:
            setattr(args, name, gpu if cuda else cpu)
    if args.arch and args.generated is not None:
        p.error("--arch serves random adapters: no --generated")
    if min(args.rounds, args.concurrency, args.fixed_tokens, args.rank, args.random_adapters) < 1:
        p.error("--rounds, --concurrency, --fixed-tokens, --rank and --random-adapters must be >= 1")
    if min(args.test_images, args.fixed_requests, args.answer_tokens) < 0:
        p.error("--test-images, --fixed-requests and --answer-tokens must be >= 0")
    if args.arch and not args.fixed_requests:
        p.error("--arch measures the fixed run only: --fixed-requests must be > 0")
    if args.warmup < 0:
        args.warmup = 2 * args.concurrency
    if args.image_size <= 0:
        args.image_size = 448
    if args.max_batch_size < 0:
        args.max_batch_size = 64 if args.device == "cuda" else 0
    return args


def print_table(rows: list[dict], args: argparse.Namespace, model: Path) -> None:
    table = Table(title=f"early release: {args.device} {args.dtype}, {model.name}, {args.concurrency} in flight")
    cols = ("setting", "accuracy", "Δ acc", "released", "base tok", "tok/s", "×", "fixed tok/s", "×", "base tok")
    for col in cols:
        table.add_column(col, justify="left" if col == "setting" else "right")
    for r in rows:
        a, f = r["answers"] or {}, r["fixed"] or {}

        def num(d: dict, k: str, fmt: str) -> str:
            return "-" if d.get(k) is None else format(d[k], fmt)

        table.add_row(
            r["setting"],
            num(a, "accuracy_mean", ".3f"),
            num(a, "accuracy_delta", "+.3f"),
            num(a, "released_share", ".2f"),
            num(a, "base_token_share", ".2f"),
            num(a, "tokens_per_s", ".1f"),
            num(a, "throughput_x", ".2f"),
            num(f, "tokens_per_s", ".1f"),
            num(f, "throughput_x", ".2f"),
            num(f, "base_token_share", ".2f"),
        )
    console.print(table)
    console.print(
        "[dim]answers (accuracy to tok/s ×): greedy at the tasks' budgets, normalised exact match; released: "
        "requests whose adapter went, base tok: tokens made without it (the worker's counts); fixed: "
        f"{args.fixed_tokens} tokens a request, EOS banned; × against none"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, sb._raise_on_sigterm)
    t_start = time.perf_counter()
    from services.generator import pipeline

    if args.arch:
        model = sb.resolve_model(args)
        gen, manifest, bundles = None, None, sb.random_bundles(model, [args.rank] * args.random_adapters, args.seed)
        tasks = random_tasks(args.random_adapters, args.test_images or 16, args.image_size, args.seed)
    else:
        gen = generated_dir(args)
        manifest, bundles, result = pipeline.load_generated(gen)
        model = Path(manifest["base_model"]).expanduser().resolve()
        tasks = text_tasks(manifest, args.test_images)
    banned = sorted(eos_ids(model))
    gpu_ids = cluster_mod.visible_gpus()[:1] if args.device == "cuda" else []
    gpus, worker_env = sb.gpu_plan(args.device, 1, gpu_ids, args.dtype, args.threads_per_worker)
    temp_home = args.home is None
    home = Path(tempfile.mkdtemp(prefix="valora-release-")) if temp_home else args.home.resolve()
    env = {
        "VALORA_DEVICE_SLOTS": str(max(1, len(bundles))),
        "VALORA_IMAGE_CACHE_BYTES": "0",
        **sb.service_env(args, home),
    }
    rows: list[dict] = []
    failures: list[dict] = []
    times: dict = {}
    interrupted: BaseException | None = None
    try:
        with console.status(f"cluster on {args.device}: start, {len(bundles)} adapters, tasks, warm-up…"):
            t0 = time.perf_counter()
            c = cluster_mod.start_cluster(
                home,
                workers=1,
                model_path=model,
                env=env,
                worker_env=worker_env,
                startup_timeout_s=args.startup_timeout_s,
            )
            cluster_mod.wait_registered(
                c.by_service("scheduler")[0].address, 1, args.startup_timeout_s, c.internal_token
            )
            t1 = time.perf_counter()
            if manifest is not None:
                pipeline.register(
                    c.gateway,
                    bundles,
                    result,
                    manifest["prompts"],
                    log=lambda _: None,
                    max_new_tokens=manifest["max_new_tokens"],
                )
            else:
                refs = sb.register_adapters(c.gateway, bundles, args.seed, prefix="release")
                with ValoraClient(c.gateway) as client:
                    for t, ref in zip(tasks, refs, strict=True):
                        client.create_task(t.name, ref)
            bundles = []
            t2 = time.perf_counter()
            warm = task_requests(examples(tasks, args.warmup), "warm", args.fixed_tokens if args.arch else 0)
            asyncio.run(sb.drive(c.gateway, warm, args.concurrency, 0.0, args.timeout_s, args.seed))
            times.update(startup_s=round(t1 - t0, 2), register_s=round(t2 - t1, 2))
            times["warmup_s"] = round(time.perf_counter() - t2, 2)
        by_setting: dict[str, list[dict]] = {s.name: [] for s in args.settings}
        for k in range(args.rounds):
            for setting in args.settings:
                with console.status(f"round {k + 1}/{args.rounds}: {setting.name}…"):
                    got = measure(c, tasks, setting, args, banned)
                by_setting[setting.name].append(got)
                a, f = got["answers"], got["fixed"]
                console.print(
                    f"round {k + 1} {setting.name}: "
                    + (
                        f"accuracy {a['accuracy']}, released {a['released_share']:.2f}, "
                        f"answers {a['tokens_per_s']:.1f} tok/s; "
                        if a
                        else ""
                    )
                    + (f"fixed {f['tokens_per_s']:.1f} tok/s, released {f['released_share']:.2f}" if f else "")
                )
        baseline = summarize(Setting(), by_setting["none"], None)
        rows = [baseline if s.name == "none" else summarize(s, by_setting[s.name], baseline) for s in args.settings]
    except (KeyboardInterrupt, SystemExit) as err:  # SIGINT/SIGTERM: the finally below stops the cluster
        interrupted = err
        failures.append({"error": f"interrupted: {err!r}"})
    except Exception as err:  # reported with the logs; the rows so far are written
        console.print(f"[red]failed: {err!r}; logs under {home / 'logs'}:\n{sb.log_tails(home)}")
        failures.append({"error": repr(err)[:2000]})
    finally:
        cluster_mod.stop_cluster(home)
    failed = bool(failures) or any((r[run] or {}).get("failed") for r in rows for run in ("answers", "fixed"))
    if temp_home and not failed:
        shutil.rmtree(home, ignore_errors=True)
    elif failed:
        console.print(f"[yellow]kept {home}")
    if rows:
        print_table(rows, args, model)
    extra = {
        "gpus": gpus,
        "adapters": "random (throughput only: no trained adapters for this model)"
        if args.arch
        else f"generated: {gen}",
        "tasks": {t.name: {"test_images": len(t.pngs), "max_new_tokens": t.max_new_tokens} for t in tasks},
        "generation": None if manifest is None else {k: manifest.get(k) for k in ("rank", "epochs", "lr", "limit")},
        **times,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    out = args.out or sb.default_out(args.device, "release")
    recorded = argparse.Namespace(**{**vars(args), "settings": [x.name for x in args.settings]})
    payload = {"rows": rows, "failures": failures}
    paths = sb.write_bench_results(out, "release", recorded, model, payload, device=args.device, **extra)
    console.print(f"results: {', '.join(map(str, paths))}")
    if interrupted is not None:
        raise interrupted
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
