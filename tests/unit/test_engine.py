"""The worker engine on the tiny Qwen2-VL: batched multi-LoRA prefill + decoding checked token for token
against PEFT + HF generate, task heads, cancellation, sampling, stop sequences, the adapter
pool and the switcher (merged / mixture modes, drift-free switching)."""

from __future__ import annotations

import os
import queue
import threading

import pytest
import torch

from services.common.errors import AdapterNotFound, CapacityExceeded, FailedPrecondition, InvalidArgument
from services.worker.adapter_weights import parse_bundle
from services.worker.adapter_pool import AdapterPool
from services.worker.detokenizer import IncrementalDetokenizer
from services.worker.engine import Engine, EngineConfig
from services.worker.lora import LoraRuntime, install_lora
from services.worker.model import build_inputs, load_model
from services.worker.requests import Failed, Finished, FinishReason, OutputKind, TextDelta, WorkRequest
from services.common.modes import Mode
from services.worker.sampling import SamplingParams
from services.worker.switcher import Switcher
from services.worker.testing import TEST_KV_BYTES, random_adapter_bundle, random_image, write_peft_dir

A, B, C = "adapters/alpha/versions/1", "adapters/beta/versions/2", "adapters/gamma/versions/1"
LABELS = ["red", "green", "blue", "yellow"]
MAX_NEW = 10
# The same checks run on a GPU with VALORA_TEST_DEVICE=cuda (fp32, so PEFT agrees token for token).
DEVICE = os.environ.get("VALORA_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def bundles(model_path):
    return {
        A: random_adapter_bundle(model_path, rank=4, lora_alpha=8, seed=1),
        B: random_adapter_bundle(model_path, rank=8, lora_alpha=4, seed=2, heads={"color": LABELS}),
        C: random_adapter_bundle(model_path, rank=2, lora_alpha=2, seed=3, target_modules=("q_proj", "v_proj")),
    }


@pytest.fixture(scope="module")
def engine(model_path, bundles):
    eng = Engine(
        EngineConfig(
            model_path=model_path,
            device=DEVICE,
            max_batch_size=8,
            device_slots=3,
            kv_cache_bytes=TEST_KV_BYTES,
            default_max_new_tokens=MAX_NEW,
            max_waiting=64,
        )
    )
    eng.start()
    for name, b in bundles.items():
        assert eng.load_adapter_bytes(name, b.sha256, b.data, b.config_json, b.heads)
    yield eng
    eng.stop()


def peft_generate(model_path, bundle, img, prompt, tmp_path, max_new=MAX_NEW) -> list[int]:
    """Greedy tokens from HF generate on a fresh model, PEFT applying `bundle` (None: base)."""
    model = load_model(model_path, DEVICE)
    if bundle is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, write_peft_dir(bundle, tmp_path / f"peft-{bundle.sha256[:8]}")).eval()
    from services.worker.model import load_processor

    inputs = build_inputs(load_processor(model_path), [img], prompt).to(DEVICE)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def run_concurrently(engine, requests):
    """Submits every request before waiting on any; returns {request_id: (deltas, result)}.
    The engine loop is held meanwhile, so one step admits them all and the prefill batches
    (max_prefills_per_step at a time, in order) do not depend on timing."""
    preps = [engine.prepare(r) for r in requests]
    sinks = {}
    with engine._wake:  # re-entrant: submit() takes it too
        for r, prep in zip(requests, preps):
            q: queue.Queue = queue.Queue()
            engine.submit(prep, q.put)
            sinks[r.request_id] = q
    out = {}
    for rid, q in sinks.items():
        deltas = []
        while True:
            ev = q.get(timeout=60)
            if isinstance(ev, TextDelta):
                deltas.append(ev.text)
            elif isinstance(ev, Finished):
                out[rid] = (deltas, ev.result)
                break
            else:
                raise ev.error
    return out


def test_logprobs_are_the_models_token_log_probabilities(engine, model_path, bundles, tmp_path):
    """logprobs=3 (OpenAI's logprobs + top_logprobs): every generated token's log-probability and
    the 3 most likely at its position equal log_softmax of PEFT + HF generate's scores there, in
    a batch beside a row that asks for none (prefill's first token and the decode steps alike)."""
    from peft import PeftModel

    from services.worker.model import load_processor

    img, prompt = random_image(5), "Describe the image."
    got = run_concurrently(
        engine,
        [
            WorkRequest("lp", prompt, [img], adapter=A, max_new_tokens=6, logprobs=3),
            WorkRequest("no-lp", prompt, [img], adapter=A, max_new_tokens=6),
        ],
    )
    model = PeftModel.from_pretrained(
        load_model(model_path, DEVICE), write_peft_dir(bundles[A], tmp_path / "peft-lp")
    ).eval()
    inputs = build_inputs(load_processor(model_path), [img], prompt).to(DEVICE)
    with torch.no_grad():
        ref = model.generate(
            **inputs, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
    r = got["lp"][1]
    assert r.token_ids == ref.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(r.logprobs) == len(r.token_ids) and got["no-lp"][1].logprobs == []
    for token, lp, scores in zip(r.token_ids, r.logprobs, ref.scores):
        want = torch.log_softmax(scores[0].float(), -1)
        top = want.topk(3)
        assert lp.token_id == token and abs(lp.logprob - float(want[token])) < 1e-3
        assert [i for i, _ in lp.top] == top.indices.tolist() and lp.top[0][0] == token  # greedy
        assert all(abs(v - float(w)) < 1e-3 for (_, v), w in zip(lp.top, top.values))


def test_repetition_penalty_gives_hf_generates_tokens(engine, model_path, bundles, tmp_path):
    """repetition_penalty 1.8 (greedy, with an adapter), beside a request without penalties:
    token for token PEFT + HF generate's with the same penalty over prompt and output; a sampled
    row with frequency and presence penalties is reproducible by its seed."""
    from peft import PeftModel

    from services.worker.model import load_processor

    img, prompt = random_image(6), "Describe the image."
    penalized = SamplingParams(repetition_penalty=1.8)
    sampled = SamplingParams(temperature=0.9, seed=5, frequency_penalty=1.5, presence_penalty=0.5)
    reqs = [
        WorkRequest("rep", prompt, [img], adapter=A, max_new_tokens=12, sampling=penalized),
        WorkRequest("plain", prompt, [img], adapter=A, max_new_tokens=12),
        WorkRequest("freq", prompt, [img], adapter=A, max_new_tokens=12, sampling=sampled),
    ]
    got = run_concurrently(engine, reqs)
    again = run_concurrently(engine, reqs[2:])
    model = PeftModel.from_pretrained(
        load_model(model_path, DEVICE), write_peft_dir(bundles[A], tmp_path / "peft-rep")
    ).eval()
    inputs = build_inputs(load_processor(model_path), [img], prompt).to(DEVICE)
    with torch.no_grad():
        want = model.generate(**inputs, max_new_tokens=12, do_sample=False, repetition_penalty=1.8)
    assert got["rep"][1].token_ids == want[0, inputs["input_ids"].shape[1] :].tolist()
    assert got["rep"][1].token_ids != got["plain"][1].token_ids  # the penalty changed the answer
    assert again["freq"][1].token_ids == got["freq"][1].token_ids


def test_a_token_prompt_generates_what_its_text_does(engine):
    """A raw prompt as token ids (OpenAI's token prompts): the tokens its text generates, with an
    adapter and without, batched beside the text requests."""
    text = "Once upon a time there was"
    ids = engine.tokenizer(text)["input_ids"]
    reqs = [
        WorkRequest(
            f"{kind}-{a}",
            text if kind == "text" else "",
            raw_prompt=True,
            adapter=a,
            prompt_token_ids=[] if kind == "text" else ids,
            max_new_tokens=8,
        )
        for kind in ("text", "ids")
        for a in (None, A)
    ]
    got = run_concurrently(engine, reqs)
    for a in (None, A):
        assert got[f"ids-{a}"][1].token_ids == got[f"text-{a}"][1].token_ids
        assert got[f"ids-{a}"][1].prompt_tokens == len(ids)
    assert got["text-None"][1].token_ids != got[f"text-{A}"][1].token_ids


def test_batched_requests_of_different_adapters_match_peft(engine, model_path, bundles, tmp_path):
    prompt = "Describe the image."
    targets = {"base": None, "a": A, "b": B, "c": C}
    imgs = {"base": random_image(1), "a": random_image(1), "b": random_image(2, 112), "c": random_image(1)}
    reqs = [
        WorkRequest(f"{name}-{i}", prompt, [imgs[name]], adapter=ad, max_new_tokens=MAX_NEW)
        for i in range(2)
        for name, ad in targets.items()
    ]
    engine.decoder.peak_entries = 0
    results = run_concurrently(engine, reqs)
    assert engine.decoder.peak_entries >= 2, "requests of different adapters never shared a decode step"
    got = {}
    for rid, (deltas, r) in results.items():
        name = rid.split("-")[0]
        assert "".join(deltas) == r.text
        assert r.output_tokens == len(r.token_ids) > 0 and r.image_tokens in (4, 16)
        assert r.prompt_tokens > r.image_tokens
        assert r.mode == (Mode.BASE if name == "base" else Mode.UNMERGED)
        assert r.adapter == (targets[name] or "")
        got.setdefault(name, set()).add(tuple(r.token_ids))
    assert all(len(v) == 1 for v in got.values()), got
    for name, ad in targets.items():
        want = peft_generate(model_path, bundles[ad] if ad else None, imgs[name], prompt, tmp_path)
        assert list(got[name].pop()) == want, name
        got[name] = want
    # An ignored adapter would reproduce the base tokens.
    assert got["a"] != got["base"] and got["c"] != got["base"]


def test_label_request_returns_reference_argmax(engine, model_path, bundles, tmp_path):
    from peft import PeftModel

    img = random_image(5)
    _, r = engine.generate(
        WorkRequest("lbl", "What color is it?", [img], adapter=B, output_kind=OutputKind.LABEL, head="color")
    )
    model = PeftModel.from_pretrained(load_model(model_path, DEVICE), write_peft_dir(bundles[B], tmp_path / "b")).eval()
    from services.worker.model import load_processor

    inputs = build_inputs(load_processor(model_path), [img], "What color is it?").to(DEVICE)
    with torch.no_grad():
        hidden = model.base_model.model.model(**inputs).last_hidden_state[0, -1].cpu()
    w = parse_bundle(B, "", bundles[B].data, bundles[B].config_json, engine.shapes).heads["color"]
    probs = torch.softmax(hidden @ w[0].t() + w[1], dim=-1)
    assert r.finish_reason == FinishReason.LABEL and r.mode == Mode.UNMERGED
    assert r.label == LABELS[int(probs.argmax())]
    assert [s[0] for s in r.scores][0] == r.label and len(r.scores) == len(LABELS)
    assert dict(r.scores)[r.label] == pytest.approx(float(probs.max()), abs=1e-4)
    with pytest.raises(InvalidArgument):
        engine.submit(
            engine.prepare(WorkRequest("x", "?", [img], adapter=B, output_kind=OutputKind.LABEL, head="nope")),
            lambda ev: None,
        )
    with pytest.raises(AdapterNotFound):
        engine.submit(engine.prepare(WorkRequest("x", "?", [img], adapter="adapters/zz/versions/1")), lambda ev: None)


def test_cancellation_frees_sequence_and_kv_cache(engine):
    events: queue.Queue = queue.Queue()
    first = threading.Event()

    def sink(ev):
        events.put(ev)
        first.set()

    handle = engine.submit(
        engine.prepare(WorkRequest("long", "Count the objects.", [random_image(3)], adapter=A, max_new_tokens=1000)),
        sink,
    )
    assert first.wait(30)
    for _ in range(600):  # stats are published at the end of each step
        s = engine.stats()
        if s.kv_cache_bytes > 0:
            break
        threading.Event().wait(0.01)
    assert s.running == 1 and s.kv_cache_bytes > 0
    handle.cancel()
    for _ in range(600):
        s = engine.stats()
        if s.running == 0 and s.kv_cache_bytes == 0:
            break
        threading.Event().wait(0.05)
    assert s.running == 0 and s.kv_cache_bytes == 0
    last = None
    while not events.empty():
        last = events.get()
    assert isinstance(last, Failed) and last.error.reason == "CANCELLED"


def test_sampling_is_seeded_and_stop_sequences_cut_text(engine):
    img = random_image(4)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7)
    runs = [
        engine.generate(WorkRequest(f"s{i}", "Hello", [img], sampling=params, max_new_tokens=12))[1] for i in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids
    greedy = engine.generate(WorkRequest("g", "Describe the image.", [img], max_new_tokens=MAX_NEW))[1]
    assert len(greedy.text) >= 4
    stop = greedy.text[2:4]
    deltas, r = engine.generate(WorkRequest("st", "Describe the image.", [img], stop=[stop], max_new_tokens=MAX_NEW))
    assert r.finish_reason == FinishReason.STOP_SEQUENCE
    assert r.text == greedy.text[: greedy.text.find(stop)] and "".join(deltas) == r.text


def test_incremental_detokenizer_never_splits_characters(engine):
    tok = engine.tokenizer
    text = "Ünïcödé 漢字 🚗 ok"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    deltas = [d.push(i) for i in ids] + [d.finish()]
    assert "".join(deltas) == text and not any("\ufffd" in x for x in deltas)
    d = IncrementalDetokenizer(tok, stop=["漢字"])
    out = "".join(d.push(i) for i in ids) + d.finish()
    assert out == "Ünïcödé " and d.stopped


def test_detokenizer_stream_and_window_paths_equal_a_full_decode(engine):
    """Random token sequences (byte-level pieces that split characters, invalid UTF-8 included):
    the deltas plus the final flush equal one full decode, on the fast tokenizer's DecodeStream
    path and on the sliding-window path of tokenizers without a Rust backend."""
    import random

    tok = engine.tokenizer

    class WindowOnly:  # no backend_tokenizer: the sliding-window path
        def decode(self, *args, **kw):
            return tok.decode(*args, **kw)

    vocab = tok.backend_tokenizer.get_vocab_size()
    for seed in range(200):
        rng = random.Random(seed)
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        full = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        for t in (tok, WindowOnly()):
            d = IncrementalDetokenizer(t)
            assert "".join(d.push(i) for i in ids) + d.finish() == full, (seed, type(t).__name__)


def test_queue_limit_and_bad_params(model_path):
    eng = Engine(EngineConfig(model_path=model_path, max_waiting=1, max_new_tokens_limit=16))
    eng.start()
    try:
        with pytest.raises(InvalidArgument):
            eng.prepare(WorkRequest("x", "hi", max_new_tokens=17))
        vocab = eng.text_config.vocab_size
        for bias, field in (
            (((vocab, 1.0),), f"item.params.logit_bias[{vocab}]"),
            (((-1, 1.0),), "item.params.logit_bias[-1]"),
            (((5, 100.5),), "item.params.logit_bias[5]"),
            (((5, float("nan")),), "item.params.logit_bias[5]"),
            (tuple((t, 1.0) for t in range(301)), "item.params.logit_bias"),
        ):
            with pytest.raises(InvalidArgument) as exc:
                eng.prepare(WorkRequest("x", "hi", max_new_tokens=1, sampling=SamplingParams(logit_bias=bias)))
            assert exc.value.field_violations[0].field == field
        eng.prepare(
            WorkRequest(
                "x", "hi", max_new_tokens=1, sampling=SamplingParams(logit_bias=((vocab - 1, -100.0), (0, 100.0)))
            )
        )
        prep = eng.prepare(WorkRequest("x", "hi", max_new_tokens=1))
        with eng._wake:  # hold the loop so the first request stays queued
            eng.submit(prep, lambda ev: None)
            with pytest.raises(CapacityExceeded):
                eng.submit(prep, lambda ev: None)
    finally:
        eng.stop()
    assert not eng.alive


def test_adapter_pool_lru_never_evicts_held_slots(model_path, bundles, engine):
    pool = AdapterPool(torch.device("cpu"), torch.float32, device_slots=2)
    for name, b in bundles.items():
        pool.add(parse_bundle(name, b.sha256, b.data, b.config_json, engine.shapes))
    assert pool.acquire(A) is not None and pool.to_device(B) is not None
    assert pool.to_device(C) is not None  # evicts B (A is held)
    assert pool.resident_names() == sorted([A, C])
    assert pool.acquire(C) is not None and pool.acquire(B) is None  # both slots held
    with pytest.raises(FailedPrecondition):
        pool.remove(A)
    pool.release(A)
    assert pool.acquire(B) is not None and pool.resident_names() == sorted([B, C])
    w = pool.get(C)
    assert w.rank == 2 and set(m for _, m in w.a) == {"q_proj", "v_proj"}
    assert w.a[(0, "q_proj")].shape == (128, 2) and w.b[(0, "q_proj")].shape == (2, 128)


def test_merged_and_mixture_modes_match_unmerged_outputs(engine):
    img = random_image(6)
    reqs = {"base": None, "a": A, "b": B}

    def run_all():
        return {
            n: engine.generate(WorkRequest(n, "What is in this picture?", [img], adapter=ad))[1]
            for n, ad in reqs.items()
        }

    unmerged = run_all()
    try:
        engine.set_mode(Mode.MERGED, A)
        merged = run_all()
        assert engine.stats().mode == Mode.MERGED and engine.stats().merged_adapter == A
        engine.set_mode(Mode.MIXTURE, B)
        mixture = run_all()
    finally:
        engine.set_mode(Mode.UNMERGED)
    again = run_all()
    assert merged["a"].mode == Mode.MERGED and merged["b"].mode == Mode.MIXTURE
    assert merged["base"].mode == Mode.MIXTURE and mixture["b"].mode == Mode.MERGED
    for n in reqs:
        assert merged[n].token_ids == unmerged[n].token_ids, n
        assert mixture[n].token_ids == unmerged[n].token_ids, n
        assert again[n].token_ids == unmerged[n].token_ids, n
    with pytest.raises(FailedPrecondition):
        engine.set_mode(Mode.MERGED, A)
        try:
            engine.offload_adapter(A)
        finally:
            engine.set_mode(Mode.UNMERGED)


@pytest.mark.parametrize("strategy", ["pristine", "delta"])
def test_repeated_switching_does_not_drift(model_path, bundles, engine, strategy):
    def fresh():
        model = load_model(model_path)
        layers = install_lora(model, LoraRuntime())
        pool = AdapterPool(torch.device("cpu"), torch.float32, device_slots=2)
        for name in (A, B):
            b = bundles[name]
            pool.add(parse_bundle(name, b.sha256, b.data, b.config_json, engine.shapes))
        return layers, pool

    layers, pool = fresh()
    sw = Switcher(layers, strategy=strategy, resync_every=64)
    da, db = pool.slot(pool.to_device(A)), pool.slot(pool.to_device(B))
    for _ in range(1000 if strategy == "pristine" else 300):  # delta: 600 switches, 9 resyncs
        sw.set(da)
        sw.set(db)
    sw.set(da)
    ref_layers, ref_pool = fresh()
    Switcher(ref_layers).set(ref_pool.slot(ref_pool.to_device(A)))
    for key, lin in layers.items():
        want = ref_layers[key].base.weight
        if strategy == "pristine":
            assert torch.equal(lin.base.weight, want), key
        else:
            torch.testing.assert_close(lin.base.weight, want, rtol=0, atol=1e-5)
    sw.set(None)
    base = load_model(model_path).state_dict()
    for (i, m), lin in layers.items():
        parent = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
        assert torch.equal(lin.base.weight, base[f"model.language_model.layers.{i}.{parent}.{m}.weight"])


def test_full_device_slots_block_only_their_adapter(model_path, bundles):
    """One device slot held by a running request: another adapter's request waits (without
    blocking a base request queued behind it) and runs once the slot is free."""
    eng = Engine(EngineConfig(model_path=model_path, device_slots=1, max_batch_size=4))
    eng.start()
    try:
        for name in (A, B):
            eng.load_adapter_bytes(name, bundles[name].sha256, bundles[name].data, bundles[name].config_json)
        started = threading.Event()
        long = eng.submit(
            eng.prepare(WorkRequest("hold", "Count.", adapter=A, max_new_tokens=1000)), lambda ev: started.set()
        )
        assert started.wait(30)
        waiting: queue.Queue = queue.Queue()
        eng.submit(eng.prepare(WorkRequest("b", "Count.", adapter=B, max_new_tokens=2)), waiting.put)
        _, base = eng.generate(WorkRequest("base", "Count.", max_new_tokens=2))
        assert base.output_tokens == 2 and waiting.empty() and eng.stats().waiting == 1
        long.cancel()
        while not isinstance(ev := waiting.get(timeout=30), Finished):
            assert isinstance(ev, TextDelta)
        assert ev.result.adapter == B and eng.stats().resident_adapters == [B]
    finally:
        eng.stop()


def test_tiny_model_loads_back_with_auto_classes(model_path):
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_path)
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_path)
    tok = processor.tokenizer
    for attr, token in (
        ("image_token_id", "<|image_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
        ("video_token_id", "<|video_pad|>"),
    ):
        assert getattr(model.config, attr) == tok.convert_tokens_to_ids(token)
    assert model.config.text_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    inputs = build_inputs(processor, [random_image(1, 56), random_image(2, 112)], "Hi")
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(model.config.image_token_id) == 4 + 16
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 8]]
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("Hi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.gpu
def test_atmm_kernel_matches_torch_reference_on_gpu(model_path, tmp_path):
    """bf16 on CUDA: every projection's multi-LoRA term (adapters and a rank-2r mixture term)
    through ATMM is close to the torch reference, and a mixed unmerged batch decodes to the same
    tokens. (Greedy tokens of bf16 mixture steps may differ at near-ties: summation order.)"""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from kernels.reference import multi_lora_reference_
    from services.worker.atmm_backend import AtmmBackend
    from services.worker.lora import StepLora

    if not AtmmBackend.available(torch.device("cuda"), torch.bfloat16):
        pytest.skip("the kernels extension is not built here")
    ads = {
        f"adapters/k{r}/versions/1": random_adapter_bundle(model_path, rank=r, lora_alpha=r, seed=r) for r in (8, 16)
    }
    names = [None, *ads]
    reqs = [
        WorkRequest(f"r{i}", "Describe the image.", [random_image(i)], adapter=names[i % 3], max_new_tokens=8)
        for i in range(6)
    ]
    outs = []
    for use_atmm in (True, False):
        eng = Engine(
            EngineConfig(
                model_path=model_path, device="cuda", dtype="bfloat16", use_atmm=use_atmm, kv_cache_bytes=TEST_KV_BYTES
            )
        )
        eng.start()
        try:
            assert (eng.runtime.backend is not None) == use_atmm
            for name, b in ads.items():
                eng.load_adapter_bytes(name, b.sha256, b.data, b.config_json)
            outs.append({rid: r.token_ids for rid, (_, r) in run_concurrently(eng, reqs).items()})
            if use_atmm:
                assert eng.runtime.backend.plan.version > 0  # steps ran on the kernel
                eng.set_mode(Mode.MIXTURE, names[1])
                seqs = [
                    eng.lora.entry(("lora", names[2])),
                    eng.lora.entry(("mix", names[2], names[1])),
                    eng.lora.entry(("mix", "", names[1])),
                ]
                step = StepLora(seqs, [-1, 0, 0, 1, 1, 1, 2], 5)
                assert eng.runtime.backend.begin(step)
                g = torch.Generator(device="cuda").manual_seed(0)
                for key, lin in eng.lora_layers.items():
                    fin, fout = eng.shapes.features[key[1]]
                    x = torch.randn(35, fin, device="cuda", generator=g).to(torch.bfloat16)
                    y0 = torch.randn(35, fout, device="cuda", generator=g).to(torch.bfloat16)
                    want = multi_lora_reference_(y0.clone(), x, *step.for_key(key))
                    got = y0.clone()
                    eng.runtime.backend.run(key, got, x, step)
                    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
                backend = eng.runtime.backend

                def check_groups(step):  # every LoraGroup's term vs the reference per part
                    for group, parts in backend.groups.items():
                        sizes = [eng.shapes.features[k[1]][1] for k in parts]
                        x = torch.randn(35, eng.shapes.features[parts[0][1]][0], device="cuda", generator=g)
                        x = x.to(torch.bfloat16)
                        y0 = torch.randn(35, sum(sizes), device="cuda", generator=g).to(torch.bfloat16)
                        want = torch.cat(
                            [
                                multi_lora_reference_(col.clone(), x, *step.for_key(k))
                                for k, col in zip(parts, y0.split(sizes, dim=1))
                            ],
                            dim=1,
                        )
                        got = y0.clone()
                        backend.run_group(group, parts, got, x, step)
                        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)

                assert backend.grouped == {"qkv_proj", "gate_up_proj"}  # q/k/v and gate/up as one call each
                check_groups(step)
                # an entry whose q+k+v ranks exceed the kernel's 128: per part, into column views
                big = random_adapter_bundle(model_path, rank=48, lora_alpha=48, seed=48)
                eng.load_adapter_bytes("adapters/k48/versions/1", big.sha256, big.data, big.config_json)
                assert eng.pool.acquire("adapters/k48/versions/1") is not None  # resident, as a request makes it
                step = StepLora(
                    [eng.lora.entry(("lora", "adapters/k48/versions/1")), seqs[0]], [-1, 0, 0, 0, 1, 1, 1], 5
                )
                assert backend.begin(step) and backend.grouped == {"gate_up_proj"}  # 3 x 48 > 128 for q/k/v
                check_groups(step)
        finally:
            eng.stop()
    assert outs[0] == outs[1]


def peft_release_reference(model_path, bundle, img, prompt, tmp_path, release_after, max_new) -> list[int]:
    """Greedy decoding by hand on PEFT: the adapter for the prompt and the first `release_after`
    tokens, then the same KV cache continued with the adapter disabled (the base model)."""
    from peft import PeftModel

    from services.worker.model import load_processor

    model = PeftModel.from_pretrained(
        load_model(model_path, DEVICE), write_peft_dir(bundle, tmp_path / "peft-release")
    ).eval()
    inputs = build_inputs(load_processor(model_path), [img], prompt).to(DEVICE)
    tokens: list[int] = []
    with torch.no_grad():
        out = model(**inputs, use_cache=True)
        while True:
            tokens.append(int(out.logits[0, -1].argmax()))
            if len(tokens) == max_new:
                return tokens
            step = dict(
                input_ids=torch.tensor([[tokens[-1]]], device=DEVICE),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
            if len(tokens) >= release_after:
                with model.disable_adapter():
                    out = model(**step)
            else:
                out = model(**step)


def test_early_adapter_release(engine, model_path, bundles, tmp_path):
    """LoRazor-style release after half the tokens: the first half equals the adapter run, the
    rest continues on the base path with the adapter's KV cache (PEFT reference, adapter disabled
    mid-generation), in a mixed batch and in merged mode alike; 0 changes nothing."""
    img, prompt, n = random_image(7), "Describe the image.", 8
    req = lambda rid, f=0.0, ad=A: WorkRequest(
        rid, prompt, [img], adapter=ad, max_new_tokens=n, adapter_release_fraction=f
    )
    got = {
        rid: r
        for rid, (_, r) in run_concurrently(
            engine,
            [
                req("full"),
                req("half", 0.5),
                req("off", 0.0),
                req("base", 0.5, None),
                req("base0", 0.0, None),
                req("b", 0.5, B),
            ],
        ).items()
    }
    full, half = got["full"].token_ids, got["half"].token_ids
    assert len(full) == len(half) == n and got["half"].finish_reason == FinishReason.LENGTH
    assert half[: n // 2] == full[: n // 2] and half != full, "release changed nothing (or too much)"
    assert half == peft_release_reference(model_path, bundles[A], img, prompt, tmp_path, n // 2, n)
    assert got["off"].token_ids == full and got["half"].mode == Mode.UNMERGED
    assert got["base"].token_ids == got["base0"].token_ids  # nothing to release without an adapter
    # what the worker counts (valora:adapter_releases_total): released rows only, at their point
    assert {rid: r.released_after_tokens for rid, r in got.items()} == {
        "full": 0,
        "half": n // 2,
        "off": 0,
        "base": 0,
        "base0": 0,
        "b": n // 2,
    }
    try:
        engine.set_mode(Mode.MERGED, A)
        merged = run_concurrently(engine, [req("m-half", 0.5), req("m-full")])
    finally:
        engine.set_mode(Mode.UNMERGED)
    assert merged["m-half"][1].token_ids == half and merged["m-half"][1].mode == Mode.MERGED
    assert merged["m-full"][1].token_ids == full
    with pytest.raises(InvalidArgument):
        engine.prepare(req("bad", 1.5))


def test_released_adapter_leaves_its_device_slot(engine, model_path):
    """After the release the request no longer holds its adapter: it can even be offloaded while
    the request keeps decoding on the base model."""
    name = "adapters/delta/versions/1"
    b = random_adapter_bundle(model_path, rank=2, seed=9)
    engine.load_adapter_bytes(name, b.sha256, b.data, b.config_json)
    events: queue.Queue = queue.Queue()
    handle = engine.submit(
        engine.prepare(
            WorkRequest(
                "rel", "Count.", [random_image(8)], adapter=name, max_new_tokens=1000, adapter_release_fraction=0.004
            )
        ),
        events.put,
    )  # 4 tokens
    try:
        assert isinstance(events.get(timeout=30), TextDelta)  # running: admitted, slot pinned
        for _ in range(1000):
            try:
                engine.offload_adapter(name)  # ADAPTER_IN_USE until the release
                break
            except FailedPrecondition as exc:
                assert exc.reason == "ADAPTER_IN_USE"
                threading.Event().wait(0.01)
        assert not engine.pool.has(name)
        for _ in range(3):  # and it keeps going on the base model
            assert isinstance(events.get(timeout=30), TextDelta)
        assert engine.stats().running == 1
    finally:
        handle.cancel()


def test_lora_entries_survive_mode_switches_unless_their_adapter_left(model_path, bundles):
    """A mode switch keeps the cached LoRA entries (rebuilding them costs new factor copies and
    kernel table writes on the next step) but drops one whose adapter left the device (it would
    keep the adapter's tensors alive)."""
    eng = Engine(EngineConfig(model_path=model_path, device_slots=3))
    eng.start()
    try:
        for name in (A, B):
            b = bundles[name]
            eng.load_adapter_bytes(name, b.sha256, b.data, b.config_json, b.heads, to_device=True)
        a_entry = eng.lora.entry(("lora", A))
        eng.lora.entry(("lora", B))
        mix = eng.lora.entry(("mix", B, A))
        eng.set_mode(Mode.MERGED, A)
        eng.set_mode(Mode.UNMERGED)
        assert eng.lora.entry(("lora", A)) is a_entry and eng.lora.entry(("mix", B, A)) is mix
        eng.offload_adapter(B)
        eng.set_mode(Mode.MERGED, A)
        assert eng.lora.entries == {("lora", A): a_entry}
    finally:
        eng.stop()


def test_only_the_adapter_commands_run(engine):
    # Tensor-parallel followers run what rank 0 broadcasts by name: nothing but the commands.
    from services.worker.lora_manager import COMMANDS, Command

    for name in ("__init__", "pool", "planner", "run"):
        assert name not in COMMANDS
        with pytest.raises(ValueError, match="unknown adapter command"):
            engine.adapters.run(Command(name, ()))


def test_host_adapters_stay_in_their_budget_never_dropping_held_or_merged_ones(model_path):
    """300 distinct adapters must not grow a worker without bound: a load past
    host_adapter_bytes drops the least recently used idle adapters, never one a request holds
    or the merged one; a dropped one loads again."""
    bundles = {f"adapters/h{i}/versions/1": random_adapter_bundle(model_path, rank=4, seed=100 + i) for i in range(8)}
    names = list(bundles)
    one = len(bundles[names[0]].data)
    eng = Engine(EngineConfig(model_path=model_path, device_slots=3, host_adapter_bytes=int(3.5 * one)))
    eng.start()
    try:

        def load(name):
            b = bundles[name]
            return eng.load_adapter_bytes(name, b.sha256, b.data, b.config_json)

        load(names[0])
        eng.set_mode(Mode.MERGED, names[0])
        load(names[1])
        assert eng.pool.acquire(names[1]) is not None  # held, as by a running request
        for name in names[2:]:
            load(name)
            assert eng.pool.host_bytes() <= 3.5 * one * 1.05, eng.pool.host_names()
        held = set(eng.pool.host_names())
        assert {names[0], names[1], names[-1]} <= held and len(held) <= 3, held
        assert load(names[2])  # dropped earlier: loads again (True: newly added)
        eng.pool.release(names[1])
    finally:
        eng.stop()
