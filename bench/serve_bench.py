"""Serving on one GPU (issue "Engine v2"): workload `mixed-vision` (docs/workloads.md) through the public API.

A real cluster (adapter store, one worker, scheduler, gateway as processes on loopback gRPC, started
and stopped with scale_bench's helpers) serves 16 random adapters of ranks 8/16/32/64 to generation
requests with 448/640 px images, one in 8 with three, prompts of 20-60 tokens, 16/32/64 new tokens,
greedy and top-p decoding (docs/workloads.md defines the mix; `request_mix` makes it). Images and
adapters are drawn before the cluster starts. After a warm-up, each load — closed loop with C requests
in flight, open loop with Poisson arrivals at R req/s — runs --repeat times back to back on the same
cluster, every run with the same requests but images of its own (the worker's feature cache must not
serve them).

One row per run in bench/results/serve-<device>-<commit>.json (and $OUT when set): throughput, TTFT and
end-to-end latency p50/p99, `gpu_busy` (the worker GPU's utilisation sampled by nvidia-smi over the run;
null on CPU), `eager_decode_steps` and the other decode-graph counters over the run (null without decode
graphs); `spread` compares the repeats of each load (the issue asks for two within 10%).

    python -m bench.serve_bench --requests 24 --concurrency 4 --rate 2 --image-sizes 56,84 \\
        --max-new-tokens 4,8                                                               # CPU, tiny model
    python -m bench.serve_bench --device cuda --arch qwen2-vl-7b --atmm --dtype bfloat16 --repeat 2  # the issue's runs
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # `python bench/serve_bench.py`: the repo root is not on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import numpy as np
from rich.table import Table

from bench import scale_bench as sb
from valora import cluster as cluster_mod
from valora_protos.internal.v1 import worker_service_pb2
from valora_protos.v1 import inference_service_pb2 as inf_pb
from valora_protos.v1 import types_pb2

console = sb.console
WORKLOAD = "mixed-vision"
ADAPTERS = 16
RANKS = (8, 16, 32, 64)  # adapter i has RANKS[i % 4]
IMAGE_SIZES = (448, 640)
MAX_NEW_TOKENS = (16, 32, 64)
PROMPT_TOKENS = (20, 60)  # inclusive
BLOCK = 16  # requests per block: each block holds the whole mix once (see request_mix)
MULTI_IMAGES = 3  # images of one request in 8
TOP_P, TEMPERATURE = 0.9, 1.0
GRAPH_COUNTERS = tuple(f.name for f in worker_service_pb2.WorkerDecodeGraphs.DESCRIPTOR.fields)
# docs/workloads.md's numbers to reach on one H200 (7B, random weights).
TARGETS = {"closed_throughput_rps": 40.0, "gpu_busy": 0.85, "eager_decode_steps": 0, "poisson_ttft_p99_ms": 1500.0}


# -- the workload -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    """One request of the mix, before it has images and an adapter reference."""

    index: int
    adapter: int  # index into the registered adapters
    rank: int  # that adapter's LoRA rank
    image_sizes: tuple[int, ...]  # side in pixels of each of its (square) images
    prompt: str
    prompt_tokens: int
    max_new_tokens: int
    greedy: bool  # else top-p TOP_P at temperature TEMPERATURE
    seed: int  # of its sampled decoding


def adapter_ranks(adapters: int = ADAPTERS, ranks: Sequence[int] = RANKS) -> list[int]:
    """Ranks round-robin over the adapters."""
    return [ranks[i % len(ranks)] for i in range(adapters)]


def prompt_words(tokenizer) -> list[str]:
    """The tokenizer's whole-word tokens (" " + two or more ASCII letters), sorted: prompts made of
    them have exactly as many tokens as words (a byte-level BPE splits before each space)."""
    pieces = {tokenizer.decode([i]) for i in range(len(tokenizer))}
    return sorted(w for w in pieces if len(w) >= 3 and w[0] == " " and w[1:].isascii() and w[1:].isalpha())


def request_mix(
    n: int,
    seed: int,
    words: Sequence[str],
    adapters: int = ADAPTERS,
    ranks: Sequence[int] = RANKS,
    image_sizes: Sequence[int] = IMAGE_SIZES,
    max_new_tokens: Sequence[int] = MAX_NEW_TOKENS,
) -> list[RequestSpec]:
    """The first n requests of the mixed-vision mix (a pure function of its arguments). Request i,
    in block b = i // 16: adapter i % adapters (ranks round-robin over the adapters); image size
    image_sizes[(i + b) % 2]; three images when (i + b // 4) % 8 == 7, else one; greedy when
    (i + b // 2) % 2 == 0, else top-p; max_new_tokens[i % 3]; a prompt of 20-60 tokens (uniform,
    from `seed` and i) drawn from `words` (prompt_words). Sizes and decoding alternate request to
    request, and every block of 16 has each of them 8 times and 2 requests of three images; the
    block offsets shift each pattern against the others and against the adapters, so that over a
    few blocks every adapter meets every size, count and decoding, and no two of them are tied."""
    if not words:
        raise ValueError("no prompt words")
    rank_of = adapter_ranks(adapters, ranks) if adapters else []
    specs = []
    for i in range(n):
        b = i // BLOCK
        rng = np.random.default_rng([seed, i])  # request i's own: a run's first requests are another's
        tokens = int(rng.integers(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1))
        specs.append(
            RequestSpec(
                index=i,
                adapter=i % adapters if adapters else -1,
                rank=rank_of[i % adapters] if adapters else 0,
                image_sizes=(image_sizes[(i + b) % len(image_sizes)],) * (MULTI_IMAGES if (i + b // 4) % 8 == 7 else 1),
                prompt="".join(words[j] for j in rng.integers(0, len(words), size=tokens)),
                prompt_tokens=tokens,
                max_new_tokens=max_new_tokens[i % len(max_new_tokens)],
                greedy=(i + b // 2) % 2 == 0,
                seed=int(rng.integers(1, 2**63)),
            )
        )
    return specs


def mix_summary(specs: Sequence[RequestSpec]) -> dict:
    """How many requests of each kind (what a run sent: the results' `info.mix`)."""

    def count(values) -> dict[str, int]:
        return {str(k): v for k, v in sorted(collections.Counter(values).items())}

    return {
        "requests": len(specs),
        "images": sum(len(s.image_sizes) for s in specs),
        "images_per_request": count(len(s.image_sizes) for s in specs),
        "image_sizes": count(size for s in specs for size in s.image_sizes),
        "ranks": count(s.rank for s in specs),
        "adapters": len({s.adapter for s in specs}),
        "max_new_tokens": count(s.max_new_tokens for s in specs),
        "greedy": sum(s.greedy for s in specs),
        "top_p": sum(not s.greedy for s in specs),
        "prompt_tokens_mean": round(statistics.fmean(s.prompt_tokens for s in specs), 2) if specs else 0.0,
    }


def build_requests(
    specs: Sequence[RequestSpec], pngs: Sequence[bytes], adapters: Sequence[str]
) -> list[inf_pb.InferRequest]:
    """The InferRequests of `specs`, taking their images from `pngs` in order (one PNG per image
    size of every spec, in that order) and spec.adapter from `adapters` (none: the base model)."""
    images = iter(pngs)
    out = []
    for s in specs:
        params = types_pb2.GenerationParams(max_new_tokens=s.max_new_tokens)
        if not s.greedy:
            params.temperature, params.top_p, params.seed = TEMPERATURE, TOP_P, s.seed
        req = inf_pb.InferRequest(
            request_id=f"serve-{s.index}-{s.seed:x}",
            input=inf_pb.InferenceInput(
                prompt=s.prompt,
                images=[types_pb2.Image(data=next(images)) for _ in s.image_sizes],
                output_kind=types_pb2.OUTPUT_KIND_TEXT,
                params=params,
            ),
        )
        if adapters:
            req.input.adapter = adapters[s.adapter % len(adapters)]
        out.append(req)
    return out


# -- loads and runs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """Closed loop with `value` requests in flight, or Poisson arrivals at `value` req/s."""

    mode: str  # "closed" or "poisson"
    value: float

    @property
    def name(self) -> str:
        return f"{self.mode}-{self.value:g}"

    @property
    def concurrency(self) -> int:
        return int(self.value) if self.mode == "closed" else 0

    @property
    def rate(self) -> float:
        return self.value if self.mode == "poisson" else 0.0


def plan_loads(args: argparse.Namespace) -> list[Load]:
    closed = [Load("closed", c) for c in args.concurrency] if "closed" in args.modes else []
    return closed + ([Load("poisson", r) for r in args.rate] if "poisson" in args.modes else [])


class GpuSampler:
    """Utilisation of some GPUs (the share of time a kernel ran, nvidia-smi's utilization.gpu,
    what `dmon -s u` calls sm) sampled every interval by a background nvidia-smi, each sample
    stamped on this process's perf_counter clock as it arrives; mean(t0, t1) over a window."""

    def __init__(self, gpu_ids: Sequence[str], interval_ms: int = 200):
        self.samples: list[tuple[float, float]] = []
        self.error = ""
        try:
            self.proc = subprocess.Popen(
                [
                    "nvidia-smi",
                    "--query-gpu=utilization.gpu",
                    "--format=csv,noheader,nounits",
                    "-lms",
                    str(interval_ms),
                    "-i",
                    ",".join(gpu_ids),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError as exc:
            self.proc, self.error = None, repr(exc)
            return
        self.thread = threading.Thread(target=self._read, name="gpu-sampler", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                value = float(line.strip()) / 100
            except ValueError:  # "[N/A]" and the like
                continue
            self.samples.append((time.perf_counter(), value))  # list.append is atomic

    def mean(self, t0: float, t1: float) -> float | None:
        got = [v for t, v in list(self.samples) if t0 <= t <= t1]
        return round(statistics.fmean(got), 3) if got else None

    def count(self, t0: float, t1: float) -> int:
        return sum(t0 <= t <= t1 for t, _ in list(self.samples))

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def worker_status(c: cluster_mod.Cluster, address: str) -> worker_service_pb2.GetWorkerStatusResponse | None:
    """The worker's GetWorkerStatus; None (and a warning) when it does not answer."""
    try:
        return sb.worker_status(c, address)
    except grpc.RpcError as err:
        console.print(f"[yellow]GetWorkerStatus {address}: {err.code().name} {err.details()}")
        return None


def graph_counters(status: worker_service_pb2.GetWorkerStatusResponse | None) -> dict[str, int] | None:
    """The worker's decode-graph counters since it started, and its prefill graphs' as
    prefill_<counter> (None: no status)."""
    if status is None:
        return None
    return {
        **{name: getattr(status.decode_graphs, name) for name in GRAPH_COUNTERS},
        **{f"prefill_{name}": getattr(status.prefill_graphs, name) for name in GRAPH_COUNTERS},
    }


def percentiles(values: list[float], prefix: str) -> dict[str, float]:
    """{prefix}_p50_ms, _p99_ms and _mean_ms of `values` (ms)."""
    out = {f"{prefix}_p{q}_ms": round(sb.percentile(values, q), 2) for q in (50, 99)}
    out[f"{prefix}_mean_ms"] = round(statistics.fmean(values), 2) if values else float("nan")
    return out


def summarize_run(outcomes: list[sb.Outcome], before: dict | None, after: dict | None) -> dict:
    """A run's row: scale_bench's counts and throughput, TTFT and end-to-end latency as the client
    saw them, and the decode-graph counters' change over the run. TTFT: from sending the request
    to its first token, i.e. end to end less what the worker spent after the first token."""
    base = sb.summarize(outcomes, workers=1, gpus=0)
    row = {
        k: base[k]
        for k in (
            "throughput_rps",
            "requests",
            "ok",
            "failed",
            "errors",
            "error_sample",
            "wall_s",
            "output_tokens",
            "tokens_per_s",
            "queue_ms",
            "modes",
        )
    }
    ok = [o for o in outcomes if o.result is not None]
    row.update(percentiles([o.ms - (o.result.total_ms - o.result.first_token_ms) for o in ok], "ttft"))
    row.update(percentiles([o.ms for o in ok], "e2e"))
    row["worker_ttft_p50_ms"] = round(sb.percentile([o.result.first_token_ms for o in ok], 50), 2)
    row.update(
        image_tokens=sum(o.result.image_tokens for o in ok),
        prompt_tokens=sum(o.result.prompt_tokens for o in ok),
        adapters_served=len({o.result.adapter_version for o in ok if o.result.adapter_version}),
    )
    # a worker without decode graphs reports all counters 0 (every decode step is eager there): null
    for kind, prefix in (("decode_graphs", ""), ("prefill_graphs", "prefill_")):
        have = before is not None and after is not None and any(after[prefix + k] for k in GRAPH_COUNTERS)
        row[kind] = {k: after[prefix + k] - before[prefix + k] for k in GRAPH_COUNTERS} if have else None
    row["eager_decode_steps"] = row["decode_graphs"]["eager_steps"] if row["decode_graphs"] else None
    return row


def measure(
    c: cluster_mod.Cluster,
    load: Load,
    requests: list[inf_pb.InferRequest],
    args: argparse.Namespace,
    sampler: GpuSampler | None,
) -> dict:
    """One run of `requests` under `load`: its row (summarize_run), with the GPU's use over the run,
    the services' CPU per request and the worker's recent step times at its end."""
    worker = c.by_service("worker")[0].address
    pids = {p.name: p.pid for p in c.processes}
    before, cpu_before = graph_counters(worker_status(c, worker)), sb.cpu_seconds(pids)
    outcomes = asyncio.run(sb.drive(c.gateway, requests, load.concurrency, load.rate, args.timeout_s, args.seed))
    cpu_after, status = sb.cpu_seconds(pids), worker_status(c, worker)
    row = summarize_run(outcomes, before, graph_counters(status))
    t0, t1 = min(o.sent for o in outcomes), max(o.done for o in outcomes)
    row["gpu_busy"] = sampler.mean(t0, t1) if sampler else None
    row["gpu_samples"] = sampler.count(t0, t1) if sampler else 0
    row["service_cpu_ms_per_request"], row["service_cpu_cores"] = sb.cpu_per_request(
        cpu_before, cpu_after, len(outcomes), row["wall_s"]
    )
    row["worker_steps"] = sb.message_fields(status.step_times) if status is not None else None
    return row


def spread(rows: list[dict]) -> list[dict]:
    """Per load run more than once: its runs' throughput and p99 TTFT and their spread ((max - min)
    / mean); `within_10pct` judges the load's headline number (closed loop: throughput; Poisson,
    whose throughput is the offered rate: p99 TTFT)."""
    out = []
    for name, group in itertools.groupby(rows, key=lambda r: r["load"]):
        group = list(group)
        if len(group) < 2:
            continue
        entry = {"load": name, "runs": len(group)}
        for key in ("throughput_rps", "ttft_p99_ms", "e2e_p99_ms"):
            values = [r[key] for r in group]
            mean = statistics.fmean(values)
            entry[key] = values
            entry[f"{key}_spread"] = round((max(values) - min(values)) / mean, 4) if mean else None
        headline = "throughput_rps" if group[0]["mode"] == "closed" else "ttft_p99_ms"
        entry["headline"] = headline
        entry["within_10pct"] = entry[f"{headline}_spread"] is not None and entry[f"{headline}_spread"] <= 0.10
        out.append(entry)
    return out


# -- options and main ---------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    out = [float(x) for x in text.split(",") if x.strip()]
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers like 30 or 10,30, got {text!r}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.serve_bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sb.add_cluster_options(p)
    p.add_argument("--modes", default="closed,poisson", help="Loads to run: closed (--concurrency), poisson (--rate).")
    p.add_argument("--concurrency", type=sb._ints, default=[128], help="Closed loop: requests in flight (list).")
    p.add_argument("--rate", type=_floats, default=[30.0], help="Open loop: Poisson arrivals, req/s (list).")
    p.add_argument("--requests", type=int, default=1024, help="Measured requests of every run.")
    p.add_argument("--repeat", type=int, default=2, help="Runs of every load, back to back (two: their spread).")
    p.add_argument(
        "--warmup",
        type=int,
        default=-1,
        help="Unmeasured requests first, closed loop at the largest --concurrency (-1: twice that).",
    )
    p.add_argument("--adapters", type=int, default=ADAPTERS, help="Random adapters registered; requests round-robin.")
    p.add_argument("--ranks", type=sb._ints, default=list(RANKS), help="LoRA ranks, round-robin over the adapters.")
    p.add_argument(
        "--image-sizes",
        type=sb._ints,
        default=list(IMAGE_SIZES),
        help="Image sides (pixels) alternating over the requests (smaller ones for CPU runs).",
    )
    p.add_argument("--max-new-tokens", type=sb._ints, default=list(MAX_NEW_TOKENS), help="Cycled over the requests.")
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=-1,
        help="The worker's VALORA_MAX_BATCH_SIZE (-1: 64 on "
        "cuda, the worker's default on cpu; 0: the worker's default).",
    )
    sb.add_output_options(p, "serve")
    args = p.parse_args(argv)
    sb.check_cluster_options(p, args)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - {"closed", "poisson"}:
        p.error(f"--modes: closed and/or poisson, got {args.modes}")
    if args.requests < 1 or args.repeat < 1 or args.adapters < 0:
        p.error("--requests and --repeat must be >= 1, --adapters >= 0")
    if args.warmup < 0:
        args.warmup = 2 * max(args.concurrency)
    if args.max_batch_size < 0:
        args.max_batch_size = 64 if args.device == "cuda" else 0
    return args


def print_table(rows: list[dict], spreads: list[dict], args: argparse.Namespace, model: Path) -> None:
    table = Table(
        title=f"serve {WORKLOAD}: {args.device} {args.dtype}, {model.name}, {args.adapters} adapters "
        f"r{'/'.join(map(str, args.ranks))}, {args.requests} requests a run"
    )
    for col in (
        "run",
        "ok/req",
        "req/s",
        "ttft p50",
        "ttft p99",
        "e2e p50",
        "e2e p99",
        "gpu busy",
        "eager",
        "replays",
        "captures",
        "new keys",
        "failed caps",
        "ref lora",
        "prefill replays/steps",
    ):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in rows:
        ok = f"{r['ok']}/{r['requests']}" if r["failed"] == 0 else f"[red]{r['ok']}/{r['requests']}[/red]"
        g = r["decode_graphs"] or {}
        table.add_row(
            r["run"],
            ok,
            f"{r['throughput_rps']:.1f}",
            *(f"{r[k]:.0f}" for k in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms")),
            "-" if r["gpu_busy"] is None else f"{r['gpu_busy']:.2f}",
            *(
                "-" if not g else str(g[k])
                for k in ("eager_steps", "replays", "captures", "new_keys", "capture_failures", "reference_steps")
            ),
            "-" if not (p := r["prefill_graphs"]) else f"{p['replays']}/{p['static_steps']}",
        )
    console.print(table)
    console.print(
        "[dim]ms; ttft: send to first token as the client saw it; gpu busy: nvidia-smi utilisation over "
        "the run; eager/replays/captures/new keys/failed caps/ref lora (steps on the torch LoRA reference): "
        "the worker's decode-graph counters over the run"
    )
    for s in spreads:
        colour = "green" if s["within_10pct"] else "red"
        console.print(
            f"[{colour}]{s['load']}: {s['headline']} {s[s['headline']]}, spread "
            f"{100 * s[s['headline'] + '_spread']:.1f}%"
        )


@dataclass
class Inputs:
    """Everything sent, made before the cluster starts: the warm-up's and every run's requests
    (the same specs, images of their own) and the adapters' bundles."""

    warm_specs: list[RequestSpec]
    specs: list[RequestSpec]
    warm_images: list[bytes]
    run_images: list[list[bytes]]  # one list per run
    bundles: list[tuple[bytes, str]]


def make_inputs(args: argparse.Namespace, model: Path, runs: int) -> Inputs:
    from transformers import AutoTokenizer

    words = prompt_words(AutoTokenizer.from_pretrained(model))
    mix = dict(
        words=words,
        adapters=args.adapters,
        ranks=args.ranks,
        image_sizes=args.image_sizes,
        max_new_tokens=args.max_new_tokens,
    )
    warm_specs, specs = request_mix(args.warmup, args.seed + 1, **mix), request_mix(args.requests, args.seed, **mix)
    sizes = [[size for s in part for size in s.image_sizes] for part in [warm_specs, *[specs] * runs]]
    with console.status(f"{sum(map(len, sizes))} random images, {args.adapters} random adapters…"):
        pngs = sb.random_pngs(sum(map(len, sizes)), list(itertools.chain(*sizes)), np.random.default_rng(args.seed))
        bundles = sb.random_bundles(model, adapter_ranks(args.adapters, args.ranks), args.seed)
    cuts = list(itertools.accumulate(map(len, sizes), initial=0))
    images = [pngs[a:b] for a, b in itertools.pairwise(cuts)]
    return Inputs(warm_specs, specs, images[0], images[1:], bundles)


def start(
    home: Path, model: Path, args: argparse.Namespace, inputs: Inputs, worker_env: list[dict[str, str]]
) -> tuple[cluster_mod.Cluster, list[str], dict]:
    """Starts the cluster (one worker), registers the adapters (their bundles are then dropped) and
    runs the warm-up: (cluster, adapter references, times and warm-up failures)."""
    env = {"VALORA_DEVICE_SLOTS": str(max(1, args.adapters)), **sb.service_env(args, home)}  # all resident
    with console.status(
        f"cluster on {args.device}: start, register {args.adapters} adapters, {args.warmup} warm-up requests…"
    ):
        t0 = time.perf_counter()
        c = cluster_mod.start_cluster(
            home, workers=1, model_path=model, env=env, worker_env=worker_env, startup_timeout_s=args.startup_timeout_s
        )
        cluster_mod.wait_registered(c.by_service("scheduler")[0].address, 1, args.startup_timeout_s, c.internal_token)
        t1 = time.perf_counter()
        refs = sb.register_adapters(c.gateway, inputs.bundles, args.seed, prefix="serve")
        inputs.bundles = []
        t2 = time.perf_counter()
        warm = (
            asyncio.run(
                sb.drive(
                    c.gateway,
                    build_requests(inputs.warm_specs, inputs.warm_images, refs),
                    max(args.concurrency),
                    0.0,
                    args.timeout_s,
                    args.seed,
                )
            )
            if inputs.warm_specs
            else []
        )
    failed = sum(o.result is None for o in warm)
    if failed:
        console.print(f"[yellow]warm-up: {failed} of {len(warm)} requests failed")
    return (
        c,
        refs,
        {
            "startup_s": round(t1 - t0, 2),
            "register_s": round(t2 - t1, 2),
            "warmup_s": round(time.perf_counter() - t2, 2),
            "warmup_failed": failed,
        },
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, sb._raise_on_sigterm)
    model = sb.resolve_model(args)
    t_start = time.perf_counter()
    runs = [(load, k) for load in plan_loads(args) for k in range(1, args.repeat + 1)]
    inputs = make_inputs(args, model, len(runs))
    gpu_ids = cluster_mod.visible_gpus()[:1] if args.device == "cuda" else []
    gpus, worker_env = sb.gpu_plan(args.device, 1, gpu_ids, args.dtype)
    temp_home = args.home is None
    home = Path(tempfile.mkdtemp(prefix="valora-serve-")) if temp_home else args.home.resolve()
    rows: list[dict] = []
    failures: list[dict] = []
    times: dict = {}
    interrupted: BaseException | None = None
    sampler = GpuSampler(gpu_ids) if gpu_ids else None
    label = None  # the run under way
    try:
        c, refs, times = start(home, model, args, inputs, worker_env)
        marks = os.environ.get("SERVE_BENCH_MARK_DIR")  # a profiler waits for a measured run to start
        for i, ((load, k), pngs) in enumerate(zip(runs, inputs.run_images, strict=True), 1):
            label = f"{load.name} #{k}"
            if marks:  # measuring-<i>: the worker's pid, written as the run's requests start
                worker_pid = next(p.pid for p in c.processes if p.service == "worker")
                (Path(marks) / f"measuring-{i}").write_text(f"{worker_pid}\n")
            with console.status(f"{label}: {args.requests} requests…"):
                row = measure(c, load, build_requests(inputs.specs, pngs, refs), args, sampler)
            rows.append(
                {
                    "run": label,
                    "load": load.name,
                    "mode": load.mode,
                    "repeat": k,
                    "concurrency": load.concurrency,
                    "rate": load.rate,
                    **row,
                }
            )
            console.print(
                f"{label}: {row['ok']}/{row['requests']} ok, {row['throughput_rps']:.1f} req/s, TTFT "
                f"p50/p99 {row['ttft_p50_ms']:.0f}/{row['ttft_p99_ms']:.0f} ms, e2e p99 "
                f"{row['e2e_p99_ms']:.0f} ms, gpu busy {row['gpu_busy']}, eager decode steps "
                f"{row['eager_decode_steps']}"
                + (f" [red]errors {row['errors']}: {row['error_sample']}" if row["failed"] else "")
            )
            label = None
    except (KeyboardInterrupt, SystemExit) as err:  # SIGINT/SIGTERM: the finally below stops the cluster
        interrupted = err
        failures.append({"run": label, "error": f"interrupted: {err!r}"})
    except Exception as err:  # reported with the logs; the rows so far are written
        console.print(f"[red]failed: {err!r}; logs under {home / 'logs'}:\n{sb.log_tails(home)}")
        failures.append({"run": label, "error": repr(err)[:2000]})
    finally:
        if sampler is not None:
            sampler.close()
        cluster_mod.stop_cluster(home)
    failed = bool(failures) or any(r["failed"] for r in rows)
    if temp_home and not failed:
        shutil.rmtree(home, ignore_errors=True)
    elif failed:
        console.print(f"[yellow]kept {home}")
    spreads = spread(rows)
    if rows:
        print_table(rows, spreads, args, model)
    paths = sb.write_bench_results(
        args.out or sb.default_out(args.device, "serve"),
        "serve",
        args,
        model,
        {"rows": rows, "spread": spreads, "failures": failures},
        workload=WORKLOAD,
        targets=TARGETS,
        gpus=gpus,
        mix=mix_summary(inputs.specs),
        warmup_mix=mix_summary(inputs.warm_specs),
        **times,
        wall_s=round(time.perf_counter() - t_start, 1),
    )
    console.print(f"results: {', '.join(map(str, paths))}")
    if interrupted is not None:
        raise interrupted
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
