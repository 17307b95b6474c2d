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

from kernels.sampling import (
    MIN_TEMPERATURE,
    WALK_TRIES,
    _kept_reference,
    random_case,
    sample_tokens,
    sample_tokens_reference,
    uniforms,
)
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
        alone = sample_tokens(*(x[i : i + 1] for x in case))
        assert int(alone) == t


# (rows, vocab, dtype, logit scale): the last one nearly flat (a small top-p walks several candidates)
INTERPRETER_CASES = [
    (16, 5000, "bfloat16", 3.0),
    (9, 4097, "float32", 3.0),
    (8, 300, "float16", 3.0),
    (3, 2048, "float32", 3.0),
    (8, 3000, "float32", 0.05),
]


def _interpreter_main() -> None:
    """Runs INTERPRETER_CASES through the Triton kernel (TRITON_INTERPRET=1 already set) and prints
    one JSON line per case: how many tokens differ from the reference."""
    from kernels.sampling import sample_tokens_triton

    g = torch.Generator().manual_seed(11)
    for i, (rows, vocab, dtype, scale) in enumerate(INTERPRETER_CASES):
        case = random_case(g, rows, vocab, "cpu", getattr(torch, dtype), scale)
        if i == 1:  # a strided row: a view into wider logits, as the decode graph's buffer is
            wide = torch.randn(rows, vocab + 9)
            wide[:, :vocab] = case[0]
            case = (wide[:, :vocab],) + case[1:]
        want = sample_tokens_reference(*case)
        # every candidate path: the default, one candidate then the bisection, the bisection alone
        differ = {tries: int((sample_tokens_triton(*case, tries=tries) != want).sum()) for tries in (WALK_TRIES, 1, 0)}
        print(json.dumps({"case": i, "differ": differ, "rows": rows, "tries": candidate_tries(*case)}))


def candidate_tries(logits, temperature, top_p, top_k, min_p, seed, counters) -> list[int]:
    """Per sampled row, the candidates the kernel's walk tests until one is in the kept set (its
    module doc), in torch: which paths a case exercises."""
    scores = logits.float() / temperature.clamp_min(MIN_TEMPERATURE)[:, None]
    noisy = scores - torch.log(-torch.log(uniforms(seed, counters, logits.shape[-1])))
    kept = _kept_reference(scores, top_p, top_k, min_p)
    floor = torch.exp(scores - scores.max(-1, keepdim=True).values) >= min_p[:, None]
    out = []
    for r in range(len(logits)):
        if temperature[r] < MIN_TEMPERATURE:
            continue
        allowed, n = floor[r].clone(), 1
        while not kept[r, (c := int(noisy[r].masked_fill(~allowed, float("-inf")).argmax()))]:
            allowed &= scores[r] > scores[r, c]
            n += 1
        out.append(n)
    return out


@needs_triton
def test_triton_kernel_under_interpreter():
    tries = []
    for r in interpreter_rows(__file__, len(INTERPRETER_CASES)):
        assert set(r["differ"].values()) == {0}, r
        tries += r["tries"]
    # the cases reach every path: a first candidate kept, a later one, and (at tries=1) the
    # bisection after a failed candidate
    assert 1 in tries and any(1 < n <= WALK_TRIES for n in tries), tries


if __name__ == "__main__" and "--interpret" in sys.argv:
    _interpreter_main()
