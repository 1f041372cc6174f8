"""The pluggy plugin manager: load built-ins and installed entry points, resolve all hooks.

Design decision: plugins are discovered once per process through the `grpo_agent` entry-point
group (as llm and datasette do) and every registration hook is called once, per plugin, with
a `register` callable bound to that plugin's distribution; the result is a plain `Registry`.
A plugin that fails to import stops start-up with its distribution's name (warning and going
on would silently change what a run trains on). `GRPO_AGENT_LOAD_PLUGINS=a,b` loads only
those entry points or distributions (empty = none); `GRPO_AGENT_TRACE_PLUGINS=1` traces hooks.
"""
from __future__ import annotations

import difflib
import inspect
import logging
import os
import sys
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType
from typing import Any

import pluggy

from grpo_agent.plugins import hookspecs
from grpo_agent.plugins.decorators import get_marker
from grpo_agent.plugins.errors import (
    DuplicateNameError,
    PluginError,
    PluginImportError,
    ToolSchemaError,
)
from grpo_agent.plugins.registry import EnvironmentSpec, Registry

BUILTIN_DISTRIBUTION = "grpo-agent (built-in)"
BUILTIN_MODULES = ("grpo_agent.plugins.builtins", "grpo_agent.demo")
LOAD_ENV = "GRPO_AGENT_LOAD_PLUGINS"
TRACE_ENV = "GRPO_AGENT_TRACE_PLUGINS"

logger = logging.getLogger(__name__)

_cache: dict[tuple, Registry] = {}
_manager_cache: dict[tuple, PluginManager] = {}


def _allowed_names() -> set[str] | None:
    """Names from GRPO_AGENT_LOAD_PLUGINS, or None when the variable is unset (load all)."""
    raw = os.environ.get(LOAD_ENV)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _distribution(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    return (dist.name, dist.version) if dist is not None else ("unknown distribution", "")


def installed_entry_points() -> list[EntryPoint]:
    """Entry points of the `grpo_agent` group that GRPO_AGENT_LOAD_PLUGINS lets through."""
    allowed = _allowed_names()
    found = sorted(entry_points(group=hookspecs.PROJECT_NAME), key=lambda ep: ep.name)
    if allowed is None:
        return found
    known = {ep.name for ep in found} | {_distribution(ep)[0] for ep in found}
    unknown = sorted(allowed - known)
    if unknown:  # a typo would otherwise load nothing and leave "Unknown environment" to explain
        close = {name: difflib.get_close_matches(name, known, n=1) for name in unknown}
        detail = ", ".join(f"{name!r} (did you mean {match[0]!r}?)" if match else repr(name)
                           for name, match in close.items())
        raise PluginError(
            f"{LOAD_ENV} names {detail}, which no installed plugin has. Installed plugins "
            f"(entry-point names and distributions): {', '.join(sorted(known)) or '(none)'}."
        )
    return [ep for ep in found if ep.name in allowed or _distribution(ep)[0] in allowed]


class PluginManager(pluggy.PluginManager):
    """pluggy's manager plus the distribution (name, version) of every registered plugin."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.distributions: dict[str, tuple[str, str]] = {}

    def distribution_of(self, plugin: Any) -> tuple[str, str]:
        return self.distributions.get(self.get_name(plugin), ("unknown distribution", ""))


def _new_manager() -> PluginManager:
    pm = PluginManager()
    pm.add_hookspecs(hookspecs)
    if os.environ.get(TRACE_ENV):
        pm.trace.root.setwriter(lambda text: sys.stderr.write(text))
        pm.enable_tracing()
    return pm


def _register(pm: PluginManager, plugin: Any, name: str, dist: str, version: str) -> None:
    if pm.has_plugin(name):
        other = pm.get_plugin(name)
        raise DuplicateNameError(
            f"Plugin name {name!r} is used twice: by {_plugin_dist(pm, other)} and by {dist}. "
            "Uninstall one of them."
        )
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as err:  # pluggy's own text names neither the fix nor the dist
        raise PluginError(_bad_arguments_message(pm, plugin, name, dist, version)) from err
    pm.distributions[name] = (dist, version)


def _origin(name: str, dist: str, version: str) -> str:
    """"Plugin 'x' from distribution d 1.0", as the import failure names it."""
    return f"Plugin {name!r} from " + (f"distribution {dist} {version}" if version else dist)


def _missing_arguments(impl: Any, wanted: list[str]) -> str:
    """' Define it as hook(register): ...' when the implementation leaves out its argument."""
    given = set(inspect.signature(impl).parameters)
    if set(wanted) <= given:
        return ""
    name = getattr(impl, "__name__", "hook")
    return (f" Define it as {name}({', '.join(wanted)}): the hook passes "
            f"{', '.join(repr(arg) for arg in wanted)}.")


def _fix_hint(dist: str, version: str) -> str:
    """How to get past a broken installed plugin (test plugins have no version to uninstall)."""
    if not version:
        return "Fix it."
    return (f"Fix or uninstall it (pip uninstall {dist}), or leave it out by naming the plugins "
            f"to load: {LOAD_ENV}=NAME,... (entry-point or distribution names).")


def _bad_arguments_message(pm: PluginManager, plugin: Any, name: str, dist: str, version: str) -> str:
    """Which hook implementations take arguments their hook does not pass, and the right ones."""
    bad = []
    for hook_name in dir(pm.hook):
        caller = getattr(pm.hook, hook_name)
        impl = getattr(plugin, hook_name, None)
        if hook_name.startswith("_") or caller.spec is None or not callable(impl):
            continue
        if pm.parse_hookimpl_opts(plugin, hook_name) is None:
            continue
        given = list(inspect.signature(impl).parameters)
        wanted = list(caller.spec.argnames)
        if set(given) - set(wanted):
            bad.append(f"{hook_name}({', '.join(given)}) should be {hook_name}({', '.join(wanted)})")
    return (f"{_origin(name, dist, version)} implements a hook with arguments it is not called "
            f"with: {'; '.join(bad) or 'see the traceback (--debug)'}. Every hook receives its "
            f"one argument by that name. {_fix_hint(dist, version)}")


def _plugin_dist(pm: PluginManager, plugin: Any) -> str:
    return pm.distribution_of(plugin)[0]


def build_plugin_manager(
    *, load_entry_points: bool = True, plugins: list[Any] | tuple = ()
) -> PluginManager:
    """A manager with the built-ins, the allowed entry points and any given plugin objects."""
    import importlib

    from grpo_agent._version import __version__

    pm = _new_manager()
    for module_name in BUILTIN_MODULES:
        _register(pm, importlib.import_module(module_name), module_name, BUILTIN_DISTRIBUTION, __version__)
    if load_entry_points:
        for ep in installed_entry_points():
            dist, version = _distribution(ep)
            _register(pm, _load(ep, dist, version), ep.name, dist, version)
    for plugin in plugins:
        name = getattr(plugin, "__name__", None) or type(plugin).__name__
        _register(pm, plugin, name, f"test plugin {name}", "")
    _check_pending(pm)
    _check_unmarked(pm)
    return pm


def _load(ep: EntryPoint, dist: str, version: str) -> ModuleType:
    try:
        return ep.load()
    except Exception as err:  # any import-time failure of third-party code
        raise PluginImportError(
            f"Plugin {ep.name!r} from distribution {dist} {version} failed to import "
            f"({ep.value}): {type(err).__name__}: {err}. {_fix_hint(dist, version)}"
        ) from err


def _check_unmarked(pm: PluginManager) -> None:
    """Fail on a hook function without `@hookimpl`: pluggy never calls it, so everything it
    registers was reported as "Unknown reward 'x' ... Install the plugin that provides it"."""
    hooks = [name for name in dir(pm.hook) if not name.startswith("_")]
    for name, plugin in pm.list_name_plugin():
        unmarked = [hook for hook in hooks if callable(getattr(plugin, hook, None))
                    and pm.parse_hookimpl_opts(plugin, hook) is None]
        if unmarked:
            dist, version = pm.distribution_of(plugin)
            raise PluginError(
                f"{_origin(name, dist, version)} defines {', '.join(unmarked)} without @hookimpl, "
                "so it is never called. Decorate it: `from grpo_agent import hookimpl`, then "
                f"`@hookimpl` above `def {unmarked[0]}(...)`.")


def _check_pending(pm: PluginManager) -> None:
    """Fail on hook implementations whose name matches no hookspec (usually a typo)."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as err:
        plugin = err.plugin
        hooks = [
            name for name in dir(pm.hook)
            if not name.startswith("_") and getattr(pm.hook, name).spec is not None
        ]
        bad = [
            name for name in dir(plugin)
            if name not in hooks and pm.parse_hookimpl_opts(plugin, name) is not None
        ]
        suggestions = {name: difflib.get_close_matches(name, hooks, n=1) for name in bad}
        detail = "; ".join(
            f"{name!r} (did you mean {match[0]!r}?)" if match else repr(name)
            for name, match in suggestions.items()
        )
        raise PluginError(
            f"Plugin {pm.get_name(plugin)!r} from {_plugin_dist(pm, plugin)} implements unknown "
            f"hooks: {detail}. Known hooks: {', '.join(sorted(hooks))}."
        ) from err


def add_plugin_commands(pm: PluginManager, app: Any) -> list[str]:
    """Call each plugin's `register_commands` hook on the CLI's app; returns what went wrong.

    One plugin at a time, so a hook that raises is named and skipped: it used to end every
    command, `--help` and `plugins list` included, in its traceback."""
    problems = []
    plugins = pm.get_plugins()
    for name, plugin in pm.list_name_plugin():
        others = [other for other in plugins if other is not plugin]
        try:
            pm.subset_hook_caller("register_commands", remove_plugins=others)(app=app)
        except Exception as err:  # noqa: BLE001 -- third-party code; the other commands still work
            dist, version = pm.distribution_of(plugin)
            problems.append(f"{_origin(name, dist, version)} raised in its register_commands hook: "
                            f"{type(err).__name__}: {err}. {_fix_hint(dist, version)}")
    return problems


def plugin_manager(*, load_entry_points: bool = True) -> PluginManager:
    """The process-wide manager (cached per GRPO_AGENT_LOAD_PLUGINS value)."""
    key = (load_entry_points, os.environ.get(LOAD_ENV))
    if key not in _manager_cache:
        _manager_cache[key] = build_plugin_manager(load_entry_points=load_entry_points)
    return _manager_cache[key]


def resolve_hooks(pm: PluginManager) -> Registry:
    """Call every registration hook once per plugin into a fresh `Registry`.

    Each plugin's implementation is called through a pluggy subset caller holding only that
    plugin, so `register` knows which distribution registered what (and tracing still works).
    """
    registry = Registry()
    plugins = pm.get_plugins()
    for plugin_name, plugin in pm.list_name_plugin():
        dist, version = pm.distribution_of(plugin)
        before = _counts(registry)
        others = [other for other in plugins if other is not plugin]
        for hook_name, kind in hookspecs.HOOK_KINDS.items():
            if kind == "environment":
                register = registry.register_environment_callable(dist)
            else:
                register = registry.register_callable(kind, dist)
            try:
                pm.subset_hook_caller(hook_name, remove_plugins=others)(register=register)
            except ToolSchemaError as err:  # it names the tool, not the plugin that registered it
                fix = f"\n{_fix_hint(dist, version)}" if version else ""  # one installed, not yours
                raise ToolSchemaError(
                    f"{_origin(plugin_name, dist, version)}, in its {hook_name} hook: {err}{fix}"
                ) from err
            except PluginError:  # register's own refusals already name the problem and the fix
                raise
            except Exception as err:  # the plugin's code raised: say whose, not just a traceback
                impl = getattr(plugin, hook_name, None)
                wanted = list(getattr(pm.hook, hook_name).spec.argnames)
                missing = _missing_arguments(impl, wanted) if callable(impl) else ""
                raise PluginError(
                    f"{_origin(plugin_name, dist, version)} raised in its {hook_name} hook: "
                    f"{type(err).__name__}: {err}.{missing} {_fix_hint(dist, version)}"
                ) from err
        hooks = [hook.name for hook in pm.get_hookcallers(plugin) or []]
        problem = None if hooks else _no_hook_problem(plugin, plugin_name, dist, version)
        if problem:
            logger.warning(problem)
        registry.plugins.append(
            {
                "name": plugin_name,
                "distribution": dist,
                "version": version,
                "registered": _added(before, _counts(registry)),
                "hooks": hooks,
                "problem": problem,
            }
        )
    return registry


def _no_hook_problem(plugin: Any, name: str, dist: str, version: str) -> str:
    """What to say of a plugin that implements no hook: it can register nothing, which is almost
    always a mistake (a hook left unwritten, or its `@hookimpl` on a misnamed function); the
    objects its module marked (`@environment`, `@reward`, ...) name the hook to write."""
    hook_of = {kind: hook for hook, kind in hookspecs.HOOK_KINDS.items()}
    module = getattr(plugin, "__name__", None)
    marked = []
    for attr, obj in sorted(vars(plugin).items()) if isinstance(plugin, ModuleType) else []:
        marker = get_marker(obj)
        home = getattr(obj, "__module__", None) or ""
        if marker and marker.kind in hook_of and (home == module or home.startswith(f"{module}.")):
            marked.append((marker.kind, attr))
    defines = ("; its module marks " + ", ".join(f"{kind} {attr}" for kind, attr in marked)
               + " but never registers them" if marked else "")
    kind, attr = marked[0] if marked else ("environment", "MyEnv")
    above = "" if marked else "a registration hook such as "
    return (f"{_origin(name, dist, version)} implements no hook, so it registers nothing"
            f"{defines}. Register what it provides in its module: `from grpo_agent import "
            f"hookimpl`, then `@hookimpl` above {above}`def {hook_of[kind]}(register): "
            f"register({attr})`. {_fix_hint(dist, version)}")


def _counts(registry: Registry) -> dict[str, set[str]]:
    return {kind: set(table) for kind, table in registry.entries.items()}


def _added(before: dict[str, set[str]], after: dict[str, set[str]]) -> dict[str, list[str]]:
    return {kind: sorted(after[kind] - before[kind]) for kind in after if after[kind] - before[kind]}


def load_registry(*, load_entry_points: bool = True) -> Registry:
    """Built-ins plus installed plugins, resolved once per process (and GRPO_AGENT_LOAD_PLUGINS)."""
    key = (load_entry_points, os.environ.get(LOAD_ENV))
    if key not in _cache:
        _cache[key] = resolve_hooks(plugin_manager(load_entry_points=load_entry_points))
    return _cache[key]


def load_environment(name: str, **options: Any) -> EnvironmentSpec:
    """The registered env `name` with `options` checked and bound: a zero-argument factory.

    The one Python form of env options: `environment_factory=load_environment("coding",
    suite="humaneval")`, with `train_dataset=env.load_dataset()` for envs that ship data.
    """
    return load_registry().environment_spec(name, options)


def build_registry(*plugins: Any, load_entry_points: bool = False) -> Registry:
    """A fresh, uncached registry of the built-ins plus the given plugin objects (for tests)."""
    return resolve_hooks(build_plugin_manager(load_entry_points=load_entry_points, plugins=plugins))


def clear_cache() -> None:
    """Forget cached managers and registries (after installing a plugin in-process)."""
    _cache.clear()
    _manager_cache.clear()

