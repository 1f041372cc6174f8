"""The `words` demo environment: a task a ~1M-parameter random model can visibly learn on a CPU.

Design decision: `make demo-words` must show learning in minutes on two cores, so the reward
has to be dense and reachable by a random policy: answer an arithmetic question in words, scored by the
share of letters among the answer's non-space characters. The random tiny model (its tokenizer
was trained on arithmetic text) answers mostly in digits, about 0.23 letters on average, so
every group has reward variance and there is a long way up; a few dozen GRPO steps at a high
learning rate move the policy towards letter tokens, which the reward curve shows. It is
registered like any env plugin (through the built-in plugin modules), so
`grpo-agent train --env words` takes the same path as any other env.
"""
from __future__ import annotations

from typing import Any

from grpo_agent.plugins.decorators import environment, reward
from grpo_agent.plugins.hookspecs import hookimpl
from grpo_agent.rewards import completion_text

QUESTIONS = (
    "In words, what is {a} plus {b}?",
    "Spell out {a} times {b}.",
    "In words, how much is {a} minus {b}?",
    "Spell out the number after {a}.",
)
NUM_PROMPTS = 256


def load_prompts():
    """Short arithmetic questions (conversational `prompt`, and their `solution`)."""
    from datasets import Dataset

    prompts, solutions = [], []
    for i in range(NUM_PROMPTS):
        a, b = 3 + (i * 7) % 90, 2 + (i * 13) % 40
        template = QUESTIONS[i % len(QUESTIONS)]
        answer = [a + b, a * b, a - b, a + 1][i % len(QUESTIONS)]
        prompts.append([{"role": "user", "content": template.format(a=a, b=b)}])
        solutions.append(str(answer))
    return Dataset.from_dict({"prompt": prompts, "solution": solutions})


def letter_fraction(completions: list, **kwargs: Any) -> list[float]:
    """Share of non-space characters of the answer that are letters (0 for an empty answer)."""
    scores = []
    for completion in completions:
        chars = [c for c in completion_text(completion) if not c.isspace()]
        scores.append(sum(c.isalpha() for c in chars) / len(chars) if chars else 0.0)
    return scores


def number_to_words(number: int) -> str:
    """
    Spell out a whole number between -999 and 999 in English words.

    Args:
        number: The number to spell out.

    Returns:
        The number in words, e.g. "forty two".
    """
    if not -999 <= number <= 999:
        raise ValueError(f"{number} is outside -999..999")
    if number < 0:
        return "minus " + number_to_words(-number)
    ones = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
    tens = ["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
    if number < 20:
        return ones[number]
    if number < 100:
        return tens[number // 10] + ("" if number % 10 == 0 else " " + ones[number % 10])
    rest = number % 100
    return ones[number // 100] + " hundred" + ("" if rest == 0 else " " + number_to_words(rest))


@environment(
    "words",
    version=1,
    dataset=load_prompts,
    rewards=["letter_fraction"],
    description="Answer arithmetic questions in words; dense reward for the CPU demo.",
)
class WordsEnv:
    """No tools and no state: the dataset and the reward define the task."""

    def reset(self, **row) -> None:
        return None


@hookimpl
def register_environments(register):
    register(WordsEnv)


@hookimpl
def register_rewards(register):
    register(reward("letter_fraction")(letter_fraction))
