"""`run_training`: what `grpo-agent train --env NAME` does after parsing its flags.

Embedded by default: with no server URL it starts a managed vLLM server on this machine for the
run's model (and stops it, by PID, when the run ends), and with no model it trains the built-in
tiny model, so the command works on a laptop with nothing else running. The output directory
receives the resolved config, `run.json` (the env and its options), `metrics.jsonl`,
`prompt_ledger.jsonl`, checkpoints and, at the end, `reward.png`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.sampler.cpu_cores import (
    OMP_BIND_ENV,
    SERVER_NICE,
    CoreSplit,
    split_cores,
    trainer_on,
)
from grpo_agent.train.final_model import INCOMPLETE_FINAL_NAME, save_final_model

logger = logging.getLogger(__name__)
# Below this rate the built-in random tiny model's reward did not move (0.24 for 100 steps at
# 1e-6); `make demo-words` learns at 3e-4.
TINY_MODEL_MIN_LEARNING_RATE = 1e-4



class RunRefused(ValueError):
    """A run refused before its server and trainer start: the CLI prints it as a usage error."""


class AgentEnvError(RunRefused):
    """An env that an agent program cannot run (`agent_task`): a start-up refusal, not a failed run."""


def run_training(
    env: str,
    config: AsyncGRPOConfig,
    model: str | None = None,
    vllm_url: str | None = None,
    resume_from_checkpoint: str | bool | None = None,
    lora: dict[str, Any] | None = None,
    env_args: dict[str, Any] | None = None,
    agent: Any = None,
) -> Path:
    """Train on a registered environment; returns the output directory.

    `lora` holds peft `LoraConfig` fields (r, lora_alpha, target_modules): the run trains an
    adapter, and a managed server is started with LoRA enabled so the adapter is what syncs.
    `env_args` are the env's options (`--env-arg key=value`), checked against its declaration
    and recorded as given in `run.json` (the summary's advice repeats them).
    `agent` (a registered agent name, `pkg.mod:attr` or an `AgentCommand`) replaces the env's
    tool loop: `HarnessAsyncGRPOTrainer` runs it on the env's dataset and rewards."""
    from transformers.trainer_callback import PrinterCallback

    from grpo_agent.train import fsdp
    from grpo_agent.train.checkpoint import CLI_RESUME, resume_advice
    from grpo_agent.train.reporting import (
        METRICS_NAME,
        PLOT_NAME,
        JsonlMetricsCallback,
        ProgressCallback,
        plot_reward_and_length,
        quiet_library_bars_off_terminal,
        write_run_record,
    )
    from grpo_agent.train.step_source import ends_the_run
    from grpo_agent.train.trainer import AsyncGRPOTrainer, interruption, prompt_limit

    fsdp.quiet_other_ranks()  # before check_run: its warnings too
    quiet_library_bars_off_terminal()  # weight loading and save_model: as our progress line
    task, eval_dataset, resume = check_run(env, config, model, resume_from_checkpoint, env_args,
                                           agent_played=agent is not None)
    output_dir = Path(config.output_dir)
    model_path = model or _tiny_model_path()
    output_dir.mkdir(parents=True, exist_ok=True)
    peft_config = _lora_config(lora) if lora else None
    # A resume from the run's last step only saves `final`: no server to start for it
    ended = resume is not None and ends_the_run(resume, config.max_steps,
                                                prompt_limit(config, task["dataset"]))
    interrupt_said = False
    try:
        with _exit_on_sigterm(), _server(model_path, vllm_url, lora, config,
                                          needed=not ended) as base_url:
            config.vllm_server_base_url = base_url
            config.disable_tqdm = True  # the run shows its own progress bar (reward, queue)
            (output_dir / "config.json").write_text(config.to_json_string())
            write_run_record(output_dir, env, env_args or {}, task["declares_eval_split"])
            common = {"model": model_path, "reward_funcs": task["reward_funcs"], "args": config,
                      "train_dataset": task["dataset"], "eval_dataset": eval_dataset,
                      "callbacks": [JsonlMetricsCallback(), ProgressCallback()],
                      "peft_config": peft_config}
            if agent is None:
                trainer = AsyncGRPOTrainer(**common, environment_factory=task["environment_factory"])
            else:
                trainer = _harness_trainer(agent, task, common)
            trainer.remove_callback(PrinterCallback)  # metrics go to metrics.jsonl, not the console
            trainer.resume_setting = CLI_RESUME  # Ctrl-C/SIGTERM advise the --set this command takes
            interrupt_said = True  # from here on by train() and save_final_model themselves
            trainer.train(resume_from_checkpoint=resume)
            save_final_model(trainer, output_dir)  # says itself if Ctrl-C cuts it short
    except (KeyboardInterrupt, SystemExit) as stop:  # Ctrl-C, or SIGTERM (_exit_on_sigterm)
        if not interrupt_said:  # the server start takes minutes on CPU: a user may give up
            logger.warning("The run was interrupted (%s) before training began. To go on, %s.",
                           interruption(stop), resume_advice(config.output_dir, CLI_RESUME))
        raise
    metrics = output_dir / METRICS_NAME
    if metrics.is_file():
        plot_reward_and_length(metrics, output_dir / PLOT_NAME)
    _leave_process_group()
    return output_dir


def check_run(env: str, config: AsyncGRPOConfig, model: str | None = None,
              resume_from_checkpoint: str | bool | None = None,
              env_args: dict[str, Any] | None = None, *,
              agent_played: bool = False) -> tuple[dict[str, Any], Any, str | None]:
    """Every refusal a run makes before its server starts; returns the run's task, eval split and
    checkpoint to resume from. `run_training` and `train --dry-run` both call it, so a dry run
    that passes is not refused seconds into the real run. Raises `RunRefused` or `ResumeError`."""
    from grpo_agent.train.checkpoint import resume_checkpoint

    task = resolve_env_task(env, env_args, config.plugin_args, agent_played=agent_played)
    if agent_played:  # an env an agent cannot run is refused here
        task = agent_task(task)
    else:
        _check_reward_source(task)
    _check_run_length(task, config)
    if model:
        refuse_non_model_folder(model)
    if model is None and (advice := tiny_model_advice(config.learning_rate)):
        logger.warning(advice)
    eval_dataset = _eval_split(task, config)  # a run that evaluates without a split is refused
    resume = resume_checkpoint(_resume_arg(resume_from_checkpoint, config), config.output_dir)
    return task, eval_dataset, resume


def _leave_process_group() -> None:
    """Under torchrun, leave the process group before the interpreter exits: gloo's threads
    torn down at exit aborted a finished rank now and then (SIGABRT, "terminate called without
    an active exception"; seen in the two-process CI test)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _harness_trainer(agent: Any, task: dict[str, Any], common: dict[str, Any]) -> Any:
    """`HarnessAsyncGRPOTrainer` on the env's rows: the agent owns the tools and the episode."""
    from grpo_agent.train.harness_trainer import HarnessAsyncGRPOTrainer

    return HarnessAsyncGRPOTrainer(agent=agent, **common)


def agent_task(task: dict[str, Any]) -> dict[str, Any]:
    """The env's task as an agent program (`--agent`, `--agent-cmd`) sees it: rows with a prompt.

    An agent replaces the env's tool loop: it gets each row and nothing else from the env. An
    env whose `reset()` only writes the prompt (no tools, no `get_reward`: reasoning-gym, whose
    rows hold just the system message) has that prompt written into each row here, as the tool
    loop would build it, so the agent sees the question. An env whose tools or `get_reward`
    make the reward (counter, coding, textarena) cannot be run by an agent, which never calls
    them: refused, naming what the env owns and what to run instead. An `agent_only` env's rows
    are its own agent's and pass unchanged."""
    name, dataset, factory = task["id"], task["dataset"], task["environment_factory"]
    if isinstance(factory, dict):
        owned = ["environments (a dict routing rows by their 'environment' column)"]
        env = None
    else:
        env = factory() if factory is not None else None
        if getattr(env, "agent_only", None):
            return task  # its rows are its agent's to play (verifiers: `--agent verifiers`)
        owned = _env_owned_scoring(env) if env is not None else []
    columns = getattr(dataset, "column_names", None)
    if dataset is None or owned or (columns is not None and "prompt" not in columns and env is None):
        rows = ("has no dataset (its reset() draws each task)" if dataset is None
                else f"has rows with columns {columns}" + ("" if "prompt" in (columns or ()) else
                                                          ", no 'prompt' column"))
        scored = f" and its reward comes from its own {' and '.join(owned)}" if owned else ""
        raise AgentEnvError(
            f"The env {name!r} {rows}{scored}. An agent program (--agent/--agent-cmd) gets only "
            "the dataset row, with its 'prompt', and calls neither the env's tools nor its "
            f"get_reward(). Train {name!r} without --agent (its built-in tool loop), or give the "
            "agent an env whose rows carry a 'prompt' and whose reward functions score the "
            "completion (words, math, reasoning-gym).")
    if env is None:
        return task
    task = dict(task)
    task["dataset"] = _with_reset_prompts(dataset, env)
    load_eval = task["eval_dataset"]
    task["eval_dataset"] = lambda: _with_reset_prompts(load_eval(), env)
    return task


def refuse_agent_only_env(name: str, factory: Any) -> None:
    """An `agent_only` env (verifiers) trained without its agent: refused before the server
    starts, naming the flag (its reset() would refuse every group, and the run would stop only
    after 10 failed groups)."""
    from grpo_agent.rollout.environments import agent_only_name

    if isinstance(factory, dict):
        return
    agent = agent_only_name(factory)
    if agent:
        raise AgentEnvError(
            f"The env {name!r} is played by its own agent program, not the built-in tool "
            f"loop: add --agent {agent} (Python: HarnessAsyncGRPOTrainer(agent={agent!r})).")


def _env_owned_scoring(env: Any) -> list[str]:
    """What of the env's own makes its reward: its tools and `get_reward` (empty: none)."""
    from grpo_agent.plugins.schemas import public_tool_names

    owned = [f"{tool}() tool" for tool in public_tool_names(type(env))]
    return owned + (["get_reward()"] if callable(getattr(env, "get_reward", None)) else [])


def _with_reset_prompts(dataset: Any, env: Any) -> Any:
    """Each row's prompt as the tool loop builds it: the row's prompt plus `reset(**row)`'s text."""
    from grpo_agent.rollout.environments import build_prompt

    if dataset is None:
        return None
    return dataset.map(lambda row: {"prompt": build_prompt(row, env.reset(**row))})


def refuse_non_model_folder(model: str) -> None:
    """The --model mistakes `train` and `eval` refuse alike before a server starts: a path to
    nothing that cannot be a hub id (`name` or `namespace/name`; the hub said "Repo id must be in
    the form"), and a run's output directory, whose config.json is the run's (transformers said
    "Unrecognized model ... Should have a `model_type` key", vLLM's tokenizer load "install
    sentencepiece or tiktoken"), and a final save cut short (`final.incomplete`)."""
    folder = Path(model)
    if not folder.exists():
        if model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model:
            raise RunRefused(
                f"--model {model}: no such folder. Pass a model folder (a run's OUTPUT_DIR/final "
                "or OUTPUT_DIR/checkpoint-N) or a hub id (name or namespace/name).")
        return
    if folder.name == INCOMPLETE_FINAL_NAME:  # its config.json may be there, its weights not
        raise RunRefused(f"--model {model} is a final model save that was cut short (Ctrl-C, a "
                         "kill), not a whole model: pass one of that run's checkpoint-N "
                         "folders instead.")
    if folder.is_dir() and run_config_of(folder) is not None:
        raise RunRefused(f"--model {model} is a run's output directory, not a model: pass "
                         f"{folder / 'final'} (the model it saved at the end) or one of its "
                         "checkpoint-N folders.")


def run_config_of(folder: Path) -> dict[str, Any] | None:
    """The `AsyncGRPOConfig` a grpo-agent run wrote to `folder/config.json` (its output
    directory); None where that file is absent or a model's own config."""
    path = folder / "config.json"
    try:
        data = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and "output_dir" in data else None


def _check_reward_source(task: dict[str, Any]) -> None:
    """An env with no declared rewards and no `get_reward` scores nothing: every group would be
    dropped as unscored until no_progress_timeout (30 min) stops the run."""
    factory = task["environment_factory"]
    classes = list(factory.values()) if isinstance(factory, dict) else [factory]
    from grpo_agent.plugins.registry import scores_itself

    if task["reward_funcs"] or any(scores_itself(cls) for cls in classes):
        return
    raise RunRefused(
        f"The env {task['id']!r} has no reward source: no rewards=[...] in its @environment(...) "
        "and no get_reward() method, so every rollout would be unscored and no step could train. "
        "Declare one of them in the env's package (`grpo-agent env show NAME` lists its reward "
        "sources).")


def _check_run_length(task: dict[str, Any], config: AsyncGRPOConfig) -> None:
    """An env without a dataset has no epochs, so `max_steps` is the run's only length: refused
    here, before the server starts (the trainer refused it only once the server and model were up)."""
    if task["dataset"] is None and config.max_steps <= 0:
        raise RunRefused(
            f"The env {task['id']!r} has no dataset (its reset() samples its own tasks), so the "
            "run length is unknown: pass --set max_steps=N (for example --set max_steps=20).")


def _eval_split(task: dict[str, Any], config: AsyncGRPOConfig) -> Any:
    """The env's eval split when the run evaluates (its success threshold unless one is set);
    eval settings that cannot work are refused here, before the server starts."""
    from grpo_agent.train.evaluation import wants_evaluation

    if not wants_evaluation(config):
        return None
    if config.eval_success_threshold is None:
        config.eval_success_threshold = task["success_threshold"]
    dataset = task["eval_dataset"]()
    if dataset is None:
        from grpo_agent.train.evaluation import evaluation_settings

        raise RunRefused(
            f"The env {task['id']!r} declares no eval split, but the run evaluates "
            f"({evaluation_settings(config)}). Train without evaluation (--set eval_strategy=no "
            "--set eval_on_start=false), or evaluate an env that declares one (counter, "
            "reasoning-gym: `grpo-agent env show NAME`).")
    from grpo_agent.rollout.evaluation import EvalSettings
    from grpo_agent.train.evaluation import check_eval_args

    try:  # the trainer checks these too, but only once the server is up and the model loaded
        EvalSettings.from_config(config)
        check_eval_args(config, dataset)
    except ValueError as err:
        raise RunRefused(str(err)) from None
    return dataset


def _resume_arg(explicit: str | bool | None, config: AsyncGRPOConfig) -> str | bool | None:
    """`--set resume_from_checkpoint=last` (or true) resumes from the newest checkpoint; false
    (or none) does not resume."""
    value = explicit if explicit is not None else config.resume_from_checkpoint
    if isinstance(value, str) and value.lower() in ("last", "true"):
        return True
    if isinstance(value, str) and value.lower() in ("false", "none", ""):
        return None
    return value


def resolve_env_task(name: str, options: dict[str, Any] | None = None,
                     plugin_args: dict[str, Any] | None = None, *,
                     agent_played: bool = False) -> dict[str, Any]:
    """The env's dataset, rewards (their `plugin_args` bound) and environment factory (options
    bound), via the plugin host; an agent-only env not `agent_played` is refused before its
    dataset loads."""
    from grpo_agent.plugins import load_registry

    registry = load_registry()
    spec = registry.environment_spec(name, options)
    if not agent_played:
        refuse_agent_only_env(spec.id, spec.environment_factory)
    return {
        "id": spec.id,
        "dataset": spec.load_dataset(),
        "reward_funcs": spec.reward_funcs(registry, plugin_args),
        "environment_factory": spec.environment_factory,
        "eval_dataset": spec.load_eval_dataset,  # called only when the run evaluates
        "declares_eval_split": spec.eval_dataset is not None,
        "success_threshold": spec.success_threshold,
    }


def tiny_model_advice(learning_rate: float) -> str | None:
    """Why a run of the built-in tiny model would not learn, or None: the config's default rate
    is the spec's, for pretrained models; a random 0.8M-parameter one needs far more. The
    advice calls the rate the default only when it is (a rate the user set is theirs)."""
    if learning_rate >= TINY_MODEL_MIN_LEARNING_RATE:
        return None
    default = AsyncGRPOConfig.__dataclass_fields__["learning_rate"].default
    why = ("the default, which is for pretrained models" if learning_rate == default else
           f"set below {TINY_MODEL_MIN_LEARNING_RATE:g}, a rate for pretrained models")
    return (f"The built-in tiny random model barely moves at learning_rate={learning_rate:g} "
            f"({why}): its reward stays flat for hours. For a run that "
            "learns in minutes add --set learning_rate=3e-4 --set num_train_epochs=0.5 --set "
            "max_completion_length=16 (make demo-words), or pass --model.")


def _tiny_model_path() -> str:
    from grpo_agent.testing import build_tiny_model

    return str(build_tiny_model())


def _lora_config(lora: dict[str, Any]) -> Any:
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **lora)


@contextlib.contextmanager
def _server(
    model_path: str, vllm_url: str | None, lora: dict[str, Any] | None, config: AsyncGRPOConfig,
    *, needed: bool = True
) -> Iterator[str]:
    """The server's URL: `vllm_url`, else a managed server started here; not `needed`: no
    server is started (the URL is never contacted)."""
    if vllm_url or not needed:
        yield vllm_url or config.vllm_server_base_url
        return
    from grpo_agent.sampler.server import MANAGED_DTYPE, ManagedVLLMServer, managed_max_model_len
    from grpo_agent.weight_sync.lora_needs import needed_loras, server_lora_rank

    lora_flags = {}
    if lora:  # room for the adapter's rank and max_staleness + 1 live versions plus the next
        lora_flags = {"enable_lora": True, "max_lora_rank": server_lora_rank(lora["r"]),
                      "max_loras": needed_loras(config.max_staleness)}
    split = _core_split()
    server = ManagedVLLMServer(
        model_path, dtype=MANAGED_DTYPE,
        max_model_len=managed_max_model_len(model_path, config.max_completion_length),
        env=split.server_env() if split else None, nice=SERVER_NICE if split else None,
        **lora_flags
    )
    # Shown, not logged at INFO (which the CLI does not print): the start takes a minute or more
    # on CPU, and the run was silent all that time.
    _say(f"No --vllm-url: starting a vLLM server for {model_path} on this machine (a minute or "
         f"more on CPU; its log: {server.log_path}) ...")
    with server:
        _say(f"vLLM server ready at {server.base_url} (pid {server.pid}).")
        if split:
            logger.info("CPU cores: vLLM computes on %s at nice %d, the trainer runs on %s.",
                        split.server, SERVER_NICE, split.trainer)
        with trainer_on(split.trainer) if split else contextlib.nullcontext():
            yield server.base_url


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _core_split() -> CoreSplit | None:
    """Disjoint cores for a CPU server started here, unless the user binds vLLM's threads."""
    import torch

    if torch.cuda.is_available() or OMP_BIND_ENV in os.environ:
        return None
    return split_cores()


@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """SIGTERM (`kill PID`, a job scheduler) exits like Ctrl-C, so the managed server and the
    rollout worker are stopped on the way out. Its default action ends the process at once,
    leaving the server (its own session, so it gets no signal) and the worker running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
