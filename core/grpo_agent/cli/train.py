"""`grpo-agent train --env NAME`: parse flags into `AsyncGRPOConfig`, then run training.

The command is thin: it builds the config and hands it to `grpo_agent.train.run.run_training`
(imported lazily; the trainer, vLLM and torch load only here).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

import typer

from grpo_agent.cli.errors import DEBUG_ENV, CliError


def train(
    env: Annotated[
        str | None,
        typer.Option("--env", help="Registered environment name (see `env list`); or `env` in the run file."),
    ] = None,
    env_args: Annotated[
        list[str] | None,
        typer.Option("--env-arg", help="Env option key=value (repeatable; `env show NAME` lists them)."),
    ] = None,
    plugin_args: Annotated[
        list[str] | None,
        typer.Option("--plugin-arg", help="Plugin option name.key=value (repeatable; see `plugins list`)."),
    ] = None,
    config_file: Annotated[
        Path | None, typer.Option("--config", help="Run file (.toml or .yaml).")
    ] = None,
    sets: Annotated[
        list[str] | None, typer.Option("--set", help="Override a config field: key=value (repeatable).")
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Model id or folder (default: the tiny test model).")
    ] = None,
    vllm_url: Annotated[
        str | None, typer.Option("--vllm-url", help="Running vLLM server (default: start one here).")
    ] = None,
    output_dir: Annotated[
        str | None, typer.Option("--output-dir", help="Where checkpoints and metrics go.")
    ] = None,
    lora_rank: Annotated[
        int | None,
        typer.Option("--lora-rank", min=1, help="Train a LoRA adapter of this rank (PEFT)."),
    ] = None,
    lora_alpha: Annotated[
        int | None, typer.Option("--lora-alpha", min=1, help="LoRA alpha (default: 2 x rank).")
    ] = None,
    lora_target_modules: Annotated[
        str, typer.Option("--lora-target-modules", help="Comma-separated module names, or all-linear.")
    ] = "all-linear",
    agent: Annotated[
        str | None,
        typer.Option("--agent", help="Agent program to train (registered name or pkg.mod:attr); "
                     "it replaces the env's tool loop and talks to the policy through the gateway."),
    ] = None,
    agent_cmd: Annotated[
        str | None,
        typer.Option("--agent-cmd", help="Command run per rollout with OPENAI_BASE_URL/OPENAI_API_KEY, "
                     "the row as JSON on stdin and its reward on stdout (docs/harness.md, As a command)."),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Make the run's start-up checks, print their "
                                "warnings, the env and config; do not train.")
    ] = False,
) -> None:
    """Train on a registered environment.

    Example: grpo-agent train --env counter --model Qwen/Qwen3-0.6B --set max_steps=20

    Example: grpo-agent train --env reasoning-gym --env-arg task=countdown --env-arg size=200

    Without --model the built-in tiny random model is trained: it learns `words`
    (make demo-words), but it does not emit tool calls, so tool envs such as `counter` give it no
    reward signal (every group scores the same and is dropped).

    With --lora-rank the policy is a LoRA adapter; a managed server is started with
    --enable-lora so the trainer pushes the adapter, not merged weights.
    """
    started = time.time()  # a stall report older than this is an earlier run's
    from grpo_agent.cli.config_files import build_config, parse_plugin_args, read_env_choice
    from grpo_agent.plugins import load_registry
    from grpo_agent.plugins.options import parse_pairs
    from grpo_agent.rollout.plugins import check_plugin_args

    if agent and agent_cmd:
        raise CliError("Pass --agent or --agent-cmd, not both: one agent program runs each rollout.")
    if lora_rank is None and lora_alpha is not None:
        raise CliError("--lora-alpha needs --lora-rank (the rank of the adapter to train).")
    config = build_config(config_file, sets or [], output_dir=output_dir)
    for name, values in parse_plugin_args(plugin_args or []).items():
        config.plugin_args[name] = {**config.plugin_args.get(name, {}), **values}
    file_env, options = read_env_choice(config_file)
    env = env or file_env
    if not env:
        raise CliError("No environment: pass --env NAME or put env = \"NAME\" in the run file.")
    options.update(parse_pairs(env_args or [], "--env-arg"))
    spec = load_registry().environment_spec(env, options)
    check_plugin_args(config, spec.reward_funcs())
    if agent:
        from grpo_agent.rollout.agent_programs import resolve_agent

        resolve_agent(agent)  # an unknown name fails here, before a server starts
    lora = None
    if lora_rank is not None:
        lora = {"r": lora_rank, "lora_alpha": lora_alpha or 2 * lora_rank,
                "target_modules": _target_modules(lora_target_modules)}
    from grpo_agent.train.checkpoint import ResumeError
    from grpo_agent.train.run import RunRefused, check_run, run_training
    if dry_run:
        try:  # the real run's refusals: a dry run that passes is not refused when it trains
            check_run(env, config, model, env_args=spec.option_values,
                      agent_played=bool(agent or agent_cmd))
        except (RunRefused, ResumeError) as err:
            raise CliError(str(err)) from None
        _warn_as_the_trainer_would(config)
        options = f"  options: {spec.option_values}" if spec.options else ""
        typer.echo(f"env: {spec.id} [{spec.distribution}]{options}")
        typer.echo(f"model: {model or '(tiny test model)'}  vllm: {vllm_url or '(managed here)'}")
        if agent or agent_cmd:
            typer.echo(f"agent: {agent or agent_cmd}")
        if lora:
            typer.echo(f"lora: {lora}")
        typer.echo(config.to_json_string())
        return
    program = agent
    if agent_cmd:
        from grpo_agent.rollout.agent_programs import AgentCommand

        program = AgentCommand(agent_cmd)
    try:
        out = run_training(env=env, config=config, model=model, vllm_url=vllm_url, lora=lora,
                           env_args=options, agent=program)
    except (RunRefused, ResumeError) as err:  # refused before anything started
        raise CliError(str(err)) from None
    except Exception as err:
        from grpo_agent.cli.failure import report_failure

        message, code = report_failure(err, config.output_dir, since=started)
        if os.environ.get(DEBUG_ENV) == "1":
            raise
        typer.echo(message, err=True)
        raise typer.Exit(code) from None
    from grpo_agent.train import fsdp

    if fsdp.is_main_process():  # under torchrun: once, not once per rank
        from grpo_agent.train.reporting import METRICS_NAME, run_summary

        typer.echo(f"Run finished: {out}")
        if (Path(out) / METRICS_NAME).is_file():
            typer.echo(run_summary(out))


def _warn_as_the_trainer_would(config) -> None:
    """The warnings the trainer logs at a real start that need no server or model (a greedy
    run's): a dry run is where a user checks a run before paying for its start."""
    import logging

    from grpo_agent.train.no_progress import greedy_sampling_warning

    if warning := greedy_sampling_warning(config.temperature):
        logging.getLogger(__name__).warning(warning)


def _target_modules(text: str) -> str | list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise CliError("--lora-target-modules is empty: name modules (q_proj,v_proj) or all-linear.")
    return names[0] if names == ["all-linear"] else names
