"""The engine at the Qwen2-VL-7B shape on the GPU (random weights, bf16): for each mode the first
token's logits of every request match HF transformers + PEFT on the same weights and inputs
(merged, one adapter unmerged, 8 adapters mixed on ATMM), run through the §3 benchmark harness on
a small batch."""

import json

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def test_7b_engine_first_token_logits_match_peft(tmp_path):
    from bench import engine_bench
    from services.worker.atmm_backend import AtmmBackend

    if not AtmmBackend.available(torch.device("cuda"), torch.bfloat16):
        pytest.skip("the kernels extension is not built here")
    engine_bench.main(["--batch", "4", "--adapters", "2", "--new-tokens", "2", "--reps", "1", "--peer-reps", "1",
                       "--warmup", "0", "--adapter-std", "0.03", "--out-dir", str(tmp_path), "--name", "e7b"])
    detail = json.loads((tmp_path / "e7b.detail.json").read_text())
    assert detail["valora"]["op"] == "atmm"
    cmp = detail["first_token_logits"]
    assert set(cmp) == {"base", "merged", "unmerged_one", "unmerged_mixed"}
    for run, c in cmp.items():
        assert c["relerr"] < 3e-2, (run, c)  # bf16 through 28 layers
        if run != "base":  # the adapters move the logits far more than the engine differs from PEFT
            assert c["relerr"] < 0.25 * c["relerr_vs_peer_base"], (run, c)
