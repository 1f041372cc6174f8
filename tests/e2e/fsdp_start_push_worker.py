"""An FSDP2 check run by fsdp_checks.py (2 processes, gloo, CPU): the start push rule
(`served_weights_may_differ`) on sharded weights. Each rank fingerprints its own shards, so
an edit on one rank's shard must make every rank push, and unchanged shards none.

Rank 0 writes what it decided to `out_path` as JSON.
"""
import json

import torch
import torch.distributed as dist
from grpo_agent.testing import build_tiny_model
from grpo_agent.train.fsdp import apply_fsdp2
from grpo_agent.train.weights import remember_loaded_weights, served_weights_may_differ
from transformers import AutoModelForCausalLM


def check(out_path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(), dtype=torch.float32)
    apply_fsdp2(model)
    remember_loaded_weights(model)  # as the trainer does at the end of its construction
    unchanged = served_weights_may_differ(model, False)  # a collective: every rank calls it
    if dist.get_rank() == 1:
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight.to_local()[0, 0] += 1.0
    edited_on_rank_1 = served_weights_may_differ(model, False)
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump({"sharded": type(model.model.layers[0].mlp.up_proj.weight).__name__,
                       "push_when_unchanged": unchanged,
                       "push_when_edited_on_rank_1": edited_on_rank_1}, fh)
