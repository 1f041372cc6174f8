"""An agent for `grpo-agent train --agent` tests: it writes each row's prompt to the file named
by PROBE_PROMPTS_LOG (what the agent was given, read by the test), and its reward says whether
that prompt holds the question (a user message)."""
from __future__ import annotations

import json
import os
import random


async def probe(client, row: dict) -> float:
    """1.x when the row's prompt has a user message, 0.0x when it has none (the question is
    missing); the small random part keeps every group's rewards apart, so no group is dropped."""
    model = (await client.models.list()).data[0].id
    await client.chat.completions.create(model=model, messages=row["prompt"], max_tokens=4)
    with open(os.environ["PROBE_PROMPTS_LOG"], "a") as log:
        log.write(json.dumps(row["prompt"]) + "\n")
    has_question = any(message["role"] == "user" for message in row["prompt"])
    return float(has_question) + random.random() / 100
