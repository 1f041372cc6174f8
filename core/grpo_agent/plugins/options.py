"""Typed options of envs and plugins: declared once, checked wherever values come in.

Design decision: an option is declared next to the object it configures (`@environment(...,
options=[Option(...)])`, `@prompt_filter(..., options=[...])`) and reaches it as keyword
arguments; this module is the one home for turning user values (CLI text, run-file values,
Python values) into typed values. Text is parsed by the declared type, so `--env-arg size=50`
and `size = 50` in a run file mean the same; anything else must already have the type. An
unknown name or a bad value is an `OptionError` listing every valid option.
"""
from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grpo_agent.plugins.errors import OptionError

_TYPES = (str, int, float, bool)
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@dataclass(frozen=True)
class Option:
    """One declared option. `choices` may be a zero-argument function (computed lazily)."""

    name: str
    type: type
    default: Any
    help: str = ""
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None

    def __post_init__(self) -> None:
        if self.type not in _TYPES:
            raise TypeError(f"Option {self.name!r}: type must be one of str, int, float, bool.")
        if isinstance(self.default, str) and self.type is not str or self._convert(self.default) is None:
            raise TypeError(f"Option {self.name!r}: default {self.default!r} is not a {self.type.__name__}.")

    def allowed(self) -> list[Any] | None:
        """The valid values, or None when any value of the type is valid."""
        if self.choices is None:
            return None
        return list(self.choices() if callable(self.choices) else self.choices)

    def parse(self, value: Any) -> Any:
        """The typed value of `value` (text is parsed by the declared type); ValueError if bad."""
        typed = self._convert(value)
        if typed is None:
            name = self.type.__name__
            raise ValueError(f"takes {'an' if name[0] in 'aeiou' else 'a'} {name}, got {value!r}")
        allowed = self.allowed()
        if allowed is not None and typed not in allowed:
            close = difflib.get_close_matches(str(typed), [str(a) for a in allowed], n=3)
            hint = f" (did you mean: {', '.join(close)}?)" if close else ""
            raise ValueError(f"has no choice {typed!r}{hint}; choices: {', '.join(map(str, allowed))}")
        return typed

    def _convert(self, value: Any) -> Any:
        if isinstance(value, str) and self.type is not str:
            text = value.strip()
            if self.type is bool:
                low = text.lower()
                return True if low in _TRUE else False if low in _FALSE else None
            try:
                return self.type(text)
            except ValueError:
                return None
        if self.type is bool:
            return value if isinstance(value, bool) else None
        if isinstance(value, bool):
            return None  # True is an int in Python, never a valid number here
        if self.type is float and isinstance(value, int):
            return float(value)
        return value if isinstance(value, self.type) else None

    def summary(self) -> str:
        """`size (int, default 500): rows in the train split`."""
        text = f"{self.name} ({self.type.__name__}, default {self.default!r})"
        return f"{text}: {self.help}" if self.help else text


def describe_inline(options: Sequence[Option]) -> str:
    return "; ".join(option.summary() for option in options) or "(none)"


def bind_options(declared: Sequence[Option], given: Mapping[str, Any] | None, owner: str) -> dict[str, Any]:
    """Defaults overlaid with the typed `given` values; unknown names and bad values raise."""
    by_name = {option.name: option for option in declared}
    for name in given or {}:
        if name not in by_name:
            close = difflib.get_close_matches(name, list(by_name), n=3)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            if not by_name:
                raise OptionError(f"{owner} takes no options, but got {name!r}. Remove it.")
            raise OptionError(
                f"Unknown option {name!r} for {owner}.{hint} Valid options: "
                f"{describe_inline(declared)}."
            )
    values = {option.name: option.default for option in declared}
    for name, value in (given or {}).items():
        try:
            values[name] = by_name[name].parse(value)
        except ValueError as err:
            raise OptionError(
                f"Option {name!r} of {owner} {err}. Valid options: {describe_inline(declared)}."
            ) from None
    return values


def parse_pairs(pairs: Sequence[str], flag: str) -> dict[str, str]:
    """`["task=countdown", "size=50"]` -> `{"task": "countdown", "size": "50"}` (typed later)."""
    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise OptionError(f"{flag} {pair!r}: write it as key=value, e.g. {flag} task=countdown.")
        values[key.strip()] = value.strip()
    return values


def declared_options(obj: Any) -> tuple[Option, ...]:
    """The options a decorated object declares (none for an unmarked object)."""
    from grpo_agent.plugins.decorators import get_marker

    marker = get_marker(obj)
    return tuple(marker.options.get("options", ())) if marker else ()


def check_takes_options(func: Callable, options: Sequence[Option], what: str) -> None:
    """Refuse at registration a `func` (an env class, its dataset function, a plugin function)
    that cannot take its declared options as keywords, or that requires an argument no option
    gives: either way every call fails, and only once a run has started (an env's in each
    rollout)."""
    import inspect

    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): left to the call
        return
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
    missing = [o.name for o in options if o.name not in names and not takes_any]
    if missing:
        raise OptionError(
            f"{what} does not take its declared option(s) {', '.join(missing)}: every option "
            f"arrives as a keyword argument, so add a parameter for each (or **_ to ignore them).")
    declared = {o.name for o in options}
    required = [p.name for p in parameters if p.default is p.empty and p.name not in declared
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required and isinstance(func, type):  # a plugin function's own arguments come from its caller
        raise OptionError(
            f"{what} requires {', '.join(required)}, which no declared option gives: declare "
            f"each with Option(name, type, default, help) in @environment(options=[...]), or "
            f"give it a default.")
