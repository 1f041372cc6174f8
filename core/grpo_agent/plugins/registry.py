"""Plain registries that the plugin hooks resolve into, and name -> object resolution.

Design decision: the registry is a dumb set of dictionaries filled once at start-up; the
rollout and training code only look names up. Each entry remembers the distribution that
registered it, so a duplicate name is an error naming both distributions (a run must never
change meaning with install order). Wherever a name is accepted, an import path
`package.module:attr` works too, and callables pass through unchanged.
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from grpo_agent.plugins.decorators import get_marker
from grpo_agent.plugins.errors import (
    DuplicateNameError,
    OptionError,
    PluginError,
    UnknownNameError,
    unknown_name_message,
)
from grpo_agent.plugins.hookspecs import HOOK_KINDS
from grpo_agent.plugins.options import Option, bind_options, check_takes_options, declared_options
from grpo_agent.plugins.schemas import method_tool_schema, public_tool_names, tool_schema

KINDS = tuple(HOOK_KINDS.values())


def scores_itself(factory: Any) -> bool:
    """Whether the env class (or a `functools.partial` of it) defines `get_reward()`."""
    return callable(getattr(getattr(factory, "func", factory), "get_reward", None))


@dataclass
class EnvironmentSpec:
    """A registered environment: the class plus the data and rewards it declares.

    `option_values` are the typed option values (defaults unless bound with `bind`); they are
    passed as keyword arguments to the class, `dataset` and `eval_dataset`. A spec is itself a
    zero-argument environment factory, so `environment_factory=load_environment(name, **opts)`
    works wherever a factory does.
    """

    name: str
    factory: type
    version: int | None = None
    distribution: str = ""
    dataset: Callable[[], Any] | None = None
    rewards: list[str | Callable] = field(default_factory=list)
    description: str = ""
    tool_examples: dict[str, dict[str, Any]] = field(default_factory=dict)
    gold: Callable[[Any, dict], str | None] | None = None
    options: tuple[Option, ...] = ()
    option_values: dict[str, Any] = field(default_factory=dict)
    eval_dataset: Callable[..., Any] | None = None
    success_threshold: float | None = None  # reward at which a rollout counts as solved (eval)
    # The registry the spec came from: `reward_funcs()` resolves reward names there. It stays
    # behind when the spec is pickled (the worker gets the spec, not every plugin).
    registry: Registry | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "registry": None}

    def __call__(self) -> Any:
        """A new environment instance built with this spec's option values."""
        return self.factory(**self.option_values)

    def bind(self, given: Mapping[str, Any] | None) -> EnvironmentSpec:
        """A copy with `given` options checked and typed over the defaults."""
        return replace(self, option_values=bind_options(self.options, given, f"environment {self.name!r}"))

    @property
    def id(self) -> str:
        """The versioned id (`counter-v1`), or the bare name for unversioned envs."""
        return f"{self.name}-v{self.version}" if self.version is not None else self.name

    @property
    def environment_factory(self) -> Callable[[], Any]:
        """The class, or the class with the option values bound (it pickles either way)."""
        if not self.option_values:
            return self.factory
        return functools.partial(self.factory, **self.option_values)

    @property
    def tool_names(self) -> list[str]:
        return public_tool_names(self.factory)

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [method_tool_schema(self.factory, name) for name in self.tool_names]

    def load_dataset(self) -> Any:
        """The env's `datasets.Dataset`, or None when `reset` samples its own tasks."""
        return None if self.dataset is None else self.dataset(**self.option_values)

    def load_eval_dataset(self) -> Any:
        """The env's evaluation split, or None when it declares none."""
        return None if self.eval_dataset is None else self.eval_dataset(**self.option_values)

    def reward_funcs(self, registry: Registry | None = None,
                     plugin_args: Mapping[str, Mapping] | None = None) -> list[Callable]:
        """The env's declared rewards, resolved to functions (by default through the registry
        the spec came from), each with the options it declares bound from `plugin_args`."""
        registry = registry if registry is not None else self.registry
        if registry is None:
            names = [ref for ref in self.rewards if isinstance(ref, str)]
            if names:
                raise ValueError(
                    f"Environment {self.name!r} names its rewards {names}, but this spec came "
                    "from no registry to look them up in; pass one: "
                    "reward_funcs(grpo_agent.plugins.load_registry()).")
            return [with_options("reward", ref, ref, plugin_args) for ref in self.rewards]
        return [registry.bind_plugin("reward", ref, plugin_args) for ref in self.rewards]


@dataclass
class Entry:
    """One registered object and the distribution that registered it."""

    obj: Any
    distribution: str


def _describe(obj: Any) -> str:
    doc = (getattr(obj, "__doc__", None) or "").strip()
    return doc.splitlines()[0] if doc else ""


class Registry:
    """Everything the installed plugins registered, by kind and name."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
        self.aliases: dict[str, str] = {}  # unversioned env name -> latest versioned id
        self.plugins: list[dict[str, Any]] = []  # what `plugins list` shows

    # ---- plain views --------------------------------------------------------------------

    @property
    def environments(self) -> dict[str, EnvironmentSpec]:
        return {name: e.obj for name, e in self.entries["environment"].items()}

    @property
    def tools(self) -> dict[str, Callable]:
        return {name: e.obj for name, e in self.entries["tool"].items()}

    @property
    def rewards(self) -> dict[str, Callable]:
        return {name: e.obj for name, e in self.entries["reward"].items()}

    @property
    def advantage_estimators(self) -> dict[str, Callable]:
        return {name: e.obj for name, e in self.entries["advantage_estimator"].items()}

    @property
    def prompt_filters(self) -> dict[str, Callable]:
        return {name: e.obj for name, e in self.entries["prompt_filter"].items()}

    @property
    def agents(self) -> dict[str, Callable]:
        return {name: e.obj for name, e in self.entries["agent"].items()}

    def distribution_of(self, kind: str, name: str) -> str:
        return self.entries[kind][self._canonical(kind, name)].distribution

    # ---- registration (called through the hooks) ----------------------------------------

    def add(self, kind: str, name: str, obj: Any, distribution: str) -> None:
        """Add one object; a name already taken raises, naming both distributions."""
        table = self.entries[kind]
        if name in table:
            other = table[name].distribution
            raise DuplicateNameError(
                f"The {kind} name {name!r} is registered twice: by {other} and by {distribution}. "
                f"Uninstall one of them, or leave one out by naming the plugins to load: "
                f"GRPO_AGENT_LOAD_PLUGINS=NAME,... (entry-point or distribution names)."
            )
        table[name] = Entry(obj, distribution)

    def register_callable(self, kind: str, distribution: str) -> Callable[..., None]:
        """The `register(obj, name=None)` callable a hook receives for one kind."""

        def register(obj: Any, name: str | None = None) -> None:
            marker = get_marker(obj)
            resolved = name or (marker.name if marker else None) or getattr(obj, "__name__", None)
            if not resolved:
                raise PluginError(f"{distribution} registered a {kind} without a name: {obj!r}.")
            if kind == "tool":
                tool_schema(obj)  # a tool without hints/docstring fails here, by name
            if declared_options(obj):
                check_takes_options(obj, declared_options(obj),
                                    f"The {kind.replace('_', ' ')} {resolved!r} (from {distribution})")
            self.add(kind, resolved, obj, distribution)

        return register

    def register_environment_callable(self, distribution: str) -> Callable[..., None]:
        """`register(EnvClass, name=None)` for `register_environments`."""

        def register(cls: type, name: str | None = None) -> None:
            spec = environment_spec_from_class(cls, name, distribution, registry=self)
            spec.tool_schemas()  # every tool method must have a schema
            env = f"environment {spec.name!r} (from {distribution})"
            for func, what in ((cls, f"The class {cls.__qualname__} of {env}"),
                               (spec.dataset, f"The dataset function of {env}"),
                               (spec.eval_dataset, f"The eval_dataset function of {env}")):
                if func is not None:
                    check_takes_options(func, spec.options, what)
            self.add("environment", spec.id, spec, distribution)
            if spec.version is not None:
                latest = self.aliases.get(spec.name)
                if latest is None or self.environments[latest].version < spec.version:
                    self.aliases[spec.name] = spec.id

        return register

    # ---- resolution ---------------------------------------------------------------------

    def _canonical(self, kind: str, name: str) -> str:
        table = self.entries[kind]
        if name in table:
            return name
        if kind == "environment" and name in self.aliases:
            return self.aliases[name]
        known = list(table) + (list(self.aliases) if kind == "environment" else [])
        raise UnknownNameError(unknown_name_message(kind.replace("_", " "), name, known))

    def _lookup(self, kind: str, ref: Any) -> Any:
        if not isinstance(ref, str):
            return ref
        if ":" in ref:
            return import_object(ref)
        return self.entries[kind][self._canonical(kind, ref)].obj

    def resolve_reward(self, ref: str | Callable) -> Callable:
        return self._lookup("reward", ref)

    def resolve_tool(self, ref: str | Callable) -> Callable:
        return self._lookup("tool", ref)

    def resolve_advantage_estimator(self, ref: str | Callable) -> Callable:
        return self._lookup("advantage_estimator", ref)

    def resolve_prompt_filter(self, ref: str | Callable) -> Callable:
        return self._lookup("prompt_filter", ref)

    def resolve_agent(self, ref: str | Callable) -> Callable:
        return self._lookup("agent", ref)

    def bind_plugin(self, kind: str, ref: str | Callable, plugin_args: Mapping[str, Mapping] | None) -> Callable:
        """`kind`'s object for `ref` with the options it declares bound (see `with_options`)."""
        return with_options(kind, self._lookup(kind, ref), ref, plugin_args)

    def names_of(self, kind: str, objects: list[Any]) -> list[str]:
        """The registered names of `objects` (a bound plugin counts as the function it wraps)."""
        wanted = {id(getattr(obj, "func", obj)) for obj in objects}
        return [name for name, entry in self.entries[kind].items() if id(entry.obj) in wanted]

    def check_plugin_args(self, plugin_args: Mapping[str, Mapping] | None, used: Mapping[str, list]) -> None:
        """Every `plugin_args` entry names a plugin in use and only options it declares.

        `used` maps a kind to the names the config selects (e.g. {"prompt_filter": [...]}).
        """
        for name, given in (plugin_args or {}).items():
            objects = [self._lookup(kind, name) for kind, names in used.items() if name in names]
            if not objects:
                in_use = sorted({n for names in used.values() for n in names if isinstance(n, str)})
                raise OptionError(
                    f"plugin_args names {name!r}, which this run does not use. Plugins in use: "
                    f"{', '.join(in_use) or '(none)'}; name one of them, or select {name!r} first."
                )
            declared = {o.name: o for obj in objects for o in declared_options(obj)}
            self._refuse_options_of_unselected_kinds(name, given, declared, used)
            bind_options(tuple(declared.values()), given, f"plugin {name!r}")

    def _refuse_options_of_unselected_kinds(self, name: str, given: Mapping, declared: Mapping,
                                            used: Mapping[str, list]) -> None:
        """An option that `name`'s objects in use lack but another of its kinds declares: the
        run does not select that kind. Said so, since "takes no options" would contradict
        `plugins list` (curriculum's `pass_rate_cap` belongs to its prompt filter, not its
        advantage estimator)."""
        for option in given:
            if option in declared:
                continue
            for kind, names in used.items():
                if name in names or name not in self.entries.get(kind, {}):
                    continue
                if option in {o.name for o in declared_options(self.entries[kind][name].obj)}:
                    select = {"prompt_filter": f"--set prompt_filters={name}",
                              "advantage_estimator": f"--set advantage_estimator={name}"}
                    raise OptionError(
                        f"Option {option!r} of plugin {name!r} belongs to its "
                        f"{kind.replace('_', ' ')}, which this run does not select: select it "
                        f"({select.get(kind, f'add the {name!r} ' + kind.replace('_', ' '))}) or "
                        "remove the option.")

    def environment_spec(self, name: str, options: Mapping[str, Any] | None = None) -> EnvironmentSpec:
        """The full spec (class, dataset, rewards) of an environment, its options bound."""
        if ":" in name:
            cls = import_object(name)
            return environment_spec_from_class(cls, None, cls.__module__, registry=self).bind(options)
        spec = self.entries["environment"][self._canonical("environment", name)].obj
        return spec.bind(options)

    def resolve_environment(self, ref: Any) -> Callable | dict[str, Callable]:
        """A name, import path, class, or dict of those -> the factory (or dict of factories)."""
        if isinstance(ref, dict):
            return {key: self.resolve_environment(value) for key, value in ref.items()}
        if isinstance(ref, str):
            return self.environment_spec(ref).environment_factory
        return ref


def environment_spec_from_class(cls: type, name: str | None, distribution: str, *,
                                registry: Registry | None = None) -> EnvironmentSpec:
    """Read the `@environment` marker (if any) of a class into an `EnvironmentSpec`."""
    if not isinstance(cls, type) or not callable(getattr(cls, "reset", None)):
        raise PluginError(
            f"{distribution} registered {cls!r} as an environment, but an environment must be a "
            "class with a reset(**row) method."
        )
    marker = get_marker(cls)
    options = dict(marker.options) if marker and marker.kind == "environment" else {}
    return EnvironmentSpec(
        name=name or (marker.name if marker else None) or cls.__name__,
        factory=cls,
        version=options.get("version"),
        distribution=distribution,
        dataset=options.get("dataset"),
        rewards=list(options.get("rewards", ())),
        description=options.get("description") or _describe(cls),
        tool_examples=dict(options.get("tool_examples", {})),
        gold=options.get("gold"),
        options=tuple(options.get("options", ())),
        option_values={option.name: option.default for option in options.get("options", ())},
        eval_dataset=options.get("eval_dataset"),
        success_threshold=options.get("success_threshold"),
        registry=registry,
    )


def with_options(kind: str, obj: Any, ref: Any, plugin_args: Mapping[str, Mapping] | None) -> Any:
    """`obj` with its declared options bound as keywords: defaults, overlaid with
    `plugin_args[name]`, where the name is `ref` when it is one, else the decorator's name.

    `plugin_args` maps a registered name to its options; every object of that name gets the
    options it declares, so one entry configures a plugin's reward, filter and estimator alike.
    """
    declared = declared_options(obj)
    if not declared:
        return obj
    marker = get_marker(obj)
    name = ref if isinstance(ref, str) else ((marker and marker.name) or getattr(obj, "__name__", None))
    given = dict((plugin_args or {}).get(name, {})) if name else {}
    mine = {key: value for key, value in given.items() if key in {o.name for o in declared}}
    return functools.partial(obj, **bind_options(declared, mine, f"{kind.replace('_', ' ')} {name!r}"))


def import_object(path: str) -> Any:
    """Import `package.module:attr` (the escape hatch wherever a name is accepted)."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise PluginError(f"Cannot import {module_name!r} from {path!r}: {err}.") from err
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"Module {module_name!r} has no attribute {attr!r} (from {path!r}).")
        obj = getattr(obj, part)
    return obj
