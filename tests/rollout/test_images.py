"""Images in prompts are stripped (the spec: they reach neither vLLM nor the forward pass)."""
from __future__ import annotations

from grpo_agent.rollout.images import strip_images


def test_image_parts_are_removed_and_the_remaining_text_becomes_a_string():
    prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is "},
                                     {"type": "image_url", "image_url": {"url": "x.png"}},
                                     {"type": "text", "text": "shown?"}]},
    ]
    stripped, removed = strip_images(prompt)
    assert removed == 2
    assert stripped == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "What is shown?"}]
    assert prompt[1]["content"][0] == {"type": "image"}  # the dataset's row is not modified


def test_a_prompt_without_images_is_returned_as_it_is():
    prompt = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert strip_images(prompt) == (prompt, 0)
