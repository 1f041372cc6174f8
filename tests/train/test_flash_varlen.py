"""The optional flash-attn varlen path: which kernel is chosen, how loading fails over to the
tree path, and that rows sharing nothing reach the kernel with the right segment bounds.

The kernel itself is a seam here (CPU CI has none): `_reference_varlen` follows
`flash_attn_varlen_func`'s documented contract with SDPA, one sequence at a time."""

from __future__ import annotations

import copy
import random
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from grpo_agent.train import flash_varlen
from grpo_agent.train.forward import forward_row
from grpo_agent.train.packing import pack_row
from grpo_agent.train.tree_attention import TreeMask, choose_backend, enable_tree_attention

from .conftest import VOCAB, make_sample


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    """[total, heads, dim] causal attention within each cu_seqlens slice (GQA by repetition)."""
    assert q.dtype == k.dtype and cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
    assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max()) and causal
    outs = []
    for start, stop in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qs, ks, vs = (t[start:stop].transpose(0, 1) for t in (q, k, v))
        outs.append(
            F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=softmax_scale, enable_gqa=True
            ).transpose(0, 1)
        )
    return torch.cat(outs)


CACHED_KERNEL = flash_varlen.varlen_kernel  # tests replace the module attribute


@pytest.fixture
def no_kernel_cache():
    CACHED_KERNEL.cache_clear()
    yield
    CACHED_KERNEL.cache_clear()


@pytest.fixture
def fake_kernel(monkeypatch, no_kernel_cache):
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return _reference_varlen(*args, **kwargs)

    monkeypatch.setattr(flash_varlen, "varlen_kernel", lambda: counted)
    return calls


@pytest.fixture
def fake_kernels_library(monkeypatch):
    calls = []
    module = types.SimpleNamespace(flash_attn_varlen_func=_reference_varlen)

    def get_local_kernel(path):
        calls.append(("local", str(path)))
        return module

    def get_kernel(repo_id, **kwargs):
        calls.append(("hub", repo_id, kwargs))
        return module

    lib = types.SimpleNamespace(get_local_kernel=get_local_kernel, get_kernel=get_kernel)
    monkeypatch.setitem(sys.modules, "kernels", lib)
    return calls


def _unshared_samples():
    gen = random.Random(3)
    samples = []
    for i, (prompt_len, comp_len) in enumerate([(7, 5), (4, 9), (11, 3)]):
        tokens = [gen.randrange(1, VOCAB) for _ in range(prompt_len + comp_len)]
        tokens[0] = i + 1  # distinct first tokens: nothing is shared
        samples.append(make_sample(tokens, [0] * prompt_len + [1] * comp_len, group_id=i, seed=i))
    return samples


def test_no_kernel_without_flash_attn_or_setting(monkeypatch, fake_kernels_library):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    assert flash_varlen.load_varlen_kernel("") is None
    assert fake_kernels_library == []  # nothing asked of the kernel hub


def test_setting_loads_a_local_directory_or_a_pinned_hub_repo(tmp_path, fake_kernels_library):
    assert flash_varlen.load_varlen_kernel(str(tmp_path)) is _reference_varlen
    assert flash_varlen.load_varlen_kernel("org/flash-attn@v0.3") is _reference_varlen
    assert flash_varlen.load_varlen_kernel("org/flash-attn@2") is _reference_varlen
    assert fake_kernels_library == [
        ("local", str(tmp_path)),
        ("hub", "org/flash-attn", {"revision": "v0.3"}),
        ("hub", "org/flash-attn", {"version": 2}),
    ]


def test_unpinned_or_failing_kernel_falls_back_with_a_warning(
    monkeypatch, fake_kernels_library, caplog
):
    assert flash_varlen.load_varlen_kernel("org/flash-attn") is None
    assert "@REVISION" in caplog.text and fake_kernels_library == []

    def broken(path):
        raise OSError("no build for this torch")

    monkeypatch.setattr(sys.modules["kernels"], "get_local_kernel", broken)
    assert flash_varlen.load_varlen_kernel(".") is None
    assert "no build for this torch" in caplog.text and flash_varlen.KERNEL_ENV in caplog.text


def test_environment_setting_is_read(monkeypatch, tmp_path, fake_kernels_library, no_kernel_cache):
    monkeypatch.setenv(flash_varlen.KERNEL_ENV, str(tmp_path))
    assert flash_varlen.varlen_kernel() is _reference_varlen


def test_backend_choice(monkeypatch, shared_samples, no_kernel_cache):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    unshared, shared = pack_row(_unshared_samples()), pack_row(shared_samples)
    monkeypatch.setattr(flash_varlen, "varlen_kernel", lambda: _reference_varlen)
    assert choose_backend(unshared, cuda, torch.bfloat16) == "varlen"
    assert choose_backend(shared, cuda, torch.bfloat16) == "flex"
    assert choose_backend(unshared, cuda, torch.float32) == "flex"  # flash is half precision
    assert choose_backend(unshared, cpu, torch.bfloat16) == "gather"
    monkeypatch.setattr(flash_varlen, "varlen_kernel", lambda: None)
    assert choose_backend(unshared, cuda, torch.bfloat16) == "flex"
    with pytest.raises(ValueError, match="install flash-attn"):
        TreeMask.build(unshared, cpu, "varlen")


def test_varlen_backend_rejects_shared_rows(fake_kernel, shared_samples):
    with pytest.raises(ValueError, match="shares no tokens"):
        TreeMask.build(pack_row(shared_samples), "cpu", "varlen")


def test_cu_seqlens_are_segment_bounds():
    row = pack_row(_unshared_samples())
    bounds, longest = flash_varlen.cu_seqlens(row.segment_ids)
    assert bounds.tolist() == [0, 12, 25, 39] and longest == 14


def test_varlen_path_matches_the_tree_path(fake_kernel, tiny_qwen3):
    enable_tree_attention(tiny_qwen3)
    other = copy.deepcopy(tiny_qwen3)
    row = pack_row(_unshared_samples())
    got = forward_row(tiny_qwen3, row, temperature=1.0, backend="varlen").token.logprobs
    ref = forward_row(other, row, temperature=1.0, backend="gather").token.logprobs
    assert len(fake_kernel) == tiny_qwen3.config.num_hidden_layers
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    got.sum().backward(), ref.sum().backward()
    for (name, a), (_, b) in zip(tiny_qwen3.named_parameters(), other.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)
