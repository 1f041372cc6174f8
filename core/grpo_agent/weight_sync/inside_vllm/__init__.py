"""Code that vLLM loads into its own processes by module path (see `sampler/vllm_plugin.py`).

Nothing in the trainer imports it; it may import only `grpo_agent.weight_sync.wire`.
"""
