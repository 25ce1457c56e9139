"""Named registries with explicit overrides: the second way into Kiln, after config strings.

A registry maps a name (an architecture, a loader, an op provider) to an entry. Registering a name
that exists is an error unless the caller says ``override=True``; every override is recorded, with
the plugin that made it, so ``kiln plugins`` can show what changed. This module knows nothing about
what the entries are.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

# The plugin whose register() is running, so registrations can be attributed to it.
_current_source: contextvars.ContextVar[str] = contextvars.ContextVar("kiln_source", default="kiln")


@contextlib.contextmanager
def registering_as(source: str) -> Iterator[None]:
    """Attribute every registration made inside the block to ``source`` (a plugin name)."""
    token = _current_source.set(source)
    try:
        yield
    finally:
        _current_source.reset(token)


def current_source() -> str:
    """The name of the plugin registering now, or ``"kiln"`` for the core."""
    return _current_source.get()


@dataclass(frozen=True)
class Override:
    """One replaced registry entry, for introspection."""

    registry: str
    name: str
    old: str
    new: str
    old_source: str
    source: str


@dataclass(frozen=True)
class Entry(Generic[T]):
    value: T
    source: str


class Registry(Generic[T]):
    """A name -> entry map that refuses silent replacement.

    Args:
        kind: what the registry holds ("model", "loader"), used in messages and introspection.
        builtins: Kiln's own entries, attributed to ``"kiln"`` whichever plugin's ``register()``
            is running when the registry's module is first imported.

    Side effect: the registry is listed by ``registries()`` while it lives.
    """

    def __init__(self, kind: str, builtins: Mapping[str, T] | None = None) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}
        self.overrides: list[Override] = []
        self.register_builtins(builtins or {})
        _registries.append(weakref.ref(self))

    def register_builtins(self, entries: Mapping[str, T]) -> None:
        """Add Kiln's own ``entries`` (attributed to ``"kiln"``, not to a running plugin)."""
        with registering_as("kiln"):
            for name, value in entries.items():
                self.register(name, value)

    def register(self, name: str, value: T, *, override: bool = False) -> None:
        """Add ``name``.

        Raises:
            ValueError: ``name`` exists, ``override`` is false, and the entry differs. Registering
                the same value again is allowed, so that plugin registration is idempotent.
        """
        source = current_source()
        old = self._entries.get(name)
        if old is not None and old.value != value:
            if not override:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by {old.source}: "
                    f"{describe(old.value)}); pass override=True to replace it"
                )
            self.overrides.append(
                Override(self.kind, name, describe(old.value), describe(value), old.source, source)
            )
        if old is None or old.value != value:
            self._entries[name] = Entry(value, source)

    def get(self, name: str) -> T:
        """The entry for ``name``.

        Raises:
            KeyError: unknown name; the message lists the registered names.
        """
        try:
            return self._entries[name].value
        except KeyError:
            raise KeyError(
                f"unknown {self.kind} {name!r}; registered: {sorted(self._entries)}"
            ) from None

    def source_of(self, name: str) -> str:
        return self._entries[name].source

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def items(self) -> list[tuple[str, T]]:
        return [(name, entry.value) for name, entry in self._entries.items()]


_registries: list[weakref.ref[Registry]] = []


def registries() -> list[Registry]:
    """Every registry alive in this process, in the order they were made (their modules were
    imported): what ``kiln plugins`` lists plugin registrations and overrides from, whatever layer
    a registry lives in (a registry with a plugin's entries was imported by that plugin)."""
    alive = [registry for ref in _registries if (registry := ref()) is not None]
    _registries[:] = [weakref.ref(registry) for registry in alive]
    return alive


def describe(value: object) -> str:
    """A short, stable description of a registry value (dotted path for classes and functions)."""
    if isinstance(value, str):
        return value
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if module and qualname:
        return f"{module}.{qualname}"
    return repr(value)
