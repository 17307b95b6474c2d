"""One worker over several GPUs with tensor parallelism (issue 10): the Qwen2-VL language model at a
13B-like shape, TP=1 vs TP=N, without and with mixed LoRA adapters (S-LoRA partitioning).

The model is Qwen2-VL's text model (transformers' Qwen2VLTextModel + a replicated lm_head) with
random weights (the same seed on every world size, so the logits can be compared across world
sizes), sharded by services/worker/tp_sharding.py; adapters are random rank-r LoRAs on all 7
projections, sharded the same way. One "batch" is the engine's work for --batch requests: one
prefill forward of --prefill tokens per row (rows sorted by adapter, one StepLora per forward,
ATMM where it runs) then --new-tokens - 1 decode steps on the KV cache, rank 0's greedy token
broadcast to every rank each step (as a TP engine would). Eager forwards (no CUDA graphs).

World size 1 runs in this process; larger ones through torch.multiprocessing.spawn, one process
per GPU, NCCL on loopback (gloo on CPU), NCCL_NVLS_ENABLE=0 (NVLink multicast stays off on the
lent hosts). Rows `{"gpus", "workers", "throughput_rps", "mean_ms", "p99_ms", ...}` (workers = 1:
one TP worker; gpus = its world size, 0 on CPU) go to bench/results/scale-tp-<device>-<commit>.json
(and $OUT when set).

    python -m bench.tp_bench --gpus 2                      # H200 x2: 13B-like shape, bf16, TP 1 and 2
    python -m bench.tp_bench --gpus 2 --layers 8 --reps 3  # a quicker partial-depth run
    python -m bench.tp_bench --device cpu --tiny --gpus 2  # CPU smoke run (gloo), tiny shape
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/tp_bench.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ["NCCL_NVLS_ENABLE"] = "0"  # before any NCCL communicator exists; spawned ranks inherit it

import numpy as np
import torch
import torch.multiprocessing as mp

from bench.common import exit_rank
from kernels.results import RESULTS_DIR, git_commit, run_info, write_json
from services.worker.tiny_model import SHAPES

# The 13B-like shape of the issue (Llama-2-13B's decoder dimensions, Qwen2-VL's vocab and M-RoPE): the
# language model of services.worker.tiny_model's "qwen2-vl-13b-like" architecture.
SHAPE_13B = {k: v for k, v in SHAPES["qwen2-vl-13b-like"]["text"].items() if k != "max_position_embeddings"}
SHAPE_TINY = dict(
    vocab_size=640,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    mrope_section=[4, 6, 6],
)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ENV = {"NCCL_NVLS_ENABLE": "0"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.tp_bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--gpus", type=int, default=2, help="Largest TP world size; measures 1, 2, 4, ... up to it.")
    p.add_argument("--tp", default="", help="Comma-separated world sizes instead (e.g. 1,2).")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="Default: bfloat16 on CUDA, float32 on CPU.")
    p.add_argument("--tiny", action="store_true", help="The tiny Qwen2-VL text shape (CPU smoke runs).")
    p.add_argument("--layers", type=int, default=0, help="Override the number of decoder layers (0: the shape's).")
    p.add_argument("--batch", type=int, default=16, help="Requests per batch (rows).")
    p.add_argument("--prefill", type=int, default=289, help="Prompt tokens per request (256 image + 33 text in §3).")
    p.add_argument("--new-tokens", type=int, default=16, help="Generated tokens per request (1 from prefill).")
    p.add_argument("--adapters", type=int, default=8, help="Mixed adapters for the LoRA runs (0: base only).")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of every adapter.")
    p.add_argument("--atmm", choices=("auto", "off"), default="auto", help="ATMM kernel where it runs.")
    p.add_argument("--reps", type=int, default=10, help="Timed batches per configuration.")
    p.add_argument("--warmup", type=int, default=2, help="Untimed batches first.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="CPU threads per rank (0: cores / world size).")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default="", help="Results file name (default scale-tp-<device>-<commit>).")
    args = p.parse_args(argv)
    if args.tp:
        args.world_sizes = [int(x) for x in args.tp.split(",") if x.strip()]
    else:
        args.world_sizes = [1]
        while args.world_sizes[-1] * 2 <= args.gpus:
            args.world_sizes.append(args.world_sizes[-1] * 2)
    if not args.world_sizes or min(args.world_sizes) < 1:
        p.error("world sizes must be positive")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def text_config(args: argparse.Namespace):
    from transformers import Qwen2VLTextConfig

    shape = dict(SHAPE_TINY if args.tiny else SHAPE_13B)
    mrope = shape.pop("mrope_section")
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    return Qwen2VLTextConfig(
        **shape,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args: argparse.Namespace, tp, device: torch.device) -> list[dict]:
    """Every rank runs this; returns, per adapter count, the batch timings and the last logits."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel

    from services.common.adapter_format import BaseModelShapes
    from services.worker.atmm_backend import AtmmBackend
    from services.worker.attention import use_grouped_decode_attention
    from transformers import DynamicCache
    from services.worker.lora import AdapterEntry, LoraRuntime, StepLora
    from services.worker.tp_sharding import local_features, shard_lora_dicts, shard_model_

    dtype = DTYPES[args.dtype]
    cfg = text_config(args)
    shapes = BaseModelShapes.from_config(cfg.to_dict())
    # The full model on every rank (same seed, same weights on every world size), then its shard.
    torch.manual_seed(args.seed)
    with torch.device(device):
        lm = Qwen2VLTextModel._from_config(cfg, dtype=dtype).eval()
        lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
    use_grouped_decode_attention(cfg)
    runtime = LoraRuntime()
    layers = shard_model_(lm, tp, runtime)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    atmm = args.atmm == "auto" and AtmmBackend.available(device, dtype)
    if atmm:
        feats = local_features(shapes, tp)
        runtime.backend = AtmmBackend({k: feats[k[1]] for k in layers}, device, dtype)

    entries = []
    for i in range(args.adapters):
        g = torch.Generator(device=device).manual_seed(args.seed + 1 + i)
        a, b = {}, {}
        for key in layers:
            fin, fout = shapes.features[key[1]]
            a[key] = (torch.randn(fin, args.rank, generator=g, device=device) * 0.02).to(dtype)
            b[key] = (torch.randn(args.rank, fout, generator=g, device=device) * 0.02).to(dtype)
        a, b = shard_lora_dicts(a, b, tp)
        entries.append(AdapterEntry(a, b, 2.0))

    g = torch.Generator().manual_seed(args.seed + 1000)
    B, P, steps = args.batch, args.prefill, max(0, args.new_tokens - 1)
    ids = torch.randint(0, cfg.vocab_size, (B, P), generator=g).to(device)
    pos = torch.arange(P, device=device).view(1, 1, P).expand(3, B, P)

    def plan(rows: list[int], tokens_per_row: int):
        if not entries or not rows:
            return None
        step = StepLora(entries, rows, tokens_per_row)
        if runtime.backend is not None and step.active:
            step.kernel = runtime.backend.begin(step)
        return step

    out = []
    for n_adapters in sorted({0, args.adapters}):
        rows = sorted(i % n_adapters for i in range(B)) if n_adapters else []  # the engine sorts rows by entry
        lat, pre, dec = [], [], []
        first = None
        with torch.inference_mode():
            for rep in range(args.warmup + args.reps):
                tp.barrier()
                _sync(device)
                t0 = time.perf_counter()
                cache = DynamicCache(config=cfg)
                runtime.step = plan(rows, P)
                h = lm(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).last_hidden_state
                logits = lm_head(h[:, -1])
                first = logits
                tok = tp.broadcast_(logits.argmax(-1))
                _sync(device)
                t1 = time.perf_counter()
                runtime.step = plan(rows, 1)
                for d in range(steps):
                    p = torch.full((3, B, 1), P + d, dtype=torch.long, device=device)
                    h = lm(
                        input_ids=tok.view(B, 1), position_ids=p, past_key_values=cache, use_cache=True
                    ).last_hidden_state
                    logits = lm_head(h[:, -1])
                    tok = tp.broadcast_(logits.argmax(-1))
                _sync(device)
                t2 = time.perf_counter()
                runtime.step = None
                del cache
                if rep >= args.warmup:
                    lat.append(t2 - t0)
                    pre.append(t1 - t0)
                    dec.append((t2 - t1) / max(1, steps))
        out.append(
            dict(
                adapters=n_adapters, latencies=lat, prefill=pre, decode=dec, atmm=atmm, first_logits=first.float().cpu()
            )
        )
    return out


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, result_path: str) -> None:
    from services.worker.tensor_parallel import init_tp_group

    os.environ.update(ENV)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    tp = init_tp_group(rank, world, port, device=device)
    got = measure(args, tp, device)
    if rank == 0:
        torch.save(got, result_path)
    tp.barrier()
    exit_rank()


def run_world(args: argparse.Namespace, world: int) -> list[dict]:
    from services.worker.tensor_parallel import TPGroup, free_loopback_port

    if world == 1:
        device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
        threads = torch.get_num_threads()
        if device.type == "cpu" and args.threads:
            torch.set_num_threads(args.threads)
        try:
            return measure(args, TPGroup(), device)
        finally:
            torch.set_num_threads(threads)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory(prefix="tp_bench.") as tmp:
        path = os.path.join(tmp, "rank0.pt")
        mp.spawn(_rank_main, args=(world, free_loopback_port(), args, path), nprocs=world, join=True)
        return torch.load(path)


def _row(args: argparse.Namespace, world: int, m: dict, base_logits: torch.Tensor | None, base_mean: float | None):
    lat = np.array(m["latencies"])
    mean = float(lat.mean())
    relerr = None
    if base_logits is not None:
        relerr = float((m["first_logits"] - base_logits).abs().max() / base_logits.abs().max().clamp_min(1e-30))
    return {
        "gpus": world if args.device == "cuda" else 0,
        "workers": 1,
        "throughput_rps": round(args.batch / mean, 3),
        "mean_ms": round(mean * 1e3, 3),
        "p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 3),
        "p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 3),
        "tp": world,
        "adapters": m["adapters"],
        "rank": args.rank if m["adapters"] else 0,
        "prefill_ms": round(statistics.fmean(m["prefill"]) * 1e3, 3),
        "decode_step_ms": round(statistics.fmean(m["decode"]) * 1e3, 3),
        "tokens_per_s": round(args.batch * args.new_tokens / mean, 1),
        "batch": args.batch,
        "prefill_tokens": args.prefill,
        "new_tokens": args.new_tokens,
        "reps": args.reps,
        "atmm": m["atmm"],
        "device": args.device,
        "dtype": args.dtype,
        "speedup": None if base_mean is None else round(base_mean / mean, 3),
        # max |first-token logits - TP1's| / max |TP1's| (same weights, inputs and adapters)
        "first_logits_relerr_vs_tp1": relerr,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    os.environ.update(ENV)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("CUDA is not available (use --device cpu --tiny for the CPU path)")
        if max(args.world_sizes) > torch.cuda.device_count():
            raise SystemExit(
                f"TP {max(args.world_sizes)} needs {max(args.world_sizes)} GPUs, {torch.cuda.device_count()} visible"
            )
    t0 = time.monotonic()
    results = {w: run_world(args, w) for w in args.world_sizes}
    first = min(results)
    base = {m["adapters"]: m for m in results[first]}
    rows = []
    for w in args.world_sizes:
        for m in results[w]:
            ref = base[m["adapters"]]
            rows.append(_row(args, w, m, ref["first_logits"], float(np.mean(ref["latencies"]))))
    cfg = text_config(args)
    info = {
        **run_info(),
        "bench": "scale-tp",
        "shape": "tiny" if args.tiny else "13b-like",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "world_sizes": args.world_sizes,
        "embeddings": "replicated",
        "lm_head": "replicated",
        "lora_partition": "S-LoRA: column layers A replicated, B sharded; row layers A sharded, B replicated, "
        "LoRA partial sums ride on the base all-reduce",
        "decode": "eager (no CUDA graphs), rank 0's token broadcast every step",
        "seed": args.seed,
        "env": dict(ENV),
        "wall_s": round(time.monotonic() - t0, 1),
        "args": {k: v for k, v in vars(args).items() if k not in ("out_dir",)},
    }
    name = args.name or f"scale-tp-{args.device}-{git_commit()[:7]}"
    write_json(name, {"info": info, "rows": rows}, Path(args.out_dir))
    for r in rows:
        print(
            f"tp={r['tp']} adapters={r['adapters']}: {r['throughput_rps']} req/s, mean {r['mean_ms']} ms, "
            f"p99 {r['p99_ms']} ms, prefill {r['prefill_ms']} ms, decode step {r['decode_step_ms']} ms, "
            f"speedup {r['speedup']}, first-token logits vs TP1 {r['first_logits_relerr_vs_tp1']}"
        )
    return rows


if __name__ == "__main__":
    main()
