"""Sync a LoRA policy to vLLM as adapters, not merged weights (the spec's PEFT section).

Design decision: the sync mode is chosen once, at train start, from what the server reports
(`/server_info`: its `lora_config`, and whether runtime adapter loading is allowed), so users
only start the server with `--enable-lora`. vLLM loads adapters from disk, so version N is
written to `<output_dir>/.vllm_lora/<prefix>-v<N>/` (a temp folder renamed into place, never a
half-written one) and registered under that name. The trainer keeps `max_staleness + 1`
versions registered, loading the next before unloading the oldest (hence
`--max-loras >= max_staleness + 2`), so a rollout that started under an old policy finishes
under it. An unloaded version's folder is deleted one sync later, because a request already in
flight may still make the server read it. Version 0 is the base model itself: PEFT initialises
LoRA B to zero, so nothing needs registering before the first optimizer step.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.sampler.client import adapter_name, version_adapters
from grpo_agent.sampler.errors import RequestRejectedError, SamplerError, WeightSyncError
from grpo_agent.sampler.server_facts import (
    RUNTIME_UPDATING_ENV,
    LoraServerLimits,
    ServerFacts,
    serve_command_at,
    server_device,
)
from grpo_agent.train import fsdp
from grpo_agent.train.weights import has_trained_adapter, is_peft_model, lora_adapter_weights
from grpo_agent.weight_sync.full import WeightPusher, served_nowhere
from grpo_agent.weight_sync.lora_needs import (
    active_config,
    adapter_rank,
    needed_loras,
    unservable_reason,
)
from grpo_agent.weight_sync.transports.control import ServerControl

logger = logging.getLogger(__name__)

CACHE_DIR_NAME = ".vllm_lora"
def check_lora_limits(limits: LoraServerLimits, rank: int, max_staleness: int, *, command: str,
                      merged_fallback: bool = True) -> None:
    """Raise, naming `command` (the run's whole server command: `lora_run_command`), when the
    server cannot hold this run's adapters. `merged_fallback`: also say that a server without
    --enable-lora gets merged weights (true at train start only: a run cannot switch modes
    once its rollouts sample adapters)."""
    needed = needed_loras(max_staleness)
    problems = []
    if rank > limits.max_lora_rank:
        problems.append(f"its --max-lora-rank is {limits.max_lora_rank} but the adapter's rank "
                        f"is {rank}")
    if limits.max_loras < needed:
        problems.append(
            f"its --max-loras is {limits.max_loras} but max_staleness={max_staleness} needs at "
            f"least max_staleness + 2 = {needed} (the trainer keeps max_staleness + 1 "
            "versions registered and loads the next before unloading the oldest)")
    if not limits.runtime_updating:
        problems.append(f"it was started without {RUNTIME_UPDATING_ENV}=1, so adapters cannot "
                        "be loaded while it runs")
    if not problems:
        return
    raise ValueError(
        "The vLLM server runs with --enable-lora but cannot serve this run's LoRA adapters: "
        + "; ".join(problems) + f". Restart it with the run's LoRA flags: `{command}`."
        + (" (Or start it without --enable-lora: the trainer then pushes merged weights.)"
           if merged_fallback else "")
    )


def lora_run_command(args: AsyncGRPOConfig, model: nn.Module, device: str | None) -> str:
    """The whole command of a server this run's adapter sync accepts, where the run's server
    is and on its `device` (`server_facts.serve_command_at`, as the start check advises):
    the LoRA refusals named only some flags, and the server they started was refused again."""
    from grpo_agent.train.setup import server_needs

    return serve_command_at(args.vllm_server_base_url, server_needs(args, model), device)


def use_adapter_sync(model: nn.Module, facts: ServerFacts, args: AsyncGRPOConfig) -> bool:
    """Adapter sync for a PEFT model on a LoRA server; merged sync otherwise (the fallback),
    said once at start: a `--lora-rank` run on a `--vllm-url` server without --enable-lora
    pushed every weight each sync, and nothing in its output said so."""
    if not is_peft_model(model):
        return False
    if facts.lora is None:
        # The whole command: --enable-lora alone lacks the limits and the runtime-updating
        # variable, so a server restarted with only it was refused by `check_lora_limits`.
        logger.warning("The vLLM server runs without --enable-lora: each weight sync pushes the "
                       "LoRA adapter merged into every weight, not the adapter alone. For adapter "
                       "sync restart it with the run's LoRA flags (its whole command: `%s`; "
                       "docs/vllm.md, 'LoRA adapter sync').",
                       lora_run_command(args, model, facts.device))
        return False
    reason = unservable_reason(model)
    if reason is not None:
        logger.warning("The server runs with --enable-lora, but %s: pushing merged weights "
                       "instead.", reason)
        return False
    check_lora_limits(facts.lora, adapter_rank(model), args.max_staleness,
                      command=lora_run_command(args, model, facts.device))
    return True


def adapter_prefix(output_dir: str) -> str:
    """Adapter names start with the run's folder name, so two runs on one server never clash."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(output_dir).resolve().name).strip("-.")
    return name or "policy"


class AdapterPusher:
    """The adapter `Pusher`: version N of the LoRA adapter, for servers with `--enable-lora`."""

    def __init__(self, args: AsyncGRPOConfig, model: nn.Module, *, base_is_stale: bool,
                 backend: str | None = None) -> None:
        """`backend`: the server's weight-transfer backend, for restoring stale base weights."""
        self.args = args
        self._backend = backend
        self.lora_name = adapter_prefix(args.output_dir)
        self.cache_dir = Path(args.output_dir).resolve() / CACHE_DIR_NAME
        self.keep_versions = args.max_staleness + 1
        self.last_num_bytes = 0
        self.on_served: Callable[[int], None] = served_nowhere
        self._registered: deque[tuple[str, Path]] = deque()
        self._unloaded_folders: list[Path] = []  # deleted at the next sync
        self._main = fsdp.is_main_process()
        self._restored = False  # set by `reopen`: the server may have other flags, adapters
        if base_is_stale:
            self._restore_base_weights(model)
        unwrapped = getattr(model, "module", model)
        with torch.no_grad():
            initial = lora_adapter_weights(unwrapped)  # FSDP2 gathers: every rank takes part
        if self._main:
            self._forget_earlier_runs()
            self._check_server_loads(unwrapped, initial)

    # ------------------------------------------------------------------ the trainer's interface

    def needs_initial_push(self, model: nn.Module, holds_pushed_weights: bool) -> bool:
        """True when the adapter is not zero (a trained one was passed in): the server's base
        model is then not version 0, so the trainer pushes before the first rollout. (Base
        weights the server may not share, `base_is_stale`, were already pushed in `__init__`.)"""
        return has_trained_adapter(model)

    def push(self, model: nn.Module, version: int) -> dict[str, float]:
        """Write and register version `version`; returns the perf/weight_sync_* timings."""
        started = time.perf_counter()
        unwrapped = getattr(model, "module", model)
        with torch.no_grad():
            state = lora_adapter_weights(unwrapped)  # FSDP2 gathers: every rank takes part
        transfer_s, failed = 0.0, None
        if self._main:
            try:
                if self._restored:
                    self._check_restarted_server(unwrapped)
                    self._take_window_from_server()
                    self._restored = False
                folder = self._write_version(unwrapped, state, adapter_name(self.lora_name, version))
                self._register(folder, version)
            except Exception as error:  # noqa: BLE001 - raised after the barrier below
                failed = error
            transfer_s = time.perf_counter() - started
            self.last_num_bytes = sum(t.numel() * t.element_size() for t in state.values())
        barrier_started = time.perf_counter()
        if fsdp.world_size() > 1:
            torch.distributed.barrier()  # also after a failed load: the others wait here
        if failed is not None:
            raise failed
        self.on_served(version)
        return {
            "perf/weight_sync_s": time.perf_counter() - started,
            "perf/weight_sync_barrier_s": time.perf_counter() - barrier_started,
            "perf/weight_sync_pause_s": 0.0,  # adapters load while generation keeps running
            "perf/weight_sync_transfer_s": transfer_s,
        }

    def wait(self) -> dict[str, float]:
        return {}  # every push has landed when it returns

    def reopen(self) -> None:
        """After a restore (`sampler/recovery.py`), which restarts the server only when it does
        not answer: a restarted one holds none of our adapters, one that answered again holds
        them all. The next push checks its flags and asks it which it holds."""
        self._restored = self._main

    def _take_window_from_server(self) -> None:
        """The window becomes the run's versions the server lists (`GET /v1/models`), oldest
        first; the folders of the others go at this sync, except the one it writes anew."""
        with self._control() as control:
            held = version_adapters(control.served_models(), self.lora_name)
        held.sort(key=lambda name: int(name.rsplit("-v", 1)[1]))
        gone = [folder for name, folder in self._registered if name not in held]
        self._unloaded_folders = [folder for folder in self._unloaded_folders + gone
                                  if folder.name not in held]
        self._registered = deque((name, self.cache_dir / name) for name in held)

    def _check_restarted_server(self, model: nn.Module) -> None:
        """The first push after a restart checks that the server still serves this run's
        adapters. One restarted by hand without the LoRA flags cannot take over by merged
        weights: the rollouts sample adapters by name (`lora_name`), and every one of them would
        be refused. So the run stops here, saying how to restart it, instead of at vLLM's 404."""
        url = self.args.vllm_server_base_url
        with self._control() as control:
            info = control.server_info()
        limits = LoraServerLimits.from_server_info(info)
        command = lora_run_command(self.args, model, server_device(info))
        if limits is None:
            raise WeightSyncError(
                f"The vLLM server at {url} came back without --enable-lora, but this run pushes "
                "LoRA adapters and its rollouts sample them by name: it cannot switch to merged "
                "weights mid-run. Restart the server with the run's LoRA flags (its whole "
                f"command: `{command}`) and resume from the last checkpoint.")
        try:
            check_lora_limits(limits, adapter_rank(model), self.args.max_staleness,
                              command=command, merged_fallback=False)
        except ValueError as error:  # a WeightSyncError, so every rank hears of it (recovery)
            raise WeightSyncError(f"The vLLM server at {url} came back with other LoRA flags. "
                                  f"{error} Then resume from the last checkpoint.") from error

    def close(self) -> None:
        """Unload this run's adapters and empty the cache (checkpoints keep the adapter):
        every folder in it, also that of a version the server failed to load, which no list
        holds."""
        if not self._main:
            return
        try:
            self._unload_all()
        except SamplerError as error:  # a dead server must not hide why training stopped
            logger.warning("Could not unload this run's LoRA adapters: %s", error)
        finally:
            for folder in self.cache_dir.iterdir() if self.cache_dir.is_dir() else ():
                shutil.rmtree(folder, ignore_errors=True)
            self._registered.clear()
            self._unloaded_folders = []

    # ------------------------------------------------------------------ disk

    def _write_version(self, model: nn.Module, state: dict[str, torch.Tensor], name: str) -> Path:
        """The adapter as PEFT saves it (weights + adapter_config.json), renamed into place."""
        from safetensors.torch import save_file

        folder = self.cache_dir / name
        temporary = self.cache_dir / f".{name}.tmp-{os.getpid()}"
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in state.items()},
                  str(temporary / "adapter_model.safetensors"), metadata={"format": "pt"})
        active_config(model).save_pretrained(str(temporary))
        shutil.rmtree(folder, ignore_errors=True)  # a leftover of a crashed run
        os.replace(temporary, folder)
        return folder

    # ------------------------------------------------------------------ server

    def _register(self, folder: Path, version: int) -> None:
        """Load the new version, then unload beyond the window; delete last sync's unloads.
        A folder the server failed to load stays (a load that timed out may still read it, a
        retry writes it anew) until `close`. A version the server holds (a restore's push to a
        server that was not restarted) is loaded in place, with the weights of now, and the
        prefix cache dropped: vLLM keys it by adapter name and folder, both unchanged."""
        for old in self._unloaded_folders:
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
        self._unloaded_folders = []
        held = (folder.name, folder) in self._registered
        with self._control() as control:
            try:
                control.load_lora_adapter(folder.name, str(folder), in_place=held)
            except SamplerError as error:
                failed = (f"The vLLM server at {self.args.vllm_server_base_url} did not load the "
                          f"LoRA adapter {folder.name!r} (weights version {version}) from "
                          f"{folder}: {error.reason}")
                raise WeightSyncError(
                    f"{failed}. Its log says why; the server must be able to read that folder "
                    "(the trainer's output_dir at the same path: same machine or a shared file "
                    "system). Fix that, then resume from the last checkpoint.",
                    reason=failed) from error
            if held:
                control.reset_prefix_cache()
                self._registered.remove((folder.name, folder))
            self._registered.append((folder.name, folder))
            while len(self._registered) > self.keep_versions:
                name, old_folder = self._registered[0]
                control.unload_lora_adapter(name)  # failed: stays, for the next sync or `close`
                self._registered.popleft()
                self._unloaded_folders.append(old_folder)

    def _forget_earlier_runs(self) -> None:
        """Unload adapters an earlier run of this output_dir left registered; clear its cache."""
        with self._control() as control:
            for served in control.served_models():
                if served.startswith(f"{self.lora_name}-v") or served == self._probe_name:
                    control.unload_lora_adapter(served)
        shutil.rmtree(self.cache_dir, ignore_errors=True)

    def _check_server_loads(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load the initial adapter once under a probe name, so a server that cannot serve it
        fails now, with its reason, rather than at the first sync."""
        folder = self._write_version(model, state, self._probe_name)
        try:
            with self._control() as control:
                control.load_lora_adapter(self._probe_name, str(folder))
                control.unload_lora_adapter(self._probe_name)
        except SamplerError as error:
            raise RuntimeError(
                f"The vLLM server at {self.args.vllm_server_base_url} runs with --enable-lora "
                f"but could not load this run's LoRA adapter: {error}. Change the LoraConfig "
                "(e.g. target_modules) to layers vLLM supports for this model, or restart the "
                "server without --enable-lora so the trainer pushes merged weights."
            ) from error
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _unload_all(self) -> None:
        """Unload the window, also a version whose unload failed at a sync. Past a refusal (a
        4xx) it goes on and names the adapters left; a server that does not answer raises (each
        unload may wait vllm_server_timeout three times)."""
        refused = []
        with self._control() as control:
            for name, _ in self._registered:
                try:
                    control.unload_lora_adapter(name)
                except RequestRejectedError as error:
                    refused.append(f"{name} ({error.reason})")
        if refused:
            logger.warning("The vLLM server at %s refused to unload this run's LoRA adapter(s) "
                           "%s: they stay loaded until it restarts or a run with this "
                           "output_dir starts on it.", self.args.vllm_server_base_url,
                           "; ".join(refused))

    @property
    def _probe_name(self) -> str:
        return f"{self.lora_name}-probe"

    def _control(self) -> ServerControl:
        """A control client per operation; adapter calls take `vllm_server_timeout`."""
        return ServerControl(self.args.vllm_server_base_url, self.args.vllm_server_timeout)

    def _restore_base_weights(self, model: nn.Module) -> None:
        """The served base weights may not be ours (an earlier merged-sync run changed them, or
        the model was not loaded from the checkpoint by the trainer): push ours, once."""
        logger.info("The server may serve other base weights than the model's (an earlier run "
                    "pushed, or the model was passed in as an object); pushing the base model "
                    "before serving LoRA adapters on it.")
        pusher = WeightPusher(self.args, backend=self._backend, background=False)
        try:
            pusher.push(model, 0, merge_adapters=False)
        finally:
            pusher.close()
