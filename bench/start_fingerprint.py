"""What telling the trainer's weights from the checkpoint costs at train start, against moving them.

The trainer skips the push before the first rollout only where it knows a fresh server serves
its weights: it loaded them itself, and their fingerprint (`train.weights._fingerprint`, integer
row and column sums of the raw bits) did not change since. This times that fingerprint on a
model of the given shape, random bf16 weights on `--device`, and, as the floor of any push, one
copy of every weight on the same device (a push also sends them to vLLM and has it load them,
with its HTTP round trips: 0.1 s for the tiny model over gloo, docs/performance.md). Medians of
`--repeats` after one warm-up; one JSON line.

    python bench/start_fingerprint.py [--shape qwen3-1.7b|tiny] [--device cuda] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SHAPES = {  # Qwen3-1.7B's config.json; the tiny model's order of size
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "vocab_size": 151936, "tie_word_embeddings": True},
    "tiny": {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "vocab_size": 2048, "tie_word_embeddings": True},
}


def timed(function, device: str, repeats: int) -> float:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        function()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    from grpo_agent.train.weights import _fingerprint
    from transformers import AutoModelForCausalLM, Qwen3Config

    with torch.device(options.device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**SHAPES[options.shape]),
                                                 dtype=torch.bfloat16)
    params = list(model.parameters())
    fingerprint_s = timed(lambda: _fingerprint(model), options.device, options.repeats)
    copy_s = timed(lambda: [p.detach().clone() for p in params], options.device, options.repeats)
    print(json.dumps({
        "shape": options.shape, "device": options.device,
        "device_name": torch.cuda.get_device_name() if options.device == "cuda" else "cpu",
        "threads": torch.get_num_threads(), "params": sum(p.numel() for p in params),
        "bytes": sum(p.numel() * p.element_size() for p in params),
        "fingerprint_s": round(fingerprint_s, 5), "copy_s": round(copy_s, 5)}))


if __name__ == "__main__":
    main()
