"""`grpo-agent doctor`: diagnose a model's setup for agent training before a run.

`doctor template` renders the scripted conversations the training template is chosen on, with
the model's chat template: one with tool calls (the tool loop, a gateway agent with tools) and
a multi-turn chat without tools (a gateway agent without tools, which renders with the chosen
template too). For each it reports whether every render extends the previous one
(prefix-preserving), where it first diverges, and which template training renders with. Heavy
imports stay inside the command so `grpo-agent --help` is fast.
"""
from __future__ import annotations

import json
import os
from typing import Annotated

import typer

from grpo_agent.cli.errors import CliError

app = typer.Typer(help="Diagnose a model's setup for agent training.", no_args_is_help=True)


@app.callback()
def doctor() -> None:
    """Diagnose a model's setup for agent training."""


@app.command("template")
def template(
    model: Annotated[str, typer.Argument(help="Model id or local folder holding the tokenizer.")],
    template_kwargs: Annotated[
        str | None,
        typer.Option("--chat-template-kwargs", help='JSON passed to the template, e.g. \'{"enable_thinking": false}\'.'),
    ] = None,
) -> None:
    """Check whether MODEL's chat template is prefix-preserving, with tools and without.

    Example: grpo-agent doctor template ~/.cache/grpo-agent/tiny-qwen3-v1
    """
    from transformers import AutoTokenizer

    from grpo_agent.rollout.chat_template import choose_training_template
    from grpo_agent.rollout.tool_calls import parser_for_template

    # Errors exit 1 (CliError), never 2: exit status 2 means "usable, but forks".
    try:
        kwargs = json.loads(template_kwargs) if template_kwargs else {}
    except json.JSONDecodeError as exc:
        raise CliError(f"--chat-template-kwargs is not valid JSON ({exc}); write e.g. "
                       '\'{"enable_thinking": false}\'.') from exc
    if not isinstance(kwargs, dict):  # a list or number failed inside the template rendering
        raise CliError(f"--chat-template-kwargs must be a JSON object of template options, got "
                       f"{template_kwargs!r}; write e.g. '{{\"enable_thinking\": false}}'.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as exc:  # a missing folder: transformers' text is about Hub
        # repo ids; an empty one: a ValueError about sentencepiece/tiktoken
        looks_local = model.startswith(("/", ".", "~")) and not os.path.exists(os.path.expanduser(model))
        raise CliError(f"Cannot load a tokenizer from {model!r}: "
                       f"{'no such folder' if looks_local else exc}. Pass a local model folder "
                       "or a Hub model id.") from exc
    if not tokenizer.chat_template:
        typer.echo(f"{model}: the tokenizer has no chat template; set one before agent training.", err=True)
        raise typer.Exit(1)
    typer.echo(f"model:             {model}")
    forks = False
    for tools, title in ((True, "tool conversation (tool loop; gateway agents with tools)"),
                         (False, "multi-turn chat without tools (gateway agents)")):
        chosen = choose_training_template(tokenizer, kwargs, tools)
        typer.echo(f"{title}:")
        typer.echo(f"  model template:    {_model_template(tokenizer, kwargs, tools)}")
        typer.echo(f"  training template: {chosen.note}")
        if chosen.family:
            typer.echo(f"  patched template:  {chosen.report.describe()}".replace("\n", "\n  "))
        if tools:
            parser = parser_for_template(chosen.template or tokenizer.chat_template)
        forks = forks or not chosen.report.preserving
    typer.echo(f"tool-call parser:  {type(parser).__name__}")
    if forks:  # usable, but forks will cost forward-pass tokens
        raise typer.Exit(2)


def _model_template(tokenizer, kwargs: dict, tools: bool) -> str:
    """The model's own template on the scripted conversation; one that cannot render the chat
    without tools is kept for such chats (`choose_training_template`), which the note says."""
    from grpo_agent.rollout.chat_template import check_prefix_preserving

    try:
        return check_prefix_preserving(tokenizer, None, kwargs, tools).describe().replace("\n", "\n  ")
    except Exception as error:  # noqa: BLE001 - with tools, choose_training_template raised first
        return f"cannot render the scripted chat ({type(error).__name__}: {error})"
