"""A tool-calling warm-up of the tiny model, so real-server agent tests see real tool calls.

Design decision: the random tiny model never emits `<tool_call>` on its own, and tests of the
tool loop against a real vLLM server need it to. A short supervised pass on synthetic,
template-rendered tool-call transcripts (the spec's IncrementEnv, coding and game tasks, and
every fourth one its `tools=[multiply, async_add]` example) teaches it the format, and on
purpose the right increment only half the time, so GRPO groups see reward variance: assistant
tokens only, fixed seed, 100 tiny steps (about a minute on a busy 2-core CPU). The result is
cached next to the base model, built behind a file lock like `build_tiny_model`; bump
`WARMUP_VERSION` when the recipe changes. `python -m grpo_agent.testing.warmup` builds it with a
progress bar (plain lines off a terminal) and prints its folder (`... warmup counter`: the
counter-warmed model `make demo` trains, see `build_counter_warmed_model`).
"""
from __future__ import annotations

import json
import random
import shutil
import sys
import time
from pathlib import Path

from grpo_agent.testing.tiny_model import (
    KIT_VERSION,
    build_once,
    build_tiny_model,
    default_cache_dir,
)

WARMUP_VERSION = 5
TOOL_WARMUP = "tool-call warm-up of the tiny model"  # its progress lines' name
EMPTY_THINK = "<think>\n\n</think>\n\n"


def increment(step: int) -> int:
    """
    Increment the internal counter.

    Args:
        step: Value to add to the counter.

    Returns:
        The updated counter value.
    """
    return step


def run_code(code: str) -> str:
    """Run the given Python code and return its stdout.

    Args:
        code: The Python source to execute.

    Returns:
        The captured standard output.
    """
    return code


def move(action: str) -> str:
    """Apply an action to the game and return the new observation.

    Args:
        action: One of "up", "down", "left", "right".

    Returns:
        The observation after the move.
    """
    return action


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


def _call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def synthetic_transcripts(count: int, seed: int = 0) -> list[tuple[list[dict], list]]:
    """(messages, tools) pairs: a task, one matching tool call, its result, a short answer.

    Every fourth pair is an arithmetic one, drawn from its own stream so the other tasks'
    sequence is the one earlier versions trained on."""
    rng = random.Random(seed)
    arithmetic = random.Random(f"{seed}:arithmetic")
    transcripts = []
    for index in range(count):
        kind = "arithmetic" if index % 4 == 3 else rng.choice(["increment", "coding", "game"])
        if kind == "arithmetic":
            a, b = arithmetic.randint(1, 9), arithmetic.randint(1, 9)
            tools = [multiply, async_add]
            if arithmetic.random() < 0.5:
                prompt, call, result = f"Multiply {a} by {b}.", _call("multiply", {"a": a, "b": b}), a * b
            else:
                prompt, call, result = f"Add {a} and {b}.", _call("async_add", {"a": a, "b": b}), a + b
            result = str(result)
        elif kind == "increment":
            target = rng.randint(1, 6)
            # Half the transcripts step by a random amount: the warmed model then reaches the
            # target only sometimes, so GRPO groups have reward variance to learn from.
            step = target if rng.random() < 0.5 else rng.randint(1, 6)
            prompt, tools = f"Increment the counter by {target}.", [increment]
            call, result = _call("increment", {"step": step}), str(step)
        elif kind == "coding":
            n = rng.randint(1, 20)
            prompt, tools = f"Compute the {n}th Fibonacci number.", [run_code]
            call, result = _call("run_code", {"code": f"print({n})"}), str(n)
        else:
            action = rng.choice(["up", "down", "left", "right"])
            prompt, tools = "Reach the goal tile.", [move]
            call, result = _call("move", {"action": action}), f"moved {action}"
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": EMPTY_THINK + call},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": EMPTY_THINK + "Done."},
        ]
        transcripts.append((messages, tools))
    return transcripts


def _assistant_masked_example(tokenizer, template: str, messages: list[dict], tools: list):
    """Token ids and labels (-100 outside assistant turns) of one transcript.

    Rendered with `enable_thinking=False` (as the spec's agent examples run): the generation
    prompt already holds the empty `<think>` block, so the assistant's own tokens start after
    it. One mode only: 80 tiny steps do not teach both.
    """
    kwargs = {"enable_thinking": False}
    ids: list[int] = []
    labels: list[int] = []
    for end in range(1, len(messages) + 1):
        if messages[end - 1]["role"] == "assistant":
            prompt = tokenizer.apply_chat_template(
                messages[: end - 1], tools=tools, chat_template=template, tokenize=False,
                add_generation_prompt=True, **kwargs,
            )
            prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
            new = prompt_ids[len(ids):]
            ids, labels = ids + new, labels + [-100] * len(new)
            turn = messages[end - 1]["content"][len(EMPTY_THINK):]
            turn_ids = tokenizer.encode(turn + tokenizer.eos_token, add_special_tokens=False)
            ids, labels = ids + turn_ids, labels + turn_ids
        else:
            text = tokenizer.apply_chat_template(
                messages[:end], tools=tools, chat_template=template, tokenize=False, **kwargs,
            )
            new = tokenizer.encode(text, add_special_tokens=False)[len(ids):]
            ids, labels = ids + new, labels + [-100] * len(new)
    return ids, labels


def _train(folder: Path, steps: int, batch_size: int, seed: int, show_progress: bool = False,
           transcripts=None, lr: float = 5e-3,
           description: str = TOOL_WARMUP) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_agent.rollout.chat_template import choose_training_template

    tokenizer = AutoTokenizer.from_pretrained(folder)
    template = choose_training_template(tokenizer).template or tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if transcripts is None:
        transcripts = synthetic_transcripts(steps * batch_size // 4, seed)
    examples = [
        _assistant_masked_example(tokenizer, template, messages, tools)
        for messages, tools in transcripts
    ]
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    model.train()
    for _ in _steps(steps, show_progress, description):
        batch = rng.sample(examples, batch_size)
        width = max(len(ids) for ids, _ in batch)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        attention = (torch.arange(width)[None, :] < torch.tensor([len(i) for i, _ in batch])[:, None]).long()
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)


def _steps(steps: int, show_progress: bool, description: str = TOOL_WARMUP):
    """range(steps), shown on stderr when asked: a progress bar on a terminal; off one (a log,
    `make demo` under nohup) plain lines as `grpo-agent train` prints them: the phase's start,
    a step at most every `PLAIN_LINE_INTERVAL_S` and its end, where a bar showed nothing for
    the whole build (40 minutes on a busy 2-core box)."""
    if not show_progress:
        return range(steps)
    from rich.console import Console
    from rich.progress import track

    console = Console(stderr=True)
    if not console.is_terminal:
        return _plain_steps(steps, description, console)
    return track(range(steps), description=description, console=console)


def _plain_steps(steps: int, description: str, console):
    from grpo_agent.train.reporting import PLAIN_LINE_INTERVAL_S

    started = said = time.perf_counter()

    def say(step: int) -> None:
        elapsed = time.strftime("%H:%M:%S", time.gmtime(time.perf_counter() - started))
        console.print(f"{description}: step {step}/{steps}  [{elapsed}]", highlight=False,
                      markup=False, soft_wrap=True)

    say(0)
    for step in range(steps):
        if step and time.perf_counter() - said >= PLAIN_LINE_INTERVAL_S:
            say(step)
            said = time.perf_counter()
        yield step
    say(steps)


def build_tool_warmed_model(
    steps: int = 100, batch_size: int = 8, seed: int = 0, show_progress: bool = False
) -> Path:
    """The tiny model after a tool-calling warm-up (cached; built once per machine)."""
    name = f"tiny-qwen3-v{KIT_VERSION}-tools-v{WARMUP_VERSION}-s{steps}"
    return _cached_build(name, build_tiny_model(), str(WARMUP_VERSION),
                         lambda folder: _train(folder, steps, batch_size, seed, show_progress))


def _cached_build(name: str, base: Path, version: str, train) -> Path:
    """`base` copied and trained into the cache folder `name`, once per machine (`build_once`)."""
    def write(staging: Path) -> None:
        shutil.copytree(base, staging, dirs_exist_ok=True)
        train(staging)

    return build_once(default_cache_dir() / name, version, write)


COUNTER_WARMUP_VERSION = 1
COUNTER_MAX_TARGET = 9
COUNTER_RIGHT_SHARE = 0.35


def counter_transcripts(count: int, seed: int = 0) -> list[tuple[list[dict], list]]:
    """The counter task only, with a habit to unlearn: the step copies the target
    COUNTER_RIGHT_SHARE of the time and overshoots it by one otherwise."""
    rng = random.Random(f"{seed}:counter")
    transcripts = []
    for _ in range(count):
        target = rng.randint(1, COUNTER_MAX_TARGET)
        step = target if rng.random() < COUNTER_RIGHT_SHARE else target + 1
        messages = [
            {"role": "user", "content": f"Increment the counter by {target}."},
            {"role": "assistant", "content": EMPTY_THINK + _call("increment", {"step": step})},
            {"role": "tool", "content": str(step)},
            {"role": "assistant", "content": EMPTY_THINK + "Done."},
        ]
        transcripts.append((messages, [increment]))
    return transcripts


def build_counter_warmed_model(
    steps: int = 300, batch_size: int = 16, seed: int = 0, show_progress: bool = False
) -> Path:
    """The `make demo` starting point: the tool-warmed model, then taught the counter task
    with an overshoot habit (cached; built once per machine).

    Why: the tool-warmed model calls `increment` with a step that ignores the target (about one
    call in nine is right, whatever the target), which leaves RL a mapping to discover from a
    ~0.8M-parameter model in minutes. After this pass the step depends on the target, but greedy
    decoding picks the overshoot: held-out success starts low while sampled groups hold right
    answers, so GRPO has the signal to flip the habit, and the eval split measures whether it
    did."""
    base = build_tool_warmed_model(show_progress=show_progress)
    name = f"{base.name}-counter-v{COUNTER_WARMUP_VERSION}-s{steps}"
    transcripts = counter_transcripts(2000, seed)
    return _cached_build(name, base, str(COUNTER_WARMUP_VERSION), lambda folder: _train(
        folder, steps, batch_size, seed, show_progress, transcripts=transcripts, lr=3e-3,
        description="counter warm-up of the tool-warmed model"))


if __name__ == "__main__":
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its per-file load/save bars would bury ours
    build = build_counter_warmed_model if sys.argv[1:] == ["counter"] else build_tool_warmed_model
    print(build(show_progress=True))
