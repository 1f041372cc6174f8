"""`accuracy_reward` scores from threads: math-verify runs in a helper process (its
signal-based timeouts need a main thread), with a time bound of our own on each check."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from grpo_agent.math_verifier import MathVerifier, _score
from grpo_agent.rewards import accuracy_reward

CASES = [  # (completion, solution)
    ("So the answer is \\boxed{4}.", "4"),
    ("So the answer is \\boxed{5}.", "4"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("no boxed answer here: 4", "4"),
    ("\\boxed{x^2 + 2x}", "$2x + x^2$"),
]


def test_accuracy_reward_scores_in_threads_exactly_as_math_verify_on_the_main_thread():
    completions = [[{"role": "assistant", "content": text}] for text, _ in CASES]
    solutions = [gold for _, gold in CASES]
    expected = [_score(text, gold) for text, gold in CASES]  # math-verify itself, main thread
    assert expected[:2] == [1.0, 0.0]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: accuracy_reward(completions, solutions), range(8)))
    assert results == [expected] * 8


def test_a_check_that_outlives_its_time_bound_scores_zero_and_the_helper_is_replaced():
    verifier = MathVerifier(check_timeout_s=0.0)  # no check can answer in no time
    try:
        assert verifier.check("\\boxed{4}", "4") == 0.0
        assert verifier.pid is None  # killed, not left computing
        verifier.check_timeout_s = 30.0
        assert verifier.check("\\boxed{4}", "4") == 1.0  # a fresh helper
        first = verifier.pid
        verifier._proc.kill()  # a helper that died between checks is restarted too
        verifier._proc.wait()
        assert verifier.check("\\boxed{4}", "4") == 1.0 and verifier.pid != first
    finally:
        verifier.close()
