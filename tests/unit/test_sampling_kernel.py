"""kernels.sampling on CPU: the reference's kept sets against their definitions (the sorted
distribution's smallest prefix reaching top_p, the k largest, min-p's share of the most likely),
ties at a threshold kept whole, and, when triton is installed, the one-launch Triton kernel under
the Triton interpreter (a subprocess: TRITON_INTERPRET=1 must be set before triton is imported)
giving the reference's tokens on fresh random rows of every kind. On CUDA:
tests/gpu/test_sampling_gpu.py."""

from __future__ import annotations

import json
import sys

import torch

from kernels.sampling import _kept_reference, random_case, sample_tokens, sample_tokens_reference
from tests.unit.test_paged_attention import interpreter_rows, needs_triton


def _sorted_definition(scores: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """The kept set by sorting one row of distinct scores: the smallest prefix whose mass reaches
    top_p, cut at k."""
    order = torch.argsort(scores, descending=True)
    probs = torch.softmax(scores, -1)[order]
    keep_sorted = torch.ones_like(probs, dtype=torch.bool)
    if 0 < top_p < 1:
        keep_sorted &= (torch.cumsum(probs, 0) - probs) <= top_p
    if top_k > 0:
        keep_sorted &= torch.arange(len(probs)) < top_k
    keep = torch.zeros_like(keep_sorted)
    keep[order] = keep_sorted
    return keep


def test_kept_sets_match_the_sorted_definition_on_distinct_scores():
    g = torch.Generator().manual_seed(3)
    for trial in range(40):
        vocab = int(torch.randint(2, 300, (1,), generator=g))
        scores = torch.randn(1, vocab, generator=g, dtype=torch.float64).float() * (0.5 + trial / 10)
        top_p = float(torch.rand(1, generator=g))
        top_k = int(torch.randint(0, vocab + 2, (1,), generator=g))
        got = _kept_reference(scores, torch.tensor([top_p]), torch.tensor([top_k]), torch.tensor([0.0]))[0]
        assert torch.equal(got, _sorted_definition(scores[0], top_p, top_k)), (trial, vocab, top_p, top_k)


def test_a_tie_at_the_threshold_is_kept_whole_and_min_p_cuts_by_share():
    scores = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    one = torch.tensor([1.0])
    # top-k 2: the 3.0 and every 2.0 (tied with the second largest)
    kept = _kept_reference(scores, one, torch.tensor([2]), torch.tensor([0.0]))[0]
    assert kept.tolist() == [True, False, True, True, True, False]
    # top-p just above the 3.0's share: the 2.0s come in together
    share = float(torch.softmax(scores[0], -1)[0])
    kept = _kept_reference(scores, torch.tensor([share + 1e-3]), torch.tensor([0]), torch.tensor([0.0]))[0]
    assert kept.tolist() == [True, False, True, True, True, False]
    kept = _kept_reference(scores, torch.tensor([share - 1e-3]), torch.tensor([0]), torch.tensor([0.0]))[0]
    assert kept.tolist() == [True, False, False, False, False, False]
    # min-p 0.3: exp(s - 3) >= 0.3 keeps 3.0 and the 2.0s (e^-1 = 0.37), not 1.0 (e^-2 = 0.14)
    kept = _kept_reference(scores, one, torch.tensor([0]), torch.tensor([0.3]))[0]
    assert kept.tolist() == [True, False, True, True, True, False]


def test_every_kind_of_row_draws_from_its_kept_set_and_alone_as_in_a_batch():
    case = random_case(torch.Generator().manual_seed(5), 24, 700, "cpu")
    tokens = sample_tokens(*case)
    logits, temperature, top_p, top_k, min_p = case[:5]
    scores = logits / temperature.clamp_min(1e-5)[:, None]
    kept = _kept_reference(scores, top_p, top_k, min_p)
    for i, t in enumerate(tokens.tolist()):
        if temperature[i] < 1e-5:
            assert t == int(logits[i].argmax())
        else:
            assert bool(kept[i, t]), i
        alone = sample_tokens(*(x[i:i + 1] for x in case))
        assert int(alone) == t


INTERPRETER_CASES = [(16, 5000, "bfloat16"), (9, 4097, "float32"), (8, 300, "float16"), (3, 2048, "float32")]


def _interpreter_main() -> None:
    """Runs INTERPRETER_CASES through the Triton kernel (TRITON_INTERPRET=1 already set) and prints
    one JSON line per case: how many tokens differ from the reference."""
    from kernels.sampling import sample_tokens_triton  # noqa: PLC0415

    g = torch.Generator().manual_seed(11)
    for i, (rows, vocab, dtype) in enumerate(INTERPRETER_CASES):
        case = random_case(g, rows, vocab, "cpu", getattr(torch, dtype))
        if i == 1:  # a strided row: a view into wider logits, as the decode graph's buffer is
            wide = torch.randn(rows, vocab + 9)
            wide[:, :vocab] = case[0]
            case = (wide[:, :vocab],) + case[1:]
        got = sample_tokens_triton(*case)
        want = sample_tokens_reference(*case)
        print(json.dumps({"case": i, "differ": int((got != want).sum()), "rows": rows}))


@needs_triton
def test_triton_kernel_under_interpreter():
    for r in interpreter_rows(__file__, len(INTERPRETER_CASES)):
        assert r["differ"] == 0, r


if __name__ == "__main__" and "--interpret" in sys.argv:
    _interpreter_main()
