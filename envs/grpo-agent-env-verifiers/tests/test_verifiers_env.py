"""The verifiers env: verifiers 0.4.0 in its own venv lists a taskset's tasks and plays an
episode against an OpenAI-compatible endpoint; the taskset's own weighted rewards come back.

The endpoint here is a stand-in (the seam: the model server), streaming a scripted reply, so the
rewards are known; tests/e2e/test_env_packages.py trains through the real gateway and server.
"""

import asyncio
import json
import re
import socket
import threading
import time
from pathlib import Path

import pytest
from grpo_agent.plugins import load_environment
from grpo_agent_env_verifiers import VerifiersEnv, VerifiersVenvMissing, play, venv_python

TASKSETS = Path(__file__).parent / "tasksets"

try:
    venv_python()
except VerifiersVenvMissing as missing:
    pytest.skip(f"{missing}", allow_module_level=True)


@pytest.fixture
def taskset_path(monkeypatch):
    """verifiers imports a taskset by id: the test taskset's folder on the runner's path."""
    monkeypatch.setenv("PYTHONPATH", str(TASKSETS))


@pytest.fixture(scope="module")
def endpoint():
    """A chat-completions stand-in that streams the reversed word, or a long wrong reply for
    'policy'; it records each request body."""
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app, requests = FastAPI(), []

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stand-in", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        requests.append(body)
        last, finish = body["messages"][-1], "stop"
        tools = [tool["function"]["name"] for tool in body.get("tools") or []]
        if last["role"] == "tool":  # the tool's answer is the reply
            delta = {"role": "assistant", "content": message_text(last)}
        else:
            word = re.search(r"Reverse the word (\w+)", last["content"]).group(1)
            if tools:  # a toolset task: call its tool first
                call = {"index": 0, "id": "call-1", "type": "function",
                        "function": {"name": tools[0], "arguments": json.dumps({"word": word})}}
                delta, finish = {"role": "assistant", "tool_calls": [call]}, "tool_calls"
            else:
                reply = "I would rather not say" if word == "policy" else word[::-1]
                delta = {"role": "assistant", "content": reply}
        head = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
        chunks = [{**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                  {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
                  {**head, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                                                    "total_tokens": 12}}]
        lines = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]
        return StreamingResponse(iter(lines), media_type="text/event-stream")

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1", requests
    server.should_exit = True
    thread.join(timeout=10)


def test_rows_are_the_tasksets_tasks_listed_by_verifiers(taskset_path):
    rows = load_environment("verifiers", id="grpo_reverse_words", size=2).load_dataset()
    assert rows["vf_idx"] == [0, 1] and rows["vf_taskset"] == ["grpo_reverse_words"] * 2
    assert rows["prompt"][1] == "Reverse the word world. Reply with it only."
    assert rows["vf_harness"] == ["null", "null"] and Path(rows["vf_python"][0]).is_file()


def test_an_episode_returns_the_tasksets_weighted_rewards(taskset_path, endpoint):
    import openai

    base_url, requests = endpoint
    rows = load_environment("verifiers", id="grpo_reverse_words").load_dataset()

    async def episode(row):
        return await play(openai.AsyncOpenAI(base_url=base_url, api_key="rollout-key"), dict(row))

    # exact (1 x 1.0) + brevity ((1 - 5/40) x 0.5); then wrong, 22 characters
    assert asyncio.run(episode(rows[0])) == pytest.approx(1.0 + 0.875 * 0.5)
    assert asyncio.run(episode(rows[2])) == pytest.approx((1 - 22 / 40) * 0.5)
    assert [r["messages"][-1]["content"] for r in requests][-2:] == [rows[0]["prompt"], rows[2]["prompt"]]


def test_a_toolset_task_serves_its_tool_and_the_model_calls_it(taskset_path, endpoint):
    """A task with a `vf.Toolset`: verifiers launches its tool server per rollout (`python -m`
    the toolset's module, tests/tasksets/grpo_reverse_tool_server.py), offers its tool, runs
    the model's call; the reply built from the tool's answer scores `exact`."""
    import openai

    base_url, requests = endpoint
    row = dict(load_environment("verifiers", id="grpo_reverse_tool", size=1).load_dataset()[0])
    client = openai.AsyncOpenAI(base_url=base_url, api_key="rollout-key")
    assert asyncio.run(play(client, row)) == 1.0
    offered, answered = requests[-2:]
    assert [tool["function"]["name"] for tool in offered["tools"]] == ["words_reverse"]
    assert answered["messages"][-1]["role"] == "tool" and message_text(answered["messages"][-1]) == "olleh"


def message_text(message: dict) -> str:
    """A chat message's text (a string, or a list of text parts)."""
    content = message["content"]
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)


def test_a_toolset_that_never_served_gets_the_fix_verifiers_does_not_say():
    from grpo_agent_env_verifiers.runner import failure_message

    lost = "server did not report its port at /tmp/vf-port-1 in its runtime: "
    assert failure_message(["toolset_error"], [lost]).endswith(
        'ends in `if __name__ == "__main__": MyToolset.run()`, as `vf init --add-tool` writes it, '
        "importable by the verifiers venv's python)")
    assert failure_message(["has_error"], ["boom"]) == "stop ['has_error']: ['boom']"


def test_a_failed_episode_raises_so_the_rollout_is_dropped(taskset_path, endpoint):
    import openai

    base_url, _ = endpoint
    row = dict(load_environment("verifiers", id="grpo_reverse_words", size=1).load_dataset()[0])
    client = openai.AsyncOpenAI(base_url=base_url, api_key="k")
    with pytest.raises(RuntimeError, match="verifiers episode failed: taskset 'grpo_reverse_words' "
                                           "has no task 99"):
        asyncio.run(play(client, {**row, "vf_idx": 99}))


def test_missing_venv_unknown_taskset_and_the_plain_loop_are_clear_errors(taskset_path):
    with pytest.raises(VerifiersVenvMissing, match="run `make verifiers-venv`"):
        load_environment("verifiers", id="grpo_reverse_words", venv="/nonexistent").load_dataset()
    with pytest.raises(ValueError) as unknown:
        load_environment("verifiers", id="no_such_taskset").load_dataset()
    said = str(unknown.value)  # one line, not verifiers' 2,000-character traceback
    assert said.startswith("verifiers taskset 'no_such_taskset' is not importable in the verifiers "
                           f"venv ({venv_python().parent.parent}): pip-install its package into that "
                           "venv, or put its folder on PYTHONPATH.") and "\n" not in said
    assert "verifiers said: taskset 'no_such_taskset' not found" in said and "must already be installed" in said
    assert said.endswith("(No module named 'no_such_taskset')")
    with pytest.raises(ValueError, match="--env-arg id=TASKSET"):
        load_environment("verifiers").load_dataset()
    with pytest.raises(RuntimeError, match="train with `--agent verifiers`"):
        VerifiersEnv(id="grpo_reverse_words").reset(prompt="x")


def test_a_taskset_missing_a_dependency_names_the_missing_import(monkeypatch, tmp_path):
    """verifiers reports a taskset whose own import fails as 'not found' too: the import that
    failed says which module is missing."""
    (tmp_path / "grpo_broken_taskset.py").write_text("import grpo_no_such_dependency\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(ValueError, match=r"not found .*\(No module named 'grpo_no_such_dependency'\)$"):
        load_environment("verifiers", id="grpo_broken_taskset").load_dataset()


def test_env_check_lists_the_tasks_and_says_the_env_is_agent_only(taskset_path):
    from grpo_agent.plugins import load_registry
    from grpo_agent.plugins.check import check_environment

    spec = load_environment("verifiers", id="grpo_reverse_words")
    steps = check_environment(spec, load_registry())
    assert all(step.ok for step in steps), steps
    assert [step.name for step in steps] == ["dataset", "tool schemas", "rewards", "episodes"]
    assert "is agent-only" in steps[-1].detail and "--agent verifiers" in steps[-1].detail
    assert steps[2].detail == "the 'verifiers' agent's own score"  # not "get_reward only"
