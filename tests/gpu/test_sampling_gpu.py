"""The one-launch sampler (kernels/sampling.py) on CUDA against its torch reference on fresh
random rows of every kind (greedy, temperature, top-p, top-k, min-p, all at once) at Qwen2's
vocabulary and batch sizes of the served decode, bf16 and fp32 logits, and the start-up check."""

from __future__ import annotations

import pytest
import torch

from kernels import sampling

pytestmark = pytest.mark.gpu
if not sampling.available("cuda"):
    pytest.skip("needs CUDA and triton", allow_module_level=True)


@pytest.mark.parametrize(
    "rows,vocab,scale", [(110, 152064, 3.0), (7, 151936, 3.0), (3, 1000, 3.0), (64, 152064, 0.05)]
)  # nearly flat: long candidate walks
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tries", [sampling.WALK_TRIES, 1, 0])  # 0: the bisection alone
def test_kernel_tokens_equal_the_reference(rows, vocab, scale, dtype, tries):
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    case = sampling.random_case(g, rows, vocab, "cuda", dtype, scale)
    got = sampling.sample_tokens_triton(*case, tries=tries)
    want = sampling.sample_tokens_reference(*case)
    # exp/log may differ from torch's in the last bit: at most a row whose two best noisy scores tie
    assert int((got != want).sum()) <= 1, (got != want).nonzero().flatten().tolist()
    alone = torch.cat(
        [sampling.sample_tokens_triton(*(x[i : i + 1] for x in case), tries=tries) for i in range(min(rows, 8))]
    )
    assert torch.equal(alone, got[: len(alone)])  # a row draws as it does alone


def test_self_check_passes():
    assert sampling.self_check("cuda") is None
