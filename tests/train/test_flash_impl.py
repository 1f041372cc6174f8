"""Which kernels torch's flash ops run (`flash_impl`): the choice, its errors, and the fallback
when FlashAttention 4 is missing or fails its probe. The real kernels are tested on a GPU
(`test_gpu.py::test_flashattention_4_behind_torch_flash_ops_matches_the_reference`)."""

from __future__ import annotations

import logging

import pytest
import torch
from grpo_agent.train import flash_impl


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    """No choice made yet and no row length expected (a trainer run earlier in this process
    sets one)."""
    monkeypatch.setattr(flash_impl, "_expected_row_tokens", None)
    monkeypatch.setattr(flash_impl, "_chosen", None)


def test_the_setting_is_read_case_insensitively_and_a_bad_one_names_the_choices():
    assert flash_impl.wanted({}) == "auto"
    assert flash_impl.wanted({flash_impl.IMPL_ENV: "fa4"}) == "FA4"
    assert flash_impl.wanted({flash_impl.IMPL_ENV: " Default "}) == "default"
    with pytest.raises(ValueError, match="GRPO_AGENT_FLASH_IMPL='fa3'.*auto, FA4, default"):
        flash_impl.wanted({flash_impl.IMPL_ENV: "fa3"})


def test_fa4_is_never_tried_off_cuda():
    assert flash_impl.fa4_missing(torch.device("cpu")) == "not a CUDA device"


def test_default_never_touches_the_dispatcher(monkeypatch):
    monkeypatch.setenv(flash_impl.IMPL_ENV, "default")
    monkeypatch.setattr(flash_impl, "use", lambda *a, **k: pytest.fail("use() called"))
    assert flash_impl.torch_flash_impl() == "default"


def test_auto_falls_back_to_torch_kernels_when_fa4_is_missing(monkeypatch, caplog):
    monkeypatch.delenv(flash_impl.IMPL_ENV, raising=False)
    monkeypatch.setattr(flash_impl, "fa4_missing", lambda device: "flash-attn-4 is not installed")
    monkeypatch.setattr(flash_impl, "use", lambda *a, **k: pytest.fail("use() called"))
    with caplog.at_level(logging.WARNING, logger=flash_impl.__name__):
        assert flash_impl.torch_flash_impl() == "default"
    assert caplog.text == ""  # nothing installed: nothing to warn about


def test_auto_warns_when_an_installed_fa4_fails_its_probe(monkeypatch, caplog):
    monkeypatch.delenv(flash_impl.IMPL_ENV, raising=False)
    monkeypatch.setattr(flash_impl, "fa4_missing", lambda device: None)

    def broken(name, device=None):
        raise RuntimeError("its probe failed (ValueError: too many values to unpack)")

    monkeypatch.setattr(flash_impl, "use", broken)
    with caplog.at_level(logging.WARNING, logger=flash_impl.__name__):
        assert flash_impl.torch_flash_impl() == "default"
    assert "probe failed" in caplog.text


def test_asking_for_fa4_where_it_cannot_run_is_an_error_naming_the_fix(monkeypatch):
    monkeypatch.setenv(flash_impl.IMPL_ENV, "FA4")
    monkeypatch.setattr(flash_impl, "fa4_missing", lambda device: (
        "compute capability 8.0 (FlashAttention 4 needs 9.x or 10.x)"))
    with pytest.raises(RuntimeError, match="compute capability 8.0.*Install flash-attn-4.*=auto"):
        flash_impl.torch_flash_impl()


def test_auto_activates_fa4_once_and_says_so(monkeypatch, caplog):
    monkeypatch.delenv(flash_impl.IMPL_ENV, raising=False)
    monkeypatch.setattr(flash_impl, "fa4_missing", lambda device: None)
    calls = []
    monkeypatch.setattr(flash_impl, "use", lambda name, device=None: calls.append(name))
    with caplog.at_level(logging.INFO, logger=flash_impl.__name__):
        assert flash_impl.torch_flash_impl() == "FA4"
        assert flash_impl.torch_flash_impl() == "FA4"
    assert calls == ["FA4"]  # resolved once per process
    assert "FlashAttention 4" in caplog.text and "GRPO_AGENT_FLASH_IMPL=default" in caplog.text


class _Dispatcher:
    """torch.nn.attention's registry functions, recorded."""

    def __init__(self):
        self.calls = []

    def activate_flash_attention_impl(self, name):
        self.calls.append(("activate", name))

    def restore_flash_attention_impl(self, _raise_warn=True):
        self.calls.append(("restore",))


def test_a_failed_probe_restores_torch_kernels(monkeypatch):
    from torch.nn import attention

    dispatcher = _Dispatcher()
    monkeypatch.setattr(attention, "activate_flash_attention_impl",
                        dispatcher.activate_flash_attention_impl)
    monkeypatch.setattr(attention, "restore_flash_attention_impl",
                        dispatcher.restore_flash_attention_impl)
    monkeypatch.setattr(flash_impl, "fa4_missing", lambda device: None)

    def wrong(device):
        raise RuntimeError("its output differs from SDPA's on a probe (head dim 128)")

    monkeypatch.setattr(flash_impl, "probe", wrong)
    with pytest.raises(RuntimeError, match="probe failed.*head dim 128"):
        flash_impl.use("FA4", torch.device("cpu"))
    assert dispatcher.calls == [("activate", "FA4"), ("restore",)]


def test_a_missing_fa4_is_reported_before_the_dispatcher_changes(monkeypatch):
    from torch.nn import attention

    dispatcher = _Dispatcher()
    monkeypatch.setattr(attention, "activate_flash_attention_impl",
                        dispatcher.activate_flash_attention_impl)
    with pytest.raises(RuntimeError, match="not a CUDA device"):
        flash_impl.use("FA4", torch.device("cpu"))
    assert dispatcher.calls == []


def test_nothing_is_active_unless_asked():
    assert flash_impl.active() == "default"


def test_auto_keeps_torch_kernels_for_host_bound_rows(monkeypatch):
    """A trainer whose rows stay under FA4_MIN_TOKENS (8k rows ran 13% slower on FA4 without
    CUDA graphs) never switches unless its rows replay graphs; FA4 asked for explicitly still
    is."""
    monkeypatch.delenv(flash_impl.IMPL_ENV, raising=False)
    calls = []
    monkeypatch.setattr(flash_impl, "fa4_missing", lambda device: None)
    monkeypatch.setattr(flash_impl, "use", lambda name, device=None: calls.append(name))
    flash_impl.expect_rows(flash_impl.FA4_MIN_TOKENS - 1)
    assert flash_impl.torch_flash_impl() == "default" and calls == []
    monkeypatch.setattr(flash_impl, "_chosen", None)
    monkeypatch.setenv(flash_impl.IMPL_ENV, "FA4")
    assert flash_impl.torch_flash_impl() == "FA4" and calls == ["FA4"]
    monkeypatch.setattr(flash_impl, "_chosen", None)
    monkeypatch.delenv(flash_impl.IMPL_ENV)
    flash_impl.expect_rows(flash_impl.FA4_MIN_TOKENS)
    assert flash_impl.torch_flash_impl() == "FA4" and calls == ["FA4", "FA4"]
    monkeypatch.setattr(flash_impl, "_chosen", None)
    flash_impl.expect_rows(8192, replayed=True)  # cuda_graphs: no host cost per call
    assert flash_impl.torch_flash_impl() == "FA4" and calls == ["FA4", "FA4", "FA4"]


def test_level_parts_leave_cudnn_to_fa4(monkeypatch):
    """`DENSE="auto"` pads depth parts onto cuDNN only while torch's own flash kernels run:
    behind FA4 every part stays on flash (0.460 -> 0.477 MFU on an H100)."""
    from grpo_agent.train import cudnn_attention, level_attention

    monkeypatch.setattr(cudnn_attention, "usable", lambda device, dtype: True)
    cuda = torch.device("cuda")
    monkeypatch.setattr(flash_impl, "active", lambda: "default")
    assert level_attention._dense_kernel("flash", cuda, "auto") == "cudnn"
    monkeypatch.setattr(flash_impl, "active", lambda: "FA4")
    assert level_attention._dense_kernel("flash", cuda, "auto") is None
    assert level_attention._dense_kernel("flash", cuda, "cudnn-depth") == "cudnn"  # as asked


def test_an_explicit_choice_is_not_overridden_by_the_first_row(monkeypatch):
    """A bench that pins torch's kernels before its first row keeps them: `auto` must not
    switch to FA4 behind it (bench/mfu.py's first variant did, before this)."""
    from torch.nn import attention

    monkeypatch.delenv(flash_impl.IMPL_ENV, raising=False)
    monkeypatch.setattr(attention, "restore_flash_attention_impl", lambda _raise_warn=True: None)
    monkeypatch.setattr(flash_impl, "fa4_missing", lambda device: None)
    flash_impl.use("default")
    calls = []
    monkeypatch.setattr(flash_impl, "use", lambda name, device=None: calls.append(name))
    assert flash_impl.torch_flash_impl() == "default" and calls == []
