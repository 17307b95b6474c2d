"""Tensor parallelism of the Qwen2-VL language model with S-LoRA's LoRA partitioning (issue #10).

One worker spans `world_size` devices; every rank holds 1/world_size of each decoder layer and
runs the same forward on the same inputs (Megatron-LM's layout, two all-reduces per layer):

    q/k/v_proj, gate/up_proj   column-parallel: output features sharded (W rows, bias too).
                               Rank r owns query heads [r·H/w, (r+1)·H/w) and KV heads
                               [r·KV/w, (r+1)·KV/w) — the same GQA groups, so attention (and the
                               rank's KV cache, local KV heads only) runs locally, no communication.
    o_proj, down_proj          row-parallel: input features sharded (W columns). Each rank's
                               x_shard·W_shard^T is a partial sum; ONE all-reduce per layer block
                               (attention, MLP) makes the full output; a bias is added after it.

LoRA follows the base weight it rides on (S-LoRA §5, "tensor parallelism"), in the multi-LoRA
op's layout A (in, r), B (r, out):

    column-parallel  A replicated (x·A computed in full on every rank; r is tiny), B sharded on
                     out like W: the rank's (x·A)·B_shard is exactly its slice of the output.
                     No extra communication.
    row-parallel     A sharded on in like W, B replicated: x_shard·A_shard·B is a partial sum
                     of the LoRA term, added into the base layer's partial output BEFORE the
                     layer's single all-reduce — the LoRA term rides on the base all-reduce,
                     no extra collective (also for the ATMM kernel, which adds into y in place).

`ColumnParallelLoraLinear` / `RowParallelLoraLinear` are `LoraLinear` subclasses: the step plan
(`StepLora`: segments, per-segment adapters, the deLoRA `MixtureEntry` terms) and the op
(`multi_lora_reference_` or the ATMM backend) are unchanged — an entry just hands out the
rank's sharded tensors, because the adapter was sharded with `shard_adapter` (a `MixtureEntry`
concatenates sharded factors along r, which keeps their sharding). The switcher (merged /
mixture modes) also works unchanged on the sharded weights: W_shard += s·(A·B)_shard, since
the slice of B·A is B_shard·A (column) or B·A_shard (row).

Embedding and lm_head stay REPLICATED on every rank (not vocab-parallel): after the last
all-reduce every rank holds the full hidden states, computes the same logits and (with the same
inputs) the same tokens. That costs one extra copy of the two vocab matrices per rank (2 × 1.5
GB at a 13B shape in bf16) and redundant lm_head work on the last tokens only; a vocab-parallel
lm_head (column-parallel + all-gather of the logits) is the next step if memory gets tight. The
vision tower is not sharded (run it on one rank and broadcast the embeddings, or on every rank).

Entry points: `shard_model_(model, tp)` shards a full model in place (every rank built the same
weights, e.g. the same seed or the same checkpoint) and installs the TP LoRA layers;
`shard_state_dict(sd, tp)` slices a full state dict; `load_full_state_dict_(model, sd, tp)`
copies a full checkpoint's slices into an already sharded model; `shard_adapter(weights, tp)`
shards an adapter; `local_features(shapes, tp)` gives the per-rank projection shapes (for the
ATMM backend's tables). `TPGroup` wraps the process group (world size 1: no communication).

The engine drives a TP group (engine.py, `EngineConfig.tp`), SPMD: one process per device, each
running its own Engine over its shard (`shard_model_` instead of `install_lora`; the fused
layers' projection groups concatenate the rank's column-parallel shards; `AtmmBackend` sized by
`local_features`). At the start of every step rank 0 broadcasts (`broadcast_object`, on a gloo
group beside NCCL) what arrived from outside — requests (prepared, without their raw images),
commands (mode switches, adapter loads with their bytes, offloads, make-resident), cancellations
and deadline expiries decided on its clock, the stop — and every rank applies the same events in
the same order; every other decision follows from identical state and the all-reduced outputs.
Each rank parses an adapter at full shape and keeps its `shard_adapter` in its pool. Followers
emit nothing; a random sampling seed is drawn once on rank 0. Tested on CPU only (2 gloo ranks,
tests/unit/test_tp_engine.py, against the single-process engine).

The gRPC worker starts the ranks (VALORA_TP_SIZE, services/worker/tp_ranks.py): its process is
rank 0 and serves; it spawns one process per other rank, each calling `init_tp_group` and running
its Engine until rank 0's stop (CPU-tested: tests/unit/test_worker_tp.py).

A failure on one rank only (an out-of-memory, a shard's bad input) stays a failure of the
requests involved, as on one device: the rank that raised inside a forward still runs the rest of
its all-reduces, over zeros (`drain`), so no rank waits in a collective its peer left; and after
every unit of device work the ranks compare their outcomes (`agree`, on the gloo event group): when
any rank failed, every rank raises (`TPStepFailed`, naming the rank and its error), so all of them
retry the same rows alone and fail the same ones; rows the output code failed on one rank are
failed on every rank at the next agreement (outputs.py). A rank that cannot go on in step with the
others (a collective failed: a rank died; a command failed on some ranks only, so their adapters
or modes differ) raises `GroupBroken`, which ends its engine loop: the worker goes NOT_SERVING and
exits non-zero (server.py's watchdog), as for any dead engine.
docs/engine.md ("Tensor parallelism") lists what the ranks agree on, and where.

Not done: any GPU run of the engine path: NCCL all-reduces inside the captured decode CUDA
graphs, the ATMM backend on sharded tables, the gloo event group's per-step cost are untested
here (no GPU); the stats report the rank's own KV memory (its KV heads only). The followers install the ATMM tile table
rank 0 got from the adapter store (tp_ranks.install_leader_table); none stored: the committed one.
A rank loads only its shard of a checkpoint (`model.load_sharded_model`: meta build, shard, fill
tensor by tensor); load_format "dummy" still builds the whole random model on every rank first.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import socket
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from services.common.adapter_format import TARGET_MODULES, BaseModelShapes, module_parent
from services.common.errors import ValoraError
from services.worker.adapter_weights import AdapterWeights
from services.worker.architectures import language_model
from services.worker.lora import LayerModule, LoraLinear, LoraRuntime

COLUMN_MODULES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_MODULES = ("o_proj", "down_proj")
assert set(COLUMN_MODULES) | set(ROW_MODULES) == set(TARGET_MODULES)


class GroupBroken(BaseException):
    """The tensor-parallel group cannot go on in lockstep: a collective failed (a rank died, the
    group timed out) or the ranks' states diverged. A BaseException: nothing that fails requests
    catches it; it ends the engine loop (the worker then goes NOT_SERVING and exits non-zero)."""


class TPStepFailed(ValoraError):
    """A unit of engine work (a forward, its tokens' choice) failed on another tensor-parallel
    rank, or on some ranks only: every rank raises this one, so all of them fail or retry the
    same requests (INTERNAL, ENGINE_STEP_FAILED, naming the rank and its error)."""


@dataclasses.dataclass
class Ledger:
    """A rank's count of the all-reduces it ran (eager; not those captured in a CUDA graph):
    how a forward that raised knows how many it still owes its peers (`TPGroup.drain`)."""

    all_reduces: int = 0


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the ranks agreed on after a unit of work (`TPGroup.agree`): the ranks whose unit
    raised (rank -> its error, as text) and the rows other ranks failed since the last
    agreement (sequence id -> why, naming the rank)."""

    failed: dict[int, str] = dataclasses.field(default_factory=dict)
    rows: dict[int, str] = dataclasses.field(default_factory=dict)

    def check(self, world_size: int, error: BaseException | None) -> None:
        """Raises unless every rank's unit ran: this rank's own error when every rank raised (the
        inputs' failure, the same everywhere), else TPStepFailed on every rank."""
        if not self.failed:
            return
        if error is not None and len(self.failed) == world_size:
            raise error
        where = "; ".join(f"rank {r}: {why}" for r, why in sorted(self.failed.items()))
        raise TPStepFailed(f"engine step failed on tensor-parallel rank{'s' if len(self.failed) > 1 else ''} "
                           f"{', '.join(map(str, sorted(self.failed)))} of {world_size} ({where})",
                           reason="ENGINE_STEP_FAILED") from error


def describe(error: BaseException, limit: int = 400) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclasses.dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group and its collectives (None: default group)."""

    rank: int = 0
    world_size: int = 1
    group: object = None
    # The group `broadcast_object` uses (None: `group`). init_tp_group gives an NCCL group a gloo
    # one over the same ranks: broadcast_object_list over NCCL stages the pickled bytes on the
    # device and reads their size on the host, which would wait for the decode step in flight at
    # every engine step (no pipelined decode).
    object_group: object = None
    ledger: Ledger = dataclasses.field(default_factory=Ledger, compare=False, repr=False)

    @classmethod
    def from_dist(cls, group=None) -> "TPGroup":
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t, group=self.group)
            if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):  # a replay runs it, not this call
                self.ledger.all_reduces += 1
        return t

    def drain(self, remaining: int, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """After this rank raised inside a forward: its `remaining` all-reduces of that forward
        (each of `numel` elements), over zeros, so the other ranks' forward completes instead of
        waiting in a collective this rank left (their result is garbage: the agreement after the
        forward fails it everywhere). GroupBroken when even that fails (the group is gone)."""
        if self.world_size == 1 or remaining <= 0:
            return
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()  # an out-of-memory: room for the zeros
            zeros = torch.zeros(numel, dtype=dtype, device=device)
            for _ in range(remaining):
                dist.all_reduce(zeros, group=self.group)
                zeros.zero_()
        except Exception as exc:  # noqa: BLE001 - the ranks cannot get back in step
            raise GroupBroken(f"tensor-parallel rank {self.rank} could not finish a failed forward's "
                              f"collectives: {describe(exc)}") from exc

    def _events(self):
        """The group of the host-side collectives (the step events, the agreements)."""
        return self.group if self.object_group is None else self.object_group

    def agree(self, error: BaseException | None = None, rows: Mapping[int, str] | None = None) -> Verdict:
        """Every rank calls it at the same point, after the same unit of work (`error`: what this
        rank's raised, or None; `rows`: the sequences this rank failed since the last agreement,
        id -> why): one small all-reduce over the event group, and only when some rank failed
        something, the reasons. Verdict.check raises when any rank's unit failed. GroupBroken
        when the collective itself fails (a rank is gone)."""
        if self.world_size == 1:
            return Verdict({0: describe(error)} if error is not None else {})
        group = self._events()
        try:
            flags = torch.tensor([int(error is not None), int(bool(rows))], dtype=torch.long)
            if dist.get_backend(group) == "nccl":
                flags = flags.cuda()
            dist.all_reduce(flags, group=group)
            if not int(flags.sum()):
                return Verdict()
            everyone: list = [None] * self.world_size
            dist.all_gather_object(everyone, (None if error is None else describe(error), dict(rows or {})),
                                   group=group)
        except Exception as exc:  # noqa: BLE001 - the group is gone
            raise GroupBroken(f"tensor-parallel rank {self.rank}: the ranks' agreement failed: {describe(exc)}") \
                from exc
        failed = {r: why for r, (why, _) in enumerate(everyone) if why is not None}
        others: dict[int, str] = {}
        for r, (_, theirs) in enumerate(everyone):
            if r != self.rank:
                for sid, why in theirs.items():
                    others.setdefault(sid, f"failed on tensor-parallel rank {r}: {why}")
        return Verdict(failed, others)

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            dist.broadcast(t, src=src, group=self.group)
        return t

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's picklable `obj`, on every rank (the engine's per-step events). With NCCL the
        pickled bytes travel through the current CUDA device."""
        if self.world_size == 1:
            return obj
        group = self._events()
        box = [obj if self.rank == 0 else None]
        src = 0 if group is None else dist.get_global_rank(group, 0)
        try:
            dist.broadcast_object_list(box, src=src, group=group)
        except Exception as exc:  # noqa: BLE001 - a rank is gone: the engine cannot go on
            raise GroupBroken(f"tensor-parallel rank {self.rank}: the step's broadcast failed: {describe(exc)}") \
                from exc
        return box[0]

    def min_int(self, n: int) -> int:
        """The smallest rank's `n`."""
        if self.world_size == 1:
            return n
        group = self._events()  # gloo when there is one
        t = torch.tensor([n], dtype=torch.long)
        if dist.get_backend(group) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return int(t.item())

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def part(self, n: int, what: str = "features") -> tuple[int, int]:
        """(start, length) of this rank's contiguous share of n; n must divide evenly."""
        if n % self.world_size:
            raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {self.world_size}")
        size = n // self.world_size
        return self.rank * size, size

    def narrow(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's shard of t along dim, as its own contiguous tensor (the full one can be freed)."""
        if self.world_size == 1:
            return t
        start, size = self.part(t.shape[dim])
        return t.narrow(dim, start, size).clone(memory_format=torch.contiguous_format)


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_tp_group(rank: int, world_size: int, port: int, backend: str | None = None,
                  device: torch.device | None = None, timeout_s: float = 300.0) -> TPGroup:
    """Joins the default process group on loopback (one host): gloo on CPU, NCCL on CUDA
    (keep NCCL_NVLS_ENABLE=0 in the environment on the lent H200 hosts) with a gloo group beside
    it for `broadcast_object`."""
    if backend is None:
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
    kw = {}
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs on loopback too, not the hostname's address
    if backend == "nccl" and device is not None:
        torch.cuda.set_device(device)
        kw["device_id"] = device
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kw)
    tp = TPGroup.from_dist()
    if backend == "nccl":
        tp = dataclasses.replace(tp, object_group=dist.new_group(backend="gloo"))
    return tp


# -- layers ------------------------------------------------------------------------------------

class ColumnParallelLoraLinear(LoraLinear):
    """Output features sharded; base and LoRA (A full, B sharded) computed locally: the forward
    is LoraLinear's, only the tensors are shards."""

    def __init__(self, base: nn.Linear, key: LayerModule, runtime: LoraRuntime, tp: TPGroup) -> None:
        super().__init__(base, key, runtime)
        self.tp = tp


class RowParallelLoraLinear(LoraLinear):
    """Input features sharded: partial base output + partial LoRA term (A sharded, B full), then
    the layer's one all-reduce, then the bias (held here, added once)."""

    def __init__(self, base: nn.Linear, key: LayerModule, runtime: LoraRuntime, tp: TPGroup,
                 bias: nn.Parameter | None = None) -> None:
        super().__init__(base, key, runtime)
        self.tp = tp
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # x_shard·W_shard^T += per segment s·(x_shard·A_shard)·B
        if not y.is_contiguous():
            y = y.contiguous()
        self.tp.all_reduce_(y)
        return y if self.bias is None else y + self.bias


TP_LAYERS = (ColumnParallelLoraLinear, RowParallelLoraLinear)


def _text_model(model: nn.Module) -> nn.Module:
    """The text model (decoder layers) of a ForConditionalGeneration, its base model or itself."""
    if hasattr(model, "layers"):
        return model
    if hasattr(model, "language_model"):
        return model.language_model
    return language_model(model)


def check_divisible(config, tp: TPGroup) -> None:
    """ValueError unless the text config's heads, KV heads and intermediate size split over tp."""
    tp.part(config.num_attention_heads, "attention heads")
    tp.part(config.num_key_value_heads or config.num_attention_heads,
            "KV heads (replicating KV heads across ranks is not supported)")
    tp.part(config.intermediate_size, "intermediate_size")


def _shard_linear_(lin: nn.Linear, module: str, tp: TPGroup) -> nn.Parameter | None:
    """Slices lin's weight (and bias) in place; returns a row-parallel layer's bias, detached from lin."""
    def param(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
        return nn.Parameter(t, requires_grad=like.requires_grad)

    w = lin.weight
    if module in COLUMN_MODULES:
        lin.weight = param(tp.narrow(w.data, 0), w)
        if lin.bias is not None:
            lin.bias = param(tp.narrow(lin.bias.data, 0), lin.bias)
        lin.out_features = lin.weight.shape[0]
        return None
    lin.weight = param(tp.narrow(w.data, 1), w)
    lin.in_features = lin.weight.shape[1]
    bias, lin.bias = lin.bias, None
    return bias


def shard_model_(model: nn.Module, tp: TPGroup, runtime: LoraRuntime | None = None) -> dict[LayerModule, LoraLinear]:
    """Shards a full model's decoder layers in place for (tp.rank, tp.world_size) and installs the
    TP LoRA layers on every LoRA-targetable projection; returns them by (layer, module) like
    `install_lora` (the switcher and the ATMM backend take that dict). Use it INSTEAD of
    `install_lora` on a TP worker, or after it: projections that are already LoraLinears are
    unwrapped and their runtime reused (a plain LoraLinear has no all-reduce: a row-parallel
    projection under it would return partial sums). `runtime`: the LoraRuntime every layer shares
    (default: install_lora's, else a new one). World size 1: the same model with TP layers that
    communicate nothing. Every rank must hold the same full weights before the call."""
    text = _text_model(model)
    if any(isinstance(m, TP_LAYERS) for m in text.modules()):
        raise ValueError("model is already sharded")
    config = text.config
    check_divisible(config, tp)
    wrapped: dict[LayerModule, LoraLinear] = {}
    for i, layer in enumerate(text.layers):
        attn = layer.self_attn
        for module in TARGET_MODULES:
            parent = getattr(layer, module_parent(module))
            lin = getattr(parent, module)
            rt = runtime
            if isinstance(lin, LoraLinear):
                rt = rt or lin.runtime
                lin = lin.base
            rt = rt or LoraRuntime()
            runtime = rt  # one runtime for the whole model
            bias = _shard_linear_(lin, module, tp)
            if module in COLUMN_MODULES:
                new = ColumnParallelLoraLinear(lin, (i, module), rt, tp)
            else:
                new = RowParallelLoraLinear(lin, (i, module), rt, tp, bias)
            setattr(parent, module, new)
            wrapped[(i, module)] = new
        # Local head counts (the forward reshapes with -1 heads; GQA groups per rank are unchanged).
        attn.num_heads = config.num_attention_heads // tp.world_size
        attn.num_key_value_heads = (config.num_key_value_heads or config.num_attention_heads) // tp.world_size
    return wrapped


# -- state dicts ---------------------------------------------------------------------------------

_PROJ = re.compile(r"layers\.\d+\.(?:self_attn|mlp)\.(?P<module>[a-z_]+_proj)\.(?:base\.)?(?P<what>weight|bias)$")


def _shard_dim(name: str) -> int | None:
    """Dimension along which a decoder-projection tensor is sharded (None: replicated or not ours)."""
    m = _PROJ.search(name)
    if m is None:  # the vision tower's blocks are named blocks.N.attn.qkv / mlp.fc1: never matched
        return None
    module, what = m["module"], m["what"]
    if module in COLUMN_MODULES:
        return 0
    if module in ROW_MODULES:
        return 1 if what == "weight" else None
    return None


def shard_state_dict(state_dict: Mapping[str, torch.Tensor], tp: TPGroup) -> dict[str, torch.Tensor]:
    """The rank's slices of a full state dict (names kept): language-model projection weights and
    biases sharded as `shard_model_` shards them, everything else (vision tower, embeddings,
    norms, lm_head, row-parallel biases) as is. Accepts HF names and the `.base.` names of a
    LoRA-wrapped model; text-model-only names (`layers.N...`) too."""
    out = {}
    for name, t in state_dict.items():
        dim = _shard_dim(name)
        out[name] = t if dim is None else tp.narrow(t, dim)
    return out


def load_full_state_dict_(model: nn.Module, state_dict: Mapping[str, torch.Tensor], tp: TPGroup,
                          strict: bool = True) -> None:
    """Copies a FULL checkpoint's slices into a model already sharded by `shard_model_` (names of
    the unwrapped HF model; the TP layers' `.base.` is mapped, a row-parallel bias found under
    the projection's `.bias`)."""
    missing = []
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            src = name.replace(".base.", ".")
            if src not in state_dict:
                if name in state_dict:
                    src = name
                else:
                    missing.append(name)
                    continue
            full = state_dict[src]
            dim = _shard_dim(src)
            part = full if dim is None else tp.narrow(full, dim)
            if part.shape != t.shape:
                raise ValueError(f"{name}: the checkpoint's shard is {tuple(part.shape)}, "
                                 f"the model holds {tuple(t.shape)}")
            t.copy_(part)
    # Non-persistent buffers (rotary inv_freq) are not in a state dict.
    persistent = set(model.state_dict())
    missing = [n for n in missing if n in persistent]
    if strict and missing:
        raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


# -- adapters ----------------------------------------------------------------------------------

def shard_lora(module: str, a: torch.Tensor, b: torch.Tensor, tp: TPGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's (A (in, r), B (r, out)) for this rank: column-parallel → (A, B[:, shard]),
    row-parallel → (A[shard, :], B)."""
    if module in COLUMN_MODULES:
        return a, tp.narrow(b, 1)
    if module in ROW_MODULES:
        return tp.narrow(a, 0), b
    raise ValueError(f"unknown module {module!r}")


def shard_lora_dicts(a: Mapping[LayerModule, torch.Tensor], b: Mapping[LayerModule, torch.Tensor],
                     tp: TPGroup) -> tuple[dict, dict]:
    out_a, out_b = {}, {}
    for key in a:
        out_a[key], out_b[key] = shard_lora(key[1], a[key], b[key], tp)
    return out_a, out_b


def shard_adapter(weights: AdapterWeights, tp: TPGroup) -> AdapterWeights:
    """The rank's copy of an adapter (validated at full shape by `parse_bundle` first); task heads
    read the replicated hidden state and stay whole. Put it in the rank's AdapterPool as usual."""
    a, b = shard_lora_dicts(weights.a, weights.b, tp)
    return dataclasses.replace(weights, a=a, b=b)


def local_features(shapes: BaseModelShapes, tp: TPGroup) -> dict[str, tuple[int, int]]:
    """Per-rank (in, out) of each projection: what the rank's ATMM tables must hold."""
    out = {}
    for module, (fin, fout) in shapes.features.items():
        if module in COLUMN_MODULES:
            out[module] = (fin, tp.part(fout, module)[1])
        else:
            out[module] = (tp.part(fin, module)[1], fout)
    return out


__all__ = [
    "COLUMN_MODULES", "ROW_MODULES", "ColumnParallelLoraLinear", "GroupBroken", "Ledger", "RowParallelLoraLinear",
    "TPGroup", "TPStepFailed", "Verdict", "check_divisible", "describe", "free_loopback_port", "init_tp_group",
    "load_full_state_dict_", "local_features", "shard_adapter", "shard_lora", "shard_lora_dicts", "shard_model_",
    "shard_state_dict",
]
