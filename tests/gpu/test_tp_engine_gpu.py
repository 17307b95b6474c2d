"""The tensor-parallel engine on 2 GPUs (NCCL on cuda:0 and cuda:1, gloo beside it for the step
events), against one process on cuda:0:
- fp32: the CPU test's scenario (tests/unit/test_tp_engine.py — images, mixed adapters,
  merged/mixture switches mid-decode, cancellation, an expired request, late arrivals) gives the
  same greedy tokens and finish reasons, and both ranks run the same steps;
- bf16 with mixed adapters on ATMM: decode steps are captured as CUDA graphs with the ranks'
  all-reduces inside, replayed and pipelined, and the tokens agree with one GPU's (bf16 greedy
  tokens may flip at near-ties: the all-reduce sums in another order)."""

from __future__ import annotations

import faulthandler
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.worker import tensor_parallel as tpm
from services.worker.engine import Engine
from tests.gpu.test_decode_graphs_gpu import A, B, config, run
from tests.unit.test_tp_engine import check_tp2_against_single_process

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices", allow_module_level=True)

os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on the lent hosts; the ranks inherit it
ADAPTERS = [None, A, B, A, B, A]


def test_tp2_engine_on_two_gpus_matches_one_gpu(model_path, tmp_path):
    check_tp2_against_single_process(model_path, tmp_path, "cuda")


def _bf16_rank(rank: int, world: int, port: int, model_path: str, out_dir: str) -> None:
    faulthandler.dump_traceback_later(120, exit=True)  # a rank stuck in a collective: its stacks, then exit
    device = f"cuda:{rank}"
    tp = tpm.init_tp_group(rank, world, port, device=torch.device(device), timeout_s=120)
    try:
        if rank == 0:
            tokens, eng = run(Path(model_path), "bfloat16", "auto", ADAPTERS, tp=tp, device=device)
        else:
            eng = Engine(config(Path(model_path), "bfloat16", "auto", tp=tp, device=device))
            eng.eos_ids = set()  # as rank 0's: the ranks must stop rows alike
            eng.start()
            eng.stop(timeout=300)  # returns once rank 0's stop reached this rank's loop
            tokens = None
        assert eng._error is None
        summary = {
            "tokens": tokens,
            "backend": eng.runtime.backend is not None,
            "captures": eng.graphs.captures,
            "replays": eng.graphs.replays,
            "pipelined": eng.decoder.pipelined_steps,
            "steps": [list(x[:2]) for x in eng.step_log],
        }
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(summary))
    finally:
        dist.destroy_process_group()


def test_bf16_tp2_decode_graphs_with_nccl_inside(model_path, tmp_path):
    mp.spawn(_bf16_rank, args=(2, tpm.free_loopback_port(), str(model_path), str(tmp_path)), nprocs=2, join=True)
    lead, follower = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert lead["steps"] == follower["steps"]
    for rank in (lead, follower):
        assert rank["backend"]  # LoRA on ATMM, inside the graphs
        assert rank["captures"] >= 1 and rank["replays"] >= 10 and rank["pipelined"] > 0
    one_gpu, _ = run(model_path, "bfloat16", "auto", ADAPTERS)
    same = sum(a == b for k in one_gpu for a, b in zip(one_gpu[k], lead["tokens"][k]))
    assert same / sum(len(v) for v in one_gpu.values()) >= 0.9
