"""The `nccl` transport's CPU-checkable rules: the NCCL group it asks vLLM's trainer engine for,
the source the engine replays, and its close/reopen. The engine itself needs GPUs
(`test_nccl_two_gpu.py`); here vLLM's `WeightTransferTrainerFactory.trainer_init` is the seam."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.distributed.weight_transfer.nccl_engine")


class _Control:
    """The server's control routes as the transport uses them."""

    base_url = "http://gpu-box:8000"

    def __init__(self, workers: int = 2):
        self.workers = workers
        self.calls: list[tuple[str, str]] = []
        self.closed = False

    def worker_count(self) -> int:
        return self.workers

    def call(self, method: str, path: str, **kwargs):
        self.calls.append((method, path))

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def engines(monkeypatch):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    opened = []

    def trainer_init(init_info, *, client, source):
        opened.append({"info": init_info, "client": client, "source": source})
        return object()

    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init", trainer_init)
    return opened


def test_the_trainer_opens_rank_0_of_a_group_with_every_server_worker(engines):
    from grpo_agent.weight_sync.transports.nccl import NcclWeightSync

    sync = NcclWeightSync(_Control(workers=4), master_address="10.0.0.7", timeout=42.0)
    sync._connect()
    (opened,) = engines
    info = opened["info"]
    assert (info.master_address, info.world_size, info.rank) == ("10.0.0.7", 5, 0)
    assert 0 < info.master_port < 65536
    assert opened["client"].base_url.rstrip("/") == "http://gpu-box:8000"
    assert opened["client"].timeout == 42.0
    assert opened["source"] is sync._source


def test_the_source_replays_the_pushs_tensors_with_their_metadata():
    from grpo_agent.weight_sync.transports.nccl import _PushSource

    source = _PushSource()
    a, b = torch.zeros(2, 3, dtype=torch.bfloat16), torch.ones(4)
    source.tensors = [("a.weight", a), ("b.bias", b)]
    assert [(m.name, m.dtype, tuple(m.shape)) for m in source.metadata()] == [
        ("a.weight", torch.bfloat16, (2, 3)), ("b.bias", torch.float32, (4,))]
    assert [name for name, _ in source] == [name for name, _ in source] == ["a.weight", "b.bias"]


def test_close_shuts_the_servers_engine_only_once_one_was_opened_and_reopen_forgets_it(engines):
    from grpo_agent.weight_sync.transports.nccl import NcclWeightSync

    control = _Control()
    sync = NcclWeightSync(control, master_address="10.0.0.7")
    sync.close()
    assert control.calls == [] and control.closed
    control = _Control()
    sync = NcclWeightSync(control, master_address="10.0.0.7")
    sync._connect()
    sync.reopen()
    assert sync._engine is None
    sync._connect()
    sync.close()
    sync.close()
    assert control.calls == [("POST", "/shutdown_weight_transfer_engine")] and control.closed
    assert len(engines) == 2
