"""ManagedVLLMServer: the command it runs, and clear errors when the server cannot start."""
import os

import pytest

from grpo_agent.sampler import ServerStartupError
from grpo_agent.sampler.server import ManagedVLLMServer, read_log_tail


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
