"""The OpenAI-compatible gateway against a real vLLM server on the tool-warmed tiny model.

Agents use the real `openai` SDK (async, sync in a subprocess, streaming). The loop is the real
`HarnessRolloutLoop` with its gateway started, as the rollout worker starts it; only the worker
process around it is left out, except in the trainer test, which runs everything.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import harness_agents
import httpx
import openai
import pytest
from grpo_agent.rollout.agent_programs import AgentCommand
from grpo_agent.rollout.gateway import SAMPLING_HEADER, HarnessLimits
from grpo_agent.rollout.harness import HarnessRolloutLoop
from grpo_agent.rollout.reconcile import reconcile_turns

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = [{"role": "user", "content": "Increment the counter by 3."}]


def harness_config(server, tmp_path, **overrides):
    from grpo_agent import AsyncGRPOConfig

    values = {"output_dir": str(tmp_path), "vllm_server_base_url": server.base_url,
              "chat_template_kwargs": {"enable_thinking": False}, "max_completion_length": 64,
              "num_generations": 4, "report_to": "none", "max_steps": 2, **overrides}
    return AsyncGRPOConfig(**values)


@contextlib.asynccontextmanager
async def started_loop(server, tmp_path, agent, config=None, **limits):
    """A `HarnessRolloutLoop` connected to the server with its gateway serving (no worker);
    `config`: overrides of `harness_config`."""
    from grpo_agent.sampler.client import SamplerClient
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.model_path)
    loop = HarnessRolloutLoop(
        config=harness_config(server, tmp_path, **(config or {})), model_name=None, dataset=None, reward_funcs=None,
        processing_class=tokenizer, eos_token_ids=[tokenizer.eos_token_id],
        agent=agent, limits=HarnessLimits(**limits))
    try:
        await loop.connect(SamplerClient(server.base_url, timeout=120.0), ThreadPoolExecutor(4))
        loop.model_name = loop.server.model_id  # what the trainer passes
        await loop.setup()
        sampled = []
        generate = loop.generate_one_turn

        async def spy(prompt_ids, max_tokens=None):  # what the sampler returned, untouched
            turn = await generate(prompt_ids, max_tokens=max_tokens)
            sampled.append((list(prompt_ids), list(turn.output_ids), list(turn.output_log_probs)))
            return turn

        loop.generate_one_turn = spy
        loop.sampled = sampled
        yield loop
    finally:
        await loop.close()
        await loop.sampler.aclose()
        loop.tool_executor.shutdown(wait=False)


def render(tokenizer, messages, tools=None):
    from grpo_agent.rollout.agent import ConversationRenderer
    from grpo_agent.rollout.gateway import template_messages

    renderer = ConversationRenderer(tokenizer, tools, {"enable_thinking": False}, rerenders=True)
    return renderer.prompt_ids(template_messages(messages))


def test_tokens_are_exactly_what_vllm_sampled_and_multi_turn_is_one_sample(warm_server, tmp_path):
    async def main():
        # At temperature 1 the warmed model now and then writes its tool call in a form the
        # template renders differently (a fork, rightly: the sampled tokens stay as sampled;
        # tests/agent/test_reconcile.py). Nearly greedy, it writes the template's own form, so
        # a fork here can only come from the gateway or the SDK altering the history.
        async with started_loop(warm_server, tmp_path, harness_agents.counter_agent,
                                config={"temperature": 0.1}) as loop:
            results = await asyncio.gather(*(loop.run_agent_rollout({"target": t}) for t in (1, 2, 3, 4)))
            return loop, results

    loop, results = asyncio.run(main())
    multi_turn = 0
    for prompt, rollout in results:
        assert rollout.turns, rollout.metrics
        recorded = [(t.prompt_ids, t.output_ids, t.output_log_probs) for t in rollout.turns]
        assert all(entry in loop.sampled for entry in recorded)  # ids and log-probs as sampled
        assert rollout.turns[0].prompt_ids == render(loop.tokenizer, prompt, [harness_agents.INCREMENT_TOOL])
        sequences, stats = reconcile_turns(rollout.turns)
        trained = [t for s in sequences for t, m in zip(s.token_ids, s.trained_mask) if m]
        assert trained == rollout.completion_ids  # every generated token trained exactly once
        if len(rollout.turns) > 1:
            multi_turn += 1
            assert stats.num_forks == 0 and len(sequences) == 1, stats  # history re-rendered exactly
            assert rollout.completion[0]["tool_calls"][0]["function"]["name"] == "increment"
    assert multi_turn >= 2, [r.completion for _, r in results]
    assert {r.reward for _, r in results} <= {0.0, 1.0}


def test_a_multi_turn_chat_without_tools_is_one_sample(warm_server, tmp_path):
    """Qwen3's own template drops the `<think>` block of every assistant turn before the last
    user query, so each follow-up message rewrote the tokens the model had sampled (a fork per
    turn); the training template keeps them, tools or not.

    Off its tools prompt the tool-warmed model writes `increment`+`e` where the tokenizer
    encodes "incremente" as `incre`+`me`+`n`+`te`: each reply the agent sends back keeps the
    ids it was sampled as (re-encoded, it forked every turn)."""
    async def main():  # nearly greedy, as above: a fork can only come from the rendering
        async with started_loop(warm_server, tmp_path, harness_agents.chat_agent,
                                config={"temperature": 0.1}) as loop:
            rows = [{"turns": 3, "max_tokens": 32}] * 3
            results = await asyncio.gather(*(loop.run_agent_rollout(row) for row in rows))
            return loop, results

    loop, results = asyncio.run(main())
    for prompt, rollout in results:
        assert len(rollout.turns) == 3 and rollout.metrics["harness/errors_count"] == [0.0], rollout.metrics
        assert rollout.turns[0].prompt_ids == render(loop.tokenizer, prompt)
        sequences, stats = reconcile_turns(rollout.turns)
        assert (len(sequences), stats.num_forks, stats.drift_tokens) == (1, 0, [0, 0]), stats
        trained = [t for t, m in zip(sequences[0].token_ids, sequences[0].trained_mask) if m]
        assert trained == rollout.completion_ids
        assert any(t.output_ids != loop.tokenizer.encode(loop.tokenizer.decode(t.output_ids), add_special_tokens=False)
                   for t in rollout.turns), "no reply sampled off the tokenizer's own split: nothing checked"


def test_edited_history_forks_streaming_and_sync_clients(warm_server, tmp_path):
    async def main():
        async with started_loop(warm_server, tmp_path, harness_agents.one_call_agent) as loop:
            session = loop.gateway.open_session(0)
            client = openai.AsyncOpenAI(base_url=loop.gateway.base_url, api_key=session.key, max_retries=0)
            model = loop.server.model_id
            raw = await client.chat.completions.with_raw_response.create(model=model, messages=PROMPT)
            first = raw.parse().choices[0].message
            stream = await client.chat.completions.create(
                model=model, stream=True, tools=[harness_agents.INCREMENT_TOOL],
                messages=[*PROMPT, {"role": "assistant", "content": "I will count."},  # edited
                          {"role": "user", "content": "Go on."}])
            chunks = [chunk async for chunk in stream]
            await client.close()
            return loop, session, raw, first, chunks

    loop, session, raw, first, chunks = asyncio.run(main())
    assert raw.headers[SAMPLING_HEADER].startswith("config")
    eos = loop.tokenizer.eos_token
    assert loop.tokenizer.decode(session.turns[0].output_ids).removesuffix(eos) == first.content
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish and finish[-1] in ("stop", "tool_calls", "length")
    assert (finish[-1] == "tool_calls") == bool(calls)
    streamed = loop.tokenizer.decode(session.turns[1].output_ids).removesuffix(eos)
    assert streamed.startswith(text)
    _, stats = reconcile_turns(session.turns)
    assert stats.num_forks == 1  # the agent rewrote the model's turn: a new sample


def test_command_agent_with_the_sync_client(warm_server, tmp_path):
    command = AgentCommand(f"{sys.executable} {Path(__file__).with_name('harness_command_agent.py')}")

    async def main():
        async with started_loop(warm_server, tmp_path, command, timeout_s=120) as loop:
            return await asyncio.gather(*(loop.run_agent_rollout({"target": t}) for t in (2, 5)))

    for _, rollout in asyncio.run(main()):
        assert rollout.turns and rollout.reward in (0.0, 1.0), rollout.metrics
        assert rollout.metrics["harness/errors_count"] == [0.0]


def test_concurrent_rollouts_are_attributed_by_key_and_bad_requests_get_openai_errors(warm_server, tmp_path):
    async def main():
        async with started_loop(warm_server, tmp_path, harness_agents.one_call_agent) as loop:
            rows = [{"prompt": [{"role": "user", "content": f"Increment the counter by {n}."}]} for n in (2, 5)]
            results = await asyncio.gather(*(loop.run_agent_rollout(row) for row in rows))
            session = loop.gateway.open_session(0)
            url = loop.gateway.base_url + "/chat/completions"
            headers = {"Authorization": f"Bearer {session.key}"}
            async with httpx.AsyncClient() as http:
                bad_json = await http.post(url, content=b"{not json", headers=headers)
                no_key = await http.post(url, json={"model": loop.server.model_id, "messages": PROMPT})
                too_long = await http.post(url, headers=headers, json={
                    "model": loop.server.model_id, "messages": [{"role": "user", "content": "a " * 3000}]})
                two = await http.post(url, headers=headers, json={
                    "model": loop.server.model_id, "messages": PROMPT, "n": 2})
            return loop, rows, results, (bad_json, no_key, too_long, two)

    loop, rows, results, responses = asyncio.run(main())
    for row, (prompt, rollout) in zip(rows, results):
        assert len(rollout.turns) == 1 and prompt == row["prompt"]
        assert rollout.turns[0].prompt_ids == render(loop.tokenizer, row["prompt"])
    assert [r.status_code for r in responses] == [400, 401, 400, 400]
    assert all(set(r.json()["error"]) >= {"message", "type", "code"} for r in responses)
    assert responses[2].json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("agent, kind", [
    (harness_agents.raising_agent, "errors"), (harness_agents.hanging_agent, "timeout"),
    (harness_agents.non_number_agent, "errors"), (harness_agents.silent_agent, "errors"),
    (harness_agents.unknown_model_agent, "errors")])
def test_a_bad_agent_costs_only_its_rollout(warm_server, tmp_path, agent, kind):
    async def main():
        async with started_loop(warm_server, tmp_path, agent, timeout_s=5.0) as loop:
            return await loop.run_agent_rollout({"prompt": PROMPT})

    _, rollout = asyncio.run(main())
    assert rollout.turns == [] and rollout.reward != rollout.reward  # dropped: no samples, NaN
    assert rollout.metrics[f"harness/{kind}_count"] == [1.0]
    assert rollout.metrics["harness/dropped_frac"] == [1.0]


@pytest.mark.e2e
def test_harness_trainer_trains_the_counter_agent_through_the_gateway(warm_server, tmp_path):
    from datasets import Dataset
    from grpo_agent import HarnessAsyncGRPOTrainer

    dataset = Dataset.from_dict({"prompt": [PROMPT] * 64, "target": [1, 2, 3, 4, 5, 6, 3, 2] * 8})
    trainer = HarnessAsyncGRPOTrainer(
        model=str(warm_server.model_path), agent="harness_agents:counter_agent",
        args=harness_config(warm_server, tmp_path), train_dataset=dataset, agent_timeout_s=120)
    trainer.train()
    assert trainer.state.global_step == 2
    logged = {}
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            logged.setdefault(key, []).append(value)
    assert min(logged["harness/calls_per_rollout"]) >= 1  # every sample came from gateway calls
    assert {"tools/call_frequency", "rollout/samples_per_rollout", "rollout/fork_frac",
            "rollout/turns_mean", "harness/errors_count", "rewards/rollout/mean"} <= set(logged), sorted(logged)
    assert max(logged["tools/call_frequency"]) > 0


@pytest.mark.e2e
def test_harness_trainer_evaluates_the_agent_greedily_on_a_held_out_split(warm_server, tmp_path,
                                                                           record_trained):
    """eval/* at eval_on_start and every eval_steps from the counter agent on the counter env's
    eval split (targets 1-9) through the evaluation's own gateway: pinned to one version,
    greedy (two evaluations of a version agree), and no eval row reaches training."""
    from datasets import Dataset
    from grpo_agent import HarnessAsyncGRPOTrainer
    from grpo_agent.plugins import load_registry

    eval_split = load_registry().environment_spec("counter").load_eval_dataset()
    train_targets = [1, 2, 3]  # eval targets 4-9 in a trained sample would be a leak
    targets = train_targets * 22
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Increment the counter by {t}."}]
                                            for t in targets], "target": targets})
    trainer = HarnessAsyncGRPOTrainer(
        model=str(warm_server.model_path), agent="harness_agents:counter_agent",
        args=harness_config(warm_server, tmp_path, eval_strategy="steps", eval_steps=1,
                            eval_on_start=True, save_strategy="no"),
        train_dataset=dataset, eval_dataset=eval_split, agent_timeout_s=120)
    trained = record_trained(trainer)
    trainer.train()
    evals = [row for row in trainer.state.log_history if "eval/pass@1" in row]
    assert [row["eval/step"] for row in evals] == [0.0, 1.0, 2.0]
    for row in evals:
        assert row["eval/num_rows"] == 9.0 and 0.0 <= row["eval/pass@1"] <= 1.0, row
        assert math.isfinite(row["eval/rewards/rollout/mean"]), row  # the agent's own reward
        assert row["eval/completions/mean_length"] > 0, row
    for result in trainer.evaluator.results:
        assert len(result.served_versions) == 1, result.served_versions  # the pin held
        if result.model_version > 0:
            assert result.served_versions == {str(result.model_version)}
        assert all(len(row.completions) == 1 for row in result.rows)
    first, second = trainer.evaluate(), trainer.evaluate()
    a, b = trainer.evaluator.results[-2:]
    assert a.model_version == b.model_version == trainer.model_version
    assert [r.completions for r in a.rows] == [r.completions for r in b.rows]  # greedy
    assert first["eval/pass@1"] == second["eval/pass@1"]
    tokenizer = trainer.processing_class
    texts = [tokenizer.decode(s.sequence.token_ids) for s in trained]
    assert texts and all("Increment the counter by" in t for t in texts)
    assert not any(f"counter by {t}." in text for text in texts for t in range(4, 10))


def test_evaluation_fails_a_dropped_agent_run_even_when_reward_funcs_score_it(warm_server, tmp_path):
    """An agent that raises costs its eval rollout (a failure), though `reward_funcs` would
    score its empty completion 1.0; the other rollouts are scored by `reward_funcs`."""
    import functools

    from grpo_agent.rollout.evaluation import EvalSession, EvalSettings
    from transformers import AutoTokenizer

    from tests.conftest import push_original_weights

    def always_one(completions, **kwargs):
        return [1.0] * len(completions)

    # Version 0 is evaluated: the model's own weights, which a trainer of this module may have
    # replaced (the fixture puts them back only after the module).
    push_original_weights(warm_server)

    async def main():
        loop_cls = functools.partial(HarnessRolloutLoop, agent=harness_agents.odd_target_fails_agent,
                                     limits=HarnessLimits(timeout_s=120))
        session = EvalSession(loop_cls, config=harness_config(warm_server, tmp_path),
                              processing_class=AutoTokenizer.from_pretrained(warm_server.model_path),
                              reward_funcs=[always_one], settings=EvalSettings(),
                              model_name=str(warm_server.model_path))
        async with session:
            return await session.evaluate([{"target": t} for t in (1, 2, 3, 4)], version=0)

    result = asyncio.run(main())
    assert [row.passed for row in result.rows] == [[False], [True], [False], [True]]
    assert [row.rewards for row in result.rows] == [[None], [1.0], [None], [1.0]]
    assert result.metrics["eval/pass@1"] == 0.5


def test_openai_agents_sdk_drives_a_rollout_end_to_end(warm_server, tmp_path):
    pytest.importorskip("agents", reason="optional extra: pip install openai-agents")

    async def main():
        async with started_loop(warm_server, tmp_path, harness_agents.agents_sdk_counter) as loop:
            return await asyncio.gather(*(loop.run_agent_rollout({"target": t}) for t in (1, 2, 3, 4)))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(warm_server.model_path)
    results = asyncio.run(main())
    for _, rollout in results:
        assert rollout.metrics["harness/errors_count"] == [0.0] and rollout.turns, rollout.metrics
        assert '"name": "increment"' in tokenizer.decode(rollout.turns[0].prompt_ids)  # its tool
        sequences, _ = reconcile_turns(rollout.turns)
        assert [t for s in sequences for t, m in zip(s.token_ids, s.trained_mask) if m] == rollout.completion_ids
    # The SDK's strict tool schema is not the one the tiny model was warmed on, so it rarely
    # writes a readable call for it: a tool round trip is not asserted here.


def test_a_call_over_the_rollouts_budget_gets_a_429_the_agent_sees(warm_server, tmp_path):
    async def main():
        async with started_loop(warm_server, tmp_path, harness_agents.over_budget_agent, max_calls=1) as loop:
            return await loop.run_agent_rollout({"prompt": PROMPT})

    _, rollout = asyncio.run(main())
    assert rollout.reward == 1.0 and len(rollout.turns) == 1  # the agent caught the budget error
    assert rollout.metrics["harness/rejected_calls_count"] == [1.0]
    assert rollout.metrics["harness/errors_count"] == [0.0]


@pytest.mark.parametrize("chain, stream", [(False, False), (True, False), (False, True)],
                         ids=["whole-history", "previous_response_id", "streamed"])
def test_responses_api_tool_calls_are_function_call_items_and_multi_turn_is_one_sample(
        warm_server, tmp_path, chain, stream):
    async def main():
        # nearly greedy, as in the chat test above: a fork can only come from the gateway
        async with started_loop(warm_server, tmp_path, harness_agents.responses_counter_agent,
                                config={"temperature": 0.1}) as loop:
            rows = [{"target": t, "chain": chain, "stream": stream} for t in (1, 2, 3, 4)]
            results = await asyncio.gather(*(loop.run_agent_rollout(row) for row in rows))
            session = loop.gateway.open_session(0)
            url = loop.gateway.base_url + "/responses"
            async with httpx.AsyncClient() as http:
                bad = await http.post(url, headers={"Authorization": f"Bearer {session.key}"}, json={
                    "model": loop.server.model_id, "input": "hi", "previous_response_id": "resp_x"})
            client = openai.AsyncOpenAI(base_url=loop.gateway.base_url, api_key=session.key, max_retries=0)
            cut = await client.responses.create(model=loop.server.model_id, input="Count.", stream=stream,
                                                max_output_tokens=1)
            cut = [event async for event in cut] if stream else cut
            await client.close()
            return loop, results, bad, cut

    loop, results, bad, cut = asyncio.run(main())
    if stream:  # a reply cut by max_output_tokens ends the stream with response.incomplete
        assert [e.type for e in cut[:2]] == ["response.created", "response.in_progress"]
        assert cut[-1].type == "response.incomplete" and cut[-1].response.usage.output_tokens == 1
        assert [e.sequence_number for e in cut] == list(range(len(cut)))
    else:
        assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    chat_tool = harness_agents.INCREMENT_TOOL
    multi_turn = 0
    for prompt, rollout in results:
        assert rollout.turns and rollout.metrics["harness/errors_count"] == [0.0], rollout.metrics
        recorded = [(t.prompt_ids, t.output_ids, t.output_log_probs) for t in rollout.turns]
        assert all(entry in loop.sampled for entry in recorded)
        # the flat Responses tool renders exactly as the chat tool the model was warmed on
        assert rollout.turns[0].prompt_ids == render(loop.tokenizer, prompt, [chat_tool])
        sequences, stats = reconcile_turns(rollout.turns)
        if len(rollout.turns) > 1:
            multi_turn += 1
            assert stats.num_forks == 0 and len(sequences) == 1, stats
    assert multi_turn >= 2
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "response_not_found"
