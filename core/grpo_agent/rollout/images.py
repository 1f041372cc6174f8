"""Images in prompts: stripped, since no part of the pipeline can use them yet.

The spec: "prompts with images are not passed to the vLLM server or the training forward
pass". A message whose content is a list of parts loses its image parts; when only text
parts remain they are joined into one string (text-only chat templates such as Qwen3's
render list content as nothing at all). The caller warns once per run.
"""
from __future__ import annotations

from typing import Any

IMAGE_PART_TYPES = frozenset({"image", "image_url", "input_image"})


def strip_images(prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The prompt without image parts, and how many were removed (the prompt itself if none)."""
    removed = 0
    stripped = []
    for message in prompt:
        content = message.get("content")
        if not isinstance(content, list):
            stripped.append(message)
            continue
        kept = [part for part in content if not _is_image(part)]
        removed += len(content) - len(kept)
        if all(isinstance(part, dict) and part.get("type") == "text" for part in kept):
            kept = "".join(part.get("text") or "" for part in kept)
        stripped.append({**message, "content": kept})
    return (stripped, removed) if removed else (prompt, 0)


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
