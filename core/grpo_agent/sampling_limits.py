"""What vLLM accepts for a sampling setting, checked before any request is sent.

At the package's first stage (no import of the config, which loads transformers, or of the
sampler), so the config and `EvalSettings`, which Python users build without a config, share
one rule and one message.
"""
from __future__ import annotations

# vLLM refuses every request above this ("temperature must be in [0, 2]", vllm/sampling_params.py
# of 0.32, the lowest version pyproject allows), so a run above it failed at its first request.
MAX_TEMPERATURE = 2.0


def check_temperature(name: str, value: float) -> None:
    """Refuse a temperature vLLM would refuse on every request, naming the setting `name`
    (`temperature`, `eval_temperature`)."""
    if not value >= 0:  # NaN too
        raise ValueError(f"{name}={value} is out of range: set {name} >= 0 (0 = greedy).")
    if value > MAX_TEMPERATURE:
        raise ValueError(f"{name}={value} is out of range: set {name} <= {MAX_TEMPERATURE:g} "
                         "(vLLM refuses every request above it).")
