"""Run under torchrun (2 processes, gloo, CPU): every FSDP2 check of test_fsdp2_cpu.py in one
process group, so the suite pays one torchrun start-up (two processes importing torch,
transformers and peft) instead of one per check. Rank 0 writes <argv[1]>/<check>.json."""
import sys
from pathlib import Path

import fsdp_lora_worker
import fsdp_metrics_worker
import fsdp_start_push_worker
import fsdp_worker
import torch.distributed as dist

CHECKS = {"loss": fsdp_worker.check, "metrics": fsdp_metrics_worker.check,
          "lora": fsdp_lora_worker.check, "start_push": fsdp_start_push_worker.check}

if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        for name, check in CHECKS.items():
            check(str(Path(sys.argv[1]) / f"{name}.json"))
    finally:
        dist.destroy_process_group()
