"""`torch_compile=True`: compile each decoder layer of the model, not the model as a whole.

Design decision: the trainer never calls the model's `forward` (it runs the decoder and reads
log-probs through the tiled LM head, `forward.py`), so wrapping the whole model, as
`transformers.Trainer` does, would compile nothing we run. Compiling the repeated decoder
layer instead ("regional compilation") fuses its element-wise work (RMSNorm, rotary, SiLU,
residual adds, casts) into a few kernels, and all layers share one compiled graph, so it
compiles once however deep the model is. `dynamic=True` because packed rows change length
every step; the varlen and FlexAttention tree paths are traced inside the layer graph.
With inductor, linears that read the same input (q/k/v, gate/up) run as one matmul in the
compiled graph (`fused_projections`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from grpo_agent.train import fused_projections


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: the `layers` list of the model's decoder."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"torch_compile=True compiles the decoder layers, but {type(model).__name__} has no "
            "`get_decoder().layers` list. Set torch_compile=False for this model."
        )
    return list(layers)


def compile_decoder_layers(
    model: nn.Module, *, backend: str | Callable | None = None, mode: str | None = None
) -> int:
    """Compile every decoder layer in place (idempotent); returns how many layers there are.

    `backend` and `mode` are `torch.compile`'s (the config's `torch_compile_backend` and
    `torch_compile_mode`); inductor by default."""
    layers = decoder_layers(model)
    if backend in (None, "inductor"):
        fused_projections.install()
    for layer in layers:
        if getattr(layer, "_compiled_call_impl", None) is None:
            layer.compile(backend=backend or "inductor", mode=mode, dynamic=True)
    return len(layers)
