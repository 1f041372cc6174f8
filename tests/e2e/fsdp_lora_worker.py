"""An FSDP2 check run by fsdp_checks.py (2 processes, gloo, CPU): what adapter sync gathers from an FSDP2-sharded
PEFT model equals the unsharded adapter, and every rank agrees the adapter is non-zero.

Rank 0 writes the comparison to `out_path` as JSON.
"""
import copy
import json

import torch
import torch.distributed as dist
from grpo_agent.testing import build_tiny_model
from grpo_agent.train.fsdp import apply_fsdp2
from grpo_agent.train.weights import lora_adapter_weights
from grpo_agent.weight_sync.adapter import AdapterPusher
from peft import LoraConfig, get_peft_model
from peft.utils import get_peft_model_state_dict
from transformers import AutoModelForCausalLM


def check(out_path: str) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(build_tiny_model(), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, target_modules="all-linear"))
    pusher = AdapterPusher.__new__(AdapterPusher)  # needs_initial_push reads no server state
    zero_before = pusher.needs_initial_push(model, False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name and ".0." in name and "q_proj" in name:
                param.normal_(std=0.1)  # one non-zero B, which only one rank's shard may hold
    reference = {k: v.detach().clone() for k, v in get_peft_model_state_dict(copy.deepcopy(model)).items()}

    apply_fsdp2(model)
    gathered = lora_adapter_weights(model)  # a collective: every rank calls it
    nonzero_after = pusher.needs_initial_push(model, False)
    errors = [(gathered[k] - reference[k]).abs().max().item() for k in reference]
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump({
                "sharded": type(next(p for n, p in model.named_parameters() if "lora_B" in n)).__name__,
                "names_match": sorted(gathered) == sorted(reference),
                "max_error": max(errors),
                "needs_push_when_zero": zero_before,
                "needs_push_when_trained": nonzero_after,
            }, fh)
