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


def test_responses_api_images_go_too_and_a_part_that_is_not_text_keeps_the_list():
    """`input_image` (the Responses API's part) is an image too. Only all-text leftovers become
    one string (a text part without text adds nothing); any other part keeps the list, so
    nothing but images is lost."""
    audio = {"type": "input_audio", "input_audio": {"data": "..."}}
    prompt = [{"role": "user", "content": [{"type": "input_image", "image_url": "x.png"},
                                           {"type": "text", "text": None}, {"type": "text", "text": "hi"}]},
              {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, audio]}]
    stripped, removed = strip_images(prompt)
    assert removed == 2
    assert [m["content"] for m in stripped] == ["hi", [{"type": "text", "text": "and"}, audio]]
