"""The SDK's and the CLI's admin calls (adapters get/delete/versions/alias/unalias, tasks, generation
jobs) against a real adapter store (SQLite) behind a real gateway that checks the admin key, both
over loopback gRPC: what each call returns or prints, and a failed call's typed error and exit code."""

from __future__ import annotations

import re

import grpc
import pytest
from typer.testing import CliRunner

from valora.cli import common as cli_common

from services.adapter_store.config import StoreSettings
from services.adapter_store.testing import RunningStore, adapter_config, make_bundle, write_tiny_model
from services.common.testing import ServiceThread
from services.gateway.config import GatewaySettings
from services.gateway.server import create_server as create_gateway
from valora import cli, errors
from valora.client import ValoraClient
from valora_protos.v1 import types_pb2

ADMIN_KEY = "admin-key-cli"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli-admin")
    settings = StoreSettings(
        database_url=f"sqlite:///{tmp / 'r.db'}",
        blob_dir=str(tmp / "blobs"),
        model_path=str(write_tiny_model(tmp / "tiny")),
        gc_interval_s=0,
        port=0,
    )
    with RunningStore(settings) as store:
        settings = GatewaySettings(
            adapter_store_address=store.address,
            scheduler_address=store.address,
            admin_keys=[ADMIN_KEY],
            http_enabled=False,
            port=0,
        )
        with ServiceThread(create_gateway, settings, "gateway") as gw:  # gRPC only, in front of the store
            yield gw.address


@pytest.fixture(scope="module")
def client(gateway):
    with ValoraClient(gateway, admin_key=ADMIN_KEY, retries=0, timeout_s=30) as c:
        yield c


def upload(client, adapter: str, seed: int):
    return client.upload_adapter_version(
        adapter,
        make_bundle(rank=4, heads={"color": 3}, seed=seed),
        adapter_config(rank=4),
        heads={"color": ["red", "green", "blue"]},
    )


# -- SDK ----------------------------------------------------------------------------------------


def test_sdk_adapters_versions_and_aliases(client):
    v1, v2 = upload(client, "sdk-cars", 0), upload(client, "sdk-cars", 1)
    a = client.get_adapter("sdk-cars")
    assert a.name == "adapters/sdk-cars" and a.latest_version == 2 and client.get_adapter(a.name) == a
    got = client.get_version(v1.name)
    assert (got.name, got.sha256, got.rank, got.state, got.heads) == (
        v1.name,
        v1.sha256,
        4,
        "ready",
        {"color": ["red", "green", "blue"]},
    )
    assert client.get_version("sdk-cars/versions/2").sha256 == v2.sha256  # "adapters/" may be left out
    client.set_alias("adapters/sdk-cars", "prod", v1.name)
    with pytest.raises(errors.FailedPrecondition) as exc:  # an alias points at it
        client.delete_version(v1.name)
    assert exc.value.reason == "VERSION_IN_USE"
    client.delete_alias("sdk-cars", "prod")
    assert dict(client.get_adapter("sdk-cars").aliases) == {}
    with pytest.raises(errors.NotFound):
        client.delete_alias("sdk-cars", "prod")
    client.delete_version(v1.name)
    assert client.get_version(v1.name).state == "retired"
    assert [v.state for v in client.list_versions("sdk-cars")] == ["retired", "ready"]

    client.create_task("sdk-color", adapter="adapters/sdk-cars", head="color")
    with pytest.raises(errors.FailedPrecondition):  # a task still uses it
        client.delete_adapter("sdk-cars")
    client.delete_task("sdk-color")
    stale = client.get_adapter("sdk-cars").etag
    client.set_alias("adapters/sdk-cars", "prod", "adapters/sdk-cars/versions/2")
    with pytest.raises(errors.Aborted) as exc:  # changed since it was read
        client.delete_adapter("sdk-cars", etag=stale)
    assert exc.value.reason == "ETAG_MISMATCH"
    client.delete_alias("sdk-cars", "prod")
    client.delete_adapter("adapters/sdk-cars", etag=client.get_adapter("sdk-cars").etag)
    with pytest.raises(errors.NotFound) as exc:
        client.get_adapter("sdk-cars")
    assert exc.value.reason == "ADAPTER_NOT_FOUND"
    assert "adapters/sdk-cars" not in [x.name for x in client.list_adapters()]
    with pytest.raises(errors.NotFound) as exc:
        client.delete_adapter("sdk-nope")
    assert isinstance(exc.value, grpc.RpcError) and exc.value.code() == grpc.StatusCode.NOT_FOUND


def test_sdk_list_tasks_reads_every_page(client):
    upload(client, "sdk-pages", 2)
    made = [
        client.create_task(
            f"sdk-page-{i}", adapter="adapters/sdk-pages", head="color", accuracy_threshold=0.5, measured_accuracy=0.75
        ).name
        for i in range(5)
    ]
    try:
        tasks = client.list_tasks(page_size=2)
        assert set(made) <= {t.name for t in tasks} and len(tasks) == len({t.name for t in tasks})
        t = next(t for t in tasks if t.name == made[0])
        assert (t.adapter, t.head, t.accuracy_threshold, t.measured_accuracy) == (
            "adapters/sdk-pages",
            "color",
            0.5,
            0.75,
        )
    finally:
        for name in made:
            client.delete_task(name)
    assert not set(made) & {t.name for t in client.list_tasks()}


def test_sdk_admin_calls_need_the_admin_key(gateway):
    with ValoraClient(gateway, retries=0, timeout_s=30) as anonymous, pytest.raises(errors.Unauthenticated):
        anonymous.list_tasks()


# -- CLI ----------------------------------------------------------------------------------------


@pytest.fixture
def invoke(gateway, monkeypatch, tmp_path):
    """Runs `valora ARGS` against the gateway (address and key from the environment, as a user
    would set them); tables printed wide enough not to wrap (COLUMNS: every CLI module's console
    reads it)."""
    env = {"VALORA_ADDRESS": gateway, "VALORA_ADMIN_KEY": ADMIN_KEY, "VALORA_HOME": str(tmp_path), "COLUMNS": "200"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # the console follows COLUMNS unless a width was fixed on it: `valora demo` run in-process
    # (tests/e2e/test_demo.py, earlier in the suite) fixes 120 when its output is not a terminal
    monkeypatch.setattr(cli_common.console, "_width", None)

    def run(*args: str, input: str | None = None):
        return CliRunner().invoke(cli.app, list(args), input=input, env=env)

    return run


def failed(capsys, *args: str) -> tuple[int, str]:
    """`valora ARGS` through cli.main (the entry point that prints a failed RPC): its exit code and
    the line it printed for the error (the in-process services log to the same stdout)."""
    code = cli.main(list(args))
    out = capsys.readouterr().out
    assert "Traceback" not in out, out
    return code, next((line for line in out.splitlines() if line.split(":")[0].isupper()), out)


def test_cli_adapters_get_versions_alias_unalias_delete(client, invoke, capsys):
    upload(client, "cli-cars", 0)
    v2 = upload(client, "cli-cars", 1)
    r = invoke("adapters", "alias", "cli-cars", "prod", "1")
    assert r.exit_code == 0, r.output
    assert r.output.startswith("adapters/cli-cars@prod → adapters/cli-cars/versions/1 etag=")
    r = invoke("adapters", "alias", "adapters/cli-cars", "canary", v2.name)  # a full version name too
    assert r.exit_code == 0, r.output
    assert dict(client.get_adapter("cli-cars").aliases) == {"prod": "adapters/cli-cars/versions/1", "canary": v2.name}

    r = invoke("adapters", "get", "cli-cars")
    assert r.exit_code == 0, r.output
    assert r.output.startswith("adapters/cli-cars latest=v2 aliases=canary→2, prod→1 created=20")
    r = invoke("adapters", "versions", "cli-cars")
    assert r.exit_code == 0, r.output
    rows = {line.split()[1]: line for line in r.output.splitlines() if line.split()[1:2] in (["v1"], ["v2"])}
    assert set(rows) == {"v1", "v2"}
    assert "ready" in rows["v1"] and "color (3)" in rows["v1"] and "prod" in rows["v1"] and "canary" in rows["v2"]
    assert v2.sha256[:12] in rows["v2"]

    r = invoke("adapters", "unalias", "cli-cars", "canary")
    assert r.exit_code == 0 and r.output.strip() == "removed adapters/cli-cars@canary", r.output
    assert set(client.get_adapter("cli-cars").aliases) == {"prod"}

    r = invoke("adapters", "delete", "cli-cars", input="n\n")  # not confirmed: nothing deleted
    assert r.exit_code == 1 and "Aborted" in r.output, r.output
    assert client.get_adapter("cli-cars").name == "adapters/cli-cars"
    r = invoke("adapters", "delete", "cli-cars", input="y\n")
    assert r.exit_code == 0 and r.output.strip().endswith("deleted adapters/cli-cars"), r.output
    with pytest.raises(errors.NotFound):
        client.get_adapter("cli-cars")

    code, out = failed(capsys, "adapters", "delete", "cli-cars", "--yes")
    assert code == cli.RPC_EXIT_BASE + grpc.StatusCode.NOT_FOUND.value[0] == 15
    assert out == "NOT_FOUND: adapters/cli-cars not found (ADAPTER_NOT_FOUND)"
    code, out = failed(capsys, "adapters", "get", "cli-nope")
    assert code == 15 and out.startswith("NOT_FOUND: "), out
    code, out = failed(capsys, "adapters", "alias", "cli-nope", "prod", "v1")
    assert code == 15 and out.startswith("NOT_FOUND: "), out


def table_rows(output: str) -> list[dict[str, str]]:
    """A rich table printed by the CLI as {column header: cell text} per body row."""
    lines = [line for line in output.splitlines() if line.count("│") >= 2 or line.count("┃") >= 2]
    cells = [[c.strip() for c in re.split("[│┃]", line)[1:-1]] for line in lines]
    return [dict(zip(cells[0], row)) for row in cells[1:]]


def test_cli_tasks_create_list_get_delete(client, invoke, capsys):
    upload(client, "cli-tasks", 3)
    r = invoke(
        "tasks",
        "create",
        "cli-color",
        "--adapter",
        "adapters/cli-tasks",
        "--head",
        "color",
        "--description",
        "colour of [the] car",
        "--threshold",
        "0.8",
        "--accuracy",
        "0.9",
    )
    assert r.exit_code == 0, r.output
    assert r.output.startswith(
        "tasks/cli-color adapter=adapters/cli-tasks head=color threshold=0.800 accuracy=0.900 created=20"
    )
    r = invoke("tasks", "list")
    assert r.exit_code == 0, r.output
    row = next(line for line in r.output.splitlines() if "tasks/cli-color" in line)
    for text in ("adapters/cli-tasks", "color", "0.800", "0.900", "colour of [the] car"):
        assert text in row, row
    assert next(t for t in table_rows(r.output) if t["task"] == "tasks/cli-color")["release"] == "-"  # off
    r = invoke("tasks", "get", "cli-color")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0].startswith("tasks/cli-color adapter=adapters/cli-tasks head=color")
    assert r.output.splitlines()[1] == "colour of [the] car"  # user text is printed as it is, not as markup
    assert " slo=- release=- etag=" in r.output.splitlines()[0]  # no latency objective, no early release
    r = invoke(
        "tasks",
        "create",
        "cli-count",
        "--adapter",
        "adapters/cli-tasks",
        "--slo-ms",
        "250",
        "--slo-class",
        "video",
        "--release-fraction",
        "0.5",
    )
    assert r.exit_code == 0 and " slo=video:250ms release=0.5 etag=" in r.output, r.output
    r = invoke("tasks", "list")
    row = next(t for t in table_rows(r.output) if t["task"] == "tasks/cli-count")
    assert (row["slo"], row["release"]) == ("video:250ms", "0.5"), row
    r = invoke("tasks", "delete", "tasks/cli-count")
    r = invoke("tasks", "delete", "tasks/cli-color")
    assert r.exit_code == 0 and r.output.strip() == "deleted tasks/cli-color", r.output
    code, out = failed(capsys, "tasks", "get", "cli-color")
    assert code == 15 and out.startswith("NOT_FOUND: tasks/cli-color not found"), out
    code, out = failed(capsys, "tasks", "create", "cli-x", "--adapter", "adapters/cli-nope")
    assert code == 15 and out.startswith("NOT_FOUND: "), out  # the adapter does not exist
    r = invoke("tasks", "create", "cli-x", "--adapter", "adapters/cli-tasks", "--threshold", "2")
    assert r.exit_code == 2  # a usage error, refused before any call


def test_cli_tasks_update(client, invoke, capsys):
    """`valora tasks update`: the options given change (UpdateTask's fields), the rest stay;
    --etag guards it as on `adapters delete`/`alias` (a stale one: ABORTED, exit 20); bad values
    and no option are usage errors before any call."""
    upload(client, "cli-upd", 4)
    created = client.create_task(
        "cli-upd", adapter="adapters/cli-upd", description="ask", slo_ms=500.0, slo_class="retrieval"
    )
    r = invoke("tasks", "update", "cli-upd", "--release-fraction", "0.25", "--etag", created.etag)
    assert r.exit_code == 0, r.output
    got = client.get_task("cli-upd")
    assert (got.adapter_release_fraction, got.slo_ms, got.slo_class, got.description) == (
        0.25,
        500.0,
        "retrieval",
        "ask",
    )
    assert (
        r.output.strip() == f"tasks/cli-upd adapter=adapters/cli-upd head=- threshold=0.000 accuracy=0.000 "
        f"created={cli_common.iso_time(got.create_time)} slo=retrieval:500ms release=0.25 etag={got.etag}"
    )
    r = invoke("tasks", "get", "cli-upd")
    assert r.output.splitlines()[0].endswith(f" release=0.25 etag={got.etag}"), r.output
    r = invoke(
        "tasks", "update", "tasks/cli-upd", "--slo-ms", "120", "--slo-class", "video", "--description", "ask [it]"
    )
    assert r.exit_code == 0, r.output
    now = client.get_task("cli-upd")
    assert (now.slo_ms, now.slo_class, now.description, now.adapter_release_fraction) == (
        120.0,
        "video",
        "ask [it]",
        0.25,
    )
    code, out = failed(capsys, "tasks", "update", "cli-upd", "--release-fraction", "0", "--etag", got.etag)
    assert code == cli.RPC_EXIT_BASE + grpc.StatusCode.ABORTED.value[0] == 20
    assert out.startswith("ABORTED: ") and out.endswith("(ETAG_MISMATCH)"), out
    assert client.get_task("cli-upd").adapter_release_fraction == 0.25  # not changed
    r = invoke("tasks", "update", "cli-upd", "--release-fraction", "0")  # no etag: unconditional; 0 turns it off
    assert r.exit_code == 0 and " release=- " in r.output, r.output
    # the run-time rule: alone, with a least share, cleared
    r = invoke("tasks", "update", "cli-upd", "--release-rule", "sentence_end")
    assert r.exit_code == 0 and " release=sentence_end " in r.output, r.output
    assert client.get_task("cli-upd").adapter_release_rule == types_pb2.ADAPTER_RELEASE_RULE_SENTENCE_END
    r = invoke("tasks", "update", "cli-upd", "--release-fraction", "0.25")
    assert r.exit_code == 0 and " release=sentence_end>=0.25 " in r.output, r.output
    r = invoke("tasks", "list")
    assert "sentence_end>=0.25" in r.output, r.output
    r = invoke("tasks", "update", "cli-upd", "--release-rule", "none")
    assert r.exit_code == 0 and " release=0.25 " in r.output, r.output
    r = invoke("tasks", "create", "cli-rule", "--adapter", "adapters/cli-upd", "--release-rule", "sentence_end")
    assert r.exit_code == 0 and " release=sentence_end " in r.output, r.output
    client.delete_task("cli-rule")
    before = client.get_task("cli-upd").etag
    for args in (("--release-fraction", "1.5"), ("--slo-ms", "-1"), ("--release-rule", "sentence-end"), ()):
        r = invoke("tasks", "update", "cli-upd", *args)
        assert r.exit_code == 2, (args, r.output)  # a usage error, refused before any call
    assert client.get_task("cli-upd").etag == before
    code, out = failed(capsys, "tasks", "update", "cli-upd-nope", "--description", "x")
    assert code == 15 and out.startswith("NOT_FOUND: ") and out.endswith("(TASK_NOT_FOUND)"), out
    client.delete_task("cli-upd")


def test_cli_jobs_list_get_cancel(client, invoke, capsys):
    job = client.create_generation_job(
        "/models/tiny", {"digit": 0.8, "parity": 0.9}, rank=4, epochs=1, job_id="cli-job"
    )
    r = invoke("jobs", "list")
    assert r.exit_code == 0, r.output
    row = next(line for line in r.output.splitlines() if job.name in line)
    assert "PENDING" in row and "digit:0.8, parity:0.9" in row and "0%" in row
    r = invoke("jobs", "get", "cli-job")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith(f"{job.name}: PENDING progress=0% rank=4 epochs=1 created=20")
    assert lines[1] == "sources: digit:0.8, parity:0.9"
    r = invoke("jobs", "cancel", "cli-job")
    assert r.exit_code == 0 and r.output.strip() == f"{job.name}: CANCELLED", r.output
    assert "CANCELLED" in invoke("jobs", "get", job.name).output
    r = invoke("jobs", "cancel", "cli-job")  # cancelling a cancelled job changes nothing
    assert r.exit_code == 0 and r.output.strip() == f"{job.name}: CANCELLED", r.output
    code, out = failed(capsys, "jobs", "cancel", "cli-nope")
    assert code == 15 and out.startswith("NOT_FOUND: generationJobs/cli-nope"), out
    code, out = failed(capsys, "jobs", "get", "cli-nope")
    assert code == 15 and out.startswith("NOT_FOUND: "), out


def test_cli_jobs_get_names_a_sources_dataset(client, invoke):
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("data.jsonl")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    dataset = client.upload_dataset(buf.getvalue())
    client.create_generation_job("/models/tiny", [("digit", 0.8), ("pets", 0.5, dataset.name)], job_id="cli-data")
    r = invoke("jobs", "get", "cli-data")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[1] == f"sources: digit:0.8, pets:0.5 ({dataset.name})"
    client.cancel_generation_job("cli-data")
