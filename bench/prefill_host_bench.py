"""Host cost of prefill attention as the engine calls it: eagerly, one call per layer, with a new
padded width at every prefill (prompts differ), µs per call on the host and on the device.

A served worker's py-spy profile put 27% of the engine thread's time inside the language model's
prefill SDPA calls (bench/results/h200-serve-b463e4e/worker-pyspy-summary.txt), ~1.4 ms a call,
where the kernel itself needs well under 0.1 ms: the cost is on the host, and depends on what
SDPA does with a shape it has not seen. This bench separates the candidates:

    sdpa_gqa[_BACKEND]   HF's path: padded (rows, H, W, D) queries, (rows, KVH, W, D) K/V,
                         is_causal, enable_gqa; the default backend choice or one forced
                         (flash, efficient, cudnn, math)
    sdpa_repeat_kv       K/V heads repeated to H first (no enable_gqa), default backend
    paged_varlen         ours (kernels/paged_prefill.py): the rows packed without padding, K/V
                         read through block tables of a paged pool

    sdpa_gqa_nocudnn     HF's path with torch's cuDNN backend turned off process-wide
                         (torch.backends.cuda.enable_cudnn_sdp(False), what the engine does)

Each case runs `--layers` calls back to back (a prefill step's layers) `--steps` times; "vary"
draws new row lengths every step (every width new; each method its own widths, so no method
meets a shape another one has seen), "fixed" repeats one. Rows: host µs a call
(time.perf_counter around the calls, no sync), device µs a call (CUDA events around the steps:
wall time on the device's clock), and the median and slowest step's host ms. Outputs are checked
against the torch reference of the paged kernel first.

    python -m bench.prefill_host_bench     # bench/results/prefill-host-<commit>.json (+ $OUT)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from bench.common import save
from kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_reference
from kernels.results import git_commit

BACKENDS = ("flash", "efficient", "cudnn", "math")
TOL = 3e-2  # bf16 outputs against the fp32-softmax reference


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2, help="requests in one prefill forward")
    p.add_argument("--min-len", type=int, default=420)
    p.add_argument("--max-len", type=int, default=1000)
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--name", default=None)
    return p.parse_args(argv)


def _kernel(backend: str | None):
    if backend is None:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        {
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "math": SDPBackend.MATH,
        }[backend]
    )


class Step:
    """One prefill step's inputs: `lens` rows, padded (sdpa) and packed + paged (ours)."""

    def __init__(self, lens: list[int], args: argparse.Namespace, dev: torch.device) -> None:
        h, kvh, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
        self.lens, width, total = lens, max(lens), sum(lens)
        g = torch.Generator(device=dev).manual_seed(sum(lens))
        self.q = torch.randn(total, h, d, device=dev, dtype=torch.bfloat16, generator=g)
        self.k = torch.randn(total, kvh, d, device=dev, dtype=torch.bfloat16, generator=g)
        self.v = torch.randn(total, kvh, d, device=dev, dtype=torch.bfloat16, generator=g)
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        self.cu_q = torch.tensor(starts, dtype=torch.int32, device=dev)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        self.pq = torch.zeros(len(lens), h, width, d, device=dev, dtype=torch.bfloat16)  # padded, right
        self.pk = torch.zeros(len(lens), kvh, width, d, device=dev, dtype=torch.bfloat16)
        self.pv = torch.zeros_like(self.pk)
        for i, n in enumerate(lens):
            a = starts[i]
            self.pq[i, :, :n] = self.q[a : a + n].transpose(0, 1)
            self.pk[i, :, :n] = self.k[a : a + n].transpose(0, 1)
            self.pv[i, :, :n] = self.v[a : a + n].transpose(0, 1)
        self.rk, self.rv = (x.repeat_interleave(h // kvh, dim=1) for x in (self.pk, self.pv))
        need = [-(-n // bs) for n in lens]
        pages = list(range(sum(need)))
        random.Random(total).shuffle(pages)  # a fragmented pool
        tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
        slots, at = [], 0
        for i, n in enumerate(lens):
            tables[i, : need[i]] = torch.tensor(pages[at : at + need[i]])
            at += need[i]
            slots += [int(tables[i, t // bs]) * bs + t % bs for t in range(n)]
        self.tables = tables.to(dev)
        self.k_pool = torch.zeros(sum(need) * bs, kvh, d, device=dev, dtype=torch.bfloat16)
        self.v_pool = torch.zeros_like(self.k_pool)
        idx = torch.tensor(slots, device=dev)
        self.k_pool[idx], self.v_pool[idx] = self.k, self.v
        self.k_pool = self.k_pool.view(sum(need), bs, kvh, d)
        self.v_pool = self.v_pool.view(sum(need), bs, kvh, d)

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        """(rows, H, W, D) padded output -> (T, H, D) packed."""
        return torch.cat([out[i, :, :n].transpose(0, 1) for i, n in enumerate(self.lens)])


def methods(args: argparse.Namespace) -> dict:
    def sdpa(backend):
        def call(s: Step):
            with _kernel(backend):
                return F.scaled_dot_product_attention(s.pq, s.pk, s.pv, is_causal=True, enable_gqa=True)

        return call

    def nocudnn(s: Step):
        was = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(False)
        try:
            return F.scaled_dot_product_attention(s.pq, s.pk, s.pv, is_causal=True, enable_gqa=True)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(was)

    out = {"sdpa_gqa": sdpa(None), **{f"sdpa_gqa_{b}": sdpa(b) for b in BACKENDS}, "sdpa_gqa_nocudnn": nocudnn}
    out["sdpa_repeat_kv"] = lambda s: F.scaled_dot_product_attention(s.pq, s.rk, s.rv, is_causal=True)
    out["paged_varlen"] = lambda s: paged_prefill_attention(s.q, s.k_pool, s.v_pool, s.tables, s.cu_q, s.seq_lens, None)
    return out


def run(name: str, fn, steps: list[Step], layers: int) -> dict:
    first = steps[0]
    try:
        got = fn(first)
    except RuntimeError as exc:  # a forced backend that refuses the shape
        return {"method": name, "ok": False, "error": str(exc).splitlines()[0][:200]}
    got = got if got.dim() == 3 else first.unpad(got)
    ref = paged_prefill_attention_reference(
        first.q, first.k_pool, first.v_pool, first.tables, first.cu_q, first.seq_lens, None
    )
    err = (got.float() - ref.float()).abs().max().item()
    row = {"method": name, "ok": err <= TOL, "max_abs_err": err}
    if not row["ok"]:
        return row
    for s in steps[:2]:
        fn(s)  # warm-up (compiles, first-shape work)
    torch.cuda.synchronize()
    times, start, end = [], torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for s in steps[2:]:
        t = time.perf_counter()
        for _ in range(layers):
            fn(s)
        times.append(time.perf_counter() - t)
    end.record()
    torch.cuda.synchronize()
    calls = layers * (len(steps) - 2)
    row.update(
        host_us=round(sum(times) / calls * 1e6, 1),
        device_us=round(start.elapsed_time(end) / calls * 1e3, 1),
        step_host_ms_median=round(statistics.median(times) * 1e3, 2),
        step_host_ms_max=round(max(times) * 1e3, 2),
    )
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    rows, seen = [], set()
    for m, (name, fn) in enumerate(methods(args).items()):
        rnd = random.Random(m)
        widths = []
        while len(widths) < args.steps + 2:  # lengths no earlier method has run (SDPA caches per shape)
            lens = tuple(sorted(rnd.randint(args.min_len, args.max_len) for _ in range(args.rows)))
            if lens not in seen or args.min_len == args.max_len:
                seen.add(lens)
                widths.append(list(lens))
        vary = [Step(lens, args, dev) for lens in widths]
        for case, steps in (("vary", vary), ("fixed", [vary[0]] * len(vary))):
            row = {"case": case, **run(name, fn, steps, args.layers)}
            rows.append(row)
            print(
                f"{case:5} {name:20} host {row.get('host_us', '-'):>8} µs  device {row.get('device_us', '-'):>8} µs"
                f"  step ms median {row.get('step_host_ms_median', '-')} max {row.get('step_host_ms_max', '-')}"
                f"  {'' if row['ok'] else row.get('error', 'WRONG ' + str(row.get('max_abs_err')))}",
                flush=True,
            )
        del vary
        torch.cuda.empty_cache()
    commit = git_commit()
    save(
        args.name or f"prefill-host-{commit}",
        {
            "bench": "prefill_host",
            "commit": commit,
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "config": vars(args),
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
