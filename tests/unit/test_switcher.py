"""CPU tests of the switch kernel's host side and the worker switcher's kernel/fallback choice:
SwitchPlan descriptor packing (sizes, pointers, the out-of-place source), config selection, the
torch reference of the out-of-place pass, and that the switcher's kernel path (run here through
SwitchPlan's reference fallback) gives bit-identical weights to its torch path."""

import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import services.worker.switcher as switcher_mod
from kernels import switch as sw
from kernels.build import CSRC, nvcc_path
from kernels.switch import LoraTerm, SwitchPlan, config_max_rank, config_tiles, pack_descriptors
from services.worker.adapter_weights import AdapterWeights
from services.worker.adapter_staging import DeviceAdapter
from services.worker.switcher import Switcher, kernel_can_take

BF = torch.bfloat16


def term(out, inp, r, s, g, dtype=BF):
    return LoraTerm(torch.randn(inp, r, generator=g).to(dtype), torch.randn(r, out, generator=g).to(dtype), s)


# -- descriptors ------------------------------------------------------------------------------------
def test_descriptor_is_80_bytes_with_src_last():
    assert sw._DESC.itemsize == 80
    assert sw._DESC.fields["tile_begin"][1] == 64 and sw._DESC.fields["src"][1] == 72


def test_descriptor_layout_matches_the_cpp_struct(tmp_path):
    nvcc = nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not found (CUDA headers for atmm_api.h)")
    src = tmp_path / "t.cpp"
    fields = ", ".join(f"(long)offsetof(valora::SwitchDesc, {f})" for f in sw._DESC.names)
    src.write_text(
        '#include <cstddef>\n#include <cstdio>\n#include "atmm_api.h"\nint main() {\n'
        f"  long v[] = {{(long)sizeof(valora::SwitchDesc), {fields}}};\n"
        '  for (long x : v) std::printf("%ld ", x);\n  return 0;\n}\n'
    )
    cuda_inc = Path(nvcc).resolve().parent.parent / "include"
    exe = tmp_path / "t"
    r = subprocess.run(
        ["c++", "-std=c++17", f"-I{CSRC}", f"-I{cuda_inc}", "-I/usr/local/cuda/include", str(src), "-o", str(exe)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0 and "cuda_runtime.h" in r.stderr:
        pytest.skip("CUDA runtime headers not found next to nvcc")
    assert r.returncode == 0, r.stderr[-2000:]
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    assert got == [sw._DESC.itemsize] + [sw._DESC.fields[f][1] for f in sw._DESC.names]


def test_plan_packs_pointers_ranks_scales_tiles_and_sources():
    g = torch.Generator().manual_seed(0)
    shapes = [(72, 136), (40, 264), (136, 40)]
    ws = [torch.randn(m, n, generator=g).to(BF) for m, n in shapes]
    src1 = torch.randn(40, 264, generator=g).to(BF)
    first = [term(72, 136, 8, 0.5, g), None, term(136, 40, 128, 2.0, g)]
    second = [term(72, 136, 16, -1.5, g), term(40, 264, 24, -0.25, g), None]
    plan = SwitchPlan(ws, first, second, sources=[ws[0], src1, ws[2]])
    for cfg in ("switch_bf16_bm64_bn128", "switch_bf16_pipe_bm128_bn64_s4_t256", "switch_bf16_regs_bm64_bn128_t256"):
        bm, bn = config_tiles(cfg)
        d, total, rmax = pack_descriptors(plan.weights, plan.first, plan.second, plan.sources, bm, bn)
        assert d.dtype.itemsize == 80 and len(d) == 3
        assert list(d["w"]) == [w.data_ptr() for w in ws]
        assert list(d["src"]) == [ws[0].data_ptr(), src1.data_ptr(), ws[2].data_ptr()]  # in place: src == w
        assert list(d["M"]) == [72, 40, 136] and list(d["N"]) == [136, 264, 40]
        assert list(d["r1"]) == [8, 0, 128] and list(d["r2"]) == [16, 24, 0]
        assert d["a1"][1] == 0 and d["b1"][1] == 0 and d["a2"][2] == 0 and d["b2"][2] == 0
        assert d["a1"][0] == first[0].a.data_ptr() and d["b2"][1] == second[1].b.data_ptr()
        np.testing.assert_allclose(d["s1"], [0.5, 0.0, 2.0])
        np.testing.assert_allclose(d["s2"], [-1.5, -0.25, 0.0])
        tiles = [-(-m // bm) * -(-n // bn) for m, n in shapes]
        assert list(d["tile_begin"]) == [0, tiles[0], tiles[0] + tiles[1]] and total == sum(tiles)
        assert rmax == 128  # 16+16, 0+32, 128+0
    assert (
        plan.descs.tobytes()
        == pack_descriptors(plan.weights, plan.first, plan.second, plan.sources, *config_tiles(plan.config))[
            0
        ].tobytes()
    )


def test_config_names_tiles_and_rank_limits():
    assert config_tiles("switch_bf16_bm64_bn128") == (64, 128)
    assert config_tiles("switch_fp16_pipe_bm128_bn64_s4_t256") == (128, 64)
    assert config_tiles("switch_bf16_regs_bm64_bn128_t256") == (64, 128)
    with pytest.raises(ValueError):
        config_tiles("expand_bt16_bn128")
    assert config_max_rank("switch_bf16_bm64_bn128") == 256
    assert config_max_rank("switch_bf16_pipe_bm64_bn128_s4_t256") == 128
    assert config_max_rank("switch_bf16_regs_bm128_bn64_t256") == 128
    assert sw.switch_configs() == [] or all(n.startswith("switch_") for n in sw.switch_configs())


def test_plan_falls_back_from_a_new_default_when_the_ranks_do_not_fit(monkeypatch):
    g = torch.Generator().manual_seed(1)
    w = [torch.randn(64, 128, generator=g).to(BF)]
    monkeypatch.setitem(sw.DEFAULT_CONFIG, BF, "switch_bf16_pipe_bm64_bn128_s4_t256")
    small = SwitchPlan(w, [term(64, 128, 64, 1.0, g)], [term(64, 128, 64, -1.0, g)])
    assert small.config == "switch_bf16_pipe_bm64_bn128_s4_t256" and small.rmax == 128
    big = SwitchPlan(w, [term(64, 128, 128, 1.0, g)], [term(64, 128, 16, -1.0, g)])
    assert big.config == sw.FALLBACK_CONFIG[BF] and big.rmax == 144
    with pytest.raises(ValueError, match="up to 128"):
        SwitchPlan(
            w, [term(64, 128, 128, 1.0, g)], [term(64, 128, 16, -1.0, g)], config="switch_bf16_regs_bm64_bn128_t256"
        )
    with pytest.raises(ValueError, match="not for"):
        SwitchPlan(w, [term(64, 128, 16, 1.0, g)], config="switch_fp16_bm64_bn128")


def test_plan_checks_sources_and_shapes():
    g = torch.Generator().manual_seed(2)
    w = [torch.zeros(64, 128, dtype=BF)]
    t = [term(64, 128, 16, 1.0, g)]
    with pytest.raises(ValueError, match="source"):
        SwitchPlan(w, t, sources=[torch.zeros(64, 120, dtype=BF)])
    with pytest.raises(ValueError, match="source"):
        SwitchPlan(w, t, sources=[torch.zeros(64, 128, dtype=torch.float16)])
    with pytest.raises(ValueError, match="one term per"):
        SwitchPlan(w, t, sources=[])
    with pytest.raises(ValueError, match="multiples of 8"):
        SwitchPlan([torch.zeros(60, 128, dtype=BF)], [term(60, 128, 16, 1.0, g)])
    with pytest.raises(ValueError, match="non-zero"):
        SwitchPlan(w, t, [term(64, 128, 16, 0.0, g)])


def test_out_of_place_reference_reads_the_source_and_leaves_it():
    g = torch.Generator().manual_seed(3)
    w0 = [torch.randn(48, 32, generator=g).to(BF), torch.randn(16, 40, generator=g).to(BF)]
    ws = [torch.full_like(x, 7.0) for x in w0]
    keep = [x.clone() for x in w0]
    tn = [term(48, 32, 16, 0.5, g), None]
    SwitchPlan(ws, tn, sources=w0).run()
    want0 = (w0[0].float() + 0.5 * (tn[0].a.float() @ tn[0].b.float()).t()).to(BF)
    assert torch.equal(ws[0], want0)
    assert torch.equal(ws[1], w0[1])  # no term: a copy of the source
    assert all(torch.equal(a, b) for a, b in zip(w0, keep))
    # in place with only a second term
    w = w0[0].clone()
    tm = term(48, 32, 8, -2.0, g)
    SwitchPlan([w], [None], [tm]).run()
    assert torch.equal(w, (w0[0].float() - 2.0 * (tm.a.float() @ tm.b.float()).t()).to(BF))


# -- the switcher's choice ----------------------------------------------------------------------------
class FakeCuda:
    """Duck-typed tensor for kernel_can_take (no CUDA here)."""

    def __init__(self, shape, dtype=BF, cuda=True, contiguous=True, ptr=4096, device="cuda:0"):
        self.shape, self.dtype, self.is_cuda, self._c, self._p = tuple(shape), dtype, cuda, contiguous, ptr
        self.device = device

    def dim(self):
        return len(self.shape)

    def is_contiguous(self):
        return self._c

    def data_ptr(self):
        return self._p


def test_kernel_can_take_only_what_the_kernel_handles():
    w = FakeCuda((4096, 11008))
    ok = [(FakeCuda((11008, 16)), FakeCuda((16, 4096)))]
    assert kernel_can_take(w, ok)
    assert kernel_can_take(w, [])  # pristine copy / no term
    assert kernel_can_take(w, ok + [(FakeCuda((11008, 128)), FakeCuda((128, 4096)))])
    assert not kernel_can_take(FakeCuda((4096, 11008), cuda=False), ok)  # CPU: torch op
    assert not kernel_can_take(FakeCuda((4096, 11008), dtype=torch.float32), ok)
    assert not kernel_can_take(FakeCuda((4096, 11004)), [])  # in_features % 8
    assert not kernel_can_take(FakeCuda((4092, 11008)), [])  # out_features % 8
    assert not kernel_can_take(FakeCuda((4096, 11008), ptr=4098), ok)  # unaligned
    assert not kernel_can_take(FakeCuda((4096, 11008), contiguous=False), ok)
    assert not kernel_can_take(w, [(FakeCuda((11008, 4)), FakeCuda((4, 4096)))])  # rank % 8
    assert not kernel_can_take(w, [(FakeCuda((11008, 136)), FakeCuda((136, 4096)))])  # rank > 128
    assert not kernel_can_take(w, [(FakeCuda((11008, 16), dtype=torch.float16), FakeCuda((16, 4096)))])
    assert not kernel_can_take(w, [(FakeCuda((4096, 16)), FakeCuda((16, 11008)))])  # transposed factors


def _layers_and_adapters(dtype=BF, ranks=(16, 8)):
    g = torch.Generator().manual_seed(5)
    shapes = {(0, "q_proj"): (64, 32), (0, "down_proj"): (32, 96), (1, "q_proj"): (64, 32)}
    layers = {}
    for k, (o, i) in shapes.items():
        lin = torch.nn.Linear(i, o, bias=False)
        lin.weight.data = torch.randn(o, i, generator=g).to(dtype)
        layers[k] = SimpleNamespace(base=lin)
    adapters = []
    for n, r in enumerate(ranks):
        keys = list(shapes) if n == 0 else [(0, "q_proj"), (0, "down_proj")]  # B skips (1, q_proj)
        a = {k: torch.randn(shapes[k][1], r, generator=g).to(dtype) for k in keys}
        b = {k: torch.randn(r, shapes[k][0], generator=g).to(dtype) for k in keys}
        w = AdapterWeights(name=f"adapters/a{n}/versions/1", sha256="x", rank=r, scale=2.0 / r, a=a, b=b)
        adapters.append(DeviceAdapter(weights=w, a=a, b=b))
    return layers, adapters


@pytest.mark.parametrize("strategy", ["pristine", "delta"])
def test_switcher_kernel_path_matches_the_torch_path(monkeypatch, strategy):
    """Forces the kernel path on CPU tensors (SwitchPlan then runs the torch reference): one plan
    per switch over every projection, same weights bit for bit as the per-projection torch op."""
    monkeypatch.setattr(switcher_mod, "kernel_can_take", lambda w, factors: w.dtype == BF)
    layers_k, (ka, kb) = _layers_and_adapters()
    layers_t, (ta, tb) = _layers_and_adapters()
    fast = Switcher(layers_k, strategy=strategy, resync_every=3, use_kernel=True)
    slow = Switcher(layers_t, strategy=strategy, resync_every=3, use_kernel=False)
    for step, (x, y) in enumerate([(ka, ta), (kb, tb), (ka, ta), (None, None), (kb, tb), (ka, ta), (kb, tb)]):
        fast.set(x)
        slow.set(y)
        for key in layers_k:
            assert torch.equal(layers_k[key].base.weight, layers_t[key].base.weight), (step, key)
    assert fast.kernel_launches == 7 and slow.kernel_launches == 0
    fast.set(None)
    for key, lin in layers_k.items():
        assert torch.equal(lin.base.weight, fast.pristine[key])


def test_switcher_jobs_out_of_place_from_pristine_and_one_pass_delta(monkeypatch):
    monkeypatch.setattr(switcher_mod, "kernel_can_take", lambda w, factors: True)
    layers, (a, b) = _layers_and_adapters()
    s = Switcher(layers, strategy="delta", use_kernel=True)
    keys = list(layers)
    ws, srcs, first, second, copies = s.kernel_jobs(keys, a, resync=True)
    assert [x is s.pristine[k] for x, k in zip(srcs, keys)] == [True] * 3  # one out-of-place pass
    assert all(t is not None and t.scale > 0 for t in first) and second == [None] * 3 and copies == []
    s.set(a)
    ws, srcs, first, second, copies = s.kernel_jobs(keys, b, resync=False)
    assert all(x is w for x, w in zip(srcs, ws))  # in place, both terms in one pass
    assert [t is not None for t in first] == [True, True, False]  # b does not target (1, q_proj)
    assert all(t is not None and t.scale < 0 for t in second)
    assert first[0].a is b.a[(0, "q_proj")] and second[0].b is a.b[(0, "q_proj")]  # ATMM layout, no copies
    # a pristine copy the kernel cannot read (non-contiguous here; another device in practice):
    # copied into W first, then merged in place
    k0 = keys[0]
    s.pristine[k0] = s.pristine[k0].t().contiguous().t()
    ws, srcs, first, second, copies = s.kernel_jobs(keys, b, resync=True)
    assert srcs[0] is ws[0] and len(copies) == 1 and copies[0][0] is ws[0] and copies[0][1] is s.pristine[k0]
    ws, srcs, first, second, copies = s.kernel_jobs(keys, None, resync=True)  # unmerge: W0 copies only
    assert len(ws) == 2 and first == [None, None] and all(w is not layers[k0].base.weight for w in ws)
    assert [c[0] for c in copies] == [layers[k0].base.weight]
    s.set(None)
    for key, lin in layers.items():
        assert torch.equal(lin.base.weight, s.pristine[key])


def test_switcher_picks_the_torch_op_for_what_the_kernel_cannot_take(monkeypatch):
    monkeypatch.setattr(
        switcher_mod, "kernel_can_take", lambda w, factors: all(a.shape[1] % 8 == 0 for a, _ in factors)
    )
    layers, (a, b) = _layers_and_adapters(ranks=(16, 4))
    s = Switcher(layers, strategy="delta", use_kernel=True)
    assert s.kernel_keys(a, resync=True) == list(layers)
    s.set(a)
    # switching to b (rank 4) needs b's factors where b targets the projection: torch op there
    assert s.kernel_keys(b, resync=False) == [(1, "q_proj")]


def test_cpu_switcher_does_not_use_the_kernel():
    layers, _ = _layers_and_adapters(dtype=torch.float32)
    assert Switcher(layers).use_kernel is False
    layers, _ = _layers_and_adapters()
    assert Switcher(layers).use_kernel is False  # bf16 on CPU


def test_switcher_caches_plans_per_adapter_pair_and_drops_dead_adapters(monkeypatch):
    monkeypatch.setattr(switcher_mod, "kernel_can_take", lambda w, factors: True)
    layers, (a, b) = _layers_and_adapters()
    s = Switcher(layers, strategy="delta", resync_every=0, use_kernel=True)
    s.set(a)  # resync (nothing merged): (None, a)
    s.set(b)  # delta: (a, b)
    s.set(a)  # delta: (b, a)
    plan_ab = s._plans[(id(a), id(b), False)][-1]
    s.set(b)  # (a, b) again: the cached plan
    assert s._plans[(id(a), id(b), False)][-1] is plan_ab and len(s._plans) == 3 and s.kernel_launches == 4
    # an adapter evicted from its slot (its DeviceAdapter dropped): entries naming it go at the next switch
    s.set(None)
    del a
    s.set(None)  # no-op (already pristine)
    c = _layers_and_adapters()[1][0]
    s.set(c)
    assert all(all(r is None or r() is not None for r in v[:2]) for v in s._plans.values())
    assert len(s._plans) <= switcher_mod.PLAN_CACHE
