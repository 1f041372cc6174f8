"""Run inside the verifiers venv (imports verifiers and the standard library only).

`python runner.py tasks TASKSET_ID SIZE` prints the taskset's first SIZE tasks as JSON lines
(idx, prompt text); `python runner.py episode` reads a row as JSON on stdin and plays one
episode of task `vf_idx` with the row's harness in a local subprocess runtime, every model call
sent to OPENAI_BASE_URL with OPENAI_API_KEY (the grpo-agent gateway), then prints the episode's
reward (the task's own weighted rewards, summed) as the last stdout line. A failed episode
exits 1 with its errors on stderr, so the rollout is dropped instead of scored 0.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys


def load_env(taskset_id: str, harness: str):
    import verifiers.v1 as vf

    config = vf.SingleAgentEnvConfig(
        taskset={"id": taskset_id},
        agent={"harness": {"id": harness}, "runtime": {"type": "subprocess"}})
    return vf.SingleAgentEnv(config)


def prompt_text(task) -> str:
    prompt = task.data.prompt
    if isinstance(prompt, str) or prompt is None:
        return prompt or ""
    return "\n".join(str(getattr(m, "content", m)) for m in prompt)


def tasks(taskset_id: str, size: int) -> None:
    env = load_env(taskset_id, "null")
    for task in itertools.islice(env.taskset, size):
        print(json.dumps({"vf_idx": task.data.idx, "prompt": prompt_text(task)}))


async def episode(row: dict) -> float:
    import verifiers.v1 as vf
    from openai import OpenAI
    from verifiers.v1.env import RunSlot

    env = load_env(row["vf_taskset"], row["vf_harness"])
    task = next(itertools.islice(env.taskset, row["vf_idx"], None))

    base_url = os.environ["OPENAI_BASE_URL"]
    model = OpenAI(base_url=base_url).models.list().data[0].id
    ctx = vf.ModelContext(model=model, client=vf.EvalClientConfig(
        base_url=base_url, api_key_var="OPENAI_API_KEY"))
    async with env.serving():
        result = await env.run_slot(RunSlot(task), ctx)
    if not result.ok:
        errors = [e.message for e in result.errors]
        errors += [e.message for t in result.traces for e in t.errors]
        errors += [c.error.message for t in result.traces for c in t.calls if c.error]
        stops = [t.stop_condition for t in result.traces]
        print(f"verifiers episode failed (stop {stops}): {errors}", file=sys.stderr)
        raise SystemExit(1)
    return sum(trace.reward for trace in result.traces)


def main(argv: list[str]) -> None:
    if argv[:1] == ["tasks"] and len(argv) == 3:
        tasks(argv[1], int(argv[2]))
    elif argv == ["episode"]:
        print(asyncio.run(episode(json.loads(sys.stdin.read()))))
    else:
        raise SystemExit("usage: runner.py tasks TASKSET_ID SIZE | runner.py episode < row.json")


if __name__ == "__main__":
    main(sys.argv[1:])
