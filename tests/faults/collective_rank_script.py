"""One trainer rank of a 2-process FSDP2 run (gloo, CPU) whose rank 1 goes missing.

argv: output dir, what rank 1 does before the step's collectives ("stop": SIGSTOP itself, a
hung rank; "die": exit, a dead one). Rank 0 holds its phase the way `AsyncGRPOTrainer` does
(the config's process group, `collectives.rank_watch`, `RankPhases`) and runs an FSDP2
forward/backward: its all-gather waits for rank 1, until the collective deadline. Rank 1
writes <output dir>/fault-at (time.time()) just before it goes missing.
"""
import os
import signal
import sys
import time

import torch
from grpo_agent import AsyncGRPOConfig
from grpo_agent.train import collectives, fsdp
from torch import nn


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


if __name__ == "__main__":
    out, fault = sys.argv[1], sys.argv[2]
    args = AsyncGRPOConfig(output_dir=out, report_to="none", stall_timeouts={"collective": 3})
    assert args.device.type == "cpu" and fsdp.world_size() == 2  # the process group exists
    model = fsdp.apply_fsdp2(Blocks())
    watch = collectives.rank_watch(args)
    phases = collectives.RankPhases(args)
    try:
        phases.enter("train step", step=1)
        model(torch.ones(2, 8)).sum().backward()  # both ranks arrive: a healthy step
        phases.enter("train step", step=2)
        if collectives.rank() == 1:
            with open(os.path.join(out, "fault-at"), "w") as note:
                note.write(str(time.time()))
            if fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                os._exit(7)
        model(torch.ones(2, 8)).sum().backward()
    except Exception as error:
        phases.raise_if_rank_missing(error)
        raise
