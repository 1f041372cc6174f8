"""Held-out success of the counter task trained three ways with `make demo`'s settings, on the
counter-warmed tiny model: as the `counter` environment through `AsyncGRPOTrainer` (the
built-in tool loop, "env": `make demo` itself), as an `openai`-SDK agent through
`HarnessAsyncGRPOTrainer` (the gateway, "harness"), and as a command agent in its own
sandboxed process ("command", bench/counter_command_agent.py, what `--agent-cmd` runs).

Same settings (the Makefile's DEMO_SETS, read from it), seed and eval split (the env's: every
target 1-9 once, greedy `eval/pass@1` at the start and every `eval_steps`). Each run gets its
own managed vLLM server with the cores split as `grpo-agent train` splits them, so every run
starts from the same weights. The agents get the rows the env would make: a seeded random
target 1-9 per row, the env's prompt and tool schema, at most `max_tool_calling_iterations`
tool rounds. If the gateway is token-faithful the agents' held-out success rises as the env's.

Prints one JSON line per run (the eval trail, training reward per step, tool calls and forks
per rollout, seconds) and a summary line last: each run's first and last `eval/pass@1` per
seed and their means.

    python bench/harness_vs_env.py [--seeds 1,2] [--runs env,harness,command] [--model DIR]
                                   [--set key=value ...]
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND_AGENT = Path(__file__).with_name("counter_command_agent.py")
PROMPT = "Increment the counter by {}."
TRAIN_ROWS = 4096
sys.path.insert(0, str(COMMAND_AGENT.parent))
from counter_command_agent import INCREMENT, MAX_ROUNDS, MAX_TARGET  # noqa: E402


async def counter_agent(client, row: dict) -> float:
    """The counter env as an SDK agent: its prompt and tool, tools run after at most
    MAX_ROUNDS turns (the tool loop's `max_tool_calling_iterations`), reward 1 on the target.
    A row without a target draws one, as the env's `reset` does."""
    import json as json_

    model = (await client.models.list()).data[0].id
    target = row["target"] if row.get("target") is not None else random.randint(1, MAX_TARGET)
    messages = [{"role": "user", "content": PROMPT.format(target)}]
    counter = 0
    for round_index in range(MAX_ROUNDS + 1):
        choice = (await client.chat.completions.create(
            model=model, messages=messages, tools=[INCREMENT])).choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if not choice.message.tool_calls or choice.finish_reason == "length" or round_index == MAX_ROUNDS:
            break
        for call in choice.message.tool_calls:
            counter += int(json_.loads(call.function.arguments).get("step", 0))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(counter)})
    return float(counter == target)


def demo_sets() -> list[str]:
    """`make demo`'s `--set` values (key=value), read from the Makefile's DEMO_SETS."""
    lines = ROOT.joinpath("Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("DEMO_SETS :="))
    text = []
    for line in lines[start:]:
        text.append(line.rstrip("\\").strip())
        if not line.rstrip().endswith("\\"):
            break
    words = shlex.split(" ".join(text).split(":=", 1)[1])
    return [word for word in words if word != "--set"]


def train(kind: str, model: str, sets: list[str], seed: int, targets: str) -> dict:
    from grpo_agent.cli.config_files import build_config
    from transformers.trainer_callback import PrinterCallback
    from grpo_agent.train.reporting import read_metrics
    from grpo_agent.train.run import _server, run_training

    output_dir = tempfile.mkdtemp(prefix=f"harness-vs-env-{kind}-{seed}-")
    config = build_config(None, [*sets, f"seed={seed}", "report_to=none"], output_dir=output_dir)
    config.eval_success_threshold = 1.0  # the counter env's declared threshold
    if config.max_tool_calling_iterations != MAX_ROUNDS:
        raise SystemExit(f"The demo's max_tool_calling_iterations is {config.max_tool_calling_iterations}; "
                         f"the agents run {MAX_ROUNDS} tool rounds (counter_command_agent.MAX_ROUNDS).")
    began = time.perf_counter()
    if kind == "env":  # `make demo`: the CLI's run, with its own managed server
        run_training("counter", config, model=model)
    else:
        with _server(model, None, None, config) as base_url:
            config.vllm_server_base_url = base_url
            config.disable_tqdm = True  # as `grpo-agent train`: metrics go to metrics.jsonl
            trainer = agent_trainer(kind, model, config, seed, targets)
            trainer.remove_callback(PrinterCallback)
            trainer.train()
    seconds = time.perf_counter() - began
    rows = read_metrics(Path(output_dir) / "metrics.jsonl")
    evals = [(int(r["eval/step"]), r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    steps = [r for r in rows if "reward" in r]
    result = {"run": kind, "seed": seed, "targets": targets, "seconds": round(seconds, 1),
              "eval_pass@1": [[step, round(value, 3)] for step, value in evals],
              "first_pass@1": evals[0][1] if evals else None,
              "last_pass@1": evals[-1][1] if evals else None,
              "rewards": [round(r["reward"], 3) for r in steps],
              "calls_per_rollout": _mean(steps, "tools/call_frequency"),
              "fork_frac": _mean(steps, "rollout/fork_frac"),
              "agent_errors": sum(r.get("harness/errors_count", 0.0) for r in steps),
              "output_dir": output_dir}
    print(json.dumps(result), flush=True)
    return result


def agent_trainer(kind: str, model: str, config, seed: int, targets: str):
    """`HarnessAsyncGRPOTrainer` on counter rows, evaluated on the env's eval split. `targets`
    "env": rows name no target, so each rollout draws its own as the env's `reset` does (the
    env owns its data: a group of `num_generations` mixes targets); "row": each row names a
    seeded target (a group shares one target, a different GRPO problem)."""
    from datasets import Dataset
    from grpo_agent import HarnessAsyncGRPOTrainer
    from grpo_agent.plugins import load_registry
    from grpo_agent.rollout.agent_programs import AgentCommand
    from grpo_agent.train.reporting import JsonlMetricsCallback

    rng = random.Random(seed)
    if targets == "row":
        row_targets = [rng.randint(1, MAX_TARGET) for _ in range(TRAIN_ROWS)]
        prompts = [[{"role": "user", "content": PROMPT.format(t)}] for t in row_targets]
    else:  # the prompt column is the trainer's; the agent writes its own from the target it draws
        row_targets = [None] * TRAIN_ROWS
        prompts = [[{"role": "user", "content": PROMPT.format("a number")}]] * TRAIN_ROWS
    dataset = Dataset.from_dict({"prompt": prompts, "target": row_targets})
    agent = counter_agent if kind == "harness" else AgentCommand(f"{sys.executable} {COMMAND_AGENT}")
    return HarnessAsyncGRPOTrainer(
        model=model, agent=agent, args=config, train_dataset=dataset,
        eval_dataset=load_registry().environment_spec("counter").load_eval_dataset(),
        callbacks=[JsonlMetricsCallback()], agent_timeout_s=300)


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return round(statistics.fmean(values), 3) if values else None


def summarize(results: list[dict]) -> dict:
    """Per run: first and last eval/pass@1 per seed and their means over seeds."""
    out = {}
    for kind in dict.fromkeys(r["run"] for r in results):
        mine = [r for r in results if r["run"] == kind and r["first_pass@1"] is not None]
        out[kind] = {"first": [r["first_pass@1"] for r in mine], "last": [r["last_pass@1"] for r in mine],
                     "first_mean": round(statistics.fmean(r["first_pass@1"] for r in mine), 3),
                     "last_mean": round(statistics.fmean(r["last_pass@1"] for r in mine), 3),
                     "seconds_mean": round(statistics.fmean(r["seconds"] for r in mine), 1)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1", help="comma-separated seeds; each run per seed")
    parser.add_argument("--runs", default="env,harness,command", help="which runs, in order")
    parser.add_argument("--model", help="the model folder (default: the counter-warmed tiny model)")
    parser.add_argument("--targets", choices=("env", "row"), default="env",
                        help="agents' training targets: env (each rollout draws one, as the env "
                        "does; a group mixes targets) or row (one seeded target per row and group)")
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        help="override a DEMO_SETS value for every run (key=value, repeatable)")
    args = parser.parse_args()
    from transformers.utils import get_json_schema

    from grpo_agent.plugins import load_registry
    from grpo_agent.testing.warmup import build_counter_warmed_model

    import grpo_agent_env_counter

    env_schema = get_json_schema(load_registry().environment_spec("counter").environment_factory().increment)
    if grpo_agent_env_counter.MAX_TARGET != MAX_TARGET:
        raise SystemExit(f"The counter env's targets go to {grpo_agent_env_counter.MAX_TARGET}, the agents' "
                         f"to {MAX_TARGET} (counter_command_agent.MAX_TARGET).")
    if json.dumps(env_schema) != json.dumps(INCREMENT):
        raise SystemExit(f"counter_command_agent.INCREMENT differs from the env's schema: {INCREMENT} vs {env_schema}")
    kinds = args.runs.split(",")
    if unknown := set(kinds) - {"env", "harness", "command"}:
        raise SystemExit(f"Unknown runs {sorted(unknown)}: use env, harness, command.")
    model = args.model or str(build_counter_warmed_model())
    sets = [*demo_sets(), *args.sets]
    results = [train(kind, model, sets, int(seed), args.targets)
               for seed in args.seeds.split(",") for kind in kinds]
    print(json.dumps({"summary": "harness_vs_env", "seeds": args.seeds, "model": model, "sets": sets,
                      "targets": args.targets,
                      **summarize(results)}))


if __name__ == "__main__":
    main()
