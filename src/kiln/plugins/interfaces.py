"""Checking, at resolve time, that the classes a platform names implement Kiln's interfaces.

A platform names classes by dotted path (``worker_cls``, ``attention_backend``...). Instead of a
crash deep in a worker when a method is missing or takes other arguments, Kiln resolves each name
once and compares the class with its interface: every public method of the interface must exist
and accept the interface's parameters (same positional names in order; extra parameters only with
defaults).

Subclassing: not required for the worker, model runner, scheduler, communicator and graph wrapper
(matching the interface is enough); REQUIRED for the attention backend, which must subclass
``AttentionBackend`` and is checked by ``validate_attention_backend`` (its impl and metadata
builder classes too). ``resolve_class`` applies exactly the check the core applies when it uses
the class, so ``kiln plugins`` and the conformance kit say "ok" only for what will run.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.utils import resolve_obj_by_qualname

if TYPE_CHECKING:
    from kiln.config import KilnConfig


@dataclass(frozen=True)
class NamedClass:
    """What Kiln knows about one class a platform names in ``config.device``."""

    interface: str
    """Dotted path of the interface the class must implement."""
    factory: str
    """The ``Platform`` classmethod that returns the default dotted path for the field."""
    validator: str | None = None
    """Dotted path of the core's own check, used instead of ``check_implements`` (raises
    ``TypeError`` naming what is wrong); None: ``check_implements`` against ``interface``."""
    takes_config: bool = False
    """Whether ``factory`` takes the config (its default depends on other settings)."""


CLASS_FIELDS: dict[str, NamedClass] = {
    "worker_cls": NamedClass("kiln.worker.worker_base.WorkerBase", "get_worker_cls"),
    "model_runner_cls": NamedClass(
        "kiln.worker.worker_base.ModelRunnerBase", "get_model_runner_cls"
    ),
    "scheduler_cls": NamedClass("kiln.scheduler.interface.SchedulerInterface", "get_scheduler_cls"),
    "attention_backend": NamedClass(
        "kiln.model_executor.layers.attention.backend.AttentionBackend",
        "get_attn_backend_cls",
        validator="kiln.model_executor.layers.attention.backend.validate_attention_backend",
        takes_config=True,
    ),
    "communicator_cls": NamedClass(
        "kiln.distributed.communicator.Communicator", "get_communicator_cls"
    ),
    "graph_wrapper_cls": NamedClass("kiln.worker.graph.GraphWrapper", "get_graph_wrapper_cls"),
    "proposer_cls": NamedClass(
        "kiln.spec_decode.interface.ProposerBase", "get_proposer_cls", takes_config=True
    ),
    "rejection_sampler_cls": NamedClass(
        "kiln.spec_decode.interface.RejectionSamplerBase", "get_rejection_sampler_cls"
    ),
}
"""The ``DeviceConfig`` fields a platform fills with dotted paths, in the order the report shows
them: the one table of them (the platform's default factories, the config's check that none is
left ``"auto"``, the interface checks and the report all read it)."""


class InterfaceError(TypeError):
    """A class that does not implement the interface its config field requires."""


def _required_members(interface: type) -> dict[str, Any]:
    members = {}
    for klass in reversed(interface.__mro__[:-1]):  # skip object
        for name, value in vars(klass).items():
            if name == "__init__" or not name.startswith("_"):
                if callable(value) or isinstance(value, (classmethod, staticmethod)):
                    members[name] = value
    return members


def _params(func: Any, drop_first: bool) -> list[inspect.Parameter] | None:
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    return params[1:] if drop_first and params else params


def _unwrap(owner: type, name: str) -> tuple[str, Any]:
    """``(kind, function)``: kind is method, classmethod or staticmethod."""
    raw = inspect.getattr_static(owner, name)
    if isinstance(raw, classmethod):
        return "classmethod", raw.__func__
    if isinstance(raw, staticmethod):
        return "staticmethod", raw.__func__
    return "method", raw


def _signature_problem(cls: type, interface: type, name: str) -> str | None:
    want_kind, want_fn = _unwrap(interface, name)
    got_kind, got_fn = _unwrap(cls, name)
    if want_kind != "method" and got_kind != want_kind:
        return f"must be a {want_kind}, is a {got_kind}"
    # Unbound functions: drop self/cls from both so that the parameters line up.
    want = _params(want_fn, drop_first=want_kind != "staticmethod")
    got = _params(got_fn, drop_first=got_kind != "staticmethod")
    if want is None or got is None:
        return None
    has_var_pos = any(p.kind is p.VAR_POSITIONAL for p in got)
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in got)
    got_by_name = {p.name: p for p in got}
    positional_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    got_positional = [p.name for p in got if p.kind in positional_kinds]
    for index, param in enumerate(p for p in want if p.kind in positional_kinds):
        if index < len(got_positional):
            if got_positional[index] != param.name and not has_var_pos:
                return (
                    f"parameter {index + 1} is {got_positional[index]!r}, the interface has "
                    f"{param.name!r}"
                )
        elif not has_var_pos:
            return f"does not accept parameter {param.name!r}"
    for param in want:
        if param.kind is inspect.Parameter.KEYWORD_ONLY and param.name not in got_by_name:
            if not has_var_kw:
                return f"does not accept keyword {param.name!r}"
    wanted = {p.name for p in want}
    for param in got:
        if (
            param.name not in wanted
            and param.default is inspect.Parameter.empty
            and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
        ):
            return f"requires parameter {param.name!r} that the interface does not pass"
    return None


def check_implements(cls: type, interface: type) -> None:
    """Raise ``InterfaceError`` naming the class and the method unless ``cls`` matches.

    Raises:
        InterfaceError: ``cls`` is not a class, lacks a method, or a method's signature differs.
    """
    if not isinstance(cls, type):
        raise InterfaceError(
            f"{cls!r} is not a class (expected an implementation of {interface.__qualname__})"
        )
    if issubclass(cls, interface) and inspect.isabstract(cls):
        missing = sorted(getattr(cls, "__abstractmethods__", ()))  # set: isabstract holds
        raise InterfaceError(
            f"{cls.__module__}.{cls.__qualname__} does not implement {missing} of "
            f"{interface.__qualname__}"
        )
    for name in _required_members(interface):
        if not hasattr(cls, name):
            raise InterfaceError(
                f"{cls.__module__}.{cls.__qualname__} lacks method {name!r} of "
                f"{interface.__qualname__}"
            )
        problem = _signature_problem(cls, interface, name)
        if problem:
            raise InterfaceError(
                f"{cls.__module__}.{cls.__qualname__}.{name} is incompatible with "
                f"{interface.__qualname__}.{name}: {problem}"
            )


def resolve_class(field: str, qualname: str) -> type:
    """Import the class ``qualname`` named by config ``field`` and check its interface.

    Raises:
        ImportError / AttributeError: the path does not resolve (the message names it).
        InterfaceError: the class does not implement the field's interface.
    """
    cls = resolve_obj_by_qualname(qualname)
    spec = CLASS_FIELDS[field]
    if spec.validator is not None:
        try:
            resolve_obj_by_qualname(spec.validator)(cls)
        except TypeError as exc:
            raise InterfaceError(str(exc)) from None
        return cls
    check_implements(cls, resolve_obj_by_qualname(spec.interface))
    return cls


def resolve_named_classes(config: KilnConfig) -> dict[str, type]:
    """Resolve and check every class ``config.device`` names (``CLASS_FIELDS``), as the
    engine core does before it builds anything, so that a class the core would only use later
    (the communicator, the graph wrapper) fails at start-up.

    Raises:
        InterfaceError: a class that does not resolve or fails its check; the message names the
            config field and the class.
    """
    classes = {}
    for name in CLASS_FIELDS:
        qualname = getattr(config.device, name)
        try:
            classes[name] = resolve_class(name, qualname)
        except (ImportError, AttributeError, TypeError) as exc:
            raise InterfaceError(f"device.{name} = {qualname}: {exc}") from exc
    return classes
