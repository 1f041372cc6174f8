"""Spec lines 526-565, example 4: the math-and-code dataset and its two task-specific reward
functions (verbatim). The spec leaves `check_math_solution` and `test_code_solution` undefined;
the stand-ins below check what their names say, on the completion's text."""
import re

from datasets import Dataset


def check_math_solution(prompt, completion):
    """The completion states the value of the prompt's `a+b` or `a*b` as a number."""
    a, op, b = re.search(r"(\d+)\s*([+*])\s*(\d+)", prompt[-1]["content"]).groups()
    value = int(a) + int(b) if op == "+" else int(a) * int(b)
    return str(value) in re.findall(r"-?\d+", completion[-1]["content"])


def test_code_solution(prompt, completion):
    """The completion is valid Python."""
    try:
        compile(completion[-1]["content"], "<completion>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True


# Define a dataset that contains both math and coding problems
dataset = Dataset.from_list(
    [
        {"prompt": [{"role": "user", "content": "What is 2+2?"}], "task": "math"},
        {"prompt": [{"role": "user", "content": "Write a function that returns the sum of two numbers."}], "task": "code"},
        {"prompt": [{"role": "user", "content": "What is 3*4?"}], "task": "math"},
        {"prompt": [{"role": "user", "content": "Write a function that returns the product of two numbers."}], "task": "code"},
    ]
)

# Math-specific reward function
def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards

# Coding-specific reward function
def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "code":
            # Calculate coding-specific reward
            works = test_code_solution(prompt, completion)
            reward = 1.0 if works else -1.0
            rewards.append(reward)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards
