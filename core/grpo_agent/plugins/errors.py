"""Errors of the plugin host: each message names the problem and the fix.

The CLI prints any `PluginError` as one line (exit code 1) unless `--debug` is given.
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable


class PluginError(Exception):
    """A user-facing plugin problem (bad name, broken plugin, duplicate registration)."""


class DuplicateNameError(PluginError):
    """Two plugins registered the same name of the same kind."""


class UnknownNameError(PluginError, KeyError):
    """A name was looked up that no installed plugin registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class PluginImportError(PluginError):
    """An installed plugin failed to import."""


class OptionError(PluginError):
    """An option that is not declared, or a value that does not fit its declaration."""


class ToolSchemaError(PluginError):
    """A tool lacks the type hints or docstring its JSON schema is derived from."""


def unknown_name_message(kind: str, name: str, installed: Iterable[str]) -> str:
    """'Unknown reward 'acuracy'. Did you mean: accuracy? Installed: ...' plus how to fix it."""
    names = sorted(installed)
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    listed = ", ".join(names) if names else "(none)"
    return (
        f"Unknown {kind} {name!r}.{hint} Installed {kind}s: {listed}. Install the plugin that "
        f"provides it, or pass an import path such as 'package.module:attr'."
    )
