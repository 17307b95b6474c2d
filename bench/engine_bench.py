"""Engine end to end (docs/benchmarks.md §3): valora's worker engine vs HF transformers + PEFT.

Workload: Qwen2-VL-7B architecture with random weights (`load_format="dummy"`), a batch of 16
requests, one 448x448 image each (256 image tokens) and ~32 text tokens, 16 new tokens (EOS
ignored, so every run decodes the same number of steps), 8 rank-16 adapters on all 7 projections.
Images are distinct and the engine's image-feature cache is off, so every run encodes every image.

Runs (rows `{"impl", "run", "generate_ms", "prefill_ms"}`; prefill_ms = the same batch with one new
token, i.e. prefill + first token):
- base: no adapter;
- merged: every request uses adapter 0, merged into the weights (valora MERGED; PEFT merge_adapter);
- unmerged_one: every request uses adapter 0, unmerged;
- unmerged_mixed: the 8 adapters mixed in the batch (valora UNMERGED; PEFT `adapter_names`);
- mixture: valora only — adapter 0 merged, requests of all 8 adapters (deLoRA term for 7 of them).
The peer runs first in the same process (same weights: one seed), then is freed.

    python -m bench.engine_bench                       # H200: 7B shape, writes results/engine-<suffix>.json
    python -m bench.engine_bench --arch tiny --device cpu --dtype float32 --batch 4 --adapters 2 --new-tokens 3
    python -m bench.engine_bench --arch llava-1.5-7b    # another family's shape (architectures.py), random weights

Decode is pipelined by default (EngineConfig.pipeline_decode); `--no-pipeline` runs serial steps for
an A/B. The detail file says which (valora.pipeline_decode, valora.pipelined_steps). Its decode
step_ms is one step's latency when serial, the interval between consecutive steps' tokens when
pipelined.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from PIL import Image

from bench.common import RESULTS, exit_rank, run_info, write_json
from services.common.server import freeze_startup_heap
from services.worker.architectures import ARCHITECTURES
from services.worker.model import ensure_shape_model, ensure_tiny_model, load_model, load_processor
from services.worker.processor import family_chat_text
from services.worker.requests import Failed, Finished, WorkRequest
from services.common.modes import Mode
from services.worker.testing import random_adapter_bundle, write_peft_dir

PROMPT = "Describe."  # with the chat template: 33 text tokens beside the image's 256 (§3: 32)
RUNS = ("base", "merged", "unmerged_one", "unmerged_mixed", "mixture")
FAMILIES = {a.name for a in ARCHITECTURES.values()}  # --arch NAME: the family's tiny model


def images(n: int, size: int, rep: int) -> list[Image.Image]:
    """Distinct images per request and per repetition (no cache can serve one twice)."""
    g = torch.Generator().manual_seed(1000 * rep + 7)
    out = []
    for _ in range(n):
        px = torch.randint(0, 256, (size // 16, size // 16, 3), generator=g, dtype=torch.uint8)
        out.append(Image.fromarray(px.numpy()).resize((size, size), Image.Resampling.NEAREST))
    return out


def adapters_for(run: str, batch: int, names: list[str]) -> list[str | None]:
    if run == "base":
        return [None] * batch
    if run in ("merged", "unmerged_one"):
        return [names[0]] * batch
    return [names[i % len(names)] for i in range(batch)]


# -- valora -----------------------------------------------------------------------------------


def freeze_heap(args) -> None:
    """As a serving process does once started (services.common.server.freeze_startup_heap): the
    loaded model's objects out of the cyclic GC's reach, so no full collection walks them inside a
    timed batch; undone (gc.unfreeze) when the implementation's runs end. Off: --no-gc-freeze."""
    if not args.no_gc_freeze:
        freeze_startup_heap()


def engine_config(args, model_dir: Path, load_format: str, adapters: int, rank: int = 0, tp=None):
    """The engine of the run (tensor parallel: rank `rank`'s, on its device)."""
    from services.worker.engine import EngineConfig
    from services.worker.tp_ranks import rank_device

    return EngineConfig(
        model_path=model_dir,
        device=rank_device(args.device, rank),
        dtype=args.dtype,
        max_batch_size=args.batch,
        max_prefills_per_step=args.batch,
        device_slots=adapters + 1,
        image_cache_bytes=0,
        load_format=load_format,
        max_new_tokens_limit=max(1024, args.new_tokens),
        decode_graphs=args.decode_graphs,
        fused_layers=not args.no_fused_layers,
        pipeline_decode=not args.no_pipeline,
        lora_fold_rows=0 if args.no_lora_fold else 512,
        kv_cache_bytes=int(args.kv_cache_gib * 2**30),
        tp=tp,
    )


def join_tp_group(args, rank: int, port: int):
    """Joins the run's group as `rank`, as a TP worker's rank does (tp_ranks.init_rank)."""
    from types import SimpleNamespace

    from services.worker.tp_ranks import init_rank

    return init_rank(SimpleNamespace(device=args.device, tp_size=args.tp, tp_port=port, tp_timeout_s=600), rank)


def tp_follower(rank: int, args, port: int, model_dir: Path, load_format: str, adapters: int) -> None:
    """Rank `rank` of a --tp run: its engine in lockstep with rank 0's until rank 0 stops."""
    from services.worker.engine import Engine

    tp = join_tp_group(args, rank, port)
    eng = Engine(engine_config(args, model_dir, load_format, adapters, rank, tp))
    eng.eos_ids = set()  # as rank 0's: the ranks must end rows alike
    eng.start()
    freeze_heap(args)
    eng.stop(timeout=None)  # returns once rank 0's stop reached this rank's loop
    if eng._error is not None:
        raise SystemExit(f"rank {rank}: {eng._error!r}")
    exit_rank()  # no group teardown (bench.common.exit_rank); rank 0 waits for this exit before its own


def run_valora(args, model_dir: Path, bundles: dict, load_format: str, tp=None) -> tuple[list[dict], dict]:
    from services.worker.engine import Engine

    names = list(bundles)
    cfg = engine_config(args, model_dir, load_format, len(names), 0, tp)
    eng = Engine(cfg)
    eng.eos_ids = set()  # benchmark: every request decodes exactly max_new_tokens (vLLM's ignore_eos)
    eng.start()
    rows, detail = (
        [],
        {"op": "atmm" if eng.runtime.backend is not None else "torch_reference", "tokens": {}, "first_logits": {}},
    )
    first_logits: dict[str, torch.Tensor] = {}
    hand_off = eng.prefiller.hand_off

    def record_prefill(rows, out):  # first-token logits, rep 0
        for i, logits in zip(out.text, out.logits if out.logits is not None else ()):
            if rows[i].req.request_id.split("-")[1] == "0":
                first_logits[rows[i].req.request_id] = logits.float().cpu()
        return hand_off(rows, out)

    eng.prefiller.hand_off = record_prefill
    try:
        for name, b in bundles.items():
            eng.load_adapter_bytes(name, b.sha256, b.data, b.config_json, to_device=True)
        freeze_heap(args)

        def batch_ms(run: str, new_tokens: int, rep: int) -> tuple[float, dict]:
            reqs = [
                WorkRequest(f"{run}-{rep}-{i}", PROMPT, [img], adapter=a, max_new_tokens=new_tokens)
                for i, (img, a) in enumerate(
                    zip(images(args.batch, args.image, rep), adapters_for(run, args.batch, names))
                )
            ]
            preps = [eng.prepare(r) for r in reqs]  # image processing + tokenizing: not timed (peer alike)
            detail["prompt_tokens"] = {"image": preps[0].image_tokens, "total": preps[0].prompt_tokens}
            done, results, errors = threading.Event(), {}, []

            def sink(rid):
                def put(ev):
                    if isinstance(ev, Finished):
                        results[rid] = ev.result.token_ids
                    elif isinstance(ev, Failed):
                        errors.append(ev.error)
                    if len(results) + len(errors) == len(preps):
                        done.set()

                return put

            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            eng.step_log.clear()
            t0 = time.perf_counter()
            now = time.monotonic()
            with eng._wake:  # the batch arrives at once (as HF gets it): admitted in one step
                for p in preps:
                    eng.submit(dataclasses.replace(p, arrived=now), sink(p.request.request_id))
            if not done.wait(600):
                raise TimeoutError(f"{run}: the engine did not finish")
            ms = (time.perf_counter() - t0) * 1e3
            if errors:
                raise errors[0]
            steps[run].extend(eng.step_log)
            return ms, results

        steps: dict[str, list] = {run: [] for run in RUNS}

        # Runs interleaved rep by rep (base, merged, ..., base, merged, ...): drift of the machine
        # (clocks, heat, neighbours) falls on every run alike, so their ratios hold within a run.
        runs = [run for run in RUNS if run == "base" or names]
        gen: dict[str, list] = {run: [] for run in runs}
        pre: dict[str, list] = {run: [] for run in runs}

        def enter(run: str) -> None:  # the engine mode the run needs
            if run in ("merged", "mixture"):
                eng.set_mode(Mode.MERGED if run == "merged" else Mode.MIXTURE, names[0])
            elif eng.stats().merged_adapter:
                eng.set_mode(Mode.UNMERGED)

        for rep in range(args.warmup + args.reps):
            for run in runs:
                enter(run)
                ms_gen, tokens = batch_ms(run, args.new_tokens, rep)
                ms_pre, _ = batch_ms(run, 1, rep + 100)
                if rep == 0:  # the peer's rep 0 has the same images: compare tokens and logits on it
                    order = sorted(tokens, key=lambda k: int(k.rsplit("-", 1)[1]))
                    detail["tokens"][run] = [tokens[k] for k in order]
                    detail["first_logits"][run] = torch.stack([first_logits.pop(k) for k in order])
                    first_logits.clear()
                if rep >= args.warmup:
                    gen[run].append(ms_gen)
                    pre[run].append(ms_pre)
        for run in runs:
            rows.append(
                {
                    "impl": "valora",
                    "run": run,
                    "generate_ms": statistics.median(gen[run]),
                    "prefill_ms": statistics.median(pre[run]),
                }
            )
            pre_steps = [ms for p, d, ms in steps[run] if p and not d]
            dec_steps = [ms for p, d, ms in steps[run] if d and not p]
            detail.setdefault("step_ms", {})[run] = {
                "prefill_median": statistics.median(pre_steps) if pre_steps else None,
                "decode_median": statistics.median(dec_steps) if dec_steps else None,
                "decode_steps": len(dec_steps),
            }
            detail.setdefault("generate_ms_reps", {})[run] = gen[run]
            print(
                f"valora  {run:15s} generate {rows[-1]['generate_ms']:9.1f} ms  "
                f"prefill {rows[-1]['prefill_ms']:8.1f} ms",
                flush=True,
            )
        if args.profile:
            detail["profile"] = profile(eng, args, enter, batch_ms)
        detail["decode_graphs"] = {
            "captures": eng.graphs.captures,
            "replays": eng.graphs.replays,
            "static_steps": eng.graphs.static_steps,
            "eager_steps": eng.graphs.eager_steps,
        }
        detail["peak_decode_rows"] = eng.decoder.peak_rows
        detail["fused_layers"] = cfg.fused_layers
        detail["pipeline_decode"] = cfg.pipeline_decode
        detail["lora_fold_rows"] = cfg.lora_fold_rows
        detail["gc_freeze"] = not args.no_gc_freeze
        detail["kv_cache_bytes"] = cfg.kv_cache_bytes
        detail["tp"] = args.tp
        if eng.runtime.backend is not None:
            detail["folded_calls"] = eng.runtime.backend.folded_calls  # projections run with the shrink folded
        detail["pipelined_steps"] = eng.decoder.pipelined_steps  # decode steps launched from device tokens
        detail["peak_decode_entries"] = eng.decoder.peak_entries
    finally:
        eng.stop()
        eng = None  # drop the engine before gc.collect/empty_cache (not `del`: batch_ms/enter close over it)
        gc.unfreeze()
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows, detail


def profile(eng, args, enter, batch_ms) -> dict:
    """Batches under torch.profiler (every device kernel, the engine thread's included; on CPU only
    this thread's ops), for each run of --profile: one
    generate and one prefill (1 new token). Writes the first run's top ops by device and host time
    (<name>.profile.txt) and every profile's device time per kernel (host time per op on CPU; <name>.kernels.json: the
    difference between two runs' tables is where one costs more than the other)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    on_cuda = args.device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    kernels: dict[str, dict] = {}
    text = ""
    for run in args.profile.split(","):
        enter(run)
        for what, new_tokens in (("generate", args.new_tokens), ("prefill", 1)):
            with torch_profile(activities=acts) as prof:
                batch_ms(run, new_tokens, 999)
            ka = prof.key_averages()
            own = (lambda e: e.self_device_time_total) if on_cuda else (lambda e: e.self_cpu_time_total)
            kernels[f"{run}/{what}"] = {e.key: {"calls": e.count, "us": round(own(e), 1)} for e in ka if own(e) > 0}
            if not text:
                text = ka.table(sort_by="self_cuda_time_total" if on_cuda else "self_cpu_time_total", row_limit=40)
                text += "\n" + ka.table(sort_by="self_cpu_time_total", row_limit=30)
    name = args.name or "engine"
    table = args.out_dir / f"{name}.profile.txt"
    table.write_text(text)
    return {"table": str(table), "kernels": [str(p) for p in write_json(f"{name}.kernels", kernels, args.out_dir)]}


# -- HF transformers + PEFT -------------------------------------------------------------------


def run_hf_peft(args, model_dir: Path, bundles: dict, load_format: str, tmp: Path) -> tuple[list[dict], dict]:
    from peft import PeftModel

    dtype = getattr(torch, args.dtype)
    names = list(bundles)
    processor = load_processor(model_dir)
    model = load_model(model_dir, args.device, dtype, load_format)
    detail = {"tokens": {}, "first_logits": {}}
    rows = []

    def inputs(rep: int):
        texts = [family_chat_text(processor, PROMPT, 1)] * args.batch
        enc = processor(images=images(args.batch, args.image, rep), text=texts, padding=True, return_tensors="pt")
        return enc.to(args.device)

    def timed(fn, rep: int, new_tokens: int) -> tuple[float, torch.Tensor, torch.Tensor | None]:
        enc = inputs(rep)
        extra = dict(output_logits=True, return_dict_in_generate=True) if rep == 0 else {}
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = fn(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **extra)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        first = out.logits[0].float().cpu() if extra else None  # raw logits of the first new token
        seqs = out.sequences if extra else out
        return ms, seqs[:, enc["input_ids"].shape[1] :], first

    def measure(run: str, fn) -> None:
        gen, pre = [], []
        for rep in range(args.warmup + args.peer_reps):
            ms_gen, out, first = timed(fn, rep, args.new_tokens)
            ms_pre, _, _ = timed(fn, rep + 100, 1)
            if rep == 0:
                detail["tokens"][run] = out.tolist()
                detail["first_logits"][run] = first
            if rep >= args.warmup:
                gen.append(ms_gen)
                pre.append(ms_pre)
        rows.append(
            {"impl": "hf_peft", "run": run, "generate_ms": statistics.median(gen), "prefill_ms": statistics.median(pre)}
        )
        print(
            f"hf_peft {run:15s} generate {rows[-1]['generate_ms']:9.1f} ms  prefill {rows[-1]['prefill_ms']:8.1f} ms",
            flush=True,
        )

    freeze_heap(args)
    measure("base", model.generate)
    if names:
        peft = PeftModel.from_pretrained(model, write_peft_dir(bundles[names[0]], tmp / "a0"), adapter_name="a0")
        for i, name in enumerate(names[1:], 1):
            peft.load_adapter(str(write_peft_dir(bundles[name], tmp / f"a{i}")), adapter_name=f"a{i}")
        peft.eval()
        peft.set_adapter("a0")
        peft.merge_adapter()
        freeze_heap(args)
        measure("merged", peft.generate)
        peft.unmerge_adapter()
        measure("unmerged_one", peft.generate)
        mixed = [f"a{i % len(names)}" for i in range(args.batch)]
        measure("unmerged_mixed", lambda **kw: peft.generate(**kw, adapter_names=mixed))
        del peft
    del model
    gc.unfreeze()
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows, detail


def run_valora_tp(args, model_dir: Path, bundles: dict, load_format: str) -> tuple[list[dict], dict]:
    """run_valora on rank 0 of a tensor-parallel group of --tp ranks (one process each: gloo on
    CPU, NCCL on cuda:0..tp-1); rows carry "tp"."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from services.worker.tensor_parallel import free_loopback_port

    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on the lent hosts; the ranks inherit it
    port = free_loopback_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=tp_follower, args=(r, args, port, model_dir, load_format, len(bundles)), daemon=True)
        for r in range(1, args.tp)
    ]
    for p in procs:
        p.start()
    try:
        tp = join_tp_group(args, 0, port)
        try:
            rows, detail = run_valora(args, model_dir, bundles, load_format, tp)
            for p in procs:  # the followers leave first: rank 0 hosts the group's store
                p.join(600)
        finally:
            dist.destroy_process_group()
        if failed := [(r, p.exitcode) for r, p in enumerate(procs, 1) if p.exitcode != 0]:
            raise RuntimeError(f"tensor-parallel followers failed (rank, exit code): {failed}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return [{**r, "tp": args.tp} for r in rows], detail


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--arch",
        default="qwen2-vl-7b",
        help="qwen2-vl-7b | qwen2-vl-2b | qwen2-vl-13b-like | "
        "qwen2.5-vl-7b | llava-1.5-7b (random weights) | tiny (Qwen2-VL's) | qwen2.5-vl | llava-1.5 "
        "(that family's tiny model)",
    )
    ap.add_argument("--model-dir", type=Path, default=None, help="default: ~/.cache/valora/<arch>")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--image", type=int, default=448)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapter-std", type=float, default=0.01, help="std of the random LoRA A and B entries")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--peer-reps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks of the engine (one process each; "
        "the peer is skipped): cuda:0..tp-1, or gloo on CPU",
    )
    ap.add_argument("--decode-graphs", default="auto", choices=("auto", "static", "off"))
    ap.add_argument("--no-fused-layers", action="store_true", help="HF's decoder layers (A/B of fused_layers.py)")
    ap.add_argument("--no-pipeline", action="store_true", help="serial decode steps (A/B of pipelined decode)")
    ap.add_argument(
        "--no-lora-fold", action="store_true", help="shrink kernels, no folded A rows (A/B of lora_fold_rows)"
    )
    ap.add_argument(
        "--kv-cache-gib", type=float, default=8.0, help="the engine's paged KV pool (the HF peer shares the device)"
    )
    ap.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="leave the loaded models in the cyclic GC's generations (A/B of the served processes' gc.freeze)",
    )
    ap.add_argument("--profile", default="", help="also profile these runs (comma-separated, e.g. base,unmerged_mixed)")
    ap.add_argument("--name", default=None, help="results file stem (default engine-<date>)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.tp > 1:
        args.skip_peer = True  # HF + PEFT runs on one device
    if unknown := [r for r in args.profile.split(",") if r and r not in RUNS]:
        ap.error(f"--profile: unknown runs {unknown} (runs: {', '.join(RUNS)})")

    model_dir = args.model_dir or Path(f"~/.cache/valora/{args.arch}").expanduser()
    if args.arch == "tiny" or args.arch in FAMILIES:
        ensure_tiny_model(model_dir, "qwen2-vl" if args.arch == "tiny" else args.arch)
        load_format = "auto"
    else:
        ensure_shape_model(model_dir, args.arch)
        load_format = "dummy"
    dtype = getattr(torch, args.dtype)
    bundles = {
        f"adapters/bench{i}/versions/1": random_adapter_bundle(
            model_dir, rank=args.rank, lora_alpha=args.rank, seed=i, std=args.adapter_std, dtype=dtype
        )
        for i in range(args.adapters)
    }
    rows, detail = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_peer:
            peer_rows, detail["hf_peft"] = run_hf_peft(args, model_dir, bundles, load_format, Path(tmp))
            rows += peer_rows
        ours, detail["valora"] = (run_valora_tp if args.tp > 1 else run_valora)(args, model_dir, bundles, load_format)
        rows += ours
    if not args.skip_peer:  # same greedy tokens as the peer? (bf16 near-ties may differ; reported, not asserted)
        for run, toks in detail["hf_peft"]["tokens"].items():
            mine = detail["valora"]["tokens"].get(run)
            if mine:
                same = sum(a == b for x, y in zip(mine, toks) for a, b in zip(x, y))
                detail.setdefault("token_agreement", {})[run] = same / max(1, sum(len(x) for x in toks))
        for run, want in detail["hf_peft"]["first_logits"].items():
            got = detail["valora"]["first_logits"].get(run)
            if got is not None:
                base = detail["hf_peft"]["first_logits"]["base"]
                detail.setdefault("first_token_logits", {})[run] = {
                    "relerr": float((got - want).norm() / want.norm()),
                    "top1_agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
                    # how far the adapters move the logits at all (what a wrong adapter would cost)
                    "relerr_vs_peer_base": float((got - base).norm() / base.norm()),
                }
    for d in detail.values():
        if isinstance(d, dict):
            d.pop("first_logits", None)  # tensors; their comparison is in first_token_logits
            # rep 0's greedy tokens per run (checks across runs: --tp N against one process)
    name = args.name or f"engine-{time.strftime('%Y-%m-%d')}"
    workload = {
        k: getattr(args, k)
        for k in (
            "arch",
            "device",
            "dtype",
            "batch",
            "image",
            "new_tokens",
            "adapters",
            "rank",
            "adapter_std",
            "reps",
            "peer_reps",
            "warmup",
            "decode_graphs",
            "tp",
        )
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out_dir / f"{name}.detail.json").write_text(
        json.dumps({"info": run_info(), "workload": workload, **detail}, indent=1, default=str) + "\n"
    )
    base = next((r for r in rows if r["impl"] == "valora" and r["run"] == "base"), None)
    peer_mixed = next((r for r in rows if r["impl"] == "hf_peft" and r["run"] == "unmerged_mixed"), None)
    for r in rows:
        if r["impl"] == "valora" and base:
            extra = f"  x{r['generate_ms'] / base['generate_ms']:.2f} of base"
            if peer_mixed and r["run"] == "unmerged_mixed":
                extra += f", {peer_mixed['generate_ms'] / r['generate_ms']:.1f}x faster than HF+PEFT mixed"
            print(f"{r['run']:15s}{extra}")
    print(f"wrote {args.out_dir / f'{name}.json'}")
    return rows


if __name__ == "__main__":
    if any(r.get("tp", 1) > 1 for r in main()):
        exit_rank()  # results written: skip the interpreter's teardown of gloo/NCCL state (see exit_rank)
