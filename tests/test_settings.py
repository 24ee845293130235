"""Settings: flags, FLAGSTOP_<SERVICE>_<FLAG> variables and a --config file (YAML or
TOML) fill one typed object through the same validation; a bad value from any of
them stops the process with one line naming where it came from."""

import subprocess
import sys

import pytest

from flagstop.executor.settings import ExecutorSettings
from flagstop.router.settings import RouterSettings
from flagstop.scheduler_svc.settings import SchedulerSettings
from flagstop.settings import SettingsInvalid
from tools.stack import ROOT, free_port, spawn, wait_serving


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("FLAGSTOP_"):
            monkeypatch.delenv(name)


def test_defaults_come_from_one_place():
    s = SchedulerSettings.load([])
    assert (s.port, s.max_num_seqs, s.policy, s.max_steps_in_flight) == (50052, 128, "fcfs", 2)
    config = s.core_config(executor_max_model_len=4096, block_size=16)
    assert (config.max_num_seqs, config.max_model_len, config.no_prefix_caching) == (
        128,
        4096,
        False,
    )


def test_a_file_then_variables_then_flags(tmp_path, monkeypatch):
    (tmp_path / "s.yaml").write_text("max-num-seqs: 7\npolicy: priority\nport: 1000\n")
    monkeypatch.setenv("FLAGSTOP_SCHEDULER_PORT", "2000")
    monkeypatch.setenv("FLAGSTOP_SCHEDULER_NO_PREFIX_CACHING", "true")
    s = SchedulerSettings.load(["--config", str(tmp_path / "s.yaml"), "--max-num-seqs", "9"])
    assert (s.max_num_seqs, s.policy, s.port, s.no_prefix_caching) == (9, "priority", 2000, True)
    (tmp_path / "e.toml").write_text('dtype = "float16"\nnum_blocks = 12\n')
    e = ExecutorSettings.load(["--config", str(tmp_path / "e.toml")])
    assert (e.dtype, e.num_blocks, e.port) == ("float16", 12, 50053)


def test_the_config_file_can_be_named_by_a_variable(tmp_path, monkeypatch):
    (tmp_path / "r.toml").write_text("max_queued_requests = 3\n")
    monkeypatch.setenv("FLAGSTOP_ROUTER_CONFIG", str(tmp_path / "r.toml"))
    assert RouterSettings.load([]).max_queued_requests == 3


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("FLAGSTOP_SCHEDULER_POLICY", "remtoe", "'hrrn', 'slo', 'fair' or 'remote'"),
        ("FLAGSTOP_SCHEDULER_MAX_STEPS_IN_FLIGHT", "7", "less than or equal to 2"),
        ("FLAGSTOP_SCHEDULER_NO_PREFIX_CACHING", "flase", "valid boolean"),
        ("FLAGSTOP_SCHEDULER_PORT", "50o52", "valid integer"),
        ("FLAGSTOP_SCHEDULER_MAX_NUM_SEQS", "0", "greater than 0"),
        ("FLAGSTOP_SCHEDULER_MAX_NUM_SEQ", "8", "is not a setting of flagstop-scheduler"),
    ],
)
def test_a_bad_variable_is_named(monkeypatch, variable, value, expected):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsInvalid) as error:
        SchedulerSettings.load([])
    message = str(error.value)
    assert variable in message and expected in message and "\n" not in message


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--port", "abc"], "--port abc: Input should be a valid integer"),
        (["--policy-deadline-ms", "-1"], "--policy-deadline-ms -1: Input should be greater than 0"),
        (["--bogus", "1"], "unrecognized arguments: --bogus 1"),
        (["--tls-cert", "c.pem"], "--tls-cert, --tls-key and --tls-ca are needed together"),
    ],
)
def test_a_bad_flag_is_named(argv, expected):
    with pytest.raises(SettingsInvalid, match=expected):
        SchedulerSettings.load(argv)


def test_the_native_grpc_server_with_tls_is_refused_in_one_line(tmp_path):
    pem = tmp_path / "c.pem"
    pem.write_text("not read")
    tls = ["--tls-cert", str(pem), "--tls-key", str(pem), "--tls-ca", str(pem)]
    with pytest.raises(SettingsInvalid) as refused:
        RouterSettings.load(["--grpc-server", "native", *tls])
    assert str(refused.value).endswith(
        "--grpc-server native serves plaintext only: unset --tls-cert, --tls-key and "
        "--tls-ca, or use --grpc-server grpcio"
    )
    assert "\n" not in str(refused.value)
    assert RouterSettings.load(["--grpc-server", "grpcio", *tls]).grpc_server == "grpcio"
    with pytest.raises(SettingsInvalid, match="--grpc-server h2o: Input should be 'grpcio'"):
        RouterSettings.load(["--grpc-server", "h2o"])


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("bad.yaml", "max_steps_in_flight: 7\n", "bad.yaml: max_steps_in_flight: 7: Input should"),
        ("bad.toml", 'policy = "remtoe"\n', "bad.toml: policy: remtoe: Input should be 'fcfs'"),
        ("typo.yaml", "max_num_seq: 4\n", "max_num_seq: 4: not a setting of flagstop-scheduler"),
        ("broken.toml", 'policy = "fcfs\n', "--config .*broken.toml: "),
        ("list.yaml", "- 1\n", "expected a mapping"),
    ],
)
def test_a_bad_file_key_is_named(tmp_path, name, text, expected):
    (tmp_path / name).write_text(text)
    with pytest.raises(SettingsInvalid, match=expected):
        SchedulerSettings.load(["--config", str(tmp_path / name)])


def run_service(module: str, *args: str, env: dict[str, str] | None = None):
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60,
        cwd=ROOT, env={"PATH": "/usr/bin:/bin", **(env or {})},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("module", "args", "env", "named"),
    [
        ("flagstop.scheduler_svc", [], {"FLAGSTOP_SCHEDULER_POLICY": "remtoe"},
         "FLAGSTOP_SCHEDULER_POLICY=remtoe"),
        ("flagstop.scheduler_svc", [], {"FLAGSTOP_SCHEDULER_MAX_STEPS_IN_FLIGHT": "7"},
         "FLAGSTOP_SCHEDULER_MAX_STEPS_IN_FLIGHT=7"),
        ("flagstop.scheduler_svc", [], {"FLAGSTOP_SCHEDULER_NO_PREFIX_CACHING": "flase"},
         "FLAGSTOP_SCHEDULER_NO_PREFIX_CACHING=flase"),
        ("flagstop.router", ["--port", "5oo51"], {}, "--port 5oo51"),
        ("flagstop.executor", [], {"FLAGSTOP_EXECUTOR_PORT": "x"}, "FLAGSTOP_EXECUTOR_PORT=x"),
    ],
)  # fmt: skip
@pytest.mark.processes
def test_a_service_with_a_bad_setting_exits_with_one_line(module, args, env, named):
    done = run_service(module, *args, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and named in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.processes
def test_a_scheduler_the_executor_cannot_honour_is_refused_at_start_up(model_dir, tmp_path):
    port = free_port()
    executor = spawn("executor", ["-m", "flagstop.executor", "--model", str(model_dir),
                                  "--port", str(port), "--metrics-port", "0", "--num-blocks", "64",
                                  "--max-num-seqs", "4"], tmp_path)  # fmt: skip
    try:
        import grpc

        wait_serving(grpc.insecure_channel(f"127.0.0.1:{port}"), executor)
        done = run_service(
            "flagstop.scheduler_svc", "--executor", f"127.0.0.1:{port}", "--port",
            str(free_port()), "--metrics-port", "0", "--max-num-seqs", "8",
        )  # fmt: skip
    finally:
        executor.terminate()
        executor.wait(30)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("flagstop-scheduler: --max-num-seqs 8 exceeds the executor's 4")


@pytest.mark.processes
def test_a_taken_port_is_one_line(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_service("examples.policy_server", "--port", str(port))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].endswith(f"127.0.0.1:{port}: is the port taken?")


def test_the_source_named_is_the_one_whose_value_won(tmp_path, monkeypatch):
    (tmp_path / "s.yaml").write_text("max_num_seqs: 4\n")
    monkeypatch.setenv("FLAGSTOP_SCHEDULER_MAX_NUM_SEQS", "0")
    with pytest.raises(SettingsInvalid, match=r"^FLAGSTOP_SCHEDULER_MAX_NUM_SEQS=0: "):
        SchedulerSettings.load(["--config", str(tmp_path / "s.yaml")])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, "cannot read .* as JSON"),
        ('["sk-1"]', 'must hold a JSON object {"KEY": "TENANT", ...}'),
        ('{"sk-1": ""}', "each key must be non-empty and name a tenant"),
        ('{"sk-1": "a\\u001fb"}', "each key must be non-empty and name a tenant"),
    ],
)
def test_a_bad_tenant_keys_file_is_named_in_one_line(tmp_path, text, expected):
    keys = tmp_path / "keys.json"
    if text is not None:
        keys.write_text(text)
    with pytest.raises(SettingsInvalid, match=f"--tenant-keys .*{expected}") as refused:
        RouterSettings.load(["--tenant-keys", str(keys)])
    assert "\n" not in str(refused.value)
    keys.write_text('{"sk-1": "acme"}')
    assert RouterSettings.load(["--tenant-keys", str(keys)]).tenant_keys == keys


def test_kv_events_config_takes_vllms_shape_and_names_a_bad_one():
    given = '{"endpoint": "tcp://*:5557", "topic": "kv@${POD_IP}@${MODEL}"}'
    config = SchedulerSettings.load(["--kv-events-config", given]).kv_events_config
    assert config.endpoint == "tcp://*:5557" and config.replay_endpoint.startswith("tcp://127.")
    assert SchedulerSettings.load([]).kv_events_config is None  # off by default
    with pytest.raises(SettingsInvalid, match=r"--kv-events-config .*pattern '\^zmq\$'"):
        SchedulerSettings.load(["--kv-events-config", '{"publisher": "nats"}'])
