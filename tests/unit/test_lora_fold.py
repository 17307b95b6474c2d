"""Folded LoRA shrink (AtmmBackend.enable_fold, EngineConfig.lora_fold_rows): the step's A^T sit in
spare rows below each projection's weight, one GEMM gives y and x·A, and only the expand runs.

On CPU the backend runs its torch references (fp32), so the same engine with and without folding
must give the same tokens, and each folded projection the same output as the unfolded one."""

from __future__ import annotations

import pytest
import torch

from services.worker.atmm_backend import AtmmBackend
from services.worker.engine import Engine, EngineConfig
from services.worker.lora import LoraGroup, StepLora
from services.worker.requests import WorkRequest
from services.worker.testing import random_adapter_bundle, random_image
from tests.unit.test_engine import run_concurrently

NAMES = ("adapters/r8/versions/1", "adapters/r16/versions/1", "adapters/qv/versions/1")


@pytest.fixture(scope="module")
def bundles(model_path):
    return {
        NAMES[0]: random_adapter_bundle(model_path, rank=8, lora_alpha=16, seed=11),
        NAMES[1]: random_adapter_bundle(model_path, rank=16, lora_alpha=16, seed=12),
        NAMES[2]: random_adapter_bundle(model_path, rank=8, lora_alpha=8, seed=13, target_modules=("q_proj", "v_proj")),
    }


def make_engine(model_path, bundles, monkeypatch, fold_rows: int, use_atmm: bool = True) -> Engine:
    monkeypatch.setattr(AtmmBackend, "available", staticmethod(lambda device, dtype: True))  # the CPU references
    eng = Engine(
        EngineConfig(
            model_path=model_path,
            device="cpu",
            max_batch_size=8,
            device_slots=4,
            lora_fold_rows=fold_rows,
            use_atmm=use_atmm,
        )
    )
    for name, b in bundles.items():
        eng.load_adapter_bytes(name, b.sha256, b.data, b.config_json)
    return eng


def generate(eng: Engine, adapters) -> dict[str, list[int]]:
    reqs = [
        WorkRequest(f"r{i}", "Describe the image.", [random_image(i)], adapter=a, max_new_tokens=6)
        for i, a in enumerate(adapters)
    ]
    eng.start()
    try:
        return {rid: r.token_ids for rid, (_, r) in run_concurrently(eng, reqs).items()}
    finally:
        eng.stop()


MIXED = [NAMES[0], None, NAMES[1], NAMES[2], NAMES[0], NAMES[1]]


def test_folded_engine_gives_the_unfolded_tokens(model_path, bundles, monkeypatch):
    want = generate(make_engine(model_path, bundles, monkeypatch, 0, use_atmm=False), MIXED)
    unfolded = make_engine(model_path, bundles, monkeypatch, 0)
    assert generate(unfolded, MIXED) == want
    assert unfolded.runtime.backend.folded_calls == 0
    eng = make_engine(model_path, bundles, monkeypatch, 256)
    assert generate(eng, MIXED) == want
    backend = eng.runtime.backend
    # every step's q|k|v, o, gate|up and down ran folded: 4 calls per layer and step
    layers = len({k[0] for k in eng.lora_layers})
    assert backend.folded_calls > 0 and backend.folded_calls % (4 * layers) == 0


def test_too_few_spare_rows_leaves_the_kind_unfolded(model_path, bundles, monkeypatch):
    """q|k|v of these three entries needs 24 + 48 + 16 rows, o 8 + 16 + 8: with 48 spare rows
    o, gate|up and down fold, q|k|v does not, and the tokens stay the same."""
    want = generate(make_engine(model_path, bundles, monkeypatch, 0, use_atmm=False), MIXED)
    eng = make_engine(model_path, bundles, monkeypatch, 48)
    assert generate(eng, MIXED) == want
    assert eng.runtime.backend.folded_calls > 0


def check_step(eng, entries, row_entries, kinds) -> None:
    """Every module of `kinds` runs folded this step and equals its unfolded output."""
    backend = eng.runtime.backend
    g = torch.Generator().manual_seed(len(row_entries))
    step = StepLora(entries, row_entries, 3)
    eng.runtime.step = step
    step.kernel = backend.begin(step)
    assert step.kernel and kinds <= set(backend.folded), (kinds, set(backend.folded))
    for key, m in backend._fold_modules.items():
        if key[1] not in kinds:
            continue
        x = torch.randn(len(row_entries), 3, m.w_ext.shape[1], generator=g)
        got = m(x)
        saved, backend.folded = backend.folded, {}  # the same module unfolded
        want = m(x)
        backend.folded = saved
        if isinstance(m, LoraGroup):
            got, want = torch.cat(got, -1), torch.cat(want, -1)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    eng.runtime.step = None


def entries(eng):
    for n in NAMES:
        assert eng.pool.acquire(n) is not None  # resident, as a request makes it
    return [eng.lora.entry(("lora", n)) for n in NAMES]


ALL = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def test_folded_projection_equals_unfolded_and_rows_follow_the_slots(model_path, bundles, monkeypatch):
    eng = make_engine(model_path, bundles, monkeypatch, 96)  # q|k|v of two entries: up to 48 + 24 rows
    assert {k[1] for k in eng.runtime.backend._fold_modules} == ALL
    e = entries(eng)
    check_step(eng, e[:2], [-1, 0, 0, 1], ALL)  # rows sorted by entry (the engine's order; permuted: unfolded)
    check_step(eng, e[1:], [0, 0, 1], ALL)  # another set of entries: new slots, rows rewritten or kept
    check_step(eng, [e[2], e[0]], [0, 1], ALL)
    check_step(eng, e[:2], [0, 1, 1], ALL)


def test_rows_another_slot_overwrote_are_written_again(model_path, bundles, monkeypatch):
    """o_proj with 24 spare rows (ranks 8, 16, and 8 for the q/v-only adapter's zero term): X at
    0; Y and Z do not fit beside X, so Z takes X's rows; X comes back to the same rows, which must
    hold X's A again, not Z's."""
    eng = make_engine(model_path, bundles, monkeypatch, 24)
    x, y, z = entries(eng)
    check_step(eng, [x], [0, 0], {"o_proj"})
    check_step(eng, [y, z], [0, 1], {"o_proj"})
    check_step(eng, [x], [0], {"o_proj"})


def test_only_slots_whose_entry_changed_are_written(model_path, bundles, monkeypatch):
    """A step's entries go into the kernel tables once: a later step with some of them (in the
    slots they have) reads no entry's tensors again, a new entry only its own."""
    eng = make_engine(model_path, bundles, monkeypatch, 0)
    backend = eng.runtime.backend
    x, y, z = entries(eng)
    read = []
    tensors = type(x).tensors
    monkeypatch.setattr(type(x), "tensors", lambda e, key: read.append(e) or tensors(e, key))
    assert backend.begin(StepLora([x, y], [0, 1], 1))
    assert set(read) == {x, y}
    read.clear()
    assert backend.begin(StepLora([y], [0, 0], 1)) and backend.begin(StepLora([x, y], [0, 1, 1], 1))
    assert read == []
    assert backend.begin(StepLora([y, z], [0, 1], 1))
    assert set(read) == {z}


def test_launch_key_keeps_a_decode_graph_across_adapter_mixes(model_path, bundles, monkeypatch):
    """The decode graph's LoRA key: the same for two mixes of the same entries over the same rows
    (other segment counts and sizes: the kernels read those from the plan's device data), other
    for another segment bucket or another token count; the folded GEMMs' widths are multiples of
    64 (capped at the spare rows), so fewer entries in the same slots mostly keep them."""
    eng = make_engine(model_path, bundles, monkeypatch, 96)
    backend = eng.runtime.backend
    e = entries(eng)

    def key(step_entries, rows):
        step = StepLora(step_entries, rows, 1)
        assert backend.begin(step)
        return backend.launch_key()

    base = key(e, [0, 0, 1, 2])
    assert key(e, [0, 1, 1, 2]) == base and key(e, [0, 1, 2, 2]) == base  # segment sizes
    assert key(e[:2], [0, 0, 1, 1]) == base  # fewer entries, same bucket: same kernels and widths
    assert key(e, [0, 1, 2, 2, 2, 2, 2, 2]) != base  # 8 tokens, not 4
    assert key(e[:1], [0, 0, 0, 0]) != base  # one segment: the 1-segment bucket of the tile table
    for kind, (rows, _, _) in backend.folded.items():
        assert rows % 64 == 0 or rows == 96, (kind, rows)


def test_group_ranks_are_the_largest_summed_rank_over_layers():
    """A grouped call's workspace is strided by the entry's summed ranks of the group's parts, the
    largest over layers (here q alone in layer 0, q + v in layer 1), worked out once per entry."""
    from services.worker.lora import AdapterEntry

    feats = {(layer, m): (16, 16) for layer in (0, 1) for m in ("q_proj", "k_proj", "v_proj", "up_proj")}
    groups = {(layer, "qkv"): tuple((layer, m) for m in ("q_proj", "k_proj", "v_proj")) for layer in (0, 1)}
    backend = AtmmBackend(feats, torch.device("cpu"), torch.float32, groups=groups)
    a = {
        (0, "q_proj"): torch.zeros(16, 8),
        (1, "q_proj"): torch.zeros(16, 8),
        (1, "v_proj"): torch.zeros(16, 16),
        (0, "up_proj"): torch.zeros(16, 32),
    }
    entry = AdapterEntry(a=a, b={k: torch.zeros(v.shape[1], 16) for k, v in a.items()}, scale=1.0)
    assert backend._group_ranks(entry) == {"qkv": 24}
    assert backend._group_ranks(entry) is backend._group_ranks(entry)


def test_the_atmm_backend_keeps_the_lora_backend_contract():
    """lora.LoraBackend is what the layers and the planner call; AtmmBackend (CUDA only, never
    instantiated here) must offer each method with the same parameters, and the plan's version."""
    import inspect

    from services.worker.atmm_backend import AtmmBackend
    from services.worker.lora import LoraBackend

    methods = [n for n, v in vars(LoraBackend).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert set(methods) == {"begin", "run", "run_group", "folded_linear", "launch_key"}
    for name in methods:
        got = list(inspect.signature(getattr(AtmmBackend, name)).parameters)
        assert got == list(inspect.signature(getattr(LoraBackend, name)).parameters), name
    assert "plan" in LoraBackend.__annotations__
    assert "self.plan = atmm.AtmmPlan(" in inspect.getsource(AtmmBackend.__init__)
