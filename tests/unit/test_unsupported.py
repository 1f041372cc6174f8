"""The spec's refusals ("兼容性与约束"), each with a message that says what to do instead.

Config settings fail when AsyncGRPOConfig is built; model properties fail when the trainer is
built, before any server is contacted."""
import pytest
import torch
from accelerate.parallelism_config import ParallelismConfig
from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer
from grpo_agent.train.forward import forward_row
from grpo_agent.train.packing import pack_row
from grpo_agent.train.tree_attention import ATTN_IMPLEMENTATION, register_tree_attention
from grpo_agent.types import TrainingSample, TrainingSequence

DATASET = [{"prompt": [{"role": "user", "content": "2+2?"}]}]


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"use_liger_kernel": True}, "use_liger_kernel=True is not supported.*Remove use_liger_kernel"),
    ({"deepspeed": {"zero_optimization": {"stage": 2}}},
     "deepspeed is not supported: sharded training uses FSDP2.*torchrun"),
    ({"parallelism_config": ParallelismConfig(cp_size=2)},
     "cp_size=2, sp_size=1: context and sequence parallelism are not supported.*Set cp_size"),
    ({"parallelism_config": ParallelismConfig(sp_size=4)}, "cp_size=1, sp_size=4.*not supported"),
    # a run file's [parallelism_config] table arrives as a dict
    ({"parallelism_config": {"cp_size": 2}}, "cp_size=2, sp_size=1: context and sequence parallelism"),
    ({"parallelism_config": {"cp_sise": 2}},
     r"^parallelism_config=\{'cp_sise': 2\}: give a table of some of dp_replicate_size, dp_shard_size"),
    ({"parallelism_config": 2}, r"^parallelism_config=2: give a table of some of dp_replicate_size"),
])
def test_unsupported_settings_are_refused_with_the_fix(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        AsyncGRPOConfig(output_dir=str(tmp_path), **kwargs)


def test_data_parallel_parallelism_config_is_accepted(tmp_path):
    config = AsyncGRPOConfig(output_dir=str(tmp_path),
                             parallelism_config=ParallelismConfig(dp_shard_size=1))
    assert config.parallelism_config.cp_size == 1
    # as a run file's table: transformers' to_json_string (config show, the run's config.json)
    # failed on the dict with "'dict' object has no attribute 'to_json'"
    config = AsyncGRPOConfig(output_dir=str(tmp_path), parallelism_config={"dp_shard_size": 1})
    assert isinstance(config.parallelism_config, ParallelismConfig)
    assert '"dp_shard_size": 1' in config.to_json_string()


def _trainer(model, tmp_path, *, tokenizer_path=None, **kwargs):
    from transformers import AutoTokenizer

    peft_config = kwargs.pop("peft_config", None)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path) if tokenizer_path else None
    return AsyncGRPOTrainer(model, reward_funcs=[_reward], args=args, train_dataset=DATASET,
                            processing_class=tokenizer, peft_config=peft_config)


def test_a_lora_adapter_on_lm_head_is_refused(tiny_model_path, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match="targets lm_head.*Remove 'lm_head' from the LoraConfig"):
        _trainer(str(tiny_model_path), tmp_path, peft_config=lora)
    saved = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"],
                       task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match="targets lm_head"):
        _trainer(str(tiny_model_path), tmp_path, peft_config=saved)


def test_a_lora_target_module_that_matches_no_module_is_refused(tiny_model_path, tmp_path):
    # PEFT adapts the names that match: `--lora-target-modules q_proj,bogus_proj` trained a
    # q_proj-only adapter and the run finished without a word (measured with grpo-agent train).
    from peft import LoraConfig

    lora = LoraConfig(r=4, target_modules=["q_proj", "bogus_proj"], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match=r"^LoRA target_modules bogus_proj match no module of the "
                                         r"model.*named: down_proj, gate_proj, k_proj, o_proj, q_proj, "
                                         r"up_proj, v_proj; name those"):
        _trainer(str(tiny_model_path), tmp_path, peft_config=lora)
    for targets in (["q_proj", "v_proj"], "all-linear"):
        lora = LoraConfig(r=4, target_modules=targets, task_type="CAUSAL_LM")
        assert _trainer(str(tiny_model_path), tmp_path, peft_config=lora).model.targeted_module_names


def test_router_aux_loss_coef_on_a_dense_model_is_refused(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.01 is set but .* has no router"
                                         ".*Leave router_aux_loss_coef unset"):
        _trainer(str(tiny_model_path), tmp_path, router_aux_loss_coef=0.01)
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.0 is set but"):  # docs: refused
        _trainer(str(tiny_model_path), tmp_path, router_aux_loss_coef=0.0)


def test_router_aux_loss_coef_on_a_moe_model_is_accepted(tiny_model_path, tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2)
    trainer = _trainer(Qwen3MoeForCausalLM(cfg), tmp_path, tokenizer_path=tiny_model_path,
                       router_aux_loss_coef=0.01)
    assert trainer.args.router_aux_loss_coef == 0.01


def _tiny_gemma2(**config):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       max_position_embeddings=64, **config)
    return Gemma2ForCausalLM(cfg)


def test_softcapping_models_are_refused(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0.*no tree attention path"):
        _trainer(_tiny_gemma2(final_logit_softcapping=None), tmp_path,
                 tokenizer_path=tiny_model_path)
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0.*does not apply"):
        _trainer(_tiny_gemma2(), tmp_path, tokenizer_path=tiny_model_path)


def test_tree_attention_refuses_a_softcap_instead_of_dropping_it():
    """Called directly (no trainer check), the attention itself refuses the cap it cannot apply."""
    model = _tiny_gemma2(final_logit_softcapping=None)
    register_tree_attention()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    sample = TrainingSample(
        sequence=TrainingSequence(token_ids=[1, 2, 3, 4], trained_mask=[0, 0, 1, 1],
                                  sampler_logprobs=[0.0, 0.0, -1.0, -1.0]),
        advantage=1.0, model_version=0, group_id=0, row_index=0)
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0"), torch.no_grad():
        forward_row(model, pack_row([sample]), temperature=1.0)
