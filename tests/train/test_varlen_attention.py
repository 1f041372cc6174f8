"""Varlen tree attention: the plan (segment bounds, gathered paths) reproduces the tree rule,
the per-segment SDPA kernel is right, which kernel is chosen and how loading fails over.

Flash kernels are a seam here (CPU CI has none): `sdpa_varlen` follows
`flash_attn_varlen_func`'s contract; `tests/train/test_gpu.py` holds PyTorch's flash build to
it on CUDA."""

from __future__ import annotations

import math
import random
import sys
import types

import pytest
import torch
import transformers.integrations.hub_kernels  # noqa: F401 -- looks for `kernels` before stubs do
from grpo_agent.train import tree_attention, varlen_attention
from grpo_agent.train.packing import pack_row
from grpo_agent.train.tree_attention import (
    TreeMask,
    choose_backend,
    dense_tree_mask,
    enable_tree_attention,
)
from grpo_agent.train.varlen_attention import VarlenPlan, sdpa_varlen

from .conftest import VOCAB, assert_tree_path_matches_sdpa, make_sample

CACHED_KERNEL = varlen_attention.varlen_kernel  # tests replace the module attribute


@pytest.fixture
def no_kernel_cache():
    CACHED_KERNEL.cache_clear()
    yield
    CACHED_KERNEL.cache_clear()


@pytest.fixture
def counted_kernel(monkeypatch, no_kernel_cache):
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return sdpa_varlen(*args, **kwargs)

    monkeypatch.setattr(varlen_attention, "varlen_kernel", lambda: counted)
    return calls


@pytest.fixture
def fake_kernels_library(monkeypatch):
    calls = []
    module = types.SimpleNamespace(flash_attn_varlen_func=sdpa_varlen)

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


def _plan_visibility(plan: VarlenPlan, n: int) -> torch.Tensor:
    """[N, N] bool that the plan asks a bottom-right causal varlen kernel to compute."""
    seen = torch.zeros(n, n, dtype=torch.bool)
    index = plan.kv_index if plan.kv_index is not None else torch.arange(n)
    bounds = zip(plan.cu_q[:-1].tolist(), plan.cu_q[1:].tolist(),
                 plan.cu_k[:-1].tolist(), plan.cu_k[1:].tolist())
    for q0, q1, k0, k1 in bounds:
        for r, query in enumerate(range(q0, q1)):
            visible = (k1 - k0) - (q1 - q0) + r + 1  # bottom-right aligned causal
            seen[query, index[k0 : k0 + visible]] = True
    return seen


def test_plan_reproduces_the_tree_rule_on_shared_rows(shared_samples):
    row = pack_row(shared_samples)
    plan = VarlenPlan.build(row, "cpu", sdpa_varlen)
    assert plan.kv_index is not None and plan.cu_q[-1] == row.num_tokens
    assert plan.cu_k[-1] == sum(len(p) for p in row.segment_paths)
    assert plan.max_k == max(len(p) for p in row.segment_paths)
    expected = dense_tree_mask(row.segment_ids, row.segment_ancestors)
    assert torch.equal(_plan_visibility(plan, row.num_tokens), expected)


def test_unshared_rows_need_no_gather():
    row = pack_row(_unshared_samples())
    plan = VarlenPlan.build(row, "cpu", sdpa_varlen)
    assert plan.kv_index is None and plan.max_q == plan.max_k == 14
    assert plan.cu_q.tolist() == plan.cu_k.tolist() == [0, 12, 25, 39]
    assert plan.cu_q.dtype == torch.int32


def test_sdpa_varlen_is_bottom_right_causal_attention_with_gqa():
    torch.manual_seed(0)
    lens = [(3, 7), (5, 5), (1, 4)]  # (queries, keys) per sequence
    q = torch.randn(sum(a for a, _ in lens), 4, 8, dtype=torch.float64)
    k = torch.randn(sum(b for _, b in lens), 2, 8, dtype=torch.float64)
    v = torch.randn_like(k)
    cu_q = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 12, 16], dtype=torch.int32)
    got = sdpa_varlen(q, k, v, cu_q, cu_k, 5, 7, softmax_scale=0.3, causal=True)
    rows = []
    for (nq, nk), q0, k0 in zip(lens, cu_q.tolist(), cu_k.tolist()):
        for r in range(nq):
            for h in range(4):
                keys = k[k0 : k0 + nk - nq + r + 1, h // 2]
                weights = torch.softmax(keys @ q[q0 + r, h] * 0.3, dim=0)
                rows.append(weights @ v[k0 : k0 + nk - nq + r + 1, h // 2])
    torch.testing.assert_close(got, torch.stack(rows).view_as(got))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gather_backward_sums_shared_rows_in_float32(device, monkeypatch):
    """A row shared by 300 paths gets 300 gradients. CUDA's bf16 index_add rounds after every
    add (300 x 1.0 stops at 256); CPU's sums exactly in either dtype, so there the rule is
    checked where it is made: the sum's buffer is float32, the gradient comes back bf16."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    buffers = []
    index_add = torch.Tensor.index_add_

    def recording(self, *args, **kwargs):
        buffers.append(self.dtype)
        return index_add(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "index_add_", recording)
    x = torch.randn(3, 2, dtype=torch.bfloat16, device=device, requires_grad=True)
    index = torch.tensor([0] * 300 + [2], device=device)
    grad = torch.full((301, 2), 1.001, dtype=torch.bfloat16, device=device)
    varlen_attention._GatherRows.apply(x, index).backward(grad)
    exact = 300 * float(torch.tensor(1.001, dtype=torch.bfloat16))
    assert buffers == [torch.float32]
    assert math.isclose(float(x.grad[0, 0]), exact, rel_tol=2**-8)
    assert x.grad[1].abs().sum() == 0 and x.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("shared", [True, False])
def test_varlen_path_matches_the_dense_tree_mask(counted_kernel, tiny_qwen3, shared_samples,
                                                  shared):
    enable_tree_attention(tiny_qwen3)
    row = pack_row(shared_samples if shared else _unshared_samples())
    assert_tree_path_matches_sdpa(tiny_qwen3, row, "varlen")
    assert len(counted_kernel) == tiny_qwen3.config.num_hidden_layers


def test_no_kernel_without_flash_attn_or_setting(monkeypatch, fake_kernels_library):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    assert varlen_attention.load_varlen_kernel("") is None
    assert fake_kernels_library == []  # nothing asked of the kernel hub


def test_setting_loads_a_local_directory_or_a_pinned_hub_repo(tmp_path, fake_kernels_library):
    assert varlen_attention.load_varlen_kernel(str(tmp_path)) is sdpa_varlen
    assert varlen_attention.load_varlen_kernel("org/flash-attn@v0.3") is sdpa_varlen
    assert varlen_attention.load_varlen_kernel("org/flash-attn@2") is sdpa_varlen
    assert fake_kernels_library == [
        ("local", str(tmp_path)),
        ("hub", "org/flash-attn", {"revision": "v0.3"}),
        ("hub", "org/flash-attn", {"version": 2}),
    ]


def test_unpinned_or_failing_kernel_falls_back_with_a_warning(
    monkeypatch, fake_kernels_library, caplog
):
    assert varlen_attention.load_varlen_kernel("org/flash-attn") is None
    assert "@REVISION" in caplog.text and fake_kernels_library == []

    def broken(path):
        raise OSError("no build for this torch")

    monkeypatch.setattr(sys.modules["kernels"], "get_local_kernel", broken)
    assert varlen_attention.load_varlen_kernel(".") is None
    assert "no build for this torch" in caplog.text and varlen_attention.KERNEL_ENV in caplog.text


def test_kernel_order_setting_then_flash_attn_then_torch(
    monkeypatch, tmp_path, fake_kernels_library, no_kernel_cache
):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setenv(varlen_attention.KERNEL_ENV, str(tmp_path))
    assert varlen_attention.varlen_kernel() is sdpa_varlen  # the configured one
    CACHED_KERNEL.cache_clear()
    monkeypatch.setenv(varlen_attention.KERNEL_ENV, "org/unpinned")  # fails: next in line
    installed = types.SimpleNamespace(flash_attn_varlen_func=lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "flash_attn", installed)
    assert varlen_attention.varlen_kernel() is installed.flash_attn_varlen_func
    CACHED_KERNEL.cache_clear()
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    assert varlen_attention.varlen_kernel() is varlen_attention.torch_flash_varlen
    CACHED_KERNEL.cache_clear()
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    assert varlen_attention.varlen_kernel() is None


def _gpu(monkeypatch, *, capability=(9, 0), hip=None):
    """A pretend GPU; the load-time probe of a Hub kernel runs on the CPU."""
    monkeypatch.setattr(varlen_attention, "probe_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.version, "hip", hip)


@pytest.mark.parametrize(("capability", "hip", "repo", "version"), [
    ((9, 0), None, "kernels-community/flash-attn3", 1),  # Hopper (H100, H200)
    ((8, 0), None, "kernels-community/flash-attn3", 1),  # Ampere: another NVIDIA GPU
    ((10, 0), None, "kernels-community/flash-attn4", 0),  # Blackwell (B200)
    ((12, 0), None, "kernels-community/flash-attn4", 0),  # Blackwell (RTX PRO 6000)
    ((9, 4), "6.4", "kernels-community/aiter-flash-attn", 2),  # AMD MI300 under ROCm
])
def test_the_specs_hub_kernel_is_chosen_by_gpu_type(
    monkeypatch, fake_kernels_library, no_kernel_cache, capability, hip, repo, version
):
    _gpu(monkeypatch, capability=capability, hip=hip)
    monkeypatch.delenv(varlen_attention.KERNEL_ENV, raising=False)
    assert varlen_attention.varlen_kernel() is sdpa_varlen  # the stand-in Hub module's function
    assert fake_kernels_library == [("hub", repo, {"version": version})]


def test_no_hub_kernel_is_tried_without_a_gpu(monkeypatch, fake_kernels_library, no_kernel_cache):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.delenv(varlen_attention.KERNEL_ENV, raising=False)
    assert varlen_attention.hub_kernel_repo() is None
    varlen_attention.varlen_kernel()
    assert fake_kernels_library == []


def test_an_unavailable_hub_kernel_falls_back_to_torch_with_one_log_line(
    monkeypatch, fake_kernels_library, no_kernel_cache, caplog
):
    _gpu(monkeypatch)
    monkeypatch.delenv(varlen_attention.KERNEL_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)

    def offline(repo_id, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' (HF_HUB_OFFLINE=1)")

    monkeypatch.setattr(sys.modules["kernels"], "get_kernel", offline)
    assert varlen_attention.varlen_kernel() is varlen_attention.torch_flash_varlen
    varlen_attention.varlen_kernel()  # cached: asked once, logged once
    lines = [r.getMessage() for r in caplog.records if "flash-attn3" in r.getMessage()]
    assert len(lines) == 1 and "HF_HUB_OFFLINE" in lines[0] and "torch" in lines[0]
    # the record holds the error's text, not the exception (whose traceback's frames would
    # keep the first forward's activations and autograd graph alive while the record lives)
    assert not [a for r in caplog.records for a in r.args if isinstance(a, BaseException)]
    CACHED_KERNEL.cache_clear()
    caplog.clear()
    monkeypatch.setitem(sys.modules, "kernels", None)  # the library is not installed
    assert varlen_attention.varlen_kernel() is varlen_attention.torch_flash_varlen
    assert "ModuleNotFoundError" in caplog.text or "ImportError" in caplog.text


@pytest.mark.parametrize("broken", ["raises", "wrong"])
def test_a_hub_kernel_that_loads_but_cannot_run_is_probed_out(
    monkeypatch, fake_kernels_library, no_kernel_cache, caplog, broken
):
    """E.g. a build whose backward does not support this GPU: caught at load, not in a step."""
    _gpu(monkeypatch)
    monkeypatch.delenv(varlen_attention.KERNEL_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)

    def bad_kernel(q, k, v, **kwargs):
        if broken == "raises":
            raise RuntimeError("FlashAttention backward only supports sm90")
        return sdpa_varlen(q, k, v, **kwargs) * 2

    module = types.SimpleNamespace(flash_attn_varlen_func=bad_kernel)
    monkeypatch.setattr(sys.modules["kernels"], "get_kernel", lambda repo_id, **kw: module)
    assert varlen_attention.varlen_kernel() is varlen_attention.torch_flash_varlen
    expected = "sm90" if broken == "raises" else "differs from the reference"
    assert expected in caplog.text and "flash-attn3" in caplog.text


def test_kernels_are_called_by_flash_attn_keyword_names(shared_samples):
    """FA4 and aiter order their positional parameters differently from FA2/FA3."""
    seen = {}

    def keyword_only(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, seqused_q=None):
        seen.update(max_seqlen_q=max_seqlen_q, causal=causal)
        return sdpa_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=softmax_scale, causal=causal)

    row = pack_row(shared_samples)
    plan = VarlenPlan.build(row, "cpu", keyword_only)
    q, k, v = (torch.randn(1, 4, row.num_tokens, 8) for _ in range(3))
    out = varlen_attention.tree_varlen_attention(q, k, v, plan, 0.35)
    assert out.shape == (1, row.num_tokens, 4, 8)
    assert seen == {"max_seqlen_q": plan.max_q, "causal": True}


def test_backend_choice(monkeypatch, shared_samples, no_kernel_cache):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(varlen_attention, "varlen_kernel", lambda: sdpa_varlen)
    monkeypatch.setattr(varlen_attention, "flash_capable", lambda device: True)
    assert choose_backend(cuda, torch.bfloat16) == "varlen"
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    long_row = tree_attention.LEVELS_MIN_TOKENS
    assert choose_backend(cuda, torch.bfloat16, long_row - 1) == "varlen"
    assert choose_backend(cuda, torch.bfloat16, long_row) == "levels"  # GPU-bound rows
    assert choose_backend(cuda, torch.float32, long_row) == "flex"
    assert choose_backend(cpu, torch.bfloat16, long_row) == "gather"
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    assert choose_backend(cuda, torch.bfloat16, long_row) == "varlen"  # an external kernel
    assert choose_backend(cuda, torch.float32) == "flex"  # flash is half precision
    assert choose_backend(cpu, torch.bfloat16) == "gather"
    monkeypatch.setattr(varlen_attention, "flash_capable", lambda device: False)  # pre-Ampere
    assert choose_backend(cuda, torch.bfloat16) == "flex"
    monkeypatch.setattr(varlen_attention, "flash_capable", lambda device: True)
    monkeypatch.setattr(varlen_attention, "varlen_kernel", lambda: None)
    assert choose_backend(cuda, torch.bfloat16) == "flex"
    with pytest.raises(ValueError, match="install flash-attn"):
        TreeMask.build(pack_row(shared_samples), cpu, "varlen")


def test_rows_take_the_masked_path_where_fa4_runs_and_the_heads_fit(monkeypatch, no_kernel_cache):
    from grpo_agent.train import flash_impl

    cuda = torch.device("cuda")
    monkeypatch.setattr(varlen_attention, "flash_capable", lambda device: True)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    long_row = tree_attention.LEVELS_MIN_TOKENS
    monkeypatch.setattr(varlen_attention, "varlen_kernel", lambda: sdpa_varlen)
    monkeypatch.setattr(flash_impl, "torch_flash_impl", lambda: "FA4")
    row = tree_attention.MASKED_MIN_TOKENS
    assert choose_backend(cuda, torch.bfloat16, row, head_dim=128) == "masked"
    assert choose_backend(cuda, torch.bfloat16, long_row, head_dim=128) == "masked"
    assert choose_backend(cuda, torch.bfloat16, row - 1, head_dim=128) == "varlen"  # unmeasured
    assert choose_backend(cuda, torch.bfloat16, long_row, head_dim=256) == "masked"  # Qwen3.5
    assert choose_backend(cuda, torch.bfloat16, long_row - 1, head_dim=256) == "varlen"
    assert choose_backend(cuda, torch.bfloat16, long_row, head_dim=192) == "levels"  # FA4: no
    assert choose_backend(cuda, torch.bfloat16, long_row) == "levels"  # head width unknown
    monkeypatch.setattr(flash_impl, "torch_flash_impl", lambda: "default")
    assert choose_backend(cuda, torch.bfloat16, long_row, head_dim=128) == "levels"
    assert choose_backend(cuda, torch.bfloat16, long_row, head_dim=256) == "levels"
    assert choose_backend(cuda, torch.bfloat16, row, head_dim=128) == "varlen"
