"""An agent for `grpo-agent train --agent` tests: its reward says whether its row's prompt holds
the question (a user message), so a run's mean reward shows what the agent was given."""
from __future__ import annotations

import random


async def probe(client, row: dict) -> float:
    """1.x when the row's prompt has a user message, 0.0x when it has none (the question is
    missing); the small random part keeps every group's rewards apart, so no group is dropped."""
    model = (await client.models.list()).data[0].id
    await client.chat.completions.create(model=model, messages=row["prompt"], max_tokens=4)
    has_question = any(message["role"] == "user" for message in row["prompt"])
    return float(has_question) + random.random() / 100
