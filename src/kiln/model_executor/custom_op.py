"""Custom ops: a pure-PyTorch reference plus per-provider implementations chosen by priority.

Every layer whose speed depends on the hardware (norms, activations, rotary embedding, linear,
embedding) is a ``CustomOp``: a ``torch.nn.Module`` with a ``forward_native`` that is the reference.
A provider (a platform plugin, a kernel library) registers an implementation of an op for a device
type with a priority, and optionally a ``supports(module, *args, **kwargs)`` predicate. A call picks
the highest-priority implementation for the registry's ``device_type`` whose predicate accepts the
call, and falls back to ``forward_native``.

An implementation is a function ``fn(module, *args, **kwargs)`` with the same contract as the op's
``forward_native``: it may read the module's parameters and attributes.

This module knows nothing about models or platforms. The plugin lifecycle sets the device type to
dispatch on once, when it selects the process's platform (``OpRegistry.select_device``); until then
(a layer built and run outside any engine) every call runs ``forward_native``. A forward never
selects a platform.

``is_capturing()`` tells an implementation that the model is being recorded into a graph
(``torch.compile`` or ``torch.jit.trace``, a platform's graph wrapper) rather than run: it must
then call dispatcher ops (``torch.ops.*``), which a graph records, never Python bindings of a
kernel, which a graph cannot see.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kiln.plugins.registry import Override, Registry, current_source, describe

ImplFn = Callable[..., Any]


def is_capturing() -> bool:
    """Whether the running forward is being compiled (``torch.compile``) or traced
    (``torch.jit.trace``) into a graph; see the module docstring."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


@dataclass(frozen=True)
class OpImpl:
    """One registered implementation of an op."""

    op: str
    provider: str
    device_type: str
    fn: ImplFn
    priority: int
    supports: Callable[..., bool] | None
    source: str


class OpRegistry:
    """Ops by name, and their implementations by (provider, device type)."""

    def __init__(self) -> None:
        self.ops: Registry[type[CustomOp]] = Registry("op")
        self._impls: dict[str, dict[tuple[str, str], OpImpl]] = {}
        self.overrides: list[Override] = []
        self.device_type: str | None = None
        """The device type calls dispatch on; None: no platform selected, ``forward_native``."""
        # Bumped on every change so that ops re-resolve their candidate lists lazily.
        self.generation = 0

    def select_device(self, device_type: str | None) -> None:
        """Dispatch every later call on ``device_type``'s implementations (None: none of them).
        Called by the plugin lifecycle when it selects the process's platform."""
        if device_type != self.device_type:
            self.device_type = device_type
            self.generation += 1

    def register_op(self, name: str, *, override: bool = False) -> Callable[[type], type]:
        """Class decorator: make a ``CustomOp`` subclass known under ``name``."""

        def decorator(cls: type) -> type:
            if not (isinstance(cls, type) and issubclass(cls, CustomOp)):
                raise TypeError(f"{describe(cls)} must subclass CustomOp to register as an op")
            cls.op_name = name
            self.ops.register(name, cls, override=override)
            self.generation += 1
            return cls

        return decorator

    def register_impl(
        self,
        op: str,
        provider: str,
        *,
        device_type: str,
        priority: int = 0,
        supports: Callable[..., bool] | None = None,
        override: bool = False,
    ) -> Callable[[ImplFn], ImplFn]:
        """Decorator: register ``fn(module, *args, **kwargs)`` as ``provider``'s version of ``op``.

        Registering the same implementation again is a no-op, so that a plugin's ``register()``
        is idempotent: the same function, priority and ``supports`` predicate, where a function
        or predicate defined inside ``register()`` (a nested ``def`` or a ``lambda``: each run
        makes a new object) counts as the same when its qualified name, code, defaults and
        captured values are. Module-level functions need none of this.

        Raises:
            ValueError: ``provider`` already has a different implementation of ``op`` for
                ``device_type`` and ``override`` is false.
        """

        def decorator(fn: ImplFn) -> ImplFn:
            impl = OpImpl(op, provider, device_type, fn, priority, supports, current_source())
            impls = self._impls.setdefault(op, {})
            old = impls.get((provider, device_type))
            if old is not None and not _same_impl(old, impl):
                if not override:
                    raise ValueError(
                        f"op {op!r} already has an implementation from provider {provider!r} for "
                        f"device {device_type!r} ({describe(old.fn)}, by {old.source}); "
                        "pass override=True to replace it"
                    )
                self.overrides.append(
                    Override(
                        "op",
                        f"{op}[{provider}@{device_type}]",
                        describe(old.fn),
                        describe(fn),
                        old.source,
                        impl.source,
                    )
                )
            if old is None or not _same_impl(old, impl):
                impls[(provider, device_type)] = impl
                self.generation += 1
            return fn

        return decorator

    def implemented_ops(self) -> list[str]:
        """Names that have at least one implementation registered (defined as ops or not)."""
        return [op for op, impls in self._impls.items() if impls]

    def implementations(self, op: str, device_type: str | None = None) -> list[OpImpl]:
        """``op``'s implementations (for ``device_type`` if given), highest priority first."""
        impls = [
            impl
            for impl in self._impls.get(op, {}).values()
            if device_type is None or impl.device_type == device_type
        ]
        return sorted(impls, key=lambda impl: -impl.priority)


def _same_impl(a: OpImpl, b: OpImpl) -> bool:
    return (
        _same_function(a.fn, b.fn)
        and a.priority == b.priority
        and _same_function(a.supports, b.supports)
    )


def _same_function(a: Callable[..., Any] | None, b: Callable[..., Any] | None) -> bool:
    """Whether two implementations or ``supports`` predicates are the same object, or functions
    of the same qualified name, code, defaults and captured values: a nested function or a lambda
    re-created by running the same ``register()`` again."""
    if a is b:
        return True
    code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if code_a is None or code_a != code_b:
        return False
    if getattr(a, "__qualname__", None) != getattr(b, "__qualname__", None):
        return False
    try:
        cells_a = [c.cell_contents for c in a.__closure__ or ()]  # type: ignore[union-attr]
        cells_b = [c.cell_contents for c in b.__closure__ or ()]  # type: ignore[union-attr]
        same_cells = len(cells_a) == len(cells_b) and all(
            x is y or x == y for x, y in zip(cells_a, cells_b, strict=True)
        )
        return bool(same_cells and a.__defaults__ == b.__defaults__)  # type: ignore[union-attr]
    except (ValueError, TypeError, RuntimeError):  # an empty cell, or == that cannot answer
        return False


OP_REGISTRY = OpRegistry()


class CustomOp(torch.nn.Module):
    """Base of every dispatchable layer. Subclasses define ``forward_native``."""

    op_name: ClassVar[str] = ""

    def __init__(self) -> None:
        super().__init__()
        self._dispatch_generation = -1
        self._candidates: list[OpImpl] = []

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define forward_native")

    @classmethod
    def make_examples(cls, generator: torch.Generator) -> list[tuple[CustomOp, tuple, dict]]:
        """Sample ``(op instance, args, kwargs)`` calls on CPU tensors drawn from ``generator``.

        The conformance kit runs every registered implementation on these and compares it with
        ``forward_native``; an op without examples cannot be checked (the kit reports it).
        """
        return []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._dispatch_generation != OP_REGISTRY.generation:
            self._refresh_candidates()
        for impl in self._candidates:
            if impl.supports is None or impl.supports(self, *args, **kwargs):
                return impl.fn(self, *args, **kwargs)
        return self.forward_native(*args, **kwargs)

    def selected_impl(self, *args: Any, **kwargs: Any) -> str:
        """The provider that would run this call (``"native"`` for ``forward_native``)."""
        self._refresh_candidates()
        for impl in self._candidates:
            if impl.supports is None or impl.supports(self, *args, **kwargs):
                return impl.provider
        return "native"

    def _refresh_candidates(self) -> None:
        device_type = OP_REGISTRY.device_type
        self._candidates = (
            [] if device_type is None else OP_REGISTRY.implementations(self.op_name, device_type)
        )
        self._dispatch_generation = OP_REGISTRY.generation


register_op = OP_REGISTRY.register_op
register_impl = OP_REGISTRY.register_impl
