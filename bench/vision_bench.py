"""The vision tower per image on the GPU: HF's forward vs services/worker/vision_tower.py eagerly and
replayed from its CUDA graph, host and device ms per image, at the workload's image sizes.

A served 7B worker's step trace put ~36 ms of device time in the vision inputs of a prefill step
of ~2.5 images (bench/results/h200-serve-4165520/steps-summary.json), about 3x what the tower's
FLOPs need: this bench times the tower alone, reports its TFLOP/s, the attention backend each
grid's capture chose (flash or cuDNN SDPA, each one's replay time), and ranks its kernels (one
eager forward under torch.profiler) to say where the device time goes.

Workload: the Qwen2-VL-7B vision tower (32 blocks, 1280 wide, 16 heads) with random weights,
bf16, one image of each --sizes (448: grid 32x32, 1024 patches; 644 from 640: 46x46, 2116), and
as many images of that size as one graph takes (16384 patches: 16 of 448, 4 of 644) in one replay.

    python -m bench.vision_bench          # bench/results/vision-<commit>.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import run_info, write_results
from services.worker.tiny_model import SHAPES, _build_config, _build_tokenizer
from services.worker.vision_tower import VisionTower


def grid_of(size: int) -> tuple[int, int, int]:
    side = round(size / 28) * 28 // 14  # the processor resizes to a multiple of patch x merge (28)
    return 1, side, side


def flops_per_image(vc, patches: int) -> float:
    """Matmul FLOPs of the tower for one image of `patches` patches (blocks + attention)."""
    d, mlp = vc.embed_dim, int(vc.embed_dim * vc.mlp_ratio)
    per_patch = 2 * d * (3 * d + d + 2 * mlp) * vc.depth
    attn = 4 * patches * patches * d * vc.depth
    return per_patch * patches + attn


def timed(fn, reps: int) -> tuple[float, float]:
    """(host ms, device ms) medians of one call."""
    host, dev = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        dev.append(a.elapsed_time(b))
    return statistics.median(host), statistics.median(dev)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[448, 640])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    torch.backends.cuda.enable_cudnn_sdp(False)  # as the engine (attention.use_shape_free_sdpa)
    dev = torch.device("cuda")
    config = _build_config(_build_tokenizer(), SHAPES["qwen2-vl-7b"])
    vc = config.vision_config
    vc._attn_implementation = "sdpa"
    torch.manual_seed(0)
    visual = Qwen2VisionTransformerPretrainedModel._from_config(vc).to(dev, torch.bfloat16).eval()
    tower = VisionTower(visual, dev, capture=True)
    rows, kernels = [], {}
    with torch.inference_mode():
        for size in args.sizes:
            grid = grid_of(size)
            n = grid[0] * grid[1] * grid[2]
            pixels = torch.randn(
                n, vc.in_channels * vc.temporal_patch_size * vc.patch_size**2, device=dev, dtype=torch.bfloat16
            )
            grid_t = torch.tensor([grid], device=dev)
            want = visual(pixels, grid_thw=grid_t).pooler_output
            entry = tower._entry(grid, 1)
            eager = tower._forward(pixels, grid, 1, entry)
            for _ in range(3):
                graphed = tower.encode(pixels, grid)
            err = (graphed.float() - want.float()).abs().max().item()
            err_eager = (eager.float() - want.float()).abs().max().item()
            flops = flops_per_image(vc, n)
            for method, fn in (
                ("hf", lambda: visual(pixels, grid_thw=grid_t)),
                ("tower_eager", lambda: tower._forward(pixels, grid, 1, entry)),
                ("tower_graph", lambda: tower.encode(pixels, grid)),
            ):
                for _ in range(2):
                    fn()
                host_ms, dev_ms = timed(fn, args.reps)
                rows.append(
                    {
                        "size": size,
                        "patches": n,
                        "method": method,
                        "host_ms": round(host_ms, 3),
                        "device_ms": round(dev_ms, 3),
                        "tflops": round(flops / dev_ms / 1e9, 1),
                        "max_abs_err_vs_hf": round(err if method == "tower_graph" else err_eager, 4),
                    }
                )
                if method == "tower_graph":  # the attention its capture measured fastest, and each one's time
                    rows[-1].update(attention=entry.attention, replay_ms_by_attention=entry.replay_ms)
                print(rows[-1])
            count = 1 << ((tower.max_graph_patches // n).bit_length() - 1) if n <= tower.max_graph_patches // 2 else 1
            if count > 1:  # `count` images of this size in one replay (encode_items' batches), ms per image
                many = pixels.repeat(count, 1)
                for _ in range(3):
                    tower.encode(many, grid, count)
                host_ms, dev_ms = timed(lambda: tower.encode(many, grid, count), args.reps)
                rows.append(
                    {
                        "size": size,
                        "patches": n,
                        "method": f"tower_graph_x{count}",
                        "images": count,
                        "host_ms": round(host_ms / count, 3),
                        "device_ms": round(dev_ms / count, 3),
                        "tflops": round(flops * count / dev_ms / 1e9, 1),
                        "attention": tower.entries[(grid, count)].attention,
                    }
                )
                print(rows[-1])
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                tower._forward(pixels, grid, 1, entry)
                torch.cuda.synchronize()
            table = sorted(
                ((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()), key=lambda r: -r[1]
            )[:15]
            kernels[str(size)] = [{"kernel": k[:110], "ms": round(ms, 3), "calls": c} for k, ms, c in table]
            for k in kernels[str(size)]:
                print(f"  {k['ms']:8.3f} ms {k['calls']:5d}x  {k['kernel']}")
    name = f"vision-{args.name or run_info()['git_commit']}"
    print(
        write_results(
            name,
            {
                "config": {**vars(args), "workload": "qwen2-vl-7b vision tower, bf16, one image"},
                "rows": rows,
                "kernels": kernels,
            },
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
