"""The batched on-device sampler (sampling.py): exact Gumbel-max samples of softmax(logits / T)
restricted to top-k / top-p / min-p, greedy rows untouched, and tokens a function of (seed, counter) only."""

from __future__ import annotations

import dataclasses

import torch

from services.worker.sampling import RowSampling, SamplingParams, sample, uniforms

CPU = torch.device("cpu")


def _draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 11) -> torch.Tensor:
    """n samples of one row's distribution: the same row at counters 0..n-1."""
    p = dataclasses.replace(params, seed=seed)
    return sample(logits.expand(n, -1), RowSampling.of([p] * n, CPU), torch.arange(n))


def _freq(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


def test_uniforms_are_uniform_and_keyed():
    u = uniforms(torch.tensor([1, 1, 2, 1 << 40]), torch.tensor([5, 6, 5, 5]), 50000)
    assert bool(((u > 0) & (u < 1)).all())
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    same = uniforms(torch.tensor([1]), torch.tensor([5]), 50000)
    assert torch.equal(u[0], same[0])  # a function of (seed, counter, index) only
    for a, b in ((0, 1), (0, 2), (0, 3)):  # another counter, seed, or the seed's high bits
        assert float((u[a] - u[b]).abs().mean()) > 0.2


def test_samples_follow_the_tempered_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 8) * 2
    for t in (0.7, 1.0, 1.5):
        got = _freq(_draw(logits, SamplingParams(temperature=t), 40000), 8)
        want = torch.softmax(logits[0] / t, -1)
        assert float((got - want).abs().max()) < 0.012, (t, got, want)


def test_top_k_and_top_p_restrict_then_renormalise():
    torch.manual_seed(1)
    logits = torch.randn(1, 10) * 1.5
    order = torch.argsort(logits[0], descending=True)
    got = _freq(_draw(logits, SamplingParams(temperature=1.0, top_k=3), 30000), 10)
    want = torch.zeros(10)
    want[order[:3]] = torch.softmax(logits[0, order[:3]], -1)
    assert float((got - want).abs().max()) < 0.012
    probs = torch.softmax(logits[0], -1)[order]
    keep = int(((torch.cumsum(probs, 0) - probs) <= 0.6).sum())  # smallest prefix reaching 0.6
    got = _freq(_draw(logits, SamplingParams(temperature=1.0, top_p=0.6), 30000), 10)
    want = torch.zeros(10)
    want[order[:keep]] = probs[:keep] / probs[:keep].sum()
    assert 1 <= keep < 10 and float((got - want).abs().max()) < 0.012
    assert torch.equal(_draw(logits, SamplingParams(temperature=1.0, top_k=1), 50), logits.argmax(-1).expand(50))


def test_min_p_keeps_tokens_within_its_share_of_the_most_likely():
    """min_p = 0.3 at temperature 2: tokens whose tempered probability is below 0.3 x the most
    likely one's never come; the rest keep their relative odds. Rows without min_p are unaffected."""
    torch.manual_seed(2)
    logits = torch.randn(1, 12) * 2
    probs = torch.softmax(logits[0] / 2.0, -1)
    keep = probs >= 0.3 * probs.max()
    assert 1 < int(keep.sum()) < 12
    got = _freq(_draw(logits, SamplingParams(temperature=2.0, min_p=0.3), 30000), 12)
    want = torch.where(keep, probs, torch.zeros_like(probs))
    assert float(got[~keep].sum()) == 0.0
    assert float((got - want / want.sum()).abs().max()) < 0.012
    mixed = [SamplingParams(temperature=2.0, seed=5), SamplingParams(temperature=2.0, min_p=0.3, seed=5)]
    rows = sample(logits.expand(2, -1), RowSampling.of(mixed, CPU), torch.tensor([3, 3]))
    alone = sample(logits, RowSampling.of(mixed[:1], CPU), torch.tensor([3]))
    assert rows[0] == alone[0]  # the unfiltered row draws as it does alone


def test_greedy_rows_and_tiny_temperatures_take_the_argmax():
    torch.manual_seed(2)
    logits = torch.randn(4, 300)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1e-39, seed=3),
        SamplingParams(temperature=1.0, seed=4),
        SamplingParams(temperature=0.9, top_p=0.5, seed=5),
    ]
    got = sample(logits, RowSampling.of(params, CPU), torch.tensor([7, 7, 7, 7]))
    assert got[:2].tolist() == logits[:2].argmax(-1).tolist()
    again = sample(logits, RowSampling.of(params, CPU), torch.tensor([7, 7, 7, 7]))
    assert torch.equal(got, again)  # seeded: the same tokens again
    assert SamplingParams(temperature=0.5).seeded().seed != 0 and SamplingParams().seeded().seed == 0


def test_penalties_follow_hf_and_openai():
    """repetition divides positive / multiplies negative logits of seen tokens; frequency and
    presence subtract per occurrence / once; neutral values change nothing."""
    from services.worker.sampling import penalize

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    counts = torch.tensor([[2.0, 0.0, 1.0, 0.0]])
    seen = torch.tensor([[True, True, True, False]])  # token 1 only in the prompt
    rep = penalize(logits, torch.tensor([[2.0], [0.0], [0.0]]), counts, seen)
    assert rep.tolist() == [[1.0, -2.0, 0.25, 3.0]]
    freq_pres = penalize(logits, torch.tensor([[1.0], [0.5], [0.25]]), counts, seen)
    assert freq_pres.tolist() == [[2.0 - 1.0 - 0.25, -1.0, 0.5 - 0.5 - 0.25, 3.0]]
    assert torch.equal(penalize(logits, torch.tensor([[1.0], [0.0], [0.0]]), counts, seen), logits)


def test_a_penalized_greedy_row_takes_the_penalized_argmax():
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    params = [SamplingParams(repetition_penalty=1.5), SamplingParams()]
    rows = RowSampling.of(params, CPU)
    history = (torch.tensor([[1.0, 0, 0], [1.0, 0, 0]]), torch.tensor([[True, False, False]] * 2))
    got = sample(logits, rows, torch.tensor([0, 0]), history)
    assert got.tolist() == [1, 0]  # 3 / 1.5 < 2.9 for the penalized row; the other keeps its argmax


def test_logit_bias_is_added_before_everything_and_only_to_its_rows():
    """OpenAI's logit_bias: +100 makes greedy and sampled rows take the token, -100 takes the
    greedy token away, a small bias shifts the sampled distribution by exp(bias); rows without a
    bias in the same batch (shorter bias lists padded) are untouched; it applies before the
    penalties (vLLM's order)."""
    from services.worker.sampling import add_bias

    torch.manual_seed(3)
    logits = torch.randn(1, 50)
    top = int(logits[0].argmax())
    forced = (top + 7) % 50
    params = [
        SamplingParams(logit_bias=((forced, 100.0),)),
        SamplingParams(logit_bias=((top, -100.0), (1, 0.5))),
        SamplingParams(temperature=1.0, seed=9, logit_bias=((forced, 100.0),)),
        SamplingParams(),
    ]
    rows = RowSampling.of(params, CPU)
    assert rows.bias[0].shape == rows.bias[1].shape == (4, 2)  # padded to the longest
    got = sample(logits.expand(4, -1).clone(), rows, torch.tensor([2, 2, 2, 2]))
    banned = logits[0].clone()
    banned[top] -= 100.0
    banned[1] += 0.5
    assert got.tolist() == [forced, int(banned.argmax()), forced, top]
    assert int(banned.argmax()) != top
    assert [p.plain_greedy for p in params] == [False, False, False, True]
    assert RowSampling.of([SamplingParams()], CPU).bias is None  # nothing to add: no tensors
    # a +1 bias multiplies the token's odds by e
    small = torch.zeros(1, 4)
    got = _freq(_draw(small, SamplingParams(temperature=1.0, logit_bias=((2, 1.0),)), 40000), 4)
    want = torch.softmax(torch.tensor([0.0, 0.0, 1.0, 0.0]), -1)
    assert float((got - want).abs().max()) < 0.012
    # before the repetition penalty: 2 + 1 = 3 divided by 1.5 = 2 (not 2 / 1.5 + 1)
    history = (torch.zeros(1, 3), torch.tensor([[True, False, False]]))
    rows = RowSampling.of([SamplingParams(repetition_penalty=1.5, logit_bias=((0, 1.0),))], CPU)
    assert torch.equal(add_bias(torch.tensor([[2.0, 2.1, 0.0]]), *rows.bias), torch.tensor([[3.0, 2.1, 0.0]]))
    assert sample(torch.tensor([[2.0, 2.1, 0.0]]), rows, torch.tensor([0]), history).tolist() == [1]
