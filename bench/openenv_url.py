"""OpenEnv by URL vs in process: wall time of one episode of the shipped guess-number env.

One episode is what a rollout asks of the env: reset (by URL: open a WebSocket session, reset,
list the MCP tools once per instance), one `guess` step, and scoring (by URL: the session
closes). The server is openenv-core's own app (`python -m grpo_agent_env_openenv.serve`) on a
local port; the two modes alternate in rounds, so load on a shared machine hits both alike.
Prints one JSON line per round and the median ratio (URL / in process) last.

Usage: python bench/openenv_url.py [--rounds 6] [--episodes 10]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

GUESS = {"type": "call_tool", "tool_name": "guess", "arguments": {"number": 32}}


def episode_s(env, episodes: int) -> float:
    started = time.perf_counter()
    for seed in range(episodes):
        env.reset(seed=seed)
        env.step(GUESS)
        env.get_reward()
    return (time.perf_counter() - started) / episodes


def main() -> None:
    from grpo_agent.plugins import load_environment
    from grpo_agent_env_openenv.serve import serving

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--episodes", type=int, default=10)
    args = parser.parse_args()
    with serving() as server:
        by_url, in_process = (load_environment("openenv", url=server.url)(),
                              load_environment("openenv")())
        episode_s(by_url, 1), episode_s(in_process, 1)  # warm: imports, first connection
        ratios = []
        for round_index in range(args.rounds):
            url_s, local_s = episode_s(by_url, args.episodes), episode_s(in_process, args.episodes)
            ratios.append(url_s / local_s)
            print(json.dumps({"round": round_index, "url_episode_s": round(url_s, 4),
                              "in_process_episode_s": round(local_s, 4),
                              "ratio": round(ratios[-1], 2)}))
    print(json.dumps({"median_ratio_url_over_in_process": round(statistics.median(ratios), 2)}))


if __name__ == "__main__":
    main()
