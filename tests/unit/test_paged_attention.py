"""kernels.paged_attention on CPU: the torch reference vs a naive per-token computation on fresh
random inputs (B 1..5, lengths 1..100, block sizes 8/16, GQA groups 1/2/4/7, shuffled page
tables, garbage in the unused table slots), the CPU dispatch and the input checks; and, when
triton is installed, the Triton kernels themselves under the Triton interpreter (a subprocess:
TRITON_INTERPRET=1 must be set before triton is imported). fp32 and fp16 there: the interpreter's
tl.dot is wrong for bf16 (triton 3.9), bf16 is covered by tests/gpu/test_paged_attention_gpu.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.paged_attention import default_num_splits, paged_decode_attention, paged_decode_attention_reference

REPO = Path(__file__).resolve().parents[2]


def make_case(seed, lens, block_size, kv_heads, group, head_dim, dtype=torch.float32, spare=5, garbage="random"):
    """A pool with every row's pages at shuffled places (plus spare pages), tables whose slots past
    a row's length hold `garbage` ("random" valid ids or "zero")."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + spare
    order = list(range(num_blocks))
    rnd.shuffle(order)
    max_blocks = max(need + [1]) + rnd.randrange(3)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(order[at : at + n], dtype=torch.int32)
        at += n
        if garbage == "random":
            tables[i, n:] = torch.randint(0, num_blocks, (max_blocks - n,), generator=g, dtype=torch.int32)
    heads = kv_heads * group
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


def naive(q, k_cache, v_cache, tables, lens, scale):
    """Token by token, head by head: the definition, fp64."""
    b, h, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(b, h, d, dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        if n == 0:
            continue
        ks = torch.stack([k_cache[int(tables[i, t // bs]), t % bs] for t in range(n)]).double()  # (n, KVH, D)
        vs = torch.stack([v_cache[int(tables[i, t // bs]), t % bs] for t in range(n)]).double()
        for j in range(h):
            kv = j // (h // kvh)
            s = ks[:, kv] @ q[i, j].double() * scale
            p = torch.exp(s - s.max())
            out[i, j] = (p / p.sum()) @ vs[:, kv]
    return out


def random_cases(count, seed=0):
    rnd = random.Random(seed)
    for c in range(count):
        b = rnd.randint(1, 5)
        yield {
            "seed": seed * 1000 + c,
            "lens": [rnd.randint(1, 100) for _ in range(b)],
            "block_size": rnd.choice([8, 16]),
            "kv_heads": rnd.choice([1, 2]),
            "group": rnd.choice([1, 2, 4, 7]),
            "head_dim": rnd.choice([16, 32]),
            "garbage": rnd.choice(["random", "zero"]),
        }


@pytest.mark.parametrize("seed", range(4))
def test_reference_matches_naive(seed):
    for case in random_cases(6, seed):
        q, k, v, bt, lens = make_case(**case)
        scale = q.shape[-1] ** -0.5
        got = paged_decode_attention_reference(q, k, v, bt, lens, scale)
        want = naive(q, k, v, bt, lens, scale)
        assert got.dtype == q.dtype and got.shape == q.shape
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5, msg=str(case))


def test_reference_bf16_within_one_rounding():
    q, k, v, bt, lens = make_case(7, [37, 100, 1], 16, 4, 7, 32, dtype=torch.bfloat16)
    got = paged_decode_attention_reference(q, k, v, bt, lens, 0.125)
    want = naive(q, k, v, bt, lens, 0.125)
    assert got.dtype == torch.bfloat16
    assert torch.all((got.double() - want).abs() <= want.abs() * 2**-7 + 1e-6)  # one bf16 ulp


def test_zero_length_row_is_zero():
    q, k, v, bt, lens = make_case(3, [5, 0, 9], 8, 2, 2, 16)
    out = paged_decode_attention_reference(q, k, v, bt, lens, 0.25)
    assert torch.all(out[1] == 0)
    torch.testing.assert_close(out.double(), naive(q, k, v, bt, lens, 0.25), atol=2e-6, rtol=1e-5)


def test_cpu_dispatch_is_the_reference_and_fills_out():
    q, k, v, bt, lens = make_case(11, [3, 64, 17], 16, 2, 4, 32)
    ref = paged_decode_attention_reference(q, k, v, bt, lens, 0.2)
    assert torch.equal(paged_decode_attention(q, k, v, bt, lens, 0.2), ref)
    out = torch.full_like(q, float("nan"))
    assert paged_decode_attention(q, k, v, bt, lens, 0.2, out=out, num_splits=3) is out
    assert torch.equal(out, ref)


def test_default_num_splits_depends_on_shapes_only():
    assert default_num_splits(1, 1) == 16
    assert default_num_splits(8, 4) == 9
    assert default_num_splits(32, 4) == 3
    assert default_num_splits(64, 4) == 2
    assert default_num_splits(512, 4) == 1


@pytest.mark.parametrize("bad", ["heads", "block", "dtype", "tables", "lens", "out", "stride"])
def test_checks_reject_bad_inputs(bad):
    q, k, v, bt, lens = make_case(1, [4, 9], 8, 2, 2, 16)
    kw = {}
    if bad == "heads":
        q = q[:, :3]
    elif bad == "block":
        k = v = torch.zeros(4, 12, 2, 16)
    elif bad == "dtype":
        k = k.half()
    elif bad == "tables":
        bt = bt.long()
    elif bad == "lens":
        lens = lens[:1]
    elif bad == "out":
        kw["out"] = torch.empty(2, 4, 8)
    elif bad == "stride":
        q = torch.randn(2, 4, 32)[..., ::2]
    with pytest.raises((ValueError, TypeError)):
        paged_decode_attention(q, k, v, bt, lens, 0.25, **kw)


def block_major(k: torch.Tensor, v: torch.Tensor, layers: int = 3, layer: int = 1):
    """`k`, `v` (blocks, block_size, kv_heads, d) as layer `layer` of a block-major pool."""
    storage = torch.zeros((k.shape[0], layers, 2, *k.shape[1:]), dtype=k.dtype)
    storage[:, layer, 0], storage[:, layer, 1] = k, v
    return storage[:, layer, 0], storage[:, layer, 1]


# ---- the Triton kernels under the interpreter -------------------------------------------------

# (lens, block_size, kv_heads, group, head_dim, dtype, num_splits, tile)
INTERPRETER_CASES = [
    ([1, 100, 37], 16, 2, 7, 32, "float32", None, 64),  # default splits (16 at B*KVH = 6): empty splits
    ([64, 65, 3, 99, 8], 8, 1, 1, 16, "float32", 3, 16),  # MHA, tile 16 (2 pages a tile)
    ([100, 0, 50], 16, 2, 4, 64, "float32", 1, 64),  # one split: direct store; a zero-length row
    ([90, 12], 8, 1, 2, 128, "float16", 4, 32),
    ([77], 16, 1, 16, 16, "float32", 2, 64),  # group 16: GROUP_PAD exactly 16
    ([33, 100], 32, 2, 3, 32, "float32", 5, 16),  # tile smaller than a page
    ([100, 41], 8, 1, 20, 16, "float16", 2, 64),  # group 20 -> GROUP_PAD 32
]


def _interpreter_main() -> None:
    """Runs INTERPRETER_CASES through the Triton path (TRITON_INTERPRET=1 already set) and prints
    one JSON line per case: the max abs error against the reference and whether `out` was reused."""
    from kernels.paged_attention import paged_decode_attention_triton

    for i, (lens, bs, kvh, group, d, dtype, splits, tile) in enumerate(INTERPRETER_CASES):
        q, k, v, bt, lens_t = make_case(100 + i, lens, bs, kvh, group, d, dtype=getattr(torch, dtype))
        if i == 0:  # a strided q (a view into a wider projection output), last dim contiguous
            wide = torch.randn(q.shape[0], q.shape[1] + 3, d).to(q.dtype)
            wide[:, : q.shape[1]] = q
            q = wide[:, : q.shape[1]]
        if i == 1:  # the engine's strides: one layer of a block-major pool (KVPool.storage)
            k, v = block_major(k, v)
        scale = d**-0.5
        out = torch.full_like(q, float("nan")).contiguous()
        got = paged_decode_attention_triton(q, k, v, bt, lens_t, scale, out=out, num_splits=splits, tile=tile)
        want = paged_decode_attention_reference(q, k, v, bt, lens_t, scale)
        print(
            json.dumps(
                {
                    "case": i,
                    "err": (got.float() - want.float()).abs().max().item(),
                    "same_out": got is out,
                    "finite": bool(torch.isfinite(got).all()),
                }
            )
        )


needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (optional dependency)"
)


def interpreter_rows(test_file: str, cases: int) -> list[dict]:
    """Runs `test_file --interpret` with TRITON_INTERPRET=1 (it must be set before triton is
    imported: a subprocess) and returns the JSON line it printed for each of its `cases` cases."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, test_file, "--interpret"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in rows] == list(range(cases))
    return rows


@needs_triton
def test_triton_kernels_under_interpreter():
    for r in interpreter_rows(__file__, len(INTERPRETER_CASES)):
        dtype = INTERPRETER_CASES[r["case"]][5]
        assert r["same_out"] and r["finite"], r
        assert r["err"] < (2e-5 if dtype == "float32" else 2e-3), r


if __name__ == "__main__" and "--interpret" in sys.argv:
    _interpreter_main()


def check_self_check(monkeypatch, module, triton_name: str, reference, n_args: int) -> None:
    """`module.self_check` (the worker's start-up check) passes a kernel that agrees with the
    reference and reports one that disagrees or raises (build or launch failure); `triton_name`:
    the module's Triton entry point, replaced by the reference (its first `n_args` arguments)."""
    assert module.self_check("cpu", torch.float32, 4, 2, 16, 8) == "triton or CUDA is not available"
    monkeypatch.setattr(module, "available", lambda device: True)
    monkeypatch.setattr(module, triton_name, lambda *a, **kw: reference(*a[:n_args]))
    assert module.self_check("cpu", torch.float32, 4, 2, 16, 8) is None
    monkeypatch.setattr(module, triton_name, lambda *a, **kw: reference(*a[:n_args]) * 1.1)
    assert module.self_check("cpu", torch.float32, 4, 2, 16, 8).startswith("max error")

    def broken(*a, **kw):
        raise RuntimeError("PTX JIT compilation failed")

    monkeypatch.setattr(module, triton_name, broken)
    assert module.self_check("cpu", torch.float32, 4, 2, 16, 8) == "RuntimeError: PTX JIT compilation failed"


def test_self_check_reports_a_wrong_or_failing_kernel(monkeypatch):
    """The worker then serves on the reference."""
    from kernels import paged_attention as pa

    check_self_check(monkeypatch, pa, "paged_decode_attention_triton", pa.paged_decode_attention_reference, 6)
