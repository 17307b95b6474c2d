"""bench.prefill_host_bench's inputs: the padded rows SDPA reads and the packed, paged rows our
kernel reads hold the same attention (the bench itself needs CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.prefill_host_bench import Step, parse_args
from kernels.paged_prefill import paged_prefill_attention_reference
from services.worker.attention import use_shape_free_sdpa


def test_padded_and_paged_rows_attend_alike():
    args = parse_args(["--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--block-size", "8"])
    s = Step([13, 29, 20], args, torch.device("cpu"))
    padded = F.scaled_dot_product_attention(s.pq.float(), s.pk.float(), s.pv.float(), is_causal=True, enable_gqa=True)
    ref = paged_prefill_attention_reference(
        s.q.float(), s.k_pool.float(), s.v_pool.float(), s.tables, s.cu_q, s.seq_lens, None
    )
    torch.testing.assert_close(s.unpad(padded), ref, rtol=1e-4, atol=1e-4)
    repeated = F.scaled_dot_product_attention(s.pq.float(), s.rk.float(), s.rv.float(), is_causal=True)
    torch.testing.assert_close(s.unpad(repeated), ref, rtol=1e-4, atol=1e-4)


def test_shape_free_sdpa_leaves_a_cpu_process_alone():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    assert use_shape_free_sdpa("cpu") is False
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
