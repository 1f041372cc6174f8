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
