"""The per-request sampling settings the worker sends, as the server's facts shape them."""
from __future__ import annotations

import logging

from grpo_agent import AsyncGRPOConfig
from grpo_agent.rollout.sampling import build_sampling_params
from grpo_agent.sampler.server_facts import ServerFacts

MASKS = ServerFacts(model_id="m", max_model_len=1024, supports_sampling_mask=True)
NO_MASKS = ServerFacts(model_id="m", max_model_len=1024)


def _config(tmp_path, **overrides):
    return AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", **overrides)


def test_the_config_settings_reach_every_request(tmp_path):
    config = _config(tmp_path, max_completion_length=77, temperature=0.7, repetition_penalty=1.1,
                     num_sampler_logprobs=5, score_centering=True)
    params = build_sampling_params(config, [2, 9], NO_MASKS)
    assert (params.max_tokens, params.temperature, params.repetition_penalty) == (77, 0.7, 1.1)
    assert params.num_logprobs == 5 and params.stop_token_ids == [2, 9]
    assert params.return_sampling_mask is False


def test_top_logprobs_are_asked_for_only_when_score_centering_uses_them(tmp_path, caplog):
    config = _config(tmp_path, num_sampler_logprobs=5, score_centering=False)
    with caplog.at_level(logging.WARNING, logger="grpo_agent.rollout.sampling"):
        params = build_sampling_params(config, [], NO_MASKS)
    assert caplog.text == ""  # full vocabulary: a server without masks is no concern
    assert params.num_logprobs == 0
    assert params.stop_token_ids is None  # no EOS ids: the server's own stop rules


def test_a_truncated_vocabulary_asks_for_masks_only_where_the_server_returns_them(tmp_path, caplog):
    """top_k alone truncates the vocabulary: a server that returns sampling masks is asked for
    them; one that cannot gets no such request and the run warns once that ratios are biased."""
    config = _config(tmp_path, top_k=20)
    assert build_sampling_params(config, [2], MASKS).return_sampling_mask is True
    with caplog.at_level(logging.WARNING, logger="grpo_agent.rollout.sampling"):
        assert build_sampling_params(config, [2], NO_MASKS).return_sampling_mask is False
    assert "importance ratios will be biased" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpo_agent.rollout.sampling"):
        assert build_sampling_params(_config(tmp_path), [2], MASKS).return_sampling_mask is False
    assert caplog.text == ""  # full vocabulary: no mask, no warning
