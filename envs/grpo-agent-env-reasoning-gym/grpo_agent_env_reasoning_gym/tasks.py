"""reasoning-gym's generators and scorers, wrapped for grpo-agent.

Design decision: a row stores where its question comes from (`task`, `size`, `seed`,
`index`), not the question itself: reasoning-gym regenerates entry `index` of a dataset deterministically
from its seed, and its scorers need the full entry (metadata of any shape), which would not
survive a `datasets.Dataset` column. The reward regenerates the entry (cached) and asks the
task's own `score_answer`. reasoning-gym is imported lazily: plugins load at CLI start-up.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

# Not tasks: `composite` mixes other tasks and needs a config of its own.
NOT_TASKS = frozenset({"composite"})
# The eval split is generated from seed + this offset, so it never shares a seed with train.
EVAL_SEED_OFFSET = 1_000_003


def task_names() -> list[str]:
    """Every task reasoning-gym registers (the `task` option's choices)."""
    from reasoning_gym.factory import DATASETS

    return sorted(set(DATASETS) - NOT_TASKS)


@lru_cache(maxsize=64)
def procedural_dataset(task: str, size: int, seed: int) -> Any:
    """reasoning-gym's generator for one task, split size and seed."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=size, seed=seed)


@lru_cache(maxsize=4096)
def entry(task: str, size: int, seed: int, index: int) -> dict[str, Any]:
    """Entry `index` (question, answer, metadata), regenerated from the seed."""
    return procedural_dataset(task, size, seed)[index]


def system_prompt() -> str:
    """reasoning-gym's default instruction: think, then answer inside <answer></answer>."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS["default"]


def extract(text: str) -> str | None:
    """The last <answer>...</answer> of a completion, as reasoning-gym's evaluations read it."""
    from reasoning_gym.utils import extract_answer

    return extract_answer(text)


def score(answer: str | None, task: str, size: int, seed: int, index: int) -> float:
    """The task's own score of `answer` in [0, 1]; no answer, or one the scorer chokes on, is 0."""
    if answer is None:
        return 0.0
    item = entry(task, size, seed, index)
    try:
        return float(procedural_dataset(task, size, seed).score_answer(answer, item))
    except Exception:  # noqa: BLE001 -- some scorers raise on malformed answers (int("abc"))
        return 0.0


def rows(task: str, size: int, seed: int) -> dict[str, list]:
    """Columns of one split: reasoning-gym's instruction as the `prompt` plus where each entry
    comes from. The question itself is generated when the env resets on the row, so a split of
    any size is ready at once and a slow generator costs time only for rows a run reaches."""
    return {
        "prompt": [[{"role": "system", "content": system_prompt()}]] * size,
        "task": [task] * size,
        "size": [size] * size,
        "seed": [seed] * size,
        "index": list(range(size)),
    }
