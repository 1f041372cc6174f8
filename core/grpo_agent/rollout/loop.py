"""`AsyncRolloutLoop`: the spec's extension surface for how rollouts are generated and scored.

Design decision: this class holds only the hooks a user overrides (`filter_prompt`,
`generate_one`, `generate_one_turn`, `compute_advantages`, `setup`, `close`) and what they
read (`config`, `tokenizer`, `sampler`, `tool_executor`, `server`). The engine that drives it
inside the rollout worker (dispatch, scoring, server polling, heartbeat, metric flushes) is
`rollout.engine.RolloutEngine`; evaluation drives the same hooks without it.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from grpo_agent.rollout import first_turns
from grpo_agent.rollout.agent import run_tool_loop
from grpo_agent.rollout.engine import RolloutEngine
from grpo_agent.rollout.environments import EnvironmentRunner
from grpo_agent.rollout.images import strip_images
from grpo_agent.rollout.plugins import (
    accept_prompt,
    call_plugin,
    check_plugin_args,
    resolve_advantage_estimator,
    resolve_prompt_filters,
)
from grpo_agent.rollout.sampling import build_sampling_params
from grpo_agent.rollout.scoring import reward_name
from grpo_agent.rollout.versions import VersionValue, rollout_version
from grpo_agent.sampler.client import adapter_name, version_adapters
from grpo_agent.sampler.errors import RequestRejectedError, ServerUnreachableError
from grpo_agent.sampler.recovery import AdapterServedAgain, restate_adapter_refusal
from grpo_agent.sampler.server_facts import ServerFacts, probe_server
from grpo_agent.stall import StallWatch
from grpo_agent.types import Rollout, RolloutGroup, TurnRecord

logger = logging.getLogger(__name__)

# How long a rollout whose adapter a push unloaded waits for the worker to learn the version it
# loaded (`AsyncRolloutLoop._adapter_after_refusal`): the rest of the push, an FSDP barrier.
ADAPTER_ANNOUNCE_WAIT_S = 30.0
ADAPTER_ANNOUNCE_POLL_S = 0.02


class AsyncRolloutLoop:
    """Generates and scores rollouts for `AsyncGRPOTrainer` in the spawned rollout worker.

    Override `filter_prompt`, `generate_one`, `generate_one_turn`, `compute_advantages`,
    `setup` or `close` in a module-level subclass and set it as the trainer's `loop_cls`.
    `channels` are the worker's shared queues and values (`rollout.channels.WorkerChannels`);
    None outside a worker. `lora_name`, when the trainer syncs LoRA adapters, is the adapter
    name prefix: every rollout samples with the adapter of the model version its group started
    under (`adapter_name`), so a rollout begun under an old policy finishes under it.
    """

    reports_tools = False  # True: log `tools/*` even without `tools` (the harness gateway)
    runs_tools = True  # False: the tools run elsewhere (an agent program), so no failures to log

    def __init__(self, config, model_name, dataset, reward_funcs, processing_class, eos_token_ids,
                 channels=None, tools=None, environment_factory=None, score_queue_maxsize=16,
                 lora_name=None, dataset_start_index=0):
        self.config = config
        self.model_name = model_name
        self.dataset = dataset
        self.reward_funcs = _named_reward_funcs(reward_funcs)
        self.tokenizer = processing_class
        self.eos_token_ids = list(eos_token_ids)
        self.channels = channels
        self.model_version_value = channels.model_version if channels is not None else VersionValue(0)
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.score_queue_maxsize = score_queue_maxsize
        self.lora_name = lora_name
        self.dataset_start_index = dataset_start_index
        # Set when a driver (the engine, an evaluation session) connects, before `setup` runs.
        self.sampler = None  # grpo_agent.sampler.client.SamplerClient
        self.server = None  # grpo_agent.sampler.server_facts.ServerFacts
        self.tool_executor = None  # a ThreadPoolExecutor for blocking work
        self.sampling_params = None  # grpo_agent.sampler.client.SamplingParams
        self.seeds = None  # an iterator of per-request seeds, or None (a CPU server)
        self._seed_stream = None
        self.env_runner: EnvironmentRunner | None = None
        self.evaluating = False  # True: driven by an evaluation session, beside the worker's loop
        self._warned_images = False
        # Stage deadlines; monitored once the engine starts it (evaluation only tracks stages).
        self.stalls = StallWatch(config, "worker")
        check_plugin_args(config, list(self.reward_funcs.values()))
        plugin_args = getattr(config, "plugin_args", None)
        self._advantage_estimator = resolve_advantage_estimator(config.advantage_estimator, plugin_args)
        self._prompt_filters = resolve_prompt_filters(config.prompt_filters, plugin_args)

    # ------------------------------------------------------------------ hooks

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """True to roll out this prompt; by default every configured prompt filter must agree."""
        return all(accept_prompt(name, accept, row_index, row, epoch)
                   for name, accept in zip(self.config.prompt_filters, self._prompt_filters))

    async def generate_one(self, prompt: list[dict], tools: list[Callable], group_id: int = 0) -> Rollout:
        """One rollout: the multi-turn tool loop (rendering, sampling, tool calls)."""
        return await run_tool_loop(self, prompt, tools, group_id)

    async def generate_one_turn(self, prompt_ids: list[int], max_tokens: int | None = None) -> TurnRecord:
        """One vLLM request with the config's sampling settings, on the rollout's policy.

        `max_tokens` lowers `max_completion_length` for this call (the gateway's max_tokens)."""
        params = self.sampling_params
        if max_tokens is not None:
            params = replace(params, max_tokens=max_tokens)
        version = rollout_version()
        if version is None:  # called outside a rollout (e.g. from setup): the newest policy
            version = int(self.model_version_value.value)
        model = adapter_name(self.lora_name, version)
        shared = first_turns.claim()  # a group's first turns: one request with n (first_turns.py)
        with self.stalls.stage("vllm_generate", recover=True, prompt_tokens=len(prompt_ids)):
            if shared is not None:
                return await shared.sample(prompt_ids, params, model, self._sample_turns)
            return (await self._sample_turns(prompt_ids, params, model, 1))[0]

    async def _sample_turns(self, prompt_ids: list[int], params, model: str | None,
                            n: int) -> list[TurnRecord]:
        """`n` samples of `prompt_ids` in one request. A seeded server gets a fresh seed per
        request and skips `n` of them (vLLM seeds choice i with seed + i)."""
        if self.seeds is not None:
            params = replace(params, seed=next(self.seeds))
            for _ in range(n - 1):
                next(self.seeds)
        try:
            return await self._request_turns(prompt_ids, params, model, n)
        except RequestRejectedError as error:
            if model is None or error.status_code != 404:
                raise
            newest = await self._adapter_after_refusal(error, model)
        # The trainer unloaded this rollout's adapter: it is more than max_staleness versions
        # old, so its samples are dropped as stale anyway. Finish it on the newest policy (or,
        # after a restore pushed it again, on the same one).
        logger.debug("Adapter %s was refused mid-rollout; continuing on %s.", model, newest)
        return await self._request_turns(prompt_ids, params, newest, n)

    async def _adapter_after_refusal(self, error: RequestRejectedError, model: str) -> str | None:
        """The adapter to finish a rollout on after the server refused `model`, its group's, as
        an unknown model (vLLM's 404). One older than the worker's newest: the trainer's push
        unloaded it beyond max_staleness, so the newest. The newest itself, in training: a
        restarted server that serves it again by now (the restore's push landed), the same one
        again; a server restarted before the trainer's restore pushed it again raises as lost
        (`recovery.restate_adapter_refusal`; the engine drops the group as `server_lost` and
        the trainer restores); under max_staleness=0 a push unloads it just before the worker
        learns the version it loaded (`AdapterPusher.push`: `_register`, then `on_served`), so
        while the server serves a newer one of the run's adapters the newest the worker learns
        within `ADAPTER_ANNOUNCE_WAIT_S`. Any other refusal (and any in an evaluation, pinned to
        its version) raises, naming the adapter."""
        newest = adapter_name(self.lora_name, int(self.model_version_value.value))
        if newest != model:
            return newest
        restated = await restate_adapter_refusal(error, self.sampler, self.lora_name)
        if restated is None:
            raise error
        if isinstance(restated, AdapterServedAgain) and not self.evaluating:
            return model  # the restore's push landed: asking for another would restart again
        if self.evaluating or isinstance(restated, ServerUnreachableError):
            raise restated from error
        refused = int(model.rsplit("-v", 1)[1])
        served = version_adapters(await self.sampler.served_models(), self.lora_name)
        if any(int(name.rsplit("-v", 1)[1]) > refused for name in served):
            deadline = time.monotonic() + ADAPTER_ANNOUNCE_WAIT_S
            while time.monotonic() < deadline:
                if int(self.model_version_value.value) > refused:
                    return adapter_name(self.lora_name, int(self.model_version_value.value))
                await asyncio.sleep(ADAPTER_ANNOUNCE_POLL_S)
        raise restated from error

    async def _request_turns(self, prompt_ids, params, model, n) -> list[TurnRecord]:
        if n == 1:
            return [await self.sampler.generate(prompt_ids, params, model=model)]
        return await self.sampler.generate_many(prompt_ids, params, n, model=model)

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout from `group.rewards` (group-normalised by default)."""
        return call_plugin("advantage estimator", self.config.advantage_estimator,
                           self._advantage_estimator, group)

    async def setup(self) -> None:
        """Create resources the other hooks need; runs on the loop before the first prompt."""

    async def close(self) -> None:
        """Release what `setup` created; runs when the loop stops, failures included."""

    # ------------------------------------------------------------------ driven by the engine

    async def connect(self, sampler, tool_executor) -> None:
        """Attach the server client and the executor for blocking work, probe the server and
        derive the sampling settings: what every hook may use once `setup` runs."""
        self.sampler, self.tool_executor = sampler, tool_executor
        self._adopt(await probe_server(sampler))
        if self.environment_factory is not None:
            self.env_runner = EnvironmentRunner(self.environment_factory, tool_executor)

    async def reconnect(self) -> ServerFacts:
        """The server was restarted (the trainer restored it): read its facts again and
        re-derive what they decide, since it may have come back with other flags or on other
        hardware: seeds (never on a CPU server), sampling masks, `max_model_len` and the model
        id the client sends and the gateway reports. Returns the facts it had before; the
        engine re-sizes its concurrency cap from the new ones (KV cache, `max_model_len`)."""
        before = self.server
        self.sampler.forget_server()
        self._adopt(await probe_server(self.sampler))
        return before

    def _adopt(self, facts: ServerFacts) -> None:
        """Take `facts` as the server's. One seed stream per run: a server that comes back on
        a GPU after a CPU one goes on with it (no seed twice)."""
        self.server = facts
        self.sampling_params = build_sampling_params(self.config, self.eos_token_ids, facts)
        if self._seed_stream is None:
            self._seed_stream = itertools.count(self.config.seed * 1_000_003)
        self.seeds = None if facts.on_cpu else self._seed_stream

    def run(self) -> None:
        """Run the engine on these hooks until `channels.stop` is set or something fails."""
        asyncio.run(RolloutEngine(self, self.channels).run())

    async def run_episode(self, row: dict[str, Any], row_index: int, group_id: int) -> tuple:
        """One rollout of `row`: the environment's reset (which may build the prompt), then
        `generate_one`, then the environment's reward. Returns (prompt, rollout, env_reward).
        A loop whose rollout is not the tool loop (the agent harness) overrides this."""
        episode = None
        if self.env_runner is not None:  # the env builds the prompt (the row may have none)
            with self.stalls.stage("env_reset", recover=True, row_index=row_index):
                episode = await self.env_runner.start(row)
            prompt, tools = episode.prompt, [*self.tools, *episode.tools]
        else:
            prompt, tools = _row_prompt(row), self.tools
        try:
            prompt = self._without_images(prompt, row_index)
            rollout = await self.generate_one(prompt, tools, group_id)
        except BaseException:
            if episode is not None:
                self.env_runner.abandon(episode)
            raise
        env_reward = None
        if episode is not None:
            with self.stalls.stage("env_finish", recover=True, row_index=row_index):
                env_reward = await self.env_runner.finish(episode)
            for name, values in episode.metrics.items():
                rollout.metrics.setdefault(name, []).extend(values)
        return prompt, rollout, env_reward

    def _without_images(self, prompt: list[dict], row_index: int) -> list[dict]:
        prompt, removed = strip_images(prompt)
        if removed and not self._warned_images:
            self._warned_images = True
            logger.warning(
                "The prompt of row %d holds %d image(s). Images are not supported yet, so they "
                "are stripped from every prompt (the model sees only the text); use a text-only "
                "dataset to silence this.", row_index, removed)
        return prompt


def _named_reward_funcs(reward_funcs) -> dict[str, Callable]:
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs] if reward_funcs else []
    named: dict[str, Callable] = {}
    for func in funcs:
        name = reward_name(func)
        if name in named:
            raise ValueError(
                f"Two reward functions are both named {name!r}; metrics are logged per name "
                "(rewards/{name}/mean), so give them distinct names.")
        named[name] = func
    return named


def _row_prompt(row: dict[str, Any]) -> list[dict]:
    if "prompt" not in row:
        raise KeyError(
            "The dataset row has no 'prompt' column (it has: "
            f"{sorted(row)}). Add a conversational 'prompt' column, or pass an "
            "environment_factory whose reset() provides the prompt.")
    return row["prompt"]
