"""The `verifiers` agent plays at most MAX_EPISODES episodes at once, all in one episode server
per worker: the worker may hold hundreds of rollouts, and each episode runs verifiers' own
servers and programs (252 episode processes at once once swapped a 2-core box to a halt)."""

import asyncio
import sys
from types import SimpleNamespace

import grpo_agent_env_verifiers as vf
import pytest

# A stand-in episode server (the seam: verifiers itself), speaking runner.py's protocol: each
# episode's reward is how many episodes were running when it started, plus the server's pid.
SERVER = """
import asyncio, json, os, sys

async def main():
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    running = 0

    async def episode(request):
        nonlocal running
        running += 1
        seen = running
        try:
            await asyncio.sleep(60 if request["row"].get("slow") else 0.3)
        finally:
            running -= 1
        if request["row"].get("fail"):
            reply = {"id": request["id"], "error": "the harness broke"}
        else:
            reply = {"id": request["id"], "reward": seen + os.getpid() * 1000}
        print(json.dumps(reply), flush=True)

    tasks = {}
    while line := await reader.readline():
        request = json.loads(line)
        if "cancel" in request:
            tasks[request["cancel"]].cancel()
            open(os.path.join(os.environ["CANCELS_DIR"], request["cancel"]), "w").close()
            continue
        if request["row"].get("die"):
            print("the server fell over", file=sys.stderr, flush=True)
            os._exit(3)
        tasks[request["id"]] = asyncio.ensure_future(episode(request))
    await asyncio.gather(*tasks.values(), return_exceptions=True)

asyncio.run(main())
"""


class Models:
    async def list(self):
        return SimpleNamespace(data=[SimpleNamespace(id="stand-in")])


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("CANCELS_DIR", str(tmp_path))
    runner = tmp_path / "runner.py"
    runner.write_text(SERVER)
    monkeypatch.setattr(vf, "RUNNER", runner)
    monkeypatch.setattr(vf, "MAX_EPISODES", 2)
    return SimpleNamespace(base_url="http://127.0.0.1:9/v1", api_key="k", models=Models())


def test_episodes_wait_for_a_slot_in_one_server(server):
    row = {"vf_python": sys.executable}

    async def main():
        return await asyncio.gather(*(vf.play(server, row) for _ in range(6)))

    rewards = asyncio.run(main())
    running, pids = [int(r) % 1000 for r in rewards], {int(r) // 1000 for r in rewards}
    assert len(pids) == 1, f"episode servers started: {pids}"
    assert max(running) <= 2, f"episodes running at once: {running}"


def test_a_failed_episode_or_server_raises_and_a_new_server_follows(server):
    async def main():
        with pytest.raises(RuntimeError, match="verifiers episode failed: the harness broke"):
            await vf.play(server, {"vf_python": sys.executable, "fail": True})
        with pytest.raises(RuntimeError, match="exited 3: the server fell over"):
            await vf.play(server, {"vf_python": sys.executable, "die": True})
        return await vf.play(server, {"vf_python": sys.executable})

    assert asyncio.run(main()) % 1000 == 1


def test_a_rollout_out_of_time_cancels_its_episode_in_the_server(server, tmp_path):
    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(vf.play(server, {"vf_python": sys.executable, "slow": True}), 2)
        # the cancel request was sent before play() re-raised; the next episode follows it
        return await vf.play(server, {"vf_python": sys.executable})

    assert asyncio.run(main()) % 1000 == 1
    assert len(list(tmp_path.iterdir())) == 2, list(tmp_path.iterdir())  # runner.py + one cancel
