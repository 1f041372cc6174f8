"""LoRA adapter sync without a server: reading the server's limits, the start-up check, names."""
from pathlib import Path

import pytest
import torch
from grpo_agent.sampler.client import adapter_name
from grpo_agent.testing import build_tiny_model
from grpo_agent.weight_sync.adapter import (
    AdapterPusher,
    LoraServerLimits,
    adapter_prefix,
    check_lora_limits,
)
from grpo_agent.weight_sync.lora_needs import adapter_rank, unservable_reason

# The parts of vLLM 0.32's `GET /server_info?config_format=json` that the trainer reads.
LORA_SERVER_INFO = {
    "vllm_config": {"lora_config": {"max_lora_rank": 8, "max_loras": 3, "max_cpu_loras": 3},
                    "device_config": {"device": "cuda"}},
    "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True},
}


def test_server_limits_come_from_the_lora_config_and_none_without_enable_lora():
    assert LoraServerLimits.from_server_info(LORA_SERVER_INFO) == LoraServerLimits(8, 3, True)
    without = {"vllm_config": {"lora_config": None}, "vllm_env": {}}
    assert LoraServerLimits.from_server_info(without) is None
    not_updatable = {**LORA_SERVER_INFO, "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": False}}
    assert not LoraServerLimits.from_server_info(not_updatable).runtime_updating


def _lora_command(rank: int, max_staleness: int) -> str:
    """The whole command adapter sync advises for an adapter of `rank` (`serve_command_for`)."""
    from grpo_agent.sampler.server_facts import ServerNeeds, serve_command_for
    from grpo_agent.weight_sync.lora_needs import needed_loras, server_lora_rank

    return serve_command_for(ServerNeeds(
        model="org/tiny", max_completion_length=256, num_sampler_logprobs=8, logprobs_per_token=9,
        lora=(server_lora_rank(rank), needed_loras(max_staleness))), 8000, cpu=False)


def test_limits_that_fit_pass_and_too_small_ones_name_the_restart_flags():
    check_lora_limits(LoraServerLimits(8, 3, True), rank=4, max_staleness=1,
                      command=_lora_command(4, 1))
    # exact fits pass: rank 8 on --max-lora-rank 8, whose advised command asks for 8 again
    check_lora_limits(LoraServerLimits(8, 3, True), rank=8, max_staleness=1,
                      command=_lora_command(8, 1))
    assert "--max-lora-rank 8 --max-loras 3" in _lora_command(8, 1)
    command = _lora_command(12, 4)
    with pytest.raises(ValueError) as error:
        check_lora_limits(LoraServerLimits(8, 3, True), rank=12, max_staleness=4, command=command)
    message = str(error.value)
    assert "--max-lora-rank is 8 but the adapter's rank is 12" in message
    assert "max_staleness + 2 = 6" in message
    assert f"Restart it with the run's LoRA flags: `{command}`." in message
    # 16 is the smallest rank vLLM accepts that holds 12
    assert "--enable-lora --max-lora-rank 16 --max-loras 6" in command
    with pytest.raises(ValueError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"):
        check_lora_limits(LoraServerLimits(8, 3, False), rank=8, max_staleness=1,
                          command=_lora_command(8, 1))


def test_adapter_names_use_the_base_model_for_version_zero_and_without_a_prefix():
    assert adapter_name("run", 0) is None
    assert adapter_name(None, 5) is None
    assert adapter_name("run", 3) == "run-v3"
    assert adapter_prefix("/tmp/out dir/My Run!") == "My-Run"


@pytest.fixture(scope="module")
def tiny_path():
    return build_tiny_model()


def _peft(tiny_path, **lora_kwargs):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(**lora_kwargs))


def test_a_trained_adapter_passed_in_is_pushed_before_the_first_rollout_under_either_sync(
        tiny_path):
    """A fresh server serves the base model. Merged sync pushed first only into a server an
    earlier run had pushed into, so a trained adapter passed in (non-zero B) without
    --enable-lora had its first rollouts sampled by the base model, labelled version 0."""
    from grpo_agent.train.weights import remember_loaded_weights
    from grpo_agent.weight_sync.full import WeightPusher

    model = _peft(tiny_path, r=4, target_modules=["q_proj"])
    remember_loaded_weights(model)  # as the trainer does with a model it loads itself
    merged, adapter = WeightPusher.__new__(WeightPusher), AdapterPusher.__new__(AdapterPusher)
    assert not merged.needs_initial_push(model, False)  # PEFT starts B at zero: the base model
    assert not adapter.needs_initial_push(model, False)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if ".lora_B." in n).fill_(0.1)
    assert merged.needs_initial_push(model, False) and adapter.needs_initial_push(model, False)


def test_rank_pattern_and_unservable_adapters_are_recognised(tiny_path):
    model = _peft(tiny_path, r=4, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 16})
    assert adapter_rank(model) == 16
    assert unservable_reason(model) is None
    dora = _peft(tiny_path, r=4, target_modules=["q_proj"], use_dora=True)
    assert "DoRA" in unservable_reason(dora)
    saved = _peft(tiny_path, r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    assert "modules_to_save" in unservable_reason(saved)


def test_a_version_is_written_as_peft_saves_it(tiny_path, tmp_path):
    """What vLLM reads: adapter_model.safetensors + adapter_config.json, same as save_pretrained."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    model = _peft(tiny_path, r=4, target_modules=["q_proj", "v_proj"])
    pusher = AdapterPusher.__new__(AdapterPusher)  # the disk half alone, no server
    pusher.cache_dir = tmp_path / ".vllm_lora"
    state = {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}
    folder = pusher._write_version(model, state, "run-v1")
    model.save_pretrained(tmp_path / "reference")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json",
                                                        "adapter_model.safetensors"]
    written = load_file(folder / "adapter_model.safetensors")
    reference = load_file(tmp_path / "reference" / "adapter_model.safetensors")
    assert written.keys() == reference.keys()
    for name in written:
        torch.testing.assert_close(written[name], reference[name])
    assert [p.name for p in pusher.cache_dir.iterdir()] == ["run-v1"]  # no temp folder left


class _RecordingSampler:
    """Seam fake: records the model each request names; `gone` adapters answer 404 like vLLM."""

    def __init__(self, gone=()):
        self.models, self.gone = [], set(gone)

    async def generate(self, prompt_ids, params, *, model=None):
        from grpo_agent.sampler.errors import RequestRejectedError

        self.models.append(model)
        if model in self.gone:
            raise RequestRejectedError("gone", status_code=404,
                                       server_message=f"The model `{model}` does not exist.")
        return model


def _loop_at_version(current: int, sampler, lora_name="run"):
    import contextlib
    import multiprocessing
    from types import SimpleNamespace

    from grpo_agent.rollout.loop import AsyncRolloutLoop
    from grpo_agent.sampler.client import SamplingParams

    loop = AsyncRolloutLoop.__new__(AsyncRolloutLoop)  # only what generate_one_turn reads
    loop.lora_name, loop.sampler, loop.seeds = lora_name, sampler, None
    loop.sampling_params = SamplingParams(max_tokens=4)
    loop.model_version_value = multiprocessing.Value("q", current)
    loop.stalls = SimpleNamespace(stage=lambda *args, **detail: contextlib.nullcontext())
    return loop


def test_each_rollout_samples_the_adapter_of_its_groups_version():
    import asyncio

    from grpo_agent.rollout.versions import pin_rollout_version

    async def turn_in_group(loop, group_version):
        pin_rollout_version(group_version)  # what the engine does for a group
        return await loop.generate_one_turn([1, 2, 3])

    sampler = _RecordingSampler(gone={"run-v1"})
    loop = _loop_at_version(3, sampler)
    assert asyncio.run(turn_in_group(loop, 2)) == "run-v2"
    assert asyncio.run(turn_in_group(loop, 0)) is None  # version 0: the base model
    assert asyncio.run(loop.generate_one_turn([1])) == "run-v3"  # outside a group: the newest
    # An unloaded adapter (older than max_staleness): the rollout finishes on the newest one.
    assert asyncio.run(turn_in_group(loop, 1)) == "run-v3"
    assert sampler.models == ["run-v2", None, "run-v3", "run-v1", "run-v3"]
    without_lora = _loop_at_version(3, _RecordingSampler(), lora_name=None)
    assert asyncio.run(turn_in_group(without_lora, 2)) is None


class _RecordingControl:
    """Seam fake for `ServerControl`: records adapter calls; `served` is what the server lists
    (the base model, then the adapters it holds), kept as vLLM keeps it: a load adds, an unload
    removes, and a name it holds is loaded again only in place. `peak`: the most adapters it
    held at once; `paths`: where each held adapter was loaded from (vLLM reads it again when
    its CPU cache evicts the adapter)."""

    def __init__(self, served=()):
        self.calls, self.served = [], list(served)
        self.info = LORA_SERVER_INFO  # what /server_info answers
        self.paths, self.peak = {}, 0

    def server_info(self):
        return self.info

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def served_models(self):
        return list(self.served)

    def load_lora_adapter(self, name, path, *, in_place=False):
        from grpo_agent.sampler.errors import RequestRejectedError

        assert (Path(path) / "adapter_model.safetensors").is_file(), "loaded before written"
        if name in self.served and not in_place:
            raise RequestRejectedError(
                f"POST /v1/load_lora_adapter was rejected with HTTP 400: The lora adapter "
                f"'{name}' has already been loaded.", status_code=400)
        self.calls.append(("reload" if in_place else "load", name))
        if name not in self.served:
            self.served.append(name)
        self.paths[name] = Path(path)
        self.peak = max(self.peak, len(self.adapters()))

    def unload_lora_adapter(self, name):
        from grpo_agent.sampler.errors import RequestRejectedError

        self.calls.append(("unload", name))
        if name not in self.served:
            raise RequestRejectedError(
                f"POST /v1/unload_lora_adapter was rejected with HTTP 404: The lora adapter "
                f"'{name}' cannot be found.", status_code=404)
        self.served.remove(name)

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def adapters(self):
        return [name for name in self.served if name != "base"]

    def restart(self):
        """A new server: the base model alone."""
        self.served, self.paths = ["base"], {}

    def unreadable(self):
        """The held adapters whose folder is gone."""
        return [name for name in self.adapters() if not self.paths[name].is_dir()]


def test_the_pusher_keeps_max_staleness_plus_one_versions_and_deletes_folders_a_sync_late(
        tiny_path, tmp_path, monkeypatch):
    from grpo_agent.config import AsyncGRPOConfig

    control = _RecordingControl(served=["run-v7", "run2-v1", "other-v1", "run-probe", "base"])
    monkeypatch.setattr(AdapterPusher, "_control", lambda self: control)
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), max_staleness=1, use_cpu=True,
                           vllm_server_base_url="http://server:8132")
    model = _peft(tiny_path, r=4, target_modules=["q_proj"])
    pusher = AdapterPusher(args, model, base_is_stale=False)
    # An earlier run's adapters of this output_dir are unloaded, others' left; the probe
    # load checks that the server can serve the adapter before training starts.
    assert control.calls == [("unload", "run-v7"), ("unload", "run-probe"),
                             ("load", "run-probe"), ("unload", "run-probe")]
    folders = lambda: sorted(p.name for p in pusher.cache_dir.iterdir())

    served = []
    pusher.on_served = served.append
    control.calls = []
    for version in (1, 2, 3):
        pusher.push(model, version)
    assert served == [1, 2, 3]
    # max_staleness + 1 = 2 versions registered; the next is loaded before the oldest goes.
    assert control.calls == [("load", "run-v1"), ("load", "run-v2"),
                             ("load", "run-v3"), ("unload", "run-v1")]
    assert folders() == ["run-v1", "run-v2", "run-v3"]  # v1 may still be read by a request
    control.calls = []
    pusher.push(model, 4)
    assert control.calls == [("load", "run-v4"), ("unload", "run-v2")]
    assert folders() == ["run-v2", "run-v3", "run-v4"]  # v1 went one sync after its unload

    control.restart()
    pusher.reopen()  # the restarted server holds none of them: nothing to unload there
    control.calls = []
    pusher.push(model, 5)
    assert control.calls == [("load", "run-v5")]
    assert folders() == ["run-v5"]
    control.calls = []
    pusher.push(model, 6)
    assert control.calls == [("load", "run-v6")]  # the window restarts with the new server
    pusher.close()
    assert control.calls == [("load", "run-v6"), ("unload", "run-v5"), ("unload", "run-v6")]
    assert folders() == []


def _recorded_adapter_pusher(tiny_path, tmp_path, monkeypatch):
    """An AdapterPusher of a q_proj LoRA whose server calls `_RecordingControl` records:
    (control, model, pusher, the versions it announced as served)."""
    from grpo_agent.config import AsyncGRPOConfig

    control = _RecordingControl()
    monkeypatch.setattr(AdapterPusher, "_control", lambda self: control)
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), max_staleness=1, use_cpu=True,
                           vllm_server_base_url="http://server:8132")
    model = _peft(tiny_path, r=4, target_modules=["q_proj"])
    pusher = AdapterPusher(args, model, base_is_stale=False)
    served = []
    pusher.on_served = served.append
    return control, model, pusher, served


def test_a_version_the_server_could_not_load_is_not_announced(tiny_path, tmp_path, monkeypatch):
    from grpo_agent.sampler.errors import SamplerError

    control, model, pusher, served = _recorded_adapter_pusher(tiny_path, tmp_path, monkeypatch)

    def refuse(name, path, **how):
        raise SamplerError(f"could not load {name}")

    control.load_lora_adapter = refuse
    with pytest.raises(SamplerError, match="could not load run-v1"):
        pusher.push(model, 1)
    assert served == []  # the worker keeps labelling groups with the version the server has


def test_a_restored_server_gets_the_current_version_again_from_its_folder(
        tiny_path, tmp_path, monkeypatch):
    """When the rollout worker lost the server, the restore pushes the current version again
    under the same name (`ServerRecovery.restore`: reopen, then push): its folder, already
    queued for deletion by `reopen`, is written anew and must survive to be loaded."""
    from grpo_agent.sampler import recovery

    control, model, pusher, served = _recorded_adapter_pusher(tiny_path, tmp_path, monkeypatch)
    monkeypatch.setattr(recovery, "restore_server", lambda url, timeout: "was restarted")
    keeper = recovery.ServerRecovery(pusher.args.vllm_server_base_url, 5)
    folders = lambda: sorted(p.name for p in pusher.cache_dir.iterdir())
    pusher.push(model, 1)
    pusher.push(model, 2)
    control.restart()
    control.calls = []
    keeper.restore(pusher, model, 2, cause="the rollout worker lost it")
    assert control.calls == [("load", "run-v2")] and served == [1, 2, 2]
    assert folders() == ["run-v2"]  # v1 went; v2 is the one just loaded
    pusher.push(model, 3)
    assert control.calls == [("load", "run-v2"), ("load", "run-v3")]
    assert folders() == ["run-v2", "run-v3"]
    pusher.close()


def test_a_restore_that_finds_the_server_still_up_reloads_the_current_version_in_place(
        tiny_path, tmp_path, monkeypatch):
    """The worker lost a server that answers again without a restart (`restore_server`:
    "answered again"): it still holds the current version's adapter, and vLLM refuses to load
    a name it holds (HTTP 400 "has already been loaded"), so the restore's push stopped the
    run. It is reloaded in place (the restore pushes the weights of now, which differ from the
    version's first push under weight_sync_steps > 1) and the prefix cache, keyed by the
    adapter's name and folder, dropped; the window goes on with the versions it holds."""
    from grpo_agent.sampler import recovery

    control, model, pusher, served = _recorded_adapter_pusher(tiny_path, tmp_path, monkeypatch)
    monkeypatch.setattr(recovery, "restore_server", lambda url, timeout: "answered again")
    keeper = recovery.ServerRecovery(pusher.args.vllm_server_base_url, 5)
    pusher.push(model, 1)
    pusher.push(model, 2)
    control.calls = []
    keeper.restore(pusher, model, 2, cause="the rollout worker lost it")
    assert control.calls == [("reload", "run-v2"), ("reset_prefix_cache",)]
    assert served == [1, 2, 2] and control.adapters() == ["run-v1", "run-v2"]
    control.calls = []
    pusher.push(model, 3)
    assert control.calls == [("load", "run-v3"), ("unload", "run-v1")]
    assert _left_in(pusher.cache_dir) == ["run-v1", "run-v2", "run-v3"] and not control.unreadable()
    pusher.close()
    assert control.adapters() == [] and _left_in(pusher.cache_dir) == []


def test_a_restore_that_finds_the_server_still_up_keeps_its_adapters_in_the_window(
        tiny_path, tmp_path, monkeypatch):
    """A failed load is retried after a restore; one that found the server still up (it
    answered again, no restart) left it holding the run's adapters, but the pusher forgot
    them: their folders were deleted at the next sync while still loaded (vLLM reads a folder
    again when its cache evicts the adapter), the server came to hold more than
    `--max-loras` = max_staleness + 2 adapters, and `close` never unloaded them. The pusher
    now takes the window from the adapters the server lists (`GET /v1/models`)."""
    from grpo_agent.sampler import recovery
    from grpo_agent.sampler.errors import RequestRejectedError

    control, model, pusher, served = _recorded_adapter_pusher(tiny_path, tmp_path, monkeypatch)
    monkeypatch.setattr(recovery, "restore_server", lambda url, timeout: "answered again")
    keeper = recovery.ServerRecovery(pusher.args.vllm_server_base_url, 5)
    pusher.push(model, 1)
    pusher.push(model, 2)
    loads, refusals = control.load_lora_adapter, [1]

    def refuse_once(name, path, **how):
        if refusals:
            refusals.pop()
            raise RequestRejectedError("POST /v1/load_lora_adapter was rejected with HTTP 400: "
                                       "No adapter found", status_code=400)
        loads(name, path, **how)

    control.load_lora_adapter = refuse_once
    control.calls = []
    keeper.push(pusher, model, 3)
    assert control.calls == [("load", "run-v3"), ("unload", "run-v1")] and served == [1, 2, 3]
    for version in (4, 5):
        keeper.push(pusher, model, version)
        assert not control.unreadable(), "a folder deleted while the server holds its adapter"
    assert control.adapters() == ["run-v4", "run-v5"]
    assert control.peak == pusher.args.max_staleness + 2  # the --max-loras the run asks for
    pusher.close()
    assert control.adapters() == []


def test_an_adapter_the_server_fails_to_load_twice_stops_the_run_and_leaves_no_folder(
        tiny_path, tmp_path, monkeypatch, caplog):
    """A load that fails is retried once after a restore (`ServerRecovery.push`); failing
    again stops the run, and closing the pusher then deleted every folder but that one: it was
    neither registered nor queued, so `.vllm_lora/run-v2/` stayed on disk. It must survive
    until then (a load that timed out may still be reading it, and the retry loads it), and
    the error must say what failed and what to do, not only vLLM's HTTP answer."""
    import logging

    from grpo_agent.sampler import recovery
    from grpo_agent.sampler.errors import RequestRejectedError, WeightSyncError

    control, model, pusher, served = _recorded_adapter_pusher(tiny_path, tmp_path, monkeypatch)
    monkeypatch.setattr(recovery, "restore_server", lambda url, timeout: "answered again")
    keeper = recovery.ServerRecovery(pusher.args.vllm_server_base_url, 5)
    folders = lambda: sorted(p.name for p in pusher.cache_dir.iterdir())
    loads = _RecordingControl.load_lora_adapter
    refusals = []

    def refuse_then_load(name, path, **how):
        if refusals:
            refusals.pop()
            raise RequestRejectedError("POST /v1/load_lora_adapter was rejected with HTTP 400: "
                                       "No adapter found", status_code=400)
        loads(control, name, path, **how)

    control.load_lora_adapter = refuse_then_load
    refusals[:] = [1]  # once: the retry loads it
    with caplog.at_level(logging.WARNING, logger="grpo_agent.sampler.recovery"):
        keeper.push(pusher, model, 1)
    assert served == [1] and folders() == ["run-v1"]
    # The retry's warning says what failed and that it retries; the advice to fix it and
    # resume belongs to the error that stops the run (below), not to a push that goes on.
    retry = caplog.records[0].getMessage()
    assert retry.startswith("Pushing weights version 1 failed (WeightSyncError: The vLLM server "
                            "at http://server:8132 did not load the LoRA adapter 'run-v1' "
                            "(weights version 1) from ")
    assert retry.endswith("was rejected with HTTP 400: No adapter found); retrying once after "
                          "restoring the server if it is down (and re-opening a transfer group, "
                          "where the push has one).")  # LoRA sync has none
    refusals[:] = [1, 1]  # twice: the run gives up
    with pytest.raises(WeightSyncError) as failed:
        keeper.push(pusher, model, 2)
    message = str(failed.value)
    assert message.startswith("The vLLM server at http://server:8132 did not load the LoRA "
                              "adapter 'run-v2' (weights version 2) from ")
    assert "was rejected with HTTP 400: No adapter found" in message
    assert "resume from the last checkpoint" in message
    assert served == [1]
    assert "run-v2" in folders()  # kept while the server may still read it
    control.calls = []
    pusher.close()
    assert control.calls == [("unload", "run-v1")]  # run-v2 was never loaded
    assert _left_in(pusher.cache_dir) == []


def test_a_version_an_unload_failed_to_take_off_the_server_leaves_no_folder(
        tiny_path, tmp_path, monkeypatch):
    """An unload that fails fails the push (retried after a restore, which forgets the old
    server's adapters): the version it took off the window was in no list, so its folder
    outlived the run."""
    from grpo_agent.sampler.errors import SamplerError

    control, model, pusher, _ = _recorded_adapter_pusher(tiny_path, tmp_path, monkeypatch)
    pusher.push(model, 1)
    pusher.push(model, 2)

    def refuse(name):
        raise SamplerError(f"POST /v1/unload_lora_adapter failed after 3 attempts ({name})")

    control.unload_lora_adapter = refuse
    with pytest.raises(SamplerError, match="run-v1"):
        pusher.push(model, 3)
    pusher.close()  # the run gives up (a dead server's unloads fail here too: logged)
    assert _left_in(pusher.cache_dir) == []


@pytest.mark.parametrize("retried_by", ["the next sync", "close"])
def test_an_adapter_whose_unload_failed_is_unloaded_by_the_next_sync_or_close(
        tiny_path, tmp_path, monkeypatch, retried_by):
    """A failed unload took the version off the window first, so nothing tried it again:
    the server held it for good, beside a full window."""
    from grpo_agent.sampler.errors import SamplerError

    control, model, pusher, _ = _recorded_adapter_pusher(tiny_path, tmp_path, monkeypatch)
    pusher.push(model, 1)
    pusher.push(model, 2)
    unloads, failures = control.unload_lora_adapter, [1]

    def fail_once(name):
        if failures:
            failures.pop()
            raise SamplerError("POST /v1/unload_lora_adapter failed after 3 attempts: ReadTimeout")
        unloads(name)

    control.unload_lora_adapter = fail_once
    with pytest.raises(SamplerError, match="ReadTimeout"):
        pusher.push(model, 3)
    assert control.adapters() == ["run-v1", "run-v2", "run-v3"]
    if retried_by == "the next sync":
        control.calls = []
        pusher.push(model, 4)
        assert control.calls == [("load", "run-v4"), ("unload", "run-v1"), ("unload", "run-v2")]
        assert control.adapters() == ["run-v3", "run-v4"]
    pusher.close()
    assert control.adapters() == []


def test_close_unloads_the_rest_past_an_adapter_the_server_refuses_to_unload(
        tiny_path, tmp_path, monkeypatch, caplog):
    """One refusal (a 4xx) stopped `close`, leaving every later version loaded; it goes on and
    names the one left. (A server that does not answer is not asked again: each unload may
    wait vllm_server_timeout three times.)"""
    import logging

    from grpo_agent.sampler.errors import RequestRejectedError

    control, model, pusher, _ = _recorded_adapter_pusher(tiny_path, tmp_path, monkeypatch)
    pusher.push(model, 1)
    pusher.push(model, 2)
    unloads = control.unload_lora_adapter

    def refuse_v1(name):
        if name == "run-v1":
            raise RequestRejectedError("POST /v1/unload_lora_adapter was rejected with HTTP 400: "
                                       "busy", status_code=400)
        unloads(name)

    control.unload_lora_adapter = refuse_v1
    with caplog.at_level(logging.WARNING, logger="grpo_agent.weight_sync.adapter"):
        pusher.close()
    assert control.adapters() == ["run-v1"]
    assert "refused to unload this run's LoRA adapter(s) run-v1 (POST " in caplog.text
    assert _left_in(pusher.cache_dir) == []


def _left_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize(("info", "refusal"), [
    ({"vllm_config": {"lora_config": None, "device_config": {"device": "cuda"}}, "vllm_env": {}},
     (r"came back without --enable-lora, but this run pushes LoRA adapters and its rollouts "
      r"sample them by name: it cannot switch to merged weights mid-run\. Restart the server "
      r"with the run's LoRA flags \(its whole command: `[^`]+`\) and resume from the last "
      r"checkpoint\.$")),
    ({**LORA_SERVER_INFO, "vllm_env": {}},
     (r"came back with other LoRA flags\. .*started without VLLM_ALLOW_RUNTIME_LORA_UPDATING=1.*"
      r"Restart it with the run's LoRA flags: `[^`]+`\. Then resume from the last checkpoint\.$")),
])
def test_a_server_restarted_without_the_runs_lora_flags_stops_the_push_saying_how_to_restart_it(
        tiny_path, tmp_path, monkeypatch, info, refusal):
    """The rollouts sample adapters by name, so a server that came back unable to load them
    cannot take merged weights instead: the restore's push stops the run with the run's whole
    server command (before, vLLM's bare 404 on /v1/load_lora_adapter, read as a missing
    VLLM_SERVER_DEV_MODE; then only the LoRA flags, and a server restarted with those alone
    lacked the others). Nothing is loaded or announced; the same server passes once fixed."""

    from grpo_agent.sampler.errors import WeightSyncError

    control, model, pusher, served = _recorded_adapter_pusher(tiny_path, tmp_path, monkeypatch)
    pusher.push(model, 1)
    control.restart()
    pusher.reopen()  # the server was restarted by hand
    control.info, control.calls = info, []
    url = "http://server:8132"
    with pytest.raises(WeightSyncError, match=f"^The vLLM server at {url} " + refusal) as refused:
        pusher.push(model, 2)
    program, advised = _advised(str(refused.value), pusher.args, model, "cuda")
    assert program == ["vllm"] and advised.port == 8132  # where the run's server is, on its GPU
    assert (advised.max_lora_rank, advised.max_loras) == (8, 3)  # r=4; max_staleness 1 + 2
    assert served == [1] and control.calls == []
    control.info = LORA_SERVER_INFO  # restarted again, with the flags
    pusher.push(model, 3)
    assert served == [1, 3] and control.calls == [("load", "run-v3")]
    pusher.close()


def _advised(message: str, args, model, device: str):
    """The one command `message` names (in backticks), parsed by vLLM's own parser and checked
    whole: a server it starts on `device` passes the training checks and adapter sync's.
    Returns its program words and vLLM's parse of its arguments."""
    import dataclasses
    import re

    from grpo_agent.sampler.server_facts import RUNTIME_UPDATING_ENV, check_training_server
    from grpo_agent.train.setup import server_needs

    from tests.sampler.test_server import _facts_of, _parse_served

    [command] = re.findall(r"`([^`]+)`", message)
    env, program, served = _parse_served(command)
    facts = dataclasses.replace(_facts_of(env, served), device=device)
    check_training_server(facts, args.vllm_server_base_url, server_needs(args, model))
    limits = LoraServerLimits(served.max_lora_rank, served.max_loras,
                              env.get(RUNTIME_UPDATING_ENV) == "1")
    check_lora_limits(limits, adapter_rank(model), args.max_staleness, command=command)
    return program, served


def test_a_lora_refusal_at_start_names_the_whole_command_of_a_server_it_accepts(
        tiny_path, tmp_path, monkeypatch):
    """Limits too small for the run's adapters are refused with the run's whole server command
    (the start check's), on the device the server runs on: it named only the LoRA flags
    (`vllm serve <model> <your other flags> --enable-lora ...`), and a server started so
    lacked the dev mode and log-probs flags the next check refused it for."""
    from grpo_agent.config import AsyncGRPOConfig
    from grpo_agent.sampler.server_facts import ServerFacts
    from grpo_agent.weight_sync.adapter import use_adapter_sync

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU trainer box
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_staleness=3,
                           vllm_server_base_url="http://127.0.0.1:8133")
    model = _peft(tiny_path, r=12, target_modules=["q_proj"])
    facts = ServerFacts(model_id=str(tiny_path), max_model_len=2048, device="cuda",
                        lora=LoraServerLimits(max_lora_rank=8, max_loras=3, runtime_updating=True))
    with pytest.raises(ValueError, match=r"its --max-lora-rank is 8 but the adapter's rank is 12"
                                         r".* \(Or start it without --enable-lora") as refused:
        use_adapter_sync(model, facts, args)
    program, served = _advised(str(refused.value), args, model, "cuda")
    assert program == ["vllm"] and served.port == 8133  # the GPU server's, not this box's
    assert served.model_tag == str(tiny_path)
    assert (served.max_lora_rank, served.max_loras) == (16, 5)  # vLLM's ranks; 3 + 2 versions


def test_a_lora_run_on_a_server_without_enable_lora_says_it_pushes_merged_weights(
        tiny_path, tmp_path, caplog):
    # `train --lora-rank 8 --vllm-url URL` on a server started without --enable-lora pushed
    # every weight each sync, and nothing in the run's output said so.
    import logging

    from grpo_agent.config import AsyncGRPOConfig
    from grpo_agent.sampler.server_facts import ServerFacts
    from grpo_agent.weight_sync.adapter import use_adapter_sync
    from transformers import AutoModelForCausalLM

    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    model = _peft(tiny_path, r=4, target_modules=["q_proj"])
    with caplog.at_level(logging.WARNING, logger="grpo_agent.weight_sync.adapter"):
        assert not use_adapter_sync(model, ServerFacts("m", 64, device="cpu"), args)
        assert caplog.text.count("runs without --enable-lora: each weight sync pushes the LoRA "
                                 "adapter merged into every weight") == 1
        # the restart it advises starts a server adapter sync accepts: it said "--enable-lora"
        # alone, and such a server lacks the limits and the runtime-updating variable
        [record] = caplog.records
        program, _ = _advised(record.getMessage(), args, model, "cpu")
        assert "grpo_agent.sampler.vllm_entry" in program  # the CPU server's command
        caplog.clear()
        assert not use_adapter_sync(AutoModelForCausalLM.from_pretrained(tiny_path),
                                    ServerFacts("m", 64), args)
        lora_server = ServerFacts("m", 64, lora=LoraServerLimits(8, 6, True))
        assert use_adapter_sync(model, lora_server, args)
    assert "--enable-lora" not in caplog.text  # no LoRA to sync, or adapter sync: nothing to say


def test_the_advised_server_command_of_a_lora_run_has_the_lora_flags(tiny_path, tmp_path,
                                                                      monkeypatch):
    """The command the start check (and every refusal) names for a `--lora-rank` run starts a
    server adapter sync accepts (`check_lora_limits`): without --enable-lora and its limits the
    run fell back to merged weights, and a server restarted by it mid-run was refused by the
    adapter pusher's own check. A run that pushes merged weights is advised none."""
    import shlex

    from grpo_agent.config import AsyncGRPOConfig
    from grpo_agent.sampler.server_facts import LoraServerLimits, serve_command_for
    from grpo_agent.train.setup import server_needs
    from grpo_agent.weight_sync.adapter import check_lora_limits
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_staleness=3)
    model = _peft(tiny_path, r=12, target_modules=["q_proj"])
    command = serve_command_for(server_needs(args, model), 8125)
    words = shlex.split(command)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in words and "--enable-lora" in words
    limits = LoraServerLimits(max_lora_rank=int(words[words.index("--max-lora-rank") + 1]),
                              max_loras=int(words[words.index("--max-loras") + 1]),
                              runtime_updating=True)
    assert (limits.max_lora_rank, limits.max_loras) == (16, 5)  # vLLM's ranks; 3 + 2 versions
    check_lora_limits(limits, 12, args.max_staleness, command=command)
    for merged in (server_needs(args, model, lora_sync=False),
                   server_needs(args, AutoModelForCausalLM.from_pretrained(tiny_path))):
        assert "lora" not in serve_command_for(merged, 8125).lower()
