"""The tensor-parallel engine on 2 GPUs (NCCL, decode steps as CUDA graphs with the all-reduces
captured inside): the CPU test's scenario (tests/unit/test_tp_engine.py — images, mixed adapters,
merged/mixture switches mid-decode, cancellation, an expired request, late arrivals) on cuda:0 and
cuda:1 gives the greedy tokens and finish reasons of one process on cuda:0, and both ranks run the
same steps (tiny Qwen2-VL, fp32)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.unit.test_tp_engine import check_tp2_against_single_process

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices", allow_module_level=True)

os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on the lent hosts; the ranks inherit it


def test_tp2_engine_on_two_gpus_matches_one_gpu(model_path, tmp_path):
    check_tp2_against_single_process(model_path, tmp_path, "cuda")
