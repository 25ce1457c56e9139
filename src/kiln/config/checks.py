"""The value checks the config sections run in ``__post_init__``: a bad value raises
``ValueError`` that names the field, the value and what is allowed.
"""

from __future__ import annotations

from typing import Any


def check(condition: bool, name: str, value: Any, allowed: str) -> None:
    """Raises ``ValueError`` (``name=value is invalid; allowed: ...``) unless ``condition``."""
    if not condition:
        raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)
