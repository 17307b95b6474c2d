"""Throughput scaling over workers (issue 10): scheduler + N workers, one per GPU where there are several.

For each N in --workers, a real cluster (adapter_store, N workers, scheduler, gateway as processes on
loopback gRPC, `valora.cluster.start_cluster`) is started, a few random adapters are registered through
the gateway's admin API, a warm-up runs, then generation requests with images (a distinct image per
request, adapters round-robin) go through the public InferenceService, closed loop (--concurrency
requests in flight) or open loop (--rate: Poisson arrivals). The cluster is stopped before the next N,
and on any failure or SIGTERM/SIGINT. With --load-per-worker the offered load (concurrency or rate,
requests, warm-up) is per worker: N workers get N times it, so each count is measured at the same
per-worker saturation (a fixed total concurrency leaves each of N workers 1/N of the queue, which
measures latency under a load rather than capacity).

Rows `{"gpus", "workers", "throughput_rps", "mean_ms", "p99_ms", ...}` go to
bench/results/scale-<device>-<commit>.json (and $OUT when set). `gpus` is the number of distinct GPUs
the workers use: 0 on CPU, 1 when they all share one; with --device cuda worker i gets GPU
i % (visible GPUs, or --gpus) through its own CUDA_VISIBLE_DEVICES.

    python -m bench.scale_bench --workers 1,2 --requests 40 --concurrency 8            # CPU, tiny model
    python -m bench.scale_bench --device cuda --workers 1,2,4 --requests 400 --concurrency 32
    python -m bench.scale_bench --device cuda --arch qwen2-vl-7b --atmm --workers 1,2 --image-size 448  # 7B workers
    python -m bench.scale_bench --device cuda --arch qwen2-vl-7b --atmm --workers 1,2 --load-per-worker  # capacity
    python -m bench.scale_bench --device cuda --arch qwen2-vl-7b --atmm --workers 1 --tp 2             # a TP worker
    valora bench scale --help                                                          # the same options
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import io
import itertools
import json
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

if __package__ in (None, ""):  # `python bench/scale_bench.py`: the repo root is not on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import numpy as np
import psutil
from PIL import Image
from rich.console import Console
from rich.table import Table

from valora import cluster as cluster_mod
from valora.client import InferResult, ValoraClient
from valora_protos.internal.v1 import worker_service_pb2, worker_service_pb2_grpc
from valora_protos.v1 import inference_service_pb2 as inf_pb
from valora_protos.v1 import inference_service_pb2_grpc as inf_grpc
from valora_protos.v1 import types_pb2

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
console = Console(width=None if sys.stdout.isatty() else 140)


# -- options ------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2,4, got {text!r}")
    return out


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def add_cluster_options(p: argparse.ArgumentParser) -> None:
    """The options of the cluster under test that the benchmarks driving it through the public API
    share (this one and serve_bench): the workers' device, dtype, model and kernels, service
    environment, deadlines, seed and state directory. check_cluster_options completes them."""
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="The workers' device.")
    p.add_argument(
        "--dtype",
        default="auto",
        help="Model dtype (float32, bfloat16, float16); auto: bfloat16 with "
        "--atmm, else float32. On CUDA, bf16/fp16 workers build the kernels extension on first use "
        "(ATMM at start, the switch kernel at the first merge) unless it is cached: build it first "
        "(python -m kernels.build) or use float32.",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="Local model directory (default: the tiny embedded model, built once if missing).",
    )
    p.add_argument(
        "--arch",
        default="",
        help="A full-size architecture with random weights instead of --model "
        "(qwen2-vl-7b, qwen2-vl-2b): its weightless directory is written under ~/.cache/valora and the "
        "workers load it with VALORA_LOAD_FORMAT=dummy.",
    )
    p.add_argument("--policy", default="", help="Scheduler policy (VALORA_POLICY; empty: default).")
    p.add_argument(
        "--atmm",
        action="store_true",
        help="CUDA: the workers run the multi-LoRA term on the ATMM "
        "extension (VALORA_USE_ATMM; bf16/fp16 only); default: the torch reference.",
    )
    p.add_argument(
        "--env",
        type=_key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Extra environment for every service (repeatable).",
    )
    p.add_argument("--timeout-s", type=float, default=120.0, help="Deadline of one request.")
    p.add_argument("--startup-timeout-s", type=float, default=300.0, help="Per cluster start.")
    p.add_argument("--seed", type=int, default=0)


def add_output_options(p: argparse.ArgumentParser, bench: str) -> None:
    """--home and --out of a cluster bench whose results default to default_out(device, bench)."""
    p.add_argument(
        "--home",
        type=Path,
        default=None,
        help="Cluster state + logs (default: a temporary directory, removed unless a run fails).",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"Results JSON (default bench/results/{bench}-<device>-<commit>.json; a copy goes to $OUT when set).",
    )


def check_cluster_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """add_cluster_options' checks and defaults, after parsing."""
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.atmm else "float32"
    if args.arch and args.model is not None:
        p.error("--arch and --model are exclusive")


def parse_args(argv: list[str] | None = None, prog: str = "python -m bench.scale_bench") -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--workers", type=_ints, default=[1, 2, 4], help="Comma-separated worker counts, one cluster each.")
    add_cluster_options(p)
    p.add_argument(
        "--gpus", type=int, default=0, help="CUDA: spread workers over this many of the visible GPUs (0: all visible)."
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="Tensor-parallel size of every worker (VALORA_TP_SIZE): "
        "with --device cuda worker i gets the next block of --tp GPUs.",
    )
    p.add_argument("--requests", type=int, default=200, help="Measured requests per worker count.")
    p.add_argument("--warmup", type=int, default=-1, help="Unmeasured requests first (-1: 2 x concurrency).")
    p.add_argument("--concurrency", type=int, default=16, help="Closed loop: requests in flight.")
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="Open loop: Poisson arrivals at this rate (req/s), no cap on requests in flight; 0 = closed loop.",
    )
    p.add_argument(
        "--load-per-worker",
        action="store_true",
        help="--concurrency/--rate, --requests and --warmup "
        "are per worker: N workers are offered N times them (capacity scaling at equal saturation).",
    )
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4, help="Random adapters registered; requests round-robin.")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank of the adapters.")
    p.add_argument("--image-size", type=int, default=56, help="Side of the square random image (pixels).")
    p.add_argument("--max-batch-size", type=int, default=0, help="Workers' VALORA_MAX_BATCH_SIZE (0: default).")
    p.add_argument(
        "--threads-per-worker",
        type=int,
        default=-1,
        help="CPU workers' torch threads (OMP_NUM_THREADS); "
        "-1: the cores divided among the workers (N processes of `cores` threads each thrash); 0: torch's "
        "default.",
    )
    p.add_argument(
        "--home",
        type=Path,
        default=None,
        help="Cluster state + logs, one sub-directory per worker "
        "count (default: a temporary directory, removed unless a run fails).",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="Results JSON (default bench/results/scale-<device>-<commit>.json; a copy goes to $OUT when set).",
    )
    args = p.parse_args(argv)
    check_cluster_options(p, args)
    if args.requests < 1 or args.concurrency < 1 or args.adapters < 0 or args.gpus < 0 or args.tp < 1:
        p.error("--requests, --concurrency and --tp must be >= 1, --adapters and --gpus >= 0")
    if args.warmup < 0:
        args.warmup = 2 * args.concurrency
    return args


# -- placement ----------------------------------------------------------------------------------


def gpu_plan(
    device: str, workers: int, gpu_ids: list[str], dtype: str, threads: int = 0, tp: int = 1
) -> tuple[int, list[dict[str, str]]]:
    """(distinct GPUs used, per-worker environment): cluster.worker_device_env's placement (worker
    i on gpu_ids[i % len], seen by it as its only GPU; with tp > 1 the next block of tp GPUs); CPU
    workers get `threads` torch threads each (OMP_NUM_THREADS; 0: torch's default)."""
    try:
        envs = cluster_mod.worker_device_env(workers, device, dtype, gpu_ids, tp)
    except ValueError as exc:
        raise SystemExit(f"--device {device}: {exc}") from None
    if device == "cpu":
        cap = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads > 0 else {}
        return 0, [{**e, **cap} for e in envs]
    return len({g for e in envs for g in e["CUDA_VISIBLE_DEVICES"].split(",")}), envs


# -- workload -----------------------------------------------------------------------------------


def random_png(rng: np.random.Generator, size: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _random_bundle(shapes, rank: int, seed: int, head_sizes: dict[str, int] | None = None) -> tuple[bytes, str]:
    from services.common.adapter_format import make_random_bundle

    return make_random_bundle(shapes, rank=rank, seed=seed, lora_alpha=2 * rank, heads=head_sizes)


def random_bundles(
    model_path: Path,
    ranks: Sequence[int],
    seed: int,
    heads: Sequence[Mapping[str, Sequence[str]] | None] | None = None,
) -> list[tuple[bytes, str]]:
    """Random PEFT bundles (LoRA on all seven projections of every layer), one per rank: bundle i
    seeded seed + i, lora_alpha 2 x its rank, with a random task head per entry of heads[i]
    ({head name: its labels}; none: no heads). A 7B rank-64 one is ~650 MB of float32 (~2 s to
    draw), so large sets are drawn in a process pool, before the cluster starts."""
    from services.common.adapter_format import TARGET_MODULES, BaseModelShapes

    shapes = BaseModelShapes.from_config(json.loads((model_path / "config.json").read_text()))
    seeds = [seed + i for i in range(len(ranks))]
    head_sizes = [{h: len(labels) for h, labels in (hs or {}).items()} for hs in (heads or [None] * len(ranks))]
    if len(head_sizes) != len(ranks):
        raise ValueError(f"{len(head_sizes)} head sets for {len(ranks)} bundles")
    floats = sum(ranks) * shapes.num_layers * sum(sum(shapes.features[m]) for m in TARGET_MODULES)
    procs = min(os.cpu_count() or 1, len(ranks), 8)  # each holds a bundle twice (arrays + bytes)
    if floats < 1 << 28 or procs < 2:  # (a 7B set of 4 rank-8 ones: 81 M, ~1.5 s here)
        return [_random_bundle(shapes, r, s, h) for r, s, h in zip(ranks, seeds, head_sizes, strict=True)]
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_random_bundle, itertools.repeat(shapes), ranks, seeds, head_sizes))


def register_adapters(
    gateway: str,
    bundles: Sequence[tuple[bytes, str]],
    seed: int,
    prefix: str = "scale",
    heads: Sequence[Mapping[str, Sequence[str]] | None] | None = None,
) -> list[str]:
    """Registers (bundle, adapter_config_json) pairs (random_bundles) through the admin API as
    adapters/{prefix}-{i}, alias `bench`, version i declaring the task heads heads[i] ({head name:
    its labels}, as its bundle was drawn with); returns their `adapters/{prefix}-{i}@bench`
    references."""
    refs = []
    with ValoraClient(gateway) as client:
        for i, (bundle, cfg) in enumerate(bundles):
            declared = {h: list(labels) for h, labels in ((heads[i] if heads else None) or {}).items()}
            version = client.upload_adapter_version(
                f"{prefix}-{i}", bundle, cfg, heads=declared, request_id=f"{prefix}-{seed}-{i}"
            )
            client.set_alias(f"adapters/{prefix}-{i}", "bench", version.name)
            refs.append(f"adapters/{prefix}-{i}@bench")
    return refs


def _seeded_png(seed: int, size: int) -> bytes:
    return random_png(np.random.default_rng(seed), size)


def random_pngs(n: int, size: int | Sequence[int], rng: np.random.Generator) -> list[bytes]:
    """n distinct random PNGs (distinct: the worker's feature cache must not serve them), one
    seed each from rng; `size`: the side of all of them, or one side per image. Encoding one
    448 px image takes ~40 ms, so many go to a process pool."""
    seeds = [int(s) for s in rng.integers(0, 2**63, size=n)]
    sizes = [size] * n if isinstance(size, int) else list(size)
    if len(sizes) != n:
        raise ValueError(f"{len(sizes)} sizes for {n} images")
    procs = min(os.cpu_count() or 1, 16)
    if n < 64 or procs < 2:
        return [_seeded_png(s, side) for s, side in zip(seeds, sizes, strict=True)]
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_seeded_png, seeds, sizes, chunksize=16))


def make_requests(n: int, image_size: int, max_new_tokens: int, rng: np.random.Generator) -> list[inf_pb.InferRequest]:
    """n requests, each with its own random image, made before the cluster starts (not while its
    GPUs idle); adapters come later (use_adapters)."""
    return [
        inf_pb.InferRequest(
            request_id=uuid.uuid4().hex,
            input=inf_pb.InferenceInput(
                prompt=f"Describe picture {i} in a few words.",
                images=[types_pb2.Image(data=png)],
                output_kind=types_pb2.OUTPUT_KIND_TEXT,
                params=types_pb2.GenerationParams(max_new_tokens=max_new_tokens),
            ),
        )
        for i, png in enumerate(random_pngs(n, image_size, rng))
    ]


def use_adapters(requests: list[inf_pb.InferRequest], adapters: list[str]) -> None:
    """Adapters round-robin over the requests (none: the base model)."""
    for i, r in enumerate(requests):
        if adapters:
            r.input.adapter = adapters[i % len(adapters)]


@dataclass
class Outcome:
    sent: float  # perf_counter seconds
    done: float
    result: InferResult | None = None
    code: str = ""
    error: str = ""

    @property
    def ms(self) -> float:
        return (self.done - self.sent) * 1000


async def drive(
    gateway: str,
    requests: list[inf_pb.InferRequest],
    concurrency: int,
    rate: float,
    timeout_s: float,
    seed: int,
    arrivals_s: Sequence[float] | None = None,
) -> list[Outcome]:
    """Sends every request once through InferenceService.Infer (no retries: a failure is counted);
    the outcomes in the requests' order. Open loop, none waiting for another: request i at
    arrivals_s[i] seconds from the start when given (a trace's schedule), else Poisson arrivals at
    `rate` req/s when rate > 0; otherwise a closed loop of `concurrency` requests in flight."""
    if not requests:
        return []
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(gateway, options=options) as channel:
        stub = inf_grpc.InferenceServiceStub(channel)

        async def one(req: inf_pb.InferRequest) -> Outcome:
            t0 = time.perf_counter()
            try:
                resp = await stub.Infer(req, timeout=timeout_s)
                return Outcome(t0, time.perf_counter(), InferResult.from_pb(resp.result))
            except grpc.aio.AioRpcError as err:
                return Outcome(t0, time.perf_counter(), code=err.code().name, error=err.details() or "")

        if arrivals_s is None and rate > 0:  # Poisson: exponential gaps from the seed
            rng = random.Random(seed)
            arrivals_s = list(itertools.accumulate((rng.expovariate(rate) for _ in requests[1:]), initial=0.0))
        if arrivals_s is not None:  # open loop
            tasks, start = [], time.perf_counter()
            for req, at in zip(requests, arrivals_s, strict=True):
                delay = start + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(req)))
            return list(await asyncio.gather(*tasks))

        pending = iter(requests)
        outcomes: list[Outcome] = []

        async def loop() -> None:
            for req in pending:  # one shared iterator: each request is taken once
                outcomes.append(await one(req))

        await asyncio.gather(*(loop() for _ in range(min(concurrency, len(requests)))))
        return outcomes


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] if s else float("nan")


def summarize(outcomes: list[Outcome], workers: int, gpus: int) -> dict:
    ok = [o for o in outcomes if o.result is not None]
    lat = [o.ms for o in ok]
    wall = max(o.done for o in outcomes) - min(o.sent for o in outcomes)
    tokens = sum(o.result.output_tokens for o in ok)
    per_worker = collections.Counter(o.result.worker for o in ok)
    errors = collections.Counter(o.code for o in outcomes if o.result is None)
    return {
        "gpus": gpus,
        "workers": workers,
        "throughput_rps": round(len(ok) / wall, 3) if wall > 0 else 0.0,
        "mean_ms": round(statistics.fmean(lat), 2) if lat else float("nan"),
        "p99_ms": round(percentile(lat, 99), 2),
        "p50_ms": round(percentile(lat, 50), 2),
        "requests": len(outcomes),
        "ok": len(ok),
        "failed": len(outcomes) - len(ok),
        "errors": dict(errors),
        "error_sample": next((f"{o.code}: {o.error}" for o in outcomes if o.result is None), ""),
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
        "ttft_ms": round(statistics.fmean(o.result.first_token_ms for o in ok), 2) if ok else float("nan"),
        "queue_ms": round(statistics.fmean(o.result.queue_ms for o in ok), 2) if ok else float("nan"),
        "per_worker": dict(sorted(per_worker.items())),
        "workers_used": len(per_worker),
        "modes": dict(sorted(collections.Counter(o.result.mode for o in ok).items())),
    }


# -- one cluster per worker count ---------------------------------------------------------------


def service_env(args: argparse.Namespace, home: Path) -> dict[str, str]:
    env = {
        "VALORA_DTYPE": args.dtype,
        "VALORA_DRAIN_DELAY_S": "0",
        "VALORA_LOG_LEVEL": "warning",
        "VALORA_USE_ATMM": "true" if args.atmm else "false",
        "VALORA_HOME": str(home),
    }  # VALORA_HOME: lets a test find every process of this run
    if args.max_batch_size:
        env["VALORA_MAX_BATCH_SIZE"] = str(args.max_batch_size)
    if args.policy:
        env["VALORA_POLICY"] = args.policy
    if args.arch:
        env["VALORA_LOAD_FORMAT"] = "dummy"  # the architecture's directory holds no weights
    env.update(dict(args.env))
    return env


def worker_status(c: cluster_mod.Cluster, address: str) -> worker_service_pb2.GetWorkerStatusResponse:
    """One worker's GetWorkerStatus: its status, recent step times and decode-graph counters."""
    with c.channel(address) as channel:
        return worker_service_pb2_grpc.WorkerServiceStub(channel).GetWorkerStatus(
            worker_service_pb2.GetWorkerStatusRequest(), timeout=10
        )


def message_fields(msg) -> dict:
    """The fields a message sets (proto3: its non-zero ones), floats to 3 decimals."""
    return {f.name: round(v, 3) if isinstance(v, float) else v for f, v in msg.ListFields()}


def worker_engine_stats(c: cluster_mod.Cluster, addresses: list[str]) -> tuple[list[dict], list[dict]]:
    """Each worker's recent engine step times and how its decode steps ran (GetWorkerStatus):
    with the run's wall time the step times tell a busy engine (steps fill the wall time) from
    one waiting for work upstream; the decode-graph counts tell replays from warm-ups/captures."""
    got = [worker_status(c, address) for address in addresses]
    return [message_fields(g.step_times) for g in got], [message_fields(g.decode_graphs) for g in got]


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds each named cluster process and its live descendants (a worker's
    preprocessing pool, tensor-parallel ranks) have used so far, and this process's own ("client":
    the load generator, without the cluster it started)."""
    own = psutil.Process().cpu_times()
    out = {"client": own.user + own.system}
    for name, pid in pids.items():
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        total = 0.0
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = proc.cpu_times()
                total += t.user + t.system
        out[name] = total
    return out


def cpu_per_request(
    before: dict[str, float], after: dict[str, float], requests: int, wall_s: float
) -> tuple[dict[str, float], dict[str, float]]:
    """(CPU ms per request, CPU cores busy) per process over the measured run: a front-end service
    near one core (its asyncio loop) caps the cluster however many GPUs serve behind it."""
    used = {k: after[k] - before[k] for k in after if k in before}
    return (
        {k: round(v * 1e3 / max(1, requests), 3) for k, v in used.items()},
        {k: round(v / wall_s, 3) if wall_s > 0 else 0.0 for k, v in used.items()},
    )


def log_tails(home: Path, chars: int = 1500) -> str:
    parts = []
    for log in sorted((home / "logs").glob("*.log")):
        parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-chars:]}")
    return "\n".join(parts)


def offered_load(args: argparse.Namespace, workers: int) -> tuple[int, float, int, int]:
    """(concurrency, rate, measured requests, warm-up requests) offered to a cluster of `workers`."""
    k = workers if args.load_per_worker else 1
    return args.concurrency * k, args.rate * k, args.requests * k, args.warmup * k


def run_one(workers: int, args: argparse.Namespace, model_path: Path, home: Path, gpu_ids: list[str]) -> dict:
    concurrency, rate, n_requests, n_warmup = offered_load(args, workers)
    threads = args.threads_per_worker
    if threads < 0:
        threads = max(1, (os.cpu_count() or 1) // workers)
    gpus, worker_env = gpu_plan(
        args.device, workers, gpu_ids, args.dtype, threads if args.device == "cpu" else 0, args.tp
    )
    rng = np.random.default_rng(args.seed + workers)
    warm = make_requests(n_warmup, args.image_size, args.max_new_tokens, rng)
    measured = make_requests(n_requests, args.image_size, args.max_new_tokens, rng)
    bundles = random_bundles(model_path, [args.rank] * args.adapters, args.seed)
    t0 = time.perf_counter()
    try:
        c = cluster_mod.start_cluster(
            home,
            workers=workers,
            model_path=model_path,
            env=service_env(args, home),
            worker_env=worker_env,
            startup_timeout_s=args.startup_timeout_s,
        )
        scheduler = c.by_service("scheduler")[0].address
        # healthy, not just up
        cluster_mod.wait_registered(scheduler, workers, args.startup_timeout_s, c.internal_token)
        startup_s = time.perf_counter() - t0
        adapters = register_adapters(c.gateway, bundles, args.seed)
        use_adapters(warm, adapters)
        use_adapters(measured, adapters)
        if warm:
            asyncio.run(drive(c.gateway, warm, concurrency, 0.0, args.timeout_s, args.seed))
        pids = {p.name: p.pid for p in c.processes}
        if os.environ.get("SCALE_BENCH_MARK_DIR"):  # tells profilers (h200_session.sh's py-spy) when and whom
            Path(os.environ["SCALE_BENCH_MARK_DIR"], f"measuring-{workers}").write_text(
                "\n".join(str(p.pid) for p in c.by_service("worker")) + "\n"
            )
        cpu_before = cpu_seconds(pids)
        outcomes = asyncio.run(drive(c.gateway, measured, concurrency, rate, args.timeout_s, args.seed))
        cpu_after = cpu_seconds(pids)
        steps, graphs = worker_engine_stats(c, [p.address for p in c.by_service("worker")])
    finally:
        cluster_mod.stop_cluster(home)
    row = summarize(outcomes, workers, gpus)
    row["service_cpu_ms_per_request"], row["service_cpu_cores"] = cpu_per_request(
        cpu_before, cpu_after, len(outcomes), row["wall_s"]
    )
    row.update(
        tp=args.tp,
        device=args.device,
        dtype=args.dtype,
        concurrency=concurrency,
        rate=rate,
        max_new_tokens=args.max_new_tokens,
        adapters=args.adapters,
        startup_s=round(startup_s, 2),
        worker_devices=[e.get("CUDA_VISIBLE_DEVICES", "cpu") for e in worker_env],
        threads_per_worker=int(worker_env[0].get("OMP_NUM_THREADS", 0)),
        worker_steps=steps,
        worker_decode_graphs=graphs,
    )
    return row


def print_table(rows: list[dict], args: argparse.Namespace, model: Path) -> None:
    load = f"open loop {args.rate:g} req/s" if args.rate > 0 else f"closed loop, concurrency {args.concurrency}"
    if args.load_per_worker:
        load += " per worker"
    tp = f" tensor parallel {args.tp}," if args.tp > 1 else ""
    table = Table(
        title=f"scale: {args.device} {args.dtype}, {model.name},{tp} {load}, {args.max_new_tokens} new "
        f"tokens, {args.adapters} adapters r{args.rank}"
    )
    for col in (
        "gpus",
        "workers",
        "ok/req",
        "req/s",
        "speedup",
        "tok/s",
        "mean ms",
        "p50 ms",
        "p99 ms",
        "ttft ms",
        "per worker",
    ):
        table.add_column(col, justify="left" if col == "per worker" else "right")
    fewest = min(r["workers"] for r in rows)
    for r in rows:
        ok = f"{r['ok']}/{r['requests']}" if r["failed"] == 0 else f"[red]{r['ok']}/{r['requests']}[/red]"
        ideal = r["workers"] / fewest
        table.add_row(
            str(r["gpus"]),
            str(r["workers"]),
            ok,
            f"{r['throughput_rps']:.1f}",
            f"{r['speedup']:.2f}x / {ideal:g}x",
            f"{r['tokens_per_s']:.0f}",
            f"{r['mean_ms']:.0f}",
            f"{r['p50_ms']:.0f}",
            f"{r['p99_ms']:.0f}",
            f"{r['ttft_ms']:.0f}",
            "/".join(str(v) for v in r["per_worker"].values()),
        )
    console.print(table)
    console.print(
        "[dim]speedup: throughput / that of the fewest workers, against the ideal (worker ratio); "
        "per worker: successful requests each worker served (InferResult.worker)"
    )


def default_out(device: str, bench: str = "scale") -> Path:
    """bench/results/<bench>-<device>-<commit>.json: where a cluster bench's results go by default."""
    from kernels.results import git_commit

    return RESULTS / f"{bench}-{device}-{git_commit()[:7]}.json"


def write_bench_results(
    path: Path, bench: str, args: argparse.Namespace, model: Path, payload: dict, **info
) -> list[Path]:
    """A cluster bench's results (serve, orchestration, release): {"info": run metadata, the bench,
    the model, its arguments (env included), the machine's cores and `info`; then `payload`'s
    keys (rows, failures, ...)} at `path` (and $OUT when set)."""
    from kernels.results import run_info, write_json  # torch: device/version metadata

    meta = {
        **run_info(),
        "bench": bench,
        "model": str(model),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in sorted(vars(args).items())},
        "cpu_count": os.cpu_count(),
        **info,
    }
    meta["args"]["env"] = dict(args.env)
    return write_json(path.with_suffix("").name, {"info": meta, **payload}, path.parent)


def write_results(
    path: Path, rows: list[dict], args: argparse.Namespace, model: Path, wall_s: float, failures: list[dict]
) -> list[Path]:
    from bench.common import run_info  # torch: device/version metadata

    info = {
        **run_info(),
        "bench": "scale",
        "device": args.device,
        "dtype": args.dtype,
        "model": str(model),
        "requests": args.requests,
        "warmup": args.warmup,
        "concurrency": args.concurrency,
        "rate": args.rate,
        "load_per_worker": args.load_per_worker,
        "max_new_tokens": args.max_new_tokens,
        "adapters": args.adapters,
        "rank": args.rank,
        "image_size": args.image_size,
        "max_batch_size": args.max_batch_size,
        "policy": args.policy,
        "atmm": args.atmm,
        "arch": args.arch,
        "tp": args.tp,
        "env": dict(args.env),
        "threads_per_worker": args.threads_per_worker,
        "seed": args.seed,
        "cpu_count": os.cpu_count(),
        "wall_s": round(wall_s, 1),
    }
    text = json.dumps({"info": info, "rows": rows, "failures": failures}, indent=1, default=str) + "\n"
    paths = [path.resolve()]
    if os.environ.get("OUT") and (Path(os.environ["OUT"]) / path.name).resolve() != paths[0]:
        paths.append(Path(os.environ["OUT"]) / path.name)
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return paths


def resolve_model(args: argparse.Namespace) -> Path:
    """The model directory the workers load: --arch's weightless one (written once), --model, or
    the tiny embedded model (built once)."""
    if args.arch:
        from services.worker.tiny_model import ensure_shape_model

        return ensure_shape_model(Path(f"~/.cache/valora/{args.arch}").expanduser(), args.arch).resolve()
    if args.model is None:
        model = cluster_mod.default_model_path(cluster_mod.DEFAULT_HOME).expanduser().resolve()
        cluster_mod.ensure_model(model)
        return model
    model = args.model.expanduser().resolve()
    if not (model / "config.json").exists():
        raise SystemExit(f"--model {model}: no config.json")
    return model


def _raise_on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the teardown short
    raise SystemExit(128 + signum)  # unwinds through run_one's finally: the cluster is stopped


def main(argv: list[str] | None = None, prog: str = "python -m bench.scale_bench") -> int:
    args = parse_args(argv, prog)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    if args.rate <= 0 and not args.load_per_worker and args.concurrency < max(args.workers):
        console.print(f"[yellow]concurrency {args.concurrency} < {max(args.workers)} workers: some stay idle")
    model = resolve_model(args)
    gpu_ids = cluster_mod.visible_gpus() if args.device == "cuda" else []
    if args.gpus:
        gpu_ids = gpu_ids[: args.gpus]
    temp_home = args.home is None
    home = Path(tempfile.mkdtemp(prefix="valora-scale-")) if temp_home else args.home.resolve()
    rows: list[dict] = []
    failures: list[dict] = []  # worker counts whose cluster or load driver broke (no row)
    interrupted: BaseException | None = None
    t0 = time.perf_counter()
    try:
        for n in args.workers:
            sub = home / f"w{n}"
            _, _, n_requests, n_warmup = offered_load(args, n)
            try:
                with console.status(
                    f"{n} worker{'s' if n > 1 else ''} on {args.device}: start, register, "
                    f"{n_warmup} warm-up + {n_requests} requests…"
                ):
                    row = run_one(n, args, model, sub, gpu_ids)
            except Exception as err:  # reported, the other worker counts still run
                console.print(f"[red]{n} workers failed: {err!r}; logs under {sub / 'logs'}:\n{log_tails(sub)}")
                failures.append({"workers": n, "error": repr(err)[:2000]})
                continue
            rows.append(row)
            console.print(
                f"{n} workers: {row['ok']}/{row['requests']} ok, {row['throughput_rps']:.1f} req/s, mean "
                f"{row['mean_ms']:.0f} ms, p99 {row['p99_ms']:.0f} ms, started in {row['startup_s']:.1f} s"
                + (f" [red]errors {row['errors']}: {row['error_sample']}" if row["failed"] else "")
            )
    except (KeyboardInterrupt, SystemExit) as err:  # SIGINT/SIGTERM: run_one's finally stopped the cluster
        interrupted = err
        failures.append({"workers": None, "error": f"interrupted: {err!r}"})
    failed = bool(failures) or any(r["failed"] for r in rows)
    if rows:  # against the row with the fewest workers
        first = min(rows, key=lambda r: r["workers"])
        for r in rows:
            r["speedup"] = round(r["throughput_rps"] / first["throughput_rps"], 3) if first["throughput_rps"] else 0.0
    if temp_home and not failed:
        shutil.rmtree(home, ignore_errors=True)
    elif failed:
        console.print(f"[yellow]kept {home}")
    wall = time.perf_counter() - t0
    if rows:
        print_table(rows, args, model)
    paths = write_results(args.out or default_out(args.device), rows, args, model, wall, failures)
    console.print(f"results: {', '.join(map(str, paths))} ({wall:.0f} s)")
    if interrupted is not None:
        raise interrupted
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
