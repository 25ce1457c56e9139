"""The value checks the config sections run in ``__post_init__``: a bad value raises
``ValueError`` that names the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any


def check(condition: bool, name: str, value: Any, allowed: str) -> None:
    """Raises ``ValueError`` (``name=value is invalid; allowed: ...``) unless ``condition``."""
    if not condition:
        raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def parse_json_fields(
    value: str | dict[str, Any], name: str, section: type, example: str, exclude: tuple = ()
) -> dict[str, Any]:
    """A flag's JSON object (or, from Python, a dict) of ``section``'s fields (``exclude``d
    ones have flags of their own), as a new dict.

    Raises:
        ValueError: not JSON, not an object, or a key that is no field; names ``--name``, the
            allowed keys and ``example``.
    """
    try:
        data = json.loads(value) if isinstance(value, str) else dict(value)
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise ValueError(f"--{name.replace('_', '-')} is not valid JSON: {exc}") from exc
    allowed = [f.name for f in dataclasses.fields(section) if f.name not in exclude]
    if not isinstance(data, dict) or not set(data) <= set(allowed):
        raise ValueError(
            f"{name}={value!r} is invalid; allowed: a JSON object with keys in {allowed}, "
            f"like {example}"
        )
    return data
