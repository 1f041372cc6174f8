"""Run inside the verifiers venv (imports verifiers and the standard library only).

`python runner.py tasks TASKSET_ID SIZE` prints the taskset's first SIZE tasks as JSON lines
(idx, prompt text), or one `{"error"}` line when the taskset cannot be imported. `python
runner.py serve` is the rollout worker's episode server: it reads requests as JSON lines on
stdin, `{"id", "row", "base_url", "api_key", "model"}` (play task `vf_idx` of the row's taskset
with the row's harness in a local subprocess runtime, every model call sent to `base_url`, the
grpo-agent gateway, with the rollout's key) or `{"cancel": id}`, plays the episodes
concurrently and answers each with one JSON line, `{"id", "reward"}` (the task's own weighted
rewards, summed) or `{"id", "error"}` (the rollout is dropped, not scored 0).
verifiers is imported and each taskset loaded once per server, not once per episode (about
20 s of a 2-core machine's time per episode).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import traceback


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
    try:
        env = load_env(taskset_id, "null")
    except ModuleNotFoundError as error:  # verifiers' "taskset ... not found", the likeliest slip
        print(json.dumps({"error": not_importable(taskset_id, error)}))
        return
    for task in itertools.islice(env.taskset, size):
        print(json.dumps({"vf_idx": task.data.idx, "prompt": prompt_text(task)}))


def not_importable(taskset_id: str, error: ModuleNotFoundError) -> str:
    """One line for a taskset this venv cannot import: where it must be installed, then
    verifiers' own message and the import that failed (the taskset's, or one of its own)."""
    cause = f" ({error.__cause__})" if error.__cause__ else ""
    return (f"verifiers taskset {taskset_id!r} is not importable in the verifiers venv "
            f"({sys.prefix}): pip-install its package into that venv, or put its folder on PYTHONPATH. "
            f"verifiers said: {error}{cause}")


async def episode(envs: dict, request: dict) -> float:
    """Play one requested episode; its key lives in an env var of its own while it runs
    (verifiers reads a client's key from the variable its config names)."""
    import verifiers.v1 as vf
    from verifiers.v1.env import RunSlot

    row = request["row"]
    key = (row["vf_taskset"], row["vf_harness"])
    if key not in envs:
        envs[key] = load_env(*key)
    env = envs[key]
    task = next(itertools.islice(env.taskset, row["vf_idx"], None), None)
    if task is None:
        raise EpisodeFailed(f"taskset {row['vf_taskset']!r} has no task {row['vf_idx']}")
    key_var = f"GRPO_AGENT_ROLLOUT_KEY_{request['id']}"
    os.environ[key_var] = request["api_key"]
    try:
        ctx = vf.ModelContext(model=request["model"], client=vf.EvalClientConfig(
            base_url=request["base_url"], api_key_var=key_var))
        result = await env.run_slot(RunSlot(task), ctx)
    finally:
        os.environ.pop(key_var, None)
    if not result.ok:
        errors = [e.message for e in result.errors]
        errors += [e.message for t in result.traces for e in t.errors]
        errors += [c.error.message for t in result.traces for c in t.calls if c.error]
        stops = [t.stop_condition for t in result.traces]
        raise EpisodeFailed(failure_message(stops, errors))
    return sum(trace.reward for trace in result.traces)


TOOLSET_HINT = (
    " (verifiers starts a Toolset as `python -m` the module its class is defined in, and waits "
    "for the server that `Toolset.run()` starts: define the Toolset in a module of its own that "
    "ends in `if __name__ == \"__main__\": MyToolset.run()`, as `vf init --add-tool` writes it, "
    "importable by the verifiers venv's python)")


def failure_message(stops: list, errors: list[str]) -> str:
    """verifiers' stop conditions and errors, with the fix for the one whose cause its message
    does not say (a toolset module that never served: verifiers only reports the missing port)."""
    message = f"stop {stops}: {errors}"
    if any("did not report its port" in error for error in errors):
        message += TOOLSET_HINT
    return message


class EpisodeFailed(Exception):
    """verifiers played the episode and reported it failed."""


async def serve() -> None:
    """Answer episode requests from stdin until it closes (see the module docstring)."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever verifiers prints goes to stderr, never between the answers
    loop = asyncio.get_running_loop()
    requests = asyncio.StreamReader(limit=2**24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(requests), sys.stdin)
    envs: dict = {}
    running: dict[str, asyncio.Task] = {}

    async def answer(request: dict) -> None:
        try:
            reply = {"id": request["id"], "reward": await episode(envs, request)}
        except asyncio.CancelledError:
            return
        except EpisodeFailed as failed:
            reply = {"id": request["id"], "error": str(failed)}
        except Exception:  # noqa: BLE001 - any episode bug costs only its rollout
            reply = {"id": request["id"], "error": traceback.format_exc(limit=8)}
        finally:
            running.pop(request["id"], None)
        answers.write(json.dumps(reply) + "\n")
        answers.flush()

    while line := await requests.readline():
        request = json.loads(line)
        if "cancel" in request:
            if (task := running.get(request["cancel"])) is not None:
                task.cancel()
        else:
            running[request["id"]] = asyncio.create_task(answer(request))
    for task in list(running.values()):
        task.cancel()


def main(argv: list[str]) -> None:
    if argv[:1] == ["tasks"] and len(argv) == 3:
        tasks(argv[1], int(argv[2]))
    elif argv == ["serve"]:
        asyncio.run(serve())
    else:
        raise SystemExit("usage: runner.py tasks TASKSET_ID SIZE | runner.py serve")


if __name__ == "__main__":
    main(sys.argv[1:])
