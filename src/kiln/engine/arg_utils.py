"""Engine arguments with vLLM's names: the flags of ``kiln serve`` and the keywords of ``LLM``.

The config dataclasses (``kiln.config``) are the one source: each user field becomes an
``EngineArgs`` field and a flag, with its type, its default and its docstring as ``--help``. A
field's ``metadata`` adds what the flag needs beyond that (choices, an alias, a converter from the
user's form, see ``kiln.config``); the class fields a platform fills (``CLASS_FIELDS``) are not
flags. Adding an engine setting is a field in a config dataclass, nothing here.

``EngineArgs`` is flat (what a user types); ``create_config()`` turns it into the per-domain
``KilnConfig``, whose dataclasses validate every value.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.config import SECTIONS, KilnConfig
from kiln.plugins.interfaces import CLASS_FIELDS


@dataclass(frozen=True)
class EngineFlag:
    """One engine setting: an ``EngineArgs`` field, an ``LLM`` keyword and a flag."""

    section: str
    """The ``KilnConfig`` section of the field it sets (``"scheduler"``)."""
    field: dataclasses.Field
    """The config field; its ``metadata`` shapes the flag (see ``kiln.config``)."""
    help: str
    """The field's docstring."""
    annotation: Any
    """The type a user gives: the field's, or the converter's argument's."""

    @property
    def name(self) -> str:
        """Keyword and ``EngineArgs`` field (``max_num_seqs``; the flag is ``--max-num-seqs``)."""
        return self.field.metadata.get("flag", self.field.name)

    @property
    def parse(self) -> Callable[[Any], dict[str, Any]] | None:
        """The converter from the user's form to ``{field: value}`` of the section, if any."""
        return self.field.metadata.get("parse")

    @property
    def default(self) -> Any:
        """The field's default; None where a converter reads None as the field's default."""
        return None if self.parse else self.field.default

    def to_fields(self, value: Any) -> dict[str, Any]:
        """``{field: value}`` of the section that the user's ``value`` sets.

        Raises:
            ValueError: a value the converter refuses.
        """
        return self.parse(value) if self.parse else {self.field.name: value}

    def add_to(self, group: argparse._ActionsContainer) -> None:
        """Declare the flag in ``group`` (a parser or an argument group)."""
        meta = self.field.metadata
        options: dict[str, Any] = {"default": self.default, "help": self.help.replace("%", "%%")}
        if meta.get("positional"):
            names, options["nargs"] = [self.name], "?"
        else:
            names = ["--" + self.name.replace("_", "-"), *meta.get("aliases", ())]
        if "choices" in meta:
            options["choices"] = list(meta["choices"])
        if "metavar" in meta:
            options["metavar"] = meta["metavar"]
        kind = _non_none(self.annotation)
        if kind is bool:
            # Flags that are on by default can be turned off (vLLM's --no-enable-prefix-caching).
            options["action"] = argparse.BooleanOptionalAction if self.default else "store_true"
        elif kind in (int, float) and not self.parse:
            options["type"] = kind
        group.add_argument(*names, **options)


def _non_none(annotation: Any) -> Any:
    """``int`` for ``int | None``; the annotation itself when it is not such a union."""
    if isinstance(annotation, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls``, by field name (read from its source:
    Python keeps no attribute docstrings at run time).

    Raises:
        OSError: the source of ``cls`` is not available.
    """
    (class_def,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    assert isinstance(class_def, ast.ClassDef)
    docs = {}
    for node, after in zip(class_def.body, class_def.body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _engine_flags() -> dict[str, EngineFlag]:
    flags = {}
    for section, cls in SECTIONS.items():
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if section == "device" and f.name in CLASS_FIELDS:
                continue
            if "set_by" in f.metadata or f.metadata.get("internal"):  # not a flag of its own
                continue
            # The type a user gives: a converter's argument, else the field's own.
            parse = f.metadata.get("parse")
            user_type = typing.get_type_hints(parse)["value"] if parse else hints[f.name]
            flag = EngineFlag(section, f, docs.get(f.name, ""), user_type)
            flags[flag.name] = flag
    return flags


ENGINE_FLAGS: dict[str, EngineFlag] = _engine_flags()
"""Every engine setting by keyword, in the config's order (sections, then fields)."""


def _with_engine_flags(cls: type) -> type:
    """``cls`` as a dataclass with one field per ``ENGINE_FLAGS`` entry, defaulting as it does."""
    cls.__annotations__ = {name: flag.annotation for name, flag in ENGINE_FLAGS.items()}
    for name, flag in ENGINE_FLAGS.items():
        setattr(cls, name, flag.default)
    return dataclass(cls)


@_with_engine_flags
class EngineArgs:
    """The engine settings flat, one field per ``ENGINE_FLAGS`` entry (``max_num_seqs=16``,
    ``kv_cache_memory="40%"``), each defaulting to its config field's default."""

    def create_config(self) -> KilnConfig:
        """The ``KilnConfig`` these arguments describe.

        Raises:
            ValueError: an invalid value (the message names the field and what is allowed).
        """
        sections: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        for name, flag in ENGINE_FLAGS.items():
            sections[flag.section].update(flag.to_fields(getattr(self, name)))
        return KilnConfig(**{name: SECTIONS[name](**values) for name, values in sections.items()})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Build from keywords, refusing unknown ones with the allowed names.

        Raises:
            ValueError: an unknown keyword.
        """
        unknown = sorted(set(kwargs) - set(ENGINE_FLAGS))
        if unknown:
            raise ValueError(
                f"unknown engine argument(s) {unknown}; allowed: {sorted(ENGINE_FLAGS)}"
            )
        return cls(**kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{name: getattr(args, name) for name in ENGINE_FLAGS})

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add the engine flags (vLLM's names), a group per config section, to ``parser``."""
        groups: dict[str, argparse._ArgumentGroup] = {}
        for flag in ENGINE_FLAGS.values():
            if flag.section not in groups:
                groups[flag.section] = parser.add_argument_group(flag.section)
            flag.add_to(groups[flag.section])
