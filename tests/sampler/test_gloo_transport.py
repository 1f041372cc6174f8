"""The gloo wire format: both ends must cut the same chunks and recover the same tensors."""
import torch
from grpo_agent.sampler.server_facts import detect_backend
from grpo_agent.weight_sync.wire import pack, plan_chunks, spec_of, unpack


def _tensors():
    generator = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=generator),  # 4096 B
        "model.norm.weight": torch.randn(16, generator=generator).to(torch.bfloat16),  # 32 B
        "lm_head.weight": torch.randn(16, 64, generator=generator),  # 4096 B
        "counts": torch.arange(10, dtype=torch.int64),  # 80 B
    }


def test_chunks_fill_up_to_the_byte_limit_and_a_big_tensor_goes_alone():
    specs = [spec_of(name, tensor) for name, tensor in _tensors().items()]
    chunks = plan_chunks(specs, chunk_bytes=4200)
    assert [[s.name for s in chunk] for chunk in chunks] == [
        ["model.embed_tokens.weight", "model.norm.weight"], ["lm_head.weight", "counts"]]
    assert [len(chunk) for chunk in plan_chunks(specs, chunk_bytes=1)] == [1, 1, 1, 1]
    # a chunk filled to exactly the limit still takes its last tensor
    assert [len(chunk) for chunk in plan_chunks(specs, chunk_bytes=4096 + 32)] == [2, 1, 1]


def test_pack_then_unpack_returns_identical_tensors_of_every_dtype():
    tensors = _tensors()
    specs = [spec_of(name, tensor) for name, tensor in tensors.items()]
    for chunk in plan_chunks(specs, chunk_bytes=4200):
        buffer = pack(chunk, tensors)
        assert buffer.dtype == torch.uint8 and buffer.numel() == sum(s.num_bytes for s in chunk)
        for name, received in unpack(chunk, buffer):
            assert received.dtype == tensors[name].dtype
            assert torch.equal(received, tensors[name])


def test_backend_comes_from_the_servers_weight_transfer_config():
    assert detect_backend({"vllm_config": {"weight_transfer_config": {"backend": "gloo"}}}) \
        == "gloo"
    assert detect_backend({"vllm_config": {"weight_transfer_config": {"backend": "nccl"}}}) \
        == "nccl"
    assert detect_backend({"vllm_config": {"weight_transfer_config": None}}) == "disk"
    assert detect_backend({}) == "disk"
