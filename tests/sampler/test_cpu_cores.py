"""Disjoint cores for a local CPU vLLM server and the trainer (grpo_agent.sampler.cpu_cores)."""
import os

import torch
from grpo_agent.sampler.cpu_cores import OMP_BIND_ENV, split_cores, trainer_on
from grpo_agent.train import run


def test_split_gives_the_server_the_first_half_and_the_trainer_the_rest():
    split = split_cores({3, 0, 2, 1, 4})
    assert (split.server, split.trainer) == ([0, 1], [2, 3, 4])
    assert split.server_env() == {OMP_BIND_ENV: "0,1"}
    assert split_cores({5}) is None  # one core: nothing to split


def test_trainer_on_pins_this_process_and_restores_it():
    before_cores, before_threads = os.sched_getaffinity(0), torch.get_num_threads()
    core = min(before_cores)
    with trainer_on([core]):
        assert os.sched_getaffinity(0) == {core}
        assert torch.get_num_threads() == 1
    assert os.sched_getaffinity(0) == before_cores
    assert torch.get_num_threads() == before_threads


def test_a_users_own_vllm_binding_is_left_alone(monkeypatch):
    monkeypatch.setenv(OMP_BIND_ENV, "0-3")
    assert run._core_split() is None
    monkeypatch.delenv(OMP_BIND_ENV)
    expected = None if torch.cuda.is_available() else split_cores()
    assert run._core_split() == expected
