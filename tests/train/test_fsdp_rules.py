"""train/fsdp.py's rules that need no process group: which blocks are sharded, which names a
tied LM head repeats, a checkpoint that does not fit the model, the loss as a forward
method, and which rank speaks. Sharding itself runs under torchrun (tests/e2e/test_fsdp2_cpu.py)."""
from __future__ import annotations

import logging

import pytest
import torch
from grpo_agent.train import fsdp
from torch import nn


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.heads = nn.ModuleList([nn.Linear(4, 4)])  # a shorter list first: not the blocks
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.empty = nn.ModuleList()
        self.norm = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 8, bias=False)
        self.lm_head.weight = self.embed.weight


def test_the_blocks_are_the_longest_module_list_and_a_model_without_one_is_refused():
    model = _TiedLM()
    assert fsdp.decoder_blocks(model) == list(model.layers)
    bare = nn.Sequential(nn.Linear(2, 2))
    bare.blocks = nn.ModuleList()  # empty: nothing to shard
    with pytest.raises(ValueError, match="Sequential has no nn.ModuleList of blocks to shard"):
        fsdp.decoder_blocks(bare)


def test_a_tied_head_is_named_once_as_a_repeat():
    assert fsdp._tied_parameter_names(_TiedLM()) == {"lm_head.weight"}
    assert fsdp._tied_parameter_names(nn.Linear(2, 2)) == set()


def _saved(model: nn.Module) -> dict:
    """The checkpoint `transformers` writes: every tensor once (a tied head left out)."""
    return {k: v.clone() + 1 for k, v in model.state_dict().items() if k != "lm_head.weight"}


def test_a_full_checkpoint_loads_without_its_tied_head():
    model = _TiedLM()
    state = _saved(model)
    expected = {k: v.clone() for k, v in state.items()}
    fsdp.load_full_model_state(model, state)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, expected["embed.weight" if name == "lm_head.weight"
                                                    else name], msg=name)


def test_a_checkpoint_missing_a_tensor_or_holding_another_is_refused():
    model = _TiedLM()
    state = _saved(model)
    del state["norm.bias"]
    with pytest.raises(ValueError, match=r"missing \['norm.bias'\], unexpected \[\]\. Resume with "
                                         "the model the run was started with"):
        fsdp.load_full_model_state(model, state)
    state = {**_saved(model), "extra.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['extra.weight'\]"):
        fsdp.load_full_model_state(model, state)


def test_an_installed_forward_method_gets_the_model_as_its_first_argument():
    model = nn.Linear(2, 2)
    fsdp.install_forward_method(model, "row_loss", lambda m, x: (m, x))
    assert model.row_loss(3) == (model, 3)


def test_without_a_process_group_there_is_one_process_and_it_is_the_main_one():
    assert fsdp.world_size() == 1 and fsdp.is_main_process()


@pytest.fixture
def package_log_level():
    """Puts the grpo_agent logger's level back after a test that quiets it."""
    package = logging.getLogger("grpo_agent")
    level = package.level
    yield package
    package.setLevel(level)


@pytest.mark.parametrize(("rank", "main"), [("0", True), ("1", False)])
def test_outside_a_process_group_the_launchers_rank_says_which_process_is_main(
        monkeypatch, rank, main):
    """After the run leaves its process group, torchrun's RANK still tells rank 0 (which prints
    "Run finished") from the others."""
    monkeypatch.setenv("RANK", rank)
    assert fsdp.is_main_process() is main


@pytest.mark.parametrize(("rank", "shown"), [("0", ["warning", "error"]), ("1", ["error"])])
def test_ranks_other_than_0_log_only_errors(monkeypatch, caplog, package_log_level, rank, shown):
    """Every rank runs the same start-up checks: their warnings (a dtype gap in train.setup, a
    missing generate route in sampler.client) print on rank 0 only; a rank's errors still show."""
    monkeypatch.setenv("RANK", rank)
    fsdp.quiet_other_ranks()
    caplog.set_level(logging.INFO, logger="root")
    logging.getLogger("grpo_agent.train.setup").warning("warning")
    logging.getLogger("grpo_agent.sampler.client").error("error")
    assert [record.getMessage() for record in caplog.records] == shown
