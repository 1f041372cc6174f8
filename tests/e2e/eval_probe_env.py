"""An env with a declared eval split and success threshold, for `grpo-agent eval` tests: its
reward depends only on the row, so pass@k and the mean reward are known in advance."""
from __future__ import annotations

from grpo_agent import environment

EVAL_ROWS = 5


def train_rows():
    from datasets import Dataset

    return Dataset.from_dict({"n": list(range(100, 104))})


def eval_rows():
    from datasets import Dataset

    return Dataset.from_dict({"n": list(range(EVAL_ROWS))})


@environment("eval-probe", dataset=train_rows, eval_dataset=eval_rows, success_threshold=0.5)
class ProbeEnv:
    """Even rows score 0.75 (a pass at the declared 0.5), odd rows 0.25."""

    def reset(self, n: int, **row) -> str:
        self.n = n
        return f"Say {n}."

    def get_reward(self) -> float:
        return 0.75 if self.n % 2 == 0 else 0.25


@environment("no-eval-probe", dataset=train_rows)
class NoEvalProbeEnv(ProbeEnv):
    """The same task without an eval split."""
