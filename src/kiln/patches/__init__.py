"""The patch registry: the last way into Kiln, for where no hook exists yet.

A plugin declares a patch instead of assigning to Kiln's internals itself::

    PATCH_REGISTRY.register(
        target="kiln.engine.core:EngineCore.step",
        replacement=my_step,
        scope="platform",                     # or "worker"
        reason="needs a hook before execute_model (#123)",
        fingerprint="3f2a9c0d1e4b5a67",       # fingerprint(target) when the patch was written
        on_mismatch="refuse",                 # or "warn"
    )

The registry applies each patch once per process, in its scope's phase of the lifecycle
(``platform``: when the platform is selected, in every process; ``worker``: when a worker starts).
When the target is missing, or its source no longer matches the fingerprint (the code moved on
since the patch was written), the patch is refused (or applied with a loud warning if the plugin
chose ``on_mismatch="warn"``). Every patch and its status per process is shown by ``kiln plugins``.
Each patch is a sign of a missing hook: ask for the hook.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import os
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.plugins.registry import current_source

logger = logging.getLogger(__name__)

SCOPES = ("platform", "worker")
ON_MISMATCH = ("refuse", "warn")


class PatchError(RuntimeError):
    """A patch that must not be applied (its target is missing or changed)."""


def _split_target(target: str) -> tuple[str, list[str]]:
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"patch target={target!r} must look like 'package.module:Qualname.attr'")
    return module_name, attr_path.split(".")


def _lookup(target: str) -> tuple[Any, str, Any]:
    """``(owner, attribute name, current value)`` of ``target``.

    Raises:
        PatchError: the module, an intermediate object or the attribute is missing.
    """
    module_name, parts = _split_target(target)
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise PatchError(f"target {target!r}: cannot import {module_name!r} ({exc})") from exc
    for part in parts[:-1]:
        if not hasattr(owner, part):
            raise PatchError(f"target {target!r}: {part!r} is missing")
        owner = getattr(owner, part)
    attr = parts[-1]
    if not hasattr(owner, attr):
        raise PatchError(f"target {target!r}: attribute {attr!r} is missing")
    # getattr_static keeps classmethod/staticmethod wrappers, so a revert restores them intact.
    return owner, attr, inspect.getattr_static(owner, attr)


def fingerprint(target: str) -> str:
    """A short hash of the target's source code, the same in every process.

    Plugin authors record it when they write a patch; the registry compares it at apply time.
    Without readable source (code made by ``exec``, a module shipped without ``.py`` files) the
    hash is of the compiled code (bytecode, constants, names), which also changes when the code
    does; a value that is not code is hashed by its ``repr``.

    Raises:
        PatchError: the target is missing, or has neither source, code nor a ``repr`` free of
            memory addresses (nothing stable to compare).
    """
    _owner, _attr, value = _lookup(target)
    func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
    try:
        source = inspect.getsource(func)
        text = "\n".join(line.rstrip() for line in inspect.cleandoc(source).splitlines())
    except (OSError, TypeError):
        code = getattr(func, "__code__", None)
        if isinstance(code, types.CodeType):
            text = _describe_code(code)
        elif " at 0x" not in repr(func):
            text = repr(func)
        else:
            raise PatchError(
                f"target {target!r} has no readable source and its repr holds a memory address "
                f"({func!r}): nothing stable to fingerprint; patch a function instead"
            ) from None
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _describe_code(code: types.CodeType) -> str:
    """A text that identifies compiled code across processes (no addresses, no line numbers)."""

    def const(value: object) -> str:
        if isinstance(value, types.CodeType):
            return _describe_code(value)
        if isinstance(value, frozenset):  # set order follows string hashing, per process
            return "frozenset(" + ",".join(sorted(map(const, value))) + ")"
        if isinstance(value, tuple):
            return "(" + ",".join(map(const, value)) + ")"
        return repr(value)

    return "|".join(
        [
            code.co_name,
            code.co_code.hex(),
            const(code.co_consts),
            ",".join(code.co_names),
            ",".join(code.co_varnames),
            str(code.co_argcount),
            str(code.co_kwonlyargcount),
        ]
    )


@dataclass
class Patch:
    """A declared patch and its status in this process."""

    target: str
    replacement: Any
    scope: str
    reason: str
    fingerprint: str
    on_mismatch: str
    source: str
    status: str = "pending"
    """pending | applied | applied-with-warning | refused"""
    detail: str = ""
    original: Any = field(default=None, repr=False)
    applied_in_pid: int | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "target": self.target,
            "scope": self.scope,
            "reason": self.reason,
            "plugin": self.source,
            "fingerprint": self.fingerprint,
            "on_mismatch": self.on_mismatch,
            "status": self.status,
            "detail": self.detail,
            "pid": self.applied_in_pid,
        }


class PatchRegistry:
    """Declared patches, applied per scope once per process."""

    def __init__(self) -> None:
        self.patches: dict[str, Patch] = {}

    def register(
        self,
        target: str,
        replacement: Callable[..., Any] | Any,
        *,
        scope: str,
        reason: str,
        fingerprint: str,
        on_mismatch: str = "refuse",
    ) -> Patch:
        """Declare a patch. Declaring the same target again with the same replacement is a no-op.

        Raises:
            ValueError: bad scope, on_mismatch, target syntax or empty reason; or another
                replacement is already declared for the target.
        """
        _split_target(target)
        if scope not in SCOPES:
            raise ValueError(f"patch scope={scope!r} is invalid; allowed: {list(SCOPES)}")
        if on_mismatch not in ON_MISMATCH:
            raise ValueError(
                f"patch on_mismatch={on_mismatch!r} is invalid; allowed: {ON_MISMATCH}"
            )
        if not reason.strip():
            raise ValueError(f"patch of {target!r} needs a reason (which hook is missing)")
        existing = self.patches.get(target)
        if existing is not None:
            if existing.replacement is replacement and existing.scope == scope:
                return existing
            raise ValueError(
                f"{target!r} is already patched by {existing.source}; two plugins cannot patch "
                "the same target"
            )
        patch = Patch(
            target, replacement, scope, reason, fingerprint, on_mismatch, current_source()
        )
        self.patches[target] = patch
        return patch

    def apply(self, scope: str) -> list[Patch]:
        """Apply every pending patch of ``scope`` (once per process); returns them.

        A refused patch is logged as an error and left unapplied; ``kiln plugins`` shows why.
        """
        todo = [p for p in self.patches.values() if p.scope == scope and p.status == "pending"]
        for patch in todo:
            self._apply_one(patch)
        return todo

    def _apply_one(self, patch: Patch) -> None:
        try:
            owner, attr, original = _lookup(patch.target)
            actual = fingerprint(patch.target)
        except PatchError as exc:
            patch.status, patch.detail = "refused", str(exc)
            logger.error("patch %s from %s refused: %s", patch.target, patch.source, exc)
            return
        if actual != patch.fingerprint:
            detail = f"target source changed: fingerprint {actual} != declared {patch.fingerprint}"
            if patch.on_mismatch == "refuse":
                patch.status, patch.detail = "refused", detail
                logger.error("patch %s from %s refused: %s", patch.target, patch.source, detail)
                return
            patch.status, patch.detail = "applied-with-warning", detail
            logger.warning(
                "patch %s from %s applied anyway: %s", patch.target, patch.source, detail
            )
        else:
            patch.status = "applied"
        patch.original = original
        patch.applied_in_pid = os.getpid()
        setattr(owner, attr, patch.replacement)
        logger.info("patch %s applied (%s): %s", patch.target, patch.source, patch.reason)

    def revert_all(self) -> None:
        """Undo every applied patch (tests use this to leave Kiln as they found it)."""
        for patch in self.patches.values():
            if patch.status.startswith("applied"):
                owner, attr, _ = _lookup(patch.target)
                setattr(owner, attr, patch.original)
                patch.status = "pending"


PATCH_REGISTRY = PatchRegistry()
register_patch = PATCH_REGISTRY.register
