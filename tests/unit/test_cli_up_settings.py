"""`valora up --set KEY=VALUE`, `--config FILE` and `--startup-timeout`: the services' settings
checked against their settings classes before anything starts, merged with the precedence --set
over --config over the caller's environment over the defaults, and a service that does not become
healthy in time named with its log, every process stopped. Most tests replace start_cluster; the
last two start real processes."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tests.unit import test_cli_up
from valora import cli, cluster as cluster_mod

started = test_cli_up.started  # the fixture: start_cluster's calls, a fake cluster back


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in (
        "VALORA_DEVICE",
        "VALORA_DTYPE",
        "VALORA_TP_SIZE",
        "CUDA_VISIBLE_DEVICES",
        "VALORA_MAX_BATCH_SIZE",
        "VALORA_MAX_WAITING",
        "VALORA_GPU_MEMORY_FRACTION",
    ):
        monkeypatch.delenv(name, raising=False)


def up(home, *args, env=None):
    return CliRunner().invoke(cli.app, ["up", "--home", str(home), "--port", "0", "--http-port", "0", *args], env=env)


def toml(tmp_path, text: str):
    path = tmp_path / "valora.toml"
    path.write_text(text)
    return str(path)


# -- checked before anything starts ---------------------------------------------------------------


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["--set", "max_batchsize=64"],
            "--set max_batchsize=64: worker has no setting 'max_batchsize' (did you mean max_batch_size?)",
        ),
        (
            ["--set", "max_batch_size=0"],
            "--set max_batch_size=0: worker setting max_batch_size: Input should be greater than or equal to 1",
        ),
        (["--set", "max_batch_size=lots"], "worker setting max_batch_size: Input should be a valid integer"),
        (
            ["--set", "decode_graphs=sometimes"],
            "worker setting decode_graphs: VALORA_DECODE_GRAPHS='sometimes': must be one of auto, static, off",
        ),
        (
            ["--set", "scheduler.policy=fastest"],
            "--set scheduler.policy=fastest: scheduler setting policy: unknown policy 'fastest'",
        ),
        (
            ["--set", "gateway.default_max_new_tokens=99999"],
            "--set gateway.default_max_new_tokens=99999: gateway settings: default_max_new_tokens exceeds "
            "max_new_tokens_limit",
        ),
        (["--set", "port=7000"], "worker setting port is set by valora up"),
        (["--set", "worker_name=w"], "worker setting worker_name is set by valora up"),
        (["--set", "internal_token=x"], "set VALORA_INTERNAL_TOKEN in the environment"),
        (["--set", "nope.max_rank=1"], "no service 'nope'"),
        (["--set", "max_batch_size"], "expected KEY=VALUE"),
        (["--set", "device=cuda", "--device", "cpu"], "--set device=cuda disagrees with --device cpu"),
        (["--startup-timeout", "0"], "--startup-timeout 0: must be more than 0 seconds"),
    ],
)
def test_a_bad_setting_is_one_line_exit_2_and_nothing_starts(tmp_path, started, args, says):
    result = up(tmp_path, *args)
    assert result.exit_code == 2, result.output
    assert says in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert started == [] and cluster_mod.Cluster.load(tmp_path) is None


@pytest.mark.parametrize(
    "text, says",
    [
        ("[worker]\nmax_batchsize = 64\n", "[worker] max_batchsize: worker has no setting 'max_batchsize'"),
        (
            "[worker]\nmax_batch_size = 0\n",
            "[worker] max_batch_size: worker setting max_batch_size: Input should be greater than or equal to 1",
        ),
        ("[gateway]\nmax_images = -1\n", "[gateway] max_images: gateway setting max_images"),
        ('[adapter_store]\nmax_rank = "big"\n', "[adapter_store] max_rank: adapter_store setting max_rank"),
        ('[scheduler]\nworker_addresses = ["h:1"]\n', "scheduler setting worker_addresses is set by valora up"),
        ("[engine]\nmax_batch_size = 4\n", "'engine' is not a table of settings"),
        ("max_batch_size = 4\n", "'max_batch_size' is not a table of settings"),
        ("[worker]\nmax_batch_size = {a = 1}\n", "[worker] max_batch_size: a dict is not a setting value"),
        ("[worker\n", "valora.toml: "),
    ],
)
def test_a_bad_config_file_is_one_line_exit_2_and_nothing_starts(tmp_path, started, text, says):
    result = up(tmp_path, "--config", toml(tmp_path, text))
    assert result.exit_code == 2, result.output
    assert says in result.output and "--config " in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert started == [] and cluster_mod.Cluster.load(tmp_path) is None


def test_a_bad_value_from_the_environment_is_named_as_such(tmp_path, started, monkeypatch):
    monkeypatch.setenv("VALORA_MAX_WAITING", "-3")
    result = up(tmp_path, "--set", "max_batch_size=4")
    assert (
        result.exit_code == 2 and "VALORA_MAX_WAITING in the environment: worker setting max_waiting" in result.output
    ), result.output
    monkeypatch.setenv("VALORA_MAX_BATCH_SIZE", "0")  # overridden by --set: not an error
    monkeypatch.delenv("VALORA_MAX_WAITING")
    assert up(tmp_path, "--set", "max_batch_size=4").exit_code == 0


# -- passed on as each service's VALORA_* environment ---------------------------------------------


def test_set_goes_to_the_workers_environment(tmp_path, started):
    result = up(
        tmp_path,
        "--set",
        "max_batch_size=64",
        "--set",
        "decode_graphs=off",
        "--set",
        "MAX-WAITING=9",
        "--set",
        "gateway.max_images=2",
    )
    assert result.exit_code == 0, result.output
    env = started[0]["service_env"]
    assert env["worker"] == {
        "VALORA_MAX_BATCH_SIZE": "64",
        "VALORA_DECODE_GRAPHS": "off",
        "VALORA_MAX_WAITING": "9",
        "VALORA_TP_SIZE": "1",
    }
    assert env["gateway"] == {"VALORA_MAX_IMAGES": "2"} and env["scheduler"] == env["adapter_store"] == {}


def test_config_tables_are_parsed_as_the_services_read_them(tmp_path):
    path = toml(
        tmp_path,
        """
[worker]
max_batch_size = 64
decode_graphs = "OFF"
use_atmm = false
gpu_memory_fraction = 0.45
[gateway]
api_keys = ["k1", "k2"]
default_deadline_s = 30.5
[scheduler]
policy = "slora"
worker_ttl_s = 4
[adapter_store]
max_rank = 64
database_url = "sqlite:///elsewhere.db"
""",
    )
    layer = cluster_mod.load_settings_file(path)
    assert layer == {
        "worker": {"max_batch_size": "64", "decode_graphs": "OFF", "use_atmm": "false", "gpu_memory_fraction": "0.45"},
        "gateway": {"api_keys": '["k1", "k2"]', "default_deadline_s": "30.5"},
        "scheduler": {"policy": "slora", "worker_ttl_s": "4"},
        "adapter_store": {"max_rank": "64", "database_url": "sqlite:///elsewhere.db"},
    }
    got = cluster_mod.check_settings({}, layer, {}, path)
    assert (got["worker"].max_batch_size, got["worker"].decode_graphs, got["worker"].use_atmm) == (64, "off", False)
    assert [k.get_secret_value() for k in got["gateway"].api_keys] == ["k1", "k2"]
    assert got["gateway"].default_deadline_s == 30.5
    assert (got["scheduler"].policy, got["scheduler"].worker_ttl_s) == ("slora", 4.0)
    assert (got["adapter_store"].max_rank, got["adapter_store"].database_url) == (64, "sqlite:///elsewhere.db")


def test_config_goes_to_each_services_environment(tmp_path, started):
    path = toml(
        tmp_path,
        "[worker]\nmax_batch_size = 64\ngpu_memory_fraction = 0.5\n[gateway]\nmax_images = 3\n"
        '[scheduler]\npolicy = "slora"\n[adapter_store]\nmax_rank = 32\n',
    )
    result = up(tmp_path, "--config", path)
    assert result.exit_code == 0, result.output
    env = started[0]["service_env"]
    assert env == {
        "worker": {"VALORA_MAX_BATCH_SIZE": "64", "VALORA_GPU_MEMORY_FRACTION": "0.5", "VALORA_TP_SIZE": "1"},
        "gateway": {"VALORA_MAX_IMAGES": "3"},
        "scheduler": {"VALORA_POLICY": "slora"},
        "adapter_store": {"VALORA_MAX_RANK": "32"},
    }


# -- precedence ---------------------------------------------------------------------------------


def test_set_over_config_over_the_environment_over_the_defaults():
    environ = {"VALORA_MAX_BATCH_SIZE": "4", "VALORA_MAX_WAITING": "7", "VALORA_MAX_RANK": "16", "PATH": "/bin"}
    config = {"worker": {"max_batch_size": "8", "max_prefill_tokens": "100"}, "adapter_store": {"max_rank": "32"}}
    sets = {"worker": {"max_batch_size": "16"}}
    merged = cluster_mod.merge_settings(sets, config, environ)
    assert merged["worker"] == {
        "VALORA_MAX_BATCH_SIZE": "16",
        "VALORA_MAX_PREFILL_TOKENS": "100",
        "VALORA_MAX_WAITING": "7",
        "VALORA_MAX_RANK": "16",
    }
    assert merged["adapter_store"]["VALORA_MAX_RANK"] == "32"
    assert merged["gateway"] == merged["scheduler"] == {k: v for k, v in environ.items() if k != "PATH"}
    assert cluster_mod.merge_settings(sets, config)["worker"] == {
        "VALORA_MAX_BATCH_SIZE": "16",
        "VALORA_MAX_PREFILL_TOKENS": "100",
    }
    got = cluster_mod.check_settings(sets, config, environ)["worker"]
    assert (got.max_batch_size, got.max_prefill_tokens, got.max_waiting, got.max_prefills_per_step) == (16, 100, 7, 2)


def test_start_cluster_puts_service_env_over_the_environment_and_its_wiring_over_both(tmp_path, monkeypatch):
    """The real start_cluster, its processes replaced by a recorder (their pid: a sleep of ours)."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    envs = {}

    class FakeProc:
        def __init__(self, args, env, **kwargs):
            envs[env["VALORA_PORT"]] = (args[-1].removeprefix("services."), env)
            self.pid, self.returncode = sleeper.pid, None

    monkeypatch.setattr(cluster_mod.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(cluster_mod, "wait_healthy", lambda *a, **k: None)
    monkeypatch.setattr(cluster_mod, "ensure_model", lambda path: None)
    monkeypatch.setenv("VALORA_MAX_BATCH_SIZE", "4")
    monkeypatch.setenv("VALORA_MAX_WAITING", "7")
    try:
        cluster_mod.start_cluster(
            tmp_path,
            workers=2,
            model_path=tmp_path,
            service_env={
                "worker": {"VALORA_MAX_BATCH_SIZE": "16", "VALORA_PORT": "1"},
                "adapter_store": {"VALORA_DATABASE_URL": "sqlite:///x.db"},
            },
            worker_env=[{"VALORA_DEVICE": "cpu"}, {"VALORA_DEVICE": "cpu", "VALORA_MAX_BATCH_SIZE": "5"}],
        )
    finally:
        sleeper.kill()
        sleeper.wait()
        (tmp_path / cluster_mod.STATE_FILE).unlink(missing_ok=True)
    by_name = {env.get("VALORA_WORKER_NAME", svc): env for svc, env in envs.values()}
    assert by_name["worker-0"]["VALORA_MAX_BATCH_SIZE"] == "16"  # service_env over the environment
    assert by_name["worker-1"]["VALORA_MAX_BATCH_SIZE"] == "5"  # worker_env over service_env
    assert by_name["worker-0"]["VALORA_MAX_WAITING"] == "7"
    assert by_name["worker-0"]["VALORA_PORT"] != "1"  # the wiring wins
    assert by_name["gateway"]["VALORA_MAX_BATCH_SIZE"] == "4"
    assert by_name["adapter_store"]["VALORA_DATABASE_URL"] == "sqlite:///x.db"


def test_the_banner_shows_the_http_url_only_when_the_gateway_serves_http(tmp_path, monkeypatch):
    """`valora up` through the real start_cluster (its processes replaced by a recorder): with
    [gateway] http_enabled = false, or --set gateway.http_enabled=false, the gateway gets no HTTP
    port, the cluster records none and the banner shows no HTTP URL; by default it does."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gateways = {}

    class FakeProc:
        def __init__(self, args, env, **kwargs):
            if args[-1] == "services.gateway":
                gateways[env["VALORA_MODEL_PATH"]] = env
            self.pid, self.returncode = sleeper.pid, None

    monkeypatch.setattr(cluster_mod.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(cluster_mod, "wait_healthy", lambda *a, **k: None)
    monkeypatch.setattr(cluster_mod, "ensure_model", lambda path: None)
    monkeypatch.delenv("VALORA_HTTP_ENABLED", raising=False)
    path = toml(tmp_path, "[gateway]\nhttp_enabled = false\n")
    runs = {"default": [], "config": ["--config", path], "set": ["--set", "gateway.http_enabled=false"]}
    try:  # no --http-port: with HTTP off it would be refused
        out = {
            name: CliRunner().invoke(
                cli.app,
                ["up", "--home", str(tmp_path / name), "--port", "0", "--model-path", str(tmp_path / name), *args],
            )
            for name, args in runs.items()
        }
    finally:
        sleeper.kill()
        sleeper.wait()
    for name, result in out.items():
        assert result.exit_code == 0, result.output
        banner = " ".join(result.output.split())
        gateway = gateways[str((tmp_path / name).resolve())]
        http_url = cluster_mod.Cluster.load(tmp_path / name).http_url
        if name == "default":
            assert http_url == f"http://127.0.0.1:{gateway['VALORA_HTTP_PORT']}/v1"
            assert f"OpenAI-compatible HTTP: {http_url}" in banner, banner
        else:
            assert http_url is None and "VALORA_HTTP_PORT" not in gateway
            assert gateway["VALORA_HTTP_ENABLED"] == "false"
            assert "HTTP" not in banner and "gateway: 127.0.0.1:" in banner, banner


def test_an_http_port_with_http_off_is_refused_not_ignored(tmp_path, started, monkeypatch):
    """--http-port (or a gateway http_port of --set/--config) while gateway.http_enabled is false
    would name a port nothing opens: one line naming both, exit 2, nothing started. HTTP off with
    no port given starts."""
    monkeypatch.delenv("VALORA_HTTP_ENABLED", raising=False)
    off = toml(tmp_path, "[gateway]\nhttp_enabled = false\n")
    both = tmp_path / "both.toml"
    both.write_text("[gateway]\nhttp_enabled = false\nhttp_port = 6001\n")
    refused = [
        (
            ["--http-port", "8081", "--set", "gateway.http_enabled=false"],
            None,
            "--http-port 8081 is a port of the OpenAI-compatible HTTP API, which --set gateway.http_enabled=false "
            "turns off: drop one of them",
        ),
        (
            ["--http-port", "0", "--config", off],
            None,
            f"--http-port 0 is a port of the OpenAI-compatible HTTP API, which --config {off} [gateway] "
            "http_enabled turns off",
        ),
        (
            ["--http-port", "8081"],
            {"VALORA_HTTP_ENABLED": "0"},
            "--http-port 8081 is a port of the OpenAI-compatible HTTP API, which VALORA_HTTP_ENABLED=0 in the "
            "environment turns off",
        ),
        (
            ["--config", str(both)],
            None,
            f"--config {both} [gateway] http_port is a port of the OpenAI-compatible "
            f"HTTP API, which --config {both} [gateway] http_enabled turns off",
        ),
        (
            ["--set", "gateway.http_port=7001"],
            {"VALORA_HTTP_ENABLED": "false"},
            "--set gateway.http_port=7001 is a port of the OpenAI-compatible HTTP API, which "
            "VALORA_HTTP_ENABLED=false in the environment turns off",
        ),
    ]
    for args, env, says in refused:
        result = CliRunner().invoke(cli.app, ["up", "--home", str(tmp_path), "--port", "0", *args], env=env)
        assert result.exit_code == 2, (args, result.output)
        assert says in " ".join(result.output.split()), (args, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert started == [] and cluster_mod.Cluster.load(tmp_path) is None
    for args, env in (
        (["--set", "gateway.http_enabled=false"], None),
        (["--config", off], None),
        ([], {"VALORA_HTTP_ENABLED": "false"}),
        (["--http-port", "8081", "--set", "gateway.http_enabled=true"], {"VALORA_HTTP_ENABLED": "0"}),
    ):
        result = CliRunner().invoke(cli.app, ["up", "--home", str(tmp_path), "--port", "0", *args], env=env)
        assert result.exit_code == 0, (args, result.output)
        assert started.pop()["http_port"] == (8081 if "--http-port" in args else 8080)
        (tmp_path / cluster_mod.STATE_FILE).unlink(missing_ok=True)
    help_text = CliRunner().invoke(cli.app, ["up", "--help"], env={"COLUMNS": "200"}).output
    words = " ".join("".join(c if c not in "│╭╮╰╯─" else " " for c in help_text).split())
    assert (
        "Given while the gateway's http_enabled is false (--set, --config or VALORA_HTTP_ENABLED) it is an "
        "error (exit 2), never ignored."
    ) in words, words


def test_flags_given_win_over_the_config_and_agree_with_set(tmp_path, started, monkeypatch):
    monkeypatch.setattr(cluster_mod, "visible_gpus", lambda: ["0", "1"])
    path = toml(
        tmp_path, '[worker]\ndevice = "cuda"\ndtype = "fp16"\ntp_size = 2\n[gateway]\nport = 6000\nhttp_port = 6001\n'
    )
    result = CliRunner().invoke(cli.app, ["up", "--home", str(tmp_path), "--config", path])
    assert result.exit_code == 0, result.output
    call = started.pop()
    assert (call["gateway_port"], call["http_port"]) == (6000, 6001)  # the config's, no flag given
    assert call["worker_env"] == [
        {"VALORA_DEVICE": "cuda", "VALORA_DTYPE": "float16", "VALORA_TP_SIZE": "2", "CUDA_VISIBLE_DEVICES": "0,1"}
    ]
    assert call["service_env"]["worker"] == {"VALORA_TP_SIZE": "2"}
    assert call["service_env"]["gateway"] == {}
    result = up(tmp_path, "--config", path, "--device", "cpu", "--dtype", "float32", "--tp", "1")
    assert result.exit_code == 0, result.output
    call = started.pop()
    assert (call["gateway_port"], call["http_port"]) == (0, 0)
    assert call["worker_env"] == [{"VALORA_DEVICE": "cpu", "VALORA_DTYPE": "float32"}]
    assert call["service_env"]["worker"] == {"VALORA_TP_SIZE": "1"}  # not the config's 2
    result = up(tmp_path, "--config", path, "--set", "tp_size=1", "--set", "device=cpu", "--set", "dtype=fp32")
    assert result.exit_code == 0, result.output  # --set over --config
    assert started.pop()["worker_env"] == [{"VALORA_DEVICE": "cpu", "VALORA_DTYPE": "float32"}]
    result = up(tmp_path, "--set", "dtype=bf16", "--dtype", "bfloat16")  # agrees
    assert result.exit_code == 0 and started.pop()["worker_env"][0]["VALORA_DTYPE"] == "bfloat16"


def test_the_callers_tp_size_does_not_outlive_tp_1(tmp_path, started, monkeypatch):
    monkeypatch.setenv("VALORA_TP_SIZE", "4")
    assert up(tmp_path, "--tp", "1").exit_code == 0
    assert started[0]["service_env"]["worker"]["VALORA_TP_SIZE"] == "1"


def test_a_gpu_memory_fraction_set_is_not_split(tmp_path, started, monkeypatch):
    monkeypatch.setattr(cluster_mod, "visible_gpus", lambda: ["0"])
    result = up(tmp_path, "--device", "cuda", "--workers", "2", "--set", "gpu_memory_fraction=0.3")
    assert result.exit_code == 0, result.output
    call = started[0]
    assert all("VALORA_GPU_MEMORY_FRACTION" not in e for e in call["worker_env"])
    assert call["service_env"]["worker"]["VALORA_GPU_MEMORY_FRACTION"] == "0.3"


def test_help_documents_set_config_the_precedence_and_the_timeout():
    result = CliRunner().invoke(cli.app, ["up", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for part in (
        "--set",
        "KEY=VALUE",
        "max_batch_size=64",
        "--config",
        "TOML",
        "--startup-timeout",
        "SECONDS",
        "[default: 180.0]",
        "--set over --config over the caller's environment over the defaults",
        "services/worker/config.py",
    ):
        assert part in text, part


def test_startup_timeout_goes_to_start_cluster(tmp_path, started):
    assert up(tmp_path).exit_code == 0 and up(tmp_path, "--startup-timeout", "7.5").exit_code == 0
    assert [c["startup_timeout_s"] for c in started] == [cluster_mod.STARTUP_TIMEOUT_S, 7.5] == [180.0, 7.5]


# -- real processes -------------------------------------------------------------------------------


@pytest.mark.e2e
def test_a_service_that_is_not_healthy_in_time_is_named_and_everything_is_stopped(tmp_path, monkeypatch):
    """A real start whose first service (the adapter store) cannot be SERVING within 0.3 s."""
    procs = []
    popen = subprocess.Popen

    def recorded(*args, **kwargs):
        procs.append(popen(*args, **kwargs))
        return procs[-1]

    monkeypatch.setattr(cluster_mod.subprocess, "Popen", recorded)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # nothing gets as far as reading it
    home = tmp_path / "home"
    result = up(home, "--model-path", str(model), "--startup-timeout", "0.3")
    log = home.resolve() / "logs" / "adapter_store.log"
    assert result.exit_code == 1, result.output
    assert f"adapter_store did not become healthy within 0.3 s (log: {log})" in result.output, result.output
    assert len(procs) == 1 and procs[0].poll() is not None  # stopped, and nothing after it started
    assert cluster_mod.Cluster.load(home) is None


@pytest.mark.e2e
def test_a_real_up_with_a_set_max_batch_size(tmp_path, model_path):
    home = tmp_path / "home"
    try:
        result = up(home, "--model-path", str(model_path), "--set", "max_batch_size=3")
        assert result.exit_code == 0, result.output
        status = CliRunner().invoke(cli.app, ["status", "--home", str(home)], env={"COLUMNS": "200"})
        assert status.exit_code == 0, status.output
        assert " 0/3 " in status.output, status.output  # running/max batch
    finally:
        cluster_mod.stop_cluster(home, grace_s=0)
