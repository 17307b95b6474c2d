"""Next-token sampling of a batch of rows in one launch: greedy, temperature, top-k, top-p, min-p.

`sample_tokens(logits, temperature, top_p, top_k, min_p, seed, counters)` -> (rows,) int64 on the
logits' device. Every argument is a device tensor (rows,); no host read, so it can follow a replayed
decode graph without a round trip. Semantics (the torch reference `sample_tokens_reference`, which
runs where triton or CUDA is missing, defines them):

- a row whose temperature is below MIN_TEMPERATURE takes argmax(logits) (the first maximum);
- else scores s = logits / T (fp32) and the token is argmax over the kept tokens of s + g, with
  g = -log(-log u) and u the counter-based uniform of (seed, counter, vocabulary index)
  (`uniforms`): an exact Gumbel-max sample of softmax(s) restricted to the kept set;
- kept: every token when no filter is on; else the tokens whose score reaches a threshold, the
  largest of: top-p (0 < top_p < 1): the smallest score t whose strictly larger scores hold at
  most top_p of the mass (the smallest prefix of the sorted distribution reaching top_p, with
  every token tied at its last score kept); top-k (k > 0): the smallest score with at most k - 1
  scores above it (the k largest, ties at the k-th kept); min-p (> 0): exp(s - max s) >= min_p.

Candidates instead of a sort: the Triton kernel (one program per row) takes the best noisy score
among the min-p kept tokens as a candidate and tests it against top-p and top-k by the mass and
the count of the scores strictly above its own (the candidate is kept iff both hold). A candidate
that fails scores below the threshold, so every kept token scores above it: the next candidate is
the best noisy score above the failed one's, found in the same pass that tests it. A test is one
pass over the row; a sample from the whole distribution falls inside top-p 0.9 nine times in ten,
so a top-p row takes about three passes (max, mass + candidate, its test). After `tries` failed
candidates (a small top-k over a flat distribution; CANDIDATE_TRIES, WALK_TRIES by default) the
thresholds come by bisection over
the 32-bit keys of the float scores (a key orders like its float, so 32 halvings end on an exact
score), each halving one pass accumulating the mass and the count above its two midpoints. A
greedy row is one pass. A batch's logits stay in L2 between passes (rows x vocab x 2 bytes: 33 MB
at 110 rows of Qwen2's 152k vocabulary in bf16). The torch path sorts (~2.6 ms at 58 rows on an
H200; bench/sampling_bench.py has the A/B).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines
    triton = None
    tl = None

MIN_TEMPERATURE = 1e-5
_MASK31 = (1 << 31) - 1
BLOCK = 2048  # vocabulary entries a program reads per iteration
SEARCH_STEPS = 32  # bisection halvings: a 32-bit key range
# Candidates tested against the filters before the bisection (module doc). The walk (6) by
# default: in one process over the same served rows it took the sampler from 1.09 to 0.42 device
# ms a decode step on an H100 (bench/results/step-profile-4a466e1-default.json, phases decode@0
# and decode@6), 0.45 against 1.73 ms in isolation (sampling-4a466e1.json). `VALORA_SAMPLER_TRIES=0`
# (read at import) runs the bisection alone.
WALK_TRIES = 6  # what the tests and bench/sampling_bench.py run the walk with
CANDIDATE_TRIES = int(os.environ.get("VALORA_SAMPLER_TRIES", str(WALK_TRIES)))


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash (murmur3's finaliser shape with 31-bit products, so int64 math never
    overflows): int64 tensor of values in [0, 2^31) -> the same."""
    h = h ^ (h >> 16)
    h = (h * 0x45D9F3B) & _MASK31
    h = h ^ (h >> 13)
    h = (h * 0x2C1B3C6D) & _MASK31
    return h ^ (h >> 16)


def row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """(rows,) int64: the hash of each row's (seed, counter) that keys its uniforms."""
    return _mix((seeds & _MASK31) ^ _mix(((seeds >> 31) & _MASK31) ^ _mix(counters & _MASK31)))


def uniforms(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) float32 in (0, 1): a function of (seed, counter, vocabulary index) only."""
    key = row_keys(seeds, counters)
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _mix((key[:, None] ^ (v * 0x9E3779B1 & _MASK31)[None, :]) & _MASK31)
    h = _mix(h ^ key[:, None])
    return (h.to(torch.float32) + 0.5) / float(1 << 31)


def _kept_reference(
    scores: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """(rows, vocab) bool: the tokens the filters keep (module doc), from fp32 scores."""
    rows, vocab = scores.shape
    m = scores.max(-1, keepdim=True).values
    e = torch.exp(scores - m)
    desc, order = scores.sort(-1, descending=True)
    mass = e.gather(1, order)
    above = torch.cumsum(mass, -1) - mass  # mass before each sorted position
    # a tie group's mass strictly above it is the exclusive sum at its first position
    first = torch.searchsorted(-desc, -desc, right=False)
    gt_mass = above.gather(1, first)
    inf = torch.tensor(float("inf"), device=scores.device)
    tau_p = torch.where(gt_mass <= top_p[:, None] * e.sum(-1, keepdim=True), desc, inf).min(-1).values
    tau_k = torch.where(first <= (top_k[:, None] - 1), desc, inf).min(-1).values  # first = count above
    tau = torch.full((rows,), float("-inf"), device=scores.device)
    tau = torch.where((top_p > 0) & (top_p < 1), torch.maximum(tau, tau_p), tau)
    tau = torch.where(top_k > 0, torch.maximum(tau, tau_k), tau)
    return (scores >= tau[:, None]) & (e >= min_p[:, None])  # exp >= 0 >= a min_p of 0: off


def sample_tokens_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
    seed: torch.Tensor,
    counters: torch.Tensor,
    filtered: bool | None = None,
) -> torch.Tensor:
    """The semantics (module doc) in torch: (rows,) int64 tokens. `filtered`: whether any row
    filters (None: read from the tensors, a device sync on CUDA)."""
    greedy = logits.argmax(-1)
    scores = logits.float() / temperature.clamp_min(MIN_TEMPERATURE)[:, None]
    noise = -torch.log(-torch.log(uniforms(seed, counters, logits.shape[-1])))
    noisy = scores + noise
    if filtered is None:
        filtered = bool(((top_k > 0) | ((top_p > 0) & (top_p < 1)) | (min_p > 0)).any())
    if filtered:
        noisy = noisy.masked_fill(~_kept_reference(scores, top_p, top_k, min_p), float("-inf"))
    return torch.where(temperature < MIN_TEMPERATURE, greedy, noisy.argmax(-1))


if triton is not None:

    @triton.jit
    def _mix_tl(h):
        h = h ^ (h >> 16)
        h = (h * 0x45D9F3B) & 0x7FFFFFFF
        h = h ^ (h >> 13)
        h = (h * 0x2C1B3C6D) & 0x7FFFFFFF
        return h ^ (h >> 16)

    @triton.jit
    def _key_tl(x):
        """int64 keys ordered as the float32 values x are (no NaN)."""
        b = x.to(tl.int32, bitcast=True)
        return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64)

    @triton.jit
    def _scores_tl(base, idx, vocab, t):
        """logits / T in fp32, rounded as torch divides; -inf past the vocabulary."""
        return tl.math.div_rn(tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32), t)

    @triton.jit
    def _noisy_tl(s, idx, rk):
        """s plus the Gumbel noise of vocabulary entries idx under the row key rk (`uniforms`)."""
        h = _mix_tl((rk ^ ((idx.to(tl.int64) * 0x9E3779B1) & 0x7FFFFFFF)) & 0x7FFFFFFF)
        h = _mix_tl(h ^ rk)
        u = (h.to(tl.float32) + 0.5) / 2147483648.0
        return s - tl.log(-tl.log(u))

    @triton.jit
    def _running_max(best, best_i, x, idx):
        """Each lane's largest x so far and its index (the first on ties)."""
        better = x > best
        return tl.where(better, x, best), tl.where(better, idx, best_i)

    @triton.jit
    def _first_max(best, best_i):
        """The smallest index holding the largest value over the lanes (torch's argmax)."""
        return tl.min(tl.where(best == tl.max(best, 0), best_i, 2147483647), 0)

    @triton.jit
    def _sample_kernel(
        logits,
        stride,
        vocab,
        temperature,
        top_p,
        top_k,
        min_p,
        seed,
        counters,
        out,
        MIN_T: tl.constexpr,
        BLOCK: tl.constexpr,
        STEPS: tl.constexpr,
        TRIES: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        offs = tl.arange(0, BLOCK)
        t = tl.load(temperature + row)
        if t < MIN_T:  # the first maximum of the raw logits
            best = tl.full((BLOCK,), float("-inf"), tl.float32)
            best_i = tl.zeros((BLOCK,), tl.int32)
            for off in range(0, vocab, BLOCK):
                idx = off + offs
                x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
                best, best_i = _running_max(best, best_i, x, idx)
            tok = _first_max(best, best_i)
        else:
            m_vec = tl.full((BLOCK,), float("-inf"), tl.float32)
            for off in range(0, vocab, BLOCK):
                idx = off + offs
                s = _scores_tl(base, idx, vocab, t)
                m_vec = tl.maximum(m_vec, s)
            m = tl.max(m_vec, 0)
            p = tl.load(top_p + row)
            k = tl.load(top_k + row)
            mp = tl.load(min_p + row)
            use_p = (p > 0) & (p < 1)
            use_k = k > 0
            sd = tl.load(seed + row)
            c = tl.load(counters + row)
            rk = _mix_tl((sd & 0x7FFFFFFF) ^ _mix_tl(((sd >> 31) & 0x7FFFFFFF) ^ _mix_tl(c & 0x7FFFFFFF)))
            top_key = _key_tl(m)
            neg_key = top_key - top_key - 2139095041  # the key of -inf
            # candidate 0: the best noisy score among the min-p kept tokens (the filters' kept set is
            # a subset: when the candidate is in it, it is the answer), in the pass summing the mass
            z_vec = tl.zeros((BLOCK,), tl.float32)
            best = tl.full((BLOCK,), float("-inf"), tl.float32)
            best_i = tl.zeros((BLOCK,), tl.int32)
            for off in range(0, vocab, BLOCK):
                idx = off + offs
                s = _scores_tl(base, idx, vocab, t)
                e = tl.exp(s - m)
                z_vec += e
                if TRIES > 0:
                    noisy = tl.where((e >= mp) & (idx < vocab), _noisy_tl(s, idx, rk), float("-inf"))
                    best, best_i = _running_max(best, best_i, noisy, idx)
            z = tl.sum(z_vec, 0)
            tok = _first_max(best, best_i)
            done = (~(use_p | use_k)).to(tl.int32)
            if TRIES == 0:  # no candidate: the draw below, after the thresholds if any filter is on
                done = done * 0
            # A candidate outside the kept set scores below the threshold, so every kept token scores
            # above it: the next candidate is the best among those, found in the pass that tests this
            # one (the mass and the count strictly above its score against top-p and top-k)
            for _ in range(TRIES):
                if done == 0:
                    c_key = _key_tl(_scores_tl(base, tok, vocab, t))
                    mass_vec = tl.zeros((BLOCK,), tl.float32)
                    cnt_vec = tl.zeros((BLOCK,), tl.int32)
                    best = tl.full((BLOCK,), float("-inf"), tl.float32)
                    best_i = tl.zeros((BLOCK,), tl.int32)
                    for off in range(0, vocab, BLOCK):
                        idx = off + offs
                        s = _scores_tl(base, idx, vocab, t)
                        e = tl.exp(s - m)
                        above = _key_tl(s) > c_key
                        mass_vec += tl.where(above, e, 0.0)
                        cnt_vec += above.to(tl.int32)
                        noisy = tl.where(above & (e >= mp) & (idx < vocab), _noisy_tl(s, idx, rk), float("-inf"))
                        best, best_i = _running_max(best, best_i, noisy, idx)
                    ok_p = (tl.sum(mass_vec, 0) <= p * z) | ~use_p
                    ok_k = (tl.sum(cnt_vec, 0) <= k - 1) | ~use_k
                    done = (ok_p & ok_k).to(tl.int32)
                    nxt = _first_max(best, best_i)
                    tok = tl.where(done != 0, tok, nxt)
            if done == 0:  # still outside after TRIES candidates: the thresholds by bisection
                lo_p = neg_key
                hi_p = top_key
                lo_k = neg_key
                hi_k = top_key
                if use_p | use_k:  # invariant: lo fails, hi holds; hi ends on the smallest key that holds
                    for _ in range(STEPS):
                        mid_p = lo_p + (hi_p - lo_p) // 2
                        mid_k = lo_k + (hi_k - lo_k) // 2
                        mass_vec = tl.zeros((BLOCK,), tl.float32)
                        cnt_vec = tl.zeros((BLOCK,), tl.int32)
                        for off in range(0, vocab, BLOCK):
                            idx = off + offs
                            s = _scores_tl(base, idx, vocab, t)
                            ks = _key_tl(s)
                            mass_vec += tl.where(ks > mid_p, tl.exp(s - m), 0.0)
                            cnt_vec += (ks > mid_k).to(tl.int32)
                        ok_p = tl.sum(mass_vec, 0) <= p * z
                        ok_k = tl.sum(cnt_vec, 0) <= k - 1
                        hi_p = tl.where(ok_p, mid_p, hi_p)
                        lo_p = tl.where(ok_p, lo_p, mid_p)
                        hi_k = tl.where(ok_k, mid_k, hi_k)
                        lo_k = tl.where(ok_k, lo_k, mid_k)
                tau = neg_key
                tau = tl.where(use_p, tl.maximum(tau, hi_p), tau)
                tau = tl.where(use_k, tl.maximum(tau, hi_k), tau)
                best = tl.full((BLOCK,), float("-inf"), tl.float32)
                best_i = tl.zeros((BLOCK,), tl.int32)
                for off in range(0, vocab, BLOCK):
                    idx = off + offs
                    s = _scores_tl(base, idx, vocab, t)
                    keep = (_key_tl(s) >= tau) & (tl.exp(s - m) >= mp) & (idx < vocab)  # exp >= 0 >= min_p 0: off
                    noisy = tl.where(keep, _noisy_tl(s, idx, rk), float("-inf"))
                    best, best_i = _running_max(best, best_i, noisy, idx)
                tok = _first_max(best, best_i)
        tl.store(out + row, tok.to(tl.int64))


def available(device) -> bool:
    """Whether the Triton kernel can run on `device`: triton importable and the device CUDA."""
    return triton is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()


def sample_tokens_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
    seed: torch.Tensor,
    counters: torch.Tensor,
    out: torch.Tensor | None = None,
    tries: int | None = None,
) -> torch.Tensor:
    """The kernel (one program per row): (rows,) int64 tokens (`out` when given; `tries`: the
    candidates tested before the bisection, module doc; None: CANDIDATE_TRIES as it is now)."""
    tries = CANDIDATE_TRIES if tries is None else tries
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _sample_kernel[(rows,)](
            logits,
            logits.stride(0),
            vocab,
            temperature.float().contiguous(),
            top_p.float().contiguous(),
            top_k.long().contiguous(),
            min_p.float().contiguous(),
            seed.long().contiguous(),
            counters.long().contiguous(),
            out,
            MIN_T=MIN_TEMPERATURE,
            BLOCK=BLOCK,
            STEPS=SEARCH_STEPS,
            TRIES=tries,
            num_warps=8,
        )
    return out


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
    seed: torch.Tensor,
    counters: torch.Tensor,
    kernel: bool = True,
    filtered: bool | None = None,
) -> torch.Tensor:
    """(rows,) int64 tokens (module doc): the Triton kernel when `kernel` and it can run here,
    else the torch reference (`filtered` as there)."""
    if kernel and available(logits.device):
        return sample_tokens_triton(logits, temperature, top_p, top_k, min_p, seed, counters)
    return sample_tokens_reference(logits, temperature, top_p, top_k, min_p, seed, counters, filtered)


def random_case(
    g: torch.Generator, rows: int, vocab: int, device, dtype: torch.dtype = torch.float32, scale: float = 3.0
) -> tuple[torch.Tensor, ...]:
    """Logits and per-row parameters cycling greedy / temperature / top-p / top-k / min-p /
    everything at once, from the CPU generator `g` (self_check and the tests' inputs)."""
    logits = (torch.randn(rows, vocab, generator=g) * scale).to(dtype)
    logits[:, ::7] = logits[:, 3:4]  # ties, as bf16 logits have them
    kinds = [
        (0.0, 1.0, 0, 0.0),
        (0.8, 1.0, 0, 0.0),
        (1.0, 0.9, 0, 0.0),
        (1.3, 1.0, 40, 0.0),
        (0.7, 1.0, 0, 0.05),
        (1.1, 0.5, 200, 0.01),
        (1.0, 1e-3, 0, 0.0),
        (1.0, 1.0, vocab + 5, 0.0),
    ]
    cols = list(zip(*(kinds[i % len(kinds)] for i in range(rows))))
    temperature = torch.tensor(cols[0], dtype=torch.float32)
    top_p = torch.tensor(cols[1], dtype=torch.float32)
    top_k = torch.tensor(cols[2], dtype=torch.int64)
    min_p = torch.tensor(cols[3], dtype=torch.float32)
    seed = torch.randint(1, 1 << 62, (rows,), generator=g)
    counters = torch.randint(0, 1 << 20, (rows,), generator=g)
    return tuple(x.to(device) for x in (logits, temperature, top_p, top_k, min_p, seed, counters))


def self_check(device) -> str | None:
    """The kernel against the reference on random rows of every kind: None when every token
    agrees, else why not (the caller then samples with the reference). Run once at start-up."""
    if not available(device):
        return "triton or CUDA is not available"
    try:
        case = random_case(torch.Generator().manual_seed(0), 16, 5000, device, torch.bfloat16)
        got = sample_tokens_triton(*case)
        want = sample_tokens_reference(*case)
    except Exception as exc:  # a build or launch failure is the answer
        return f"{type(exc).__name__}: {exc}"[:500]
    # the kernel's exp/log may differ from torch's in the last bit: a row whose two best noisy
    # scores are that close may differ (about one row in a million); a wrong kernel differs in most
    bad = int((got != want).sum())
    return None if bad <= 1 else f"{bad} of {got.numel()} tokens differ from the reference"


__all__ = [
    "MIN_TEMPERATURE",
    "available",
    "random_case",
    "row_keys",
    "sample_tokens",
    "sample_tokens_reference",
    "sample_tokens_triton",
    "self_check",
    "uniforms",
]
