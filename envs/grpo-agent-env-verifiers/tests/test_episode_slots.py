"""The `verifiers` agent runs at most MAX_EPISODES episode processes at once, and an episode dies
with its rollout worker: the worker may hold hundreds of rollouts, and each episode is a Python
process with verifiers' own servers (252 at once once swapped a 2-core box to a halt)."""

import asyncio
import sys
from types import SimpleNamespace

import grpo_agent_env_verifiers as vf

# A stand-in runner (the seam: verifiers itself): notes its start and end in a shared folder,
# records how many episodes were running when it started, and reports reward 1.
RUNNER = """
import os, sys, time, uuid
folder = os.environ["SLOTS_DIR"]
me = os.path.join(folder, uuid.uuid4().hex + ".running")
open(me, "w").close()
running = sum(name.endswith(".running") for name in os.listdir(folder))
open(os.path.join(folder, uuid.uuid4().hex + f".seen{running}"), "w").close()
sys.stdin.read()
time.sleep(0.4)
os.remove(me)
print(1.0)
"""


def test_episodes_wait_for_a_slot(tmp_path, monkeypatch):
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    folder = tmp_path / "slots"
    folder.mkdir()
    monkeypatch.setattr(vf, "RUNNER", runner)
    monkeypatch.setattr(vf, "MAX_EPISODES", 2)
    monkeypatch.setenv("SLOTS_DIR", str(folder))
    client = SimpleNamespace(base_url="http://127.0.0.1:9/v1", api_key="k")
    row = {"vf_python": sys.executable}

    async def main():
        return await asyncio.gather(*(vf.play(client, row) for _ in range(6)))

    assert asyncio.run(main()) == [1.0] * 6
    seen = [int(path.suffix.removeprefix(".seen")) for path in folder.iterdir()
            if path.suffix.startswith(".seen")]
    assert len(seen) == 6
    assert max(seen) <= 2, f"episodes running at once: {sorted(seen)}"
