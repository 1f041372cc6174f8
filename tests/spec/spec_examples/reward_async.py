"""Spec lines 587-593, example 5 (verbatim), and a second async function for the mixed list of
lines 608-613 (`[reward_func, async_reward_func1, async_reward_func2]`, which the spec leaves
open: the tests pass example 5's function as the first, and this one, with its body, as the
second)."""
import asyncio


async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]


async def async_reward_func2(prompts, completions, **kwargs):
    await asyncio.sleep(0.01)
    return [1.0 if completion else 0.0 for completion in completions]
