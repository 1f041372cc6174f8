"""vLLM's shared-memory queues sleep instead of spinning on CPU servers we start (`vllm_wait`)."""
import time

import httpx
import pytest
from grpo_agent.sampler import server as server_module
from grpo_agent.sampler import vllm_wait
from grpo_agent.sampler.server import ManagedVLLMServer
from grpo_agent.sampler.vllm_wait import CPU_WAIT_SLEEP_S, WAIT_SLEEP_ENV, install, sleep_seconds
from grpo_agent.testing.processes import cpu_seconds, descendants


def test_the_sleep_is_read_from_the_environment_and_a_bad_value_is_named():
    assert sleep_seconds({}) == 0 and sleep_seconds({WAIT_SLEEP_ENV: "0"}) == 0
    assert sleep_seconds({WAIT_SLEEP_ENV: "0.0002"}) == 0.0002
    for bad in ("fast", "-1", "2"):
        with pytest.raises(ValueError, match=f"{WAIT_SLEEP_ENV}='{bad}'.*seconds in \\[0, 1\\)"):
            sleep_seconds({WAIT_SLEEP_ENV: bad})


def test_install_replaces_the_queue_yield_with_a_sleep(monkeypatch):
    from vllm.distributed.device_communicators import shm_broadcast

    spin = shm_broadcast.sched_yield
    monkeypatch.setattr(shm_broadcast, "sched_yield", spin)  # put back after the test
    assert not install({}) and shm_broadcast.sched_yield is spin
    assert not install({WAIT_SLEEP_ENV: "0"}) and shm_broadcast.sched_yield is spin
    assert install({WAIT_SLEEP_ENV: "0.005"})
    began = time.perf_counter()
    shm_broadcast.sched_yield()
    assert time.perf_counter() - began >= 0.004


def test_a_managed_cpu_server_gets_the_sleep_unless_the_user_set_one(tiny_model_path, monkeypatch):
    monkeypatch.delenv(WAIT_SLEEP_ENV, raising=False)
    monkeypatch.setattr(server_module, "_cuda_available", lambda: False)
    server = ManagedVLLMServer(tiny_model_path)
    assert server.environment()[WAIT_SLEEP_ENV] == str(CPU_WAIT_SLEEP_S)
    monkeypatch.setenv(WAIT_SLEEP_ENV, "0")  # the user keeps vLLM's spin
    assert server.environment()[WAIT_SLEEP_ENV] == "0"
    monkeypatch.setenv(WAIT_SLEEP_ENV, "soon")
    with pytest.raises(ValueError, match=WAIT_SLEEP_ENV):
        server.environment()
    monkeypatch.delenv(WAIT_SLEEP_ENV)
    monkeypatch.setattr(server_module, "_cuda_available", lambda: True)  # GPU servers: untouched
    assert WAIT_SLEEP_ENV not in server.environment()


def _tree_cpu_s(pid: int) -> float:
    return sum(cpu_seconds(p) for p in [pid, *descendants(pid)])


def idle_cpu_after_a_request(base_url: str, pid: int, model: str, seconds: float = 0.8) -> float:
    """CPU seconds the server's processes use in the `seconds` after a request returns: vLLM's
    worker spins for one second after each message unless `vllm_wait` is installed."""
    body = {"model": model, "token_ids": [5, 6, 7],
            "sampling_params": {"max_tokens": 4, "detokenize": False}}
    httpx.post(f"{base_url}/inference/v1/generate", json=body, timeout=60).raise_for_status()
    before = _tree_cpu_s(pid)
    time.sleep(seconds)
    return _tree_cpu_s(pid) - before


def test_a_managed_cpu_server_does_not_spin_between_requests(vllm_server):
    if getattr(vllm_server, "pid", None) is None or server_module._cuda_available():
        pytest.skip("needs a CPU server this test session started")
    model = httpx.get(f"{vllm_server.base_url}/v1/models").json()["data"][0]["id"]
    used = min(idle_cpu_after_a_request(vllm_server.base_url, vllm_server.pid, model)
               for _ in range(2))
    # Spinning, the worker alone takes most of a core for the whole 0.8 s (0.6-0.8 s measured
    # with the sleep off); with it, its 100 us polls took 0.07-0.09 s.
    assert used < 0.25, f"the idle server used {used:.2f} CPU s in 0.8 s: is {vllm_wait.__name__} loaded?"


def test_a_whole_second_is_no_poll_interval_and_spaces_around_the_value_are_fine():
    with pytest.raises(ValueError, match=r"seconds in \[0, 1\)"):
        sleep_seconds({WAIT_SLEEP_ENV: "1"})
    assert sleep_seconds({WAIT_SLEEP_ENV: " 0.0001\n"}) == 0.0001
    assert sleep_seconds({WAIT_SLEEP_ENV: "  "}) == 0


def test_a_vllm_without_the_queue_yield_is_left_alone_with_a_warning(monkeypatch, caplog):
    from vllm.distributed.device_communicators import shm_broadcast

    monkeypatch.delattr(shm_broadcast, "sched_yield")
    with caplog.at_level("WARNING", logger="vllm.grpo_agent"):
        assert not install({WAIT_SLEEP_ENV: "0.005"})
    assert not hasattr(shm_broadcast, "sched_yield")
    assert "no sched_yield to replace" in caplog.text
