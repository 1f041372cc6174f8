"""What `WeightPusher.push` hands its transport: LoRA merged into the base weights under the
base model's names (and unmerged again after), and the version the caller announces, whether
the push overlaps the next step (a snapshot) or runs inside it."""
from types import SimpleNamespace

import pytest
import torch
from grpo_agent import AsyncGRPOConfig
from grpo_agent.testing import build_tiny_model
from grpo_agent.weight_sync.full import WeightPusher
from grpo_agent.weight_sync.transports.control import SyncTimings
from transformers import AutoModelForCausalLM

TIMINGS = SyncTimings(pause_s=0.0, transfer_s=0.01, total_s=0.01, num_bytes=4)


class RecordingSync:
    """A transport that copies what it is given, as it is given (a merged weight is only merged
    while the push holds it), and records which call got which version."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []  # ("prepare" or "push", version)
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}

    def prepare(self, weights, version):
        self.calls.append(("prepare", version))
        return SimpleNamespace(version=version, tensors={n: t.clone() for n, t in weights})

    def send(self, packed):
        self.tensors[packed.version] = packed.tensors
        return TIMINGS

    def push(self, weights, version):
        self.calls.append(("push", version))
        self.tensors[version] = {n: t.clone() for n, t in weights}
        return TIMINGS

    def reopen(self): ...

    def close(self): ...


@pytest.fixture
def make_pusher(tmp_path, monkeypatch):
    sync = RecordingSync()
    monkeypatch.setattr("grpo_agent.weight_sync.full.build_weight_sync", lambda *a, **k: sync)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    made = []

    def make(background):
        pusher = WeightPusher(args, backend="gloo", background=background)
        made.append(pusher)
        return pusher, sync

    yield make
    for pusher in made:
        pusher.close()


@pytest.fixture(scope="module")
def tiny_path():
    return build_tiny_model()


def _lora_model(tiny_path):
    """The tiny Qwen3 under a LoRA adapter whose B is non-zero (so merging changes weights);
    returns it, the base model's parameter names and, per adapted weight, (base, merged)."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    names = set(dict(base.named_parameters()))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    expected = {}
    for name, module in model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            before = module.base_layer.weight.detach().clone()
            delta = (module.lora_B["default"].weight @ module.lora_A["default"].weight
                     * module.scaling["default"])
            expected[f"{name}.weight"] = (before, before + delta.detach())
    assert expected and all(not torch.equal(b, m) for b, m in expected.values())
    return model, names, expected


def _assert_unmerged(model, expected):
    layers = dict(model.base_model.model.named_modules())
    for name, (before, _) in expected.items():
        module = layers[name.removesuffix(".weight")]
        assert not module.merged, name
        torch.testing.assert_close(module.base_layer.weight, before, msg=name)


@pytest.mark.parametrize("background", [True, False], ids=["overlapping", "in_step"])
def test_a_push_sends_the_lora_merged_weights_under_base_names_then_unmerges(
        make_pusher, tiny_path, background):
    """The server serves merged weights: the push must merge the adapters in while the transport
    reads them (base + scale * B @ A under the base model's names, no lora_ tensor sent) and
    leave the model unmerged for the next step, with or without a background snapshot."""
    pusher, sync = make_pusher(background)
    assert pusher.background is background
    model, names, expected = _lora_model(tiny_path)
    pusher.push(model, 3)
    pusher.wait()
    sent = sync.tensors[3]
    assert set(sent) == names
    assert not any("lora_" in name for name in sent)
    for name, (_, merged) in expected.items():
        torch.testing.assert_close(sent[name], merged, msg=name)
    _assert_unmerged(model, expected)


def test_a_push_without_merging_sends_the_base_weights(make_pusher, tiny_path):
    """`merge_adapters=False` (restoring the served base model before LoRA serving) sends the
    base weights as they are, adapters left out."""
    pusher, sync = make_pusher(False)
    model, names, expected = _lora_model(tiny_path)
    pusher.push(model, 0, merge_adapters=False)
    assert set(sync.tensors[0]) == names
    for name, (before, _) in expected.items():
        torch.testing.assert_close(sync.tensors[0][name], before, msg=name)
    _assert_unmerged(model, expected)


def test_the_transport_gets_the_version_the_push_announces(make_pusher, monkeypatch):
    """Inside the step and overlapping it, the transport labels the weights with the version
    the caller pushes (the one `on_served` then announces), not a neighbouring one: the rollout
    worker tags its groups with it, so the staleness accounting rests on it."""
    overlapping, sync = make_pusher(True)
    served = []
    overlapping.on_served = served.append
    model = torch.nn.Linear(2, 2)
    overlapping.push(model, 5)
    overlapping.wait()
    monkeypatch.setattr("grpo_agent.weight_sync.full.BACKGROUND_MAX_BYTES", 8)
    overlapping.push(model, 6)  # 24 bytes of weights: pushed inside the step
    in_step, _ = make_pusher(False)
    in_step.on_served = served.append
    in_step.push(model, 7)
    assert sync.calls == [("prepare", 5), ("push", 6), ("push", 7)]
    assert sorted(sync.tensors) == [5, 6, 7] and served == [5, 6, 7]
