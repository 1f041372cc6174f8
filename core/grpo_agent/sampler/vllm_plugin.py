"""vLLM general plugin (entry point `vllm.general_plugins`): registers the `gloo` backend,
builds the generate answer's log-probs cheaply in the API server (`vllm_answer`) and, where
asked, makes vLLM's queues sleep instead of spin (`vllm_wait`).

vLLM imports this in every one of its processes, so `--weight-transfer-config
'{"backend": "gloo"}'` resolves on CPU workers. Registration is lazy (module path + class
name) and idempotent, as vLLM's plugin docs require.
"""


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from grpo_agent.sampler import vllm_answer, vllm_vl_shim, vllm_wait

    vllm_answer.install()  # the API server process only; GRPO_AGENT_VLLM_FAST_ANSWER=0: off
    vllm_wait.install()  # only with GRPO_AGENT_VLLM_WAIT_SLEEP_S set (CPU servers we start)
    vllm_vl_shim.install()  # Qwen3.5 model code without torchvision (vllm_vl_shim)

    if "gloo" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            "gloo", "grpo_agent.weight_sync.inside_vllm.gloo_engine", "GlooWeightTransferEngine"
        )
