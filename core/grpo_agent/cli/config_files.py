"""Run files (TOML/YAML) plus `--set key=value` overrides -> `AsyncGRPOConfig`.

Design decision: the config dataclass is the only source of truth; the CLI adds no knobs of
its own. Values given with `--set` are read as JSON when they parse (`3`, `1e-6`, `true`,
`["a"]`) and as plain strings otherwise, except that a text-only field (output_dir, run_name)
keeps its text; unknown keys fail with close matches, and a bool, int or float field given
another type (text that did not parse) fails naming the field.
"""
from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from grpo_agent.cli.errors import CliError

# Run-file keys that pick the env rather than set a config field: `env = "NAME"` and an
# `[env_args]` table of its options (the run-file form of `--env` and `--env-arg`).
ENV_KEYS = ("env", "env_args")


def read_run_file(path: Path) -> dict[str, Any]:
    """The key/value table of a `.toml`, `.yaml` or `.yml` run file."""
    if not path.is_file():
        raise CliError(f"Config file {path} is a folder: pass a .toml or .yaml run file."
                       if path.is_dir() else f"Config file {path} does not exist.")
    text = path.read_text()
    # A syntax error names the file: tomllib's message alone ("Invalid value (at line 2, column
    # 17)") does not, and yaml's error was no CLI error, so it printed a traceback.
    if path.suffix == ".toml":
        import tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise CliError(f"Config file {path} is not valid TOML: {err}.") from err
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            where = getattr(err, "problem_mark", None)
            at = f" (at line {where.line + 1}, column {where.column + 1})" if where else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise CliError(f"Config file {path} is not valid YAML: {problem}{at}.") from err
    else:
        raise CliError(f"Config file {path}: use a .toml, .yaml or .yml file.")
    if not isinstance(data, dict):
        raise CliError(f"Config file {path} must hold a table of key = value pairs.")
    return data


def parse_value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_sets(pairs: list[str], text_fields: frozenset[str] = frozenset()) -> dict[str, Any]:
    """`["lr=1e-6", "num_generations=4"]` -> `{"lr": 1e-06, "num_generations": 4}`; a field of
    `text_fields` keeps its text (`--set output_dir=3` is the folder "3", not the number 3)."""
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise CliError(f"--set {pair!r}: write it as key=value, e.g. --set max_steps=10.")
        parsed = parse_value(value.strip())
        keep_text = key.strip() in text_fields and parsed is not None and not isinstance(parsed, str)
        values[key.strip()] = value.strip() if keep_text else parsed
    return values


def read_env_choice(config_file: Path | None) -> tuple[str | None, dict[str, Any]]:
    """The run file's `env` name and `[env_args]` table (None and {} when absent)."""
    data = read_run_file(config_file) if config_file else {}
    env_args = data.get("env_args", {})
    if not isinstance(env_args, dict):
        raise CliError(f"Config file {config_file}: env_args must be a table of option = value.")
    return data.get("env"), env_args


def parse_plugin_args(pairs: list[str]) -> dict[str, dict[str, str]]:
    """`["curriculum.pass_rate_cap=0.8"]` -> `{"curriculum": {"pass_rate_cap": "0.8"}}`."""
    values: dict[str, dict[str, str]] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        plugin, dot, option = key.strip().rpartition(".")
        if not sep or not dot or not plugin or not option:
            raise CliError(
                f"--plugin-arg {pair!r}: write it as name.option=value, e.g. "
                "--plugin-arg curriculum.pass_rate_cap=0.8."
            )
        values.setdefault(plugin, {})[option] = value.strip()
    return values


def build_config(config_file: Path | None, sets: list[str], base: dict[str, Any] | None = None,
                 **overrides: Any):
    """Merge `base` < run file < --set < explicit flags (None = not given) into an
    `AsyncGRPOConfig`."""
    from dataclasses import fields

    from grpo_agent.config import AsyncGRPOConfig

    data = dict(base or {})
    data.update(read_run_file(config_file) if config_file else {})
    for key in ENV_KEYS:
        data.pop(key, None)
    data.update(parse_sets(sets, _text_fields(AsyncGRPOConfig)))
    data.update({key: value for key, value in overrides.items() if value is not None})
    known = {f.name for f in fields(AsyncGRPOConfig) if f.init}
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise CliError(f"Unknown config field {key!r}.{hint} See docs/config.md for all fields.")
    _check_scalar_types(AsyncGRPOConfig, data)
    return AsyncGRPOConfig(**data)


def _allowed_types(config_class: type) -> dict[str, set]:
    """Each field's allowed types: `int | None` -> {int, NoneType}; a plain type -> {it}."""
    import types
    import typing

    return {key: set(typing.get_args(hint)) if isinstance(hint, types.UnionType) else {hint}
            for key, hint in typing.get_type_hints(config_class).items()}


def _text_fields(config_class: type) -> frozenset[str]:
    """Fields that take text only (str, or str or None; enum-or-str ones such as optim too)."""
    return frozenset(key for key, allowed in _allowed_types(config_class).items()
                     if str in allowed and not allowed & {int, float, bool, dict, list}
                     and not any(getattr(kind, "__origin__", None) in (dict, list) for kind in allowed))


# Dict fields whose text may also be a path to a JSON file (as in transformers).
PATH_OR_DICT_FIELDS = ("accelerator_config", "deepspeed", "fsdp_config")


def _check_json_object(key: str, value: Any, allowed: set) -> None:
    """A dict field given text that is no JSON object (`--set 'chat_template_kwargs={"a": 1'`
    with its brace lost) was kept as a string and failed only inside the run's rollouts; a
    number (`--set stall_timeouts=5`) failed as an AttributeError traceback."""
    import typing

    if value is None or isinstance(value, dict):
        return
    if not any(kind is dict or typing.get_origin(kind) is dict for kind in allowed):
        return
    problem = type(value).__name__
    if isinstance(value, str):
        if key in PATH_OR_DICT_FIELDS and not value.lstrip().startswith("{"):
            return
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as err:
            problem = f"not valid JSON: {err}"
        else:
            if isinstance(parsed, dict):  # a run file's string holding a JSON object
                return
            problem = f"JSON, but a {type(parsed).__name__}"
    raise CliError(f"Config field {key!r} takes a JSON object, got {value!r} ({problem}). Quote the "
                   f"whole pair for the shell, e.g. --set '{key}={{\"name\": value}}'.")


def _check_scalar_types(config_class: type, data: dict[str, Any]) -> None:
    """A bool, int or float field given a value of another type (`--set max_steps=ten` arrives as
    the text 'ten') fails here, naming the field, instead of deep inside a run."""
    hints = _allowed_types(config_class)
    text = _text_fields(config_class)
    names = {bool: "true or false", int: "an integer", float: "a number"}
    for key, value in data.items():
        allowed = set(hints.get(key, {None}))
        _check_json_object(key, value, allowed)
        if key in text and isinstance(value, int | float) and not isinstance(value, bool):
            # a run file's `output_dir = 3` failed as "expected str, bytes or os.PathLike
            # object, not int", naming no field (true stays: resume_from_checkpoint takes it)
            raise CliError(f"Config field {key!r} takes text, got {value!r}. Quote it in the run "
                           f"file ({key} = \"{value}\").")
        optional = type(None) in allowed
        allowed.discard(type(None))
        if len(allowed) != 1 or next(iter(allowed)) not in names or (value is None and optional):
            continue
        kind = next(iter(allowed))
        fits = (isinstance(value, bool) if kind is bool else
                isinstance(value, kind if kind is int else (int, float)) and not isinstance(value, bool))
        if not fits:
            raise CliError(f"Config field {key!r} takes {names[kind]}"
                           f"{' (or null)' if optional else ''}, got {value!r}. "
                           "See docs/config.md for its meaning.")
