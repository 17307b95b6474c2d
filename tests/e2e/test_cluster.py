"""The whole path, for real: four service processes on loopback, a registered adapter per
request, outputs checked token for token against PEFT on the same weights in this process."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image

from services.common.adapter_format import BaseModelShapes, make_random_bundle
from valora.client import ValoraClient
from valora.errors import ValoraRpcError

pytestmark = pytest.mark.e2e
MAX_NEW = 8
REPO = Path(__file__).resolve().parents[2]


def png(seed: int, size: int = 56) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    """The e2e suite's shared cluster (tests/e2e/conftest.py), on the session's `model_path`."""
    return shared_cluster


@pytest.fixture(scope="module")
def adapters(cluster, model_path):
    """Two adapters of different ranks, registered through the gateway's admin API."""
    shapes = BaseModelShapes.from_config(json.loads((model_path / "config.json").read_text()))
    out = {}
    with ValoraClient(cluster.gateway) as client:
        for name, rank in (("alpha", 8), ("beta", 4)):
            bundle, cfg = make_random_bundle(shapes, rank=rank, seed=rank, lora_alpha=2 * rank)
            version = client.upload_adapter_version(name, bundle, cfg, request_id=f"e2e-{name}")
            client.set_alias(f"adapters/{name}", "prod", version.name)
            out[name] = (version, bundle, cfg)
    return out


def peft_reference(
    model_path: Path, bundle: bytes | None, cfg: str | None, image: bytes, prompt: str, tmp: Path
) -> str:
    """Greedy text from HF generate, with PEFT applying the adapter (None: base model)."""
    import torch
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    from services.worker.model import build_inputs

    model = Qwen2VLForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32).eval()
    if bundle is not None:
        from peft import PeftModel

        adir = tmp / "peft-adapter"
        adir.mkdir(exist_ok=True)
        (adir / "adapter_model.safetensors").write_bytes(bundle)
        (adir / "adapter_config.json").write_text(cfg)
        model = PeftModel.from_pretrained(model, adir).eval()
    processor = AutoProcessor.from_pretrained(model_path)
    inputs = build_inputs(processor, [Image.open(io.BytesIO(image)).convert("RGB")], prompt)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_concurrent_mixed_requests_match_peft_reference(cluster, adapters, model_path, tmp_path):
    image = png(1)
    prompt = "What is in this picture?"
    targets = {"base": None, "alpha": "adapters/alpha@prod", "beta": "adapters/beta/versions/1"}
    with ValoraClient(cluster.gateway) as client:

        def run(name):
            return name, client.infer(prompt, [image], adapter=targets[name], max_new_tokens=MAX_NEW)

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(run, ["base", "alpha", "beta"] * 2))
    texts: dict[str, set[str]] = {}
    for name, r in results:
        texts.setdefault(name, set()).add(r.text)
        assert r.output_tokens > 0 and r.image_tokens > 0 and r.prompt_tokens > r.image_tokens
        assert r.adapter_version == ("" if name == "base" else adapters[name][0].name)
        assert r.mode == ("base" if name == "base" else "unmerged") or r.mode in ("merged", "mixture")
    assert all(len(t) == 1 for t in texts.values()), f"same request gave different texts: {texts}"
    for name in targets:
        bundle, cfg = (None, None) if name == "base" else adapters[name][1:]
        want = peft_reference(model_path, bundle, cfg, image, prompt, tmp_path)
        assert texts[name] == {want}, f"{name}: served {texts[name]} but PEFT says {want!r}"
    # An adapter that was silently ignored would have produced the base text.
    assert texts["alpha"] != texts["base"] and texts["beta"] != texts["base"]


def test_stream_equals_unary(cluster, adapters):
    with ValoraClient(cluster.gateway) as client:
        unary = client.infer("Count the things.", [png(2)], adapter="adapters/alpha", max_new_tokens=MAX_NEW)
        parts = list(
            client.infer_stream("Count the things.", [png(2)], adapter="adapters/alpha", max_new_tokens=MAX_NEW)
        )
    assert "".join(p for p in parts if isinstance(p, str)) == unary.text
    assert parts[-1].text == unary.text


def test_raw_prompt_continues_the_text_as_hf_does(cluster, model_path):
    """A raw prompt (OpenAI's /v1/completions) is the model's whole input: served greedy text
    equals HF generate on the prompt's bare tokens (no chat template)."""
    import torch
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    prompt = "The objects in the picture are"
    with ValoraClient(cluster.gateway) as client:
        got = client.infer(prompt, max_new_tokens=MAX_NEW, raw_prompt=True)
    tok = AutoTokenizer.from_pretrained(model_path)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False
        )
    assert got.prompt_tokens == ids.shape[1]
    assert got.text == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_logprobs_come_back_with_the_tokens_unary_and_streamed(cluster, adapters):
    """logprobs through gateway, scheduler and worker: one per generated token, each named, with
    its alternatives; the stream's final result holds the same."""
    with ValoraClient(cluster.gateway) as client:
        unary = client.infer(
            "Count the things.",
            [png(2)],
            adapter="adapters/alpha",
            max_new_tokens=MAX_NEW,
            logprobs=True,
            top_logprobs=2,
        )
        parts = list(
            client.infer_stream(
                "Count the things.",
                [png(2)],
                adapter="adapters/alpha",
                max_new_tokens=MAX_NEW,
                logprobs=True,
                top_logprobs=2,
            )
        )
    assert len(unary.logprobs) == unary.output_tokens > 0
    for t in unary.logprobs:
        assert t.logprob <= 0 and len(t.top) == 2 and t.top[0].logprob >= t.top[1].logprob
        assert t.top[0].token_id == t.token_id and t.top[0].logprob == t.logprob  # greedy: the most likely
    assert b"".join(t.bytes for t in unary.logprobs).decode(errors="replace").startswith(unary.text[:1])
    assert [(t.token_id, round(t.logprob, 4)) for t in parts[-1].logprobs] == [
        (t.token_id, round(t.logprob, 4)) for t in unary.logprobs
    ]


@pytest.mark.parametrize(
    "kwargs,code,field",
    [
        ({"prompt": "hi", "adapter": "adapters/nope"}, grpc.StatusCode.NOT_FOUND, None),
        ({"prompt": "hi", "images": [b"\x89PNG not really"]}, grpc.StatusCode.INVALID_ARGUMENT, "images"),
        ({"prompt": "", "images": []}, grpc.StatusCode.INVALID_ARGUMENT, None),
        ({"prompt": "hi", "max_new_tokens": -1}, grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        ({"prompt": "hi", "adapter": "adapters/Bad Name"}, grpc.StatusCode.INVALID_ARGUMENT, "adapter"),
    ],
)
def test_bad_input_gets_clear_status_and_nothing_crashes(cluster, kwargs, code, field):
    from grpc_status import rpc_status
    from google.rpc import error_details_pb2

    with ValoraClient(cluster.gateway) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.infer(**kwargs)
        assert err.value.code() == code, err.value.details()
        if field:
            status = rpc_status.from_call(err.value)
            violations = []
            for d in status.details:
                if d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                    bad = error_details_pb2.BadRequest()
                    d.Unpack(bad)
                    violations += [v.field for v in bad.field_violations]
            assert any(field in v for v in violations), violations
        # The cluster still answers.
        assert client.infer("still there?", max_new_tokens=2).output_tokens > 0


def test_oversized_payload_is_rejected(cluster):
    with ValoraClient(cluster.gateway) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.infer("big", [png(3, size=16) + b"\0" * (40 << 20)])
        assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


@pytest.mark.skipif(
    shutil.which("node") is None or not (REPO / "examples/node/node_modules").exists(),
    reason="node or examples/node/node_modules missing (npm ci in examples/node)",
)
def test_node_client_calls_infer(cluster, adapters, tmp_path):
    image = tmp_path / "img.png"
    image.write_bytes(png(4))
    with ValoraClient(cluster.gateway) as client:
        want = client.infer("Hello from Python", [image.read_bytes()], adapter="adapters/beta", max_new_tokens=8)
    out = subprocess.run(
        [
            "node",
            str(REPO / "examples/node/infer.js"),
            cluster.gateway,
            "Hello from Python",
            str(image),
            "adapters/beta",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    got = json.loads(out.stdout)
    assert got["text"] == want.text
    assert got["adapter_version"] == adapters["beta"][0].name


@pytest.fixture(scope="module")
def cpp_client(tmp_path_factory) -> Path:
    """examples/cpp built into a temp dir. scripts/install_cpp.sh (run by scripts/test.sh too) is a
    no-op once Debian's gRPC packages are there; only a machine where apt cannot install skips."""
    install = subprocess.run(
        ["bash", str(REPO / "scripts/install_cpp.sh")], capture_output=True, text=True, timeout=600
    )
    if install.returncode != 0:
        pytest.skip(
            "apt could not install libgrpc++-dev and protobuf-compiler-grpc (scripts/install_cpp.sh): "
            + install.stderr.strip()[-300:]
        )
    build = tmp_path_factory.mktemp("cpp-client")
    out = subprocess.run(
        ["make", "-s", f"-j{os.cpu_count() or 2}", "-C", str(REPO / "examples/cpp"), f"BUILD={build}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    return build / "valora_client"


def run_cpp(cluster, cpp_client, tmp_path, command: str, prompt: str, seed: int, adapter: str):
    """(the Python client's answer, the C++ client's completed process) for one image request."""
    image = tmp_path / "img.png"
    image.write_bytes(png(seed))
    with ValoraClient(cluster.gateway) as client:
        want = client.infer(prompt, [image.read_bytes()], adapter=adapter, max_new_tokens=8)
    out = subprocess.run(
        [str(cpp_client), command, cluster.gateway, prompt, str(image), adapter],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return want, out


def test_cpp_client_calls_infer(cluster, adapters, cpp_client, tmp_path):
    want, out = run_cpp(cluster, cpp_client, tmp_path, "infer", "Hello from C++", 4, "adapters/beta")
    got = json.loads(out.stdout)
    assert got["text"] == want.text and got["adapter_version"] == adapters["beta"][0].name
    assert got["finish_reason"].startswith("FINISH_REASON_")  # enums by name, as the protos spell them


def test_cpp_client_streams_tokens(cluster, adapters, cpp_client, tmp_path):
    want, out = run_cpp(cluster, cpp_client, tmp_path, "stream", "Stream it", 5, "adapters/alpha@prod")
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    deltas = [line["text_delta"] for line in lines if "text_delta" in line]
    result = lines[-1]["result"]
    assert len(deltas) > 1, lines  # streamed piece by piece, not one message at the end
    assert "".join(deltas) == result["text"] == want.text
    assert result["adapter_version"] == adapters["alpha"][0].name


@pytest.mark.parametrize(
    "adapter, code",
    [("adapters/nope", grpc.StatusCode.NOT_FOUND), ("adapters/Not A Name", grpc.StatusCode.INVALID_ARGUMENT)],
)
def test_cpp_client_shows_the_status_code_and_its_error_info(cluster, cpp_client, adapter, code):
    """A failed call: `CODE: message (REASON)` on stderr, the reason read from the status details'
    google.rpc.ErrorInfo, then each BadRequest field violation, exactly as the Python SDK's typed
    error has them."""
    with pytest.raises(ValoraRpcError) as raised:
        with ValoraClient(cluster.gateway, retries=0) as client:
            client.infer("hi", adapter=adapter, max_new_tokens=8)
    want = raised.value
    assert want.code() == code and want.reason, want  # a reason to read: the test can fail
    assert bool(want.field_violations) == (code == grpc.StatusCode.INVALID_ARGUMENT), want.field_violations
    out = subprocess.run(
        [str(cpp_client), "infer", cluster.gateway, "hi", "", adapter], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == f"{code.name}: {want.message} ({want.reason})\n" + "".join(
        f"  {field}: {why}\n" for field, why in want.field_violations
    )
