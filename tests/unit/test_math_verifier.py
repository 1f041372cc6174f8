"""`accuracy_reward` scores from threads: math-verify runs in a helper process (its
signal-based timeouts need a main thread), with a time bound of our own on each check."""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from grpo_agent.math_verifier import MathVerifier, MathVerifierError, _score
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


def test_an_answer_counts_boxed_or_anchored_and_gold_is_verifys_first_argument_as_in_trl():
    """TRL's check: LaTeX without `\\boxed{}` or an "answer is" anchor is no answer, and
    `verify(gold, answer)` is not symmetric (an interval answer matches an inequality gold)."""
    completions = [[{"role": "assistant", "content": text}] for text in (
        "we get $4$", "The answer is $4$.", "\\boxed{(-\\infty, 2]}", "\\boxed{x \\le 2}")]
    solutions = ["4", "4", "$x \\le 2$", "$(-\\infty, 2]$"]
    assert accuracy_reward(completions, solutions) == [0.0, 1.0, 1.0, 0.0]


def _stand_in_helper(script: str) -> subprocess.Popen:
    """A process in the helper's place (the seam: the helper process), speaking its protocol."""
    return subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, bufsize=0)


def test_a_helper_that_dies_mid_check_raises_and_the_next_check_starts_a_new_one():
    verifier = MathVerifier()
    verifier._proc = _stand_in_helper("import sys; sys.stdin.buffer.readline(); sys.exit(3)")
    try:
        with pytest.raises(MathVerifierError, match="exited with code 3 mid-check"):
            verifier.check("\\boxed{4}", "4")
        assert verifier.pid is None
        assert verifier.check("\\boxed{4}", "4") == 1.0
    finally:
        verifier.close()


def test_an_error_in_the_helper_is_raised_with_its_traceback():
    verifier = MathVerifier()
    verifier._proc = _stand_in_helper(
        "import sys; sys.stdin.buffer.readline(); "
        "print('{\"error\": \"Traceback: boom\"}', flush=True); sys.stdin.buffer.readline()")
    try:
        with pytest.raises(MathVerifierError, match="math-verify raised in the helper process:\nTraceback: boom"):
            verifier.check("\\boxed{4}", "4")
    finally:
        verifier.close()

