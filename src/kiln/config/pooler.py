"""The pooling runner's settings: ``--runner`` and ``--pooler-config`` (vLLM's flags).

``parse_pooler_config`` reads ``--pooler-config '{"pooling_type": "MEAN", "normalize": true}'``
into ``ModelConfig``'s ``pooling_type`` and ``pooling_normalize`` fields. This module knows the
names and their allowed values only.
"""

from __future__ import annotations

import json
from typing import Any

RUNNERS = ("generate", "pooling")
"""Values of ``model.runner``."""

POOLING_TYPES = ("LAST", "MEAN", "CLS")
"""Values of ``model.pooling_type``: the last prompt token's hidden state, the mean over the
prompt's, or the first token's."""

_POOLER_CONFIG_KEYS = {"pooling_type": "pooling_type", "normalize": "pooling_normalize"}


def parse_pooler_config(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """``--pooler-config``: JSON (or, from Python, a dict) with ``pooling_type`` and
    ``normalize``, as vLLM spells them; missing keys keep their defaults.

    Raises:
        ValueError: not JSON, not an object, or a key outside ``pooling_type`` / ``normalize``.
    """
    if not value:
        return {}
    try:
        data = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as exc:
        raise ValueError(f"--pooler-config is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not set(data) <= set(_POOLER_CONFIG_KEYS):
        raise ValueError(
            f"pooler_config={value!r} is invalid; allowed: a JSON object with keys in "
            f'{sorted(_POOLER_CONFIG_KEYS)}, like \'{{"pooling_type": "MEAN", "normalize": true}}\''
        )
    fields = {_POOLER_CONFIG_KEYS[key]: item for key, item in data.items()}
    if isinstance(fields.get("pooling_type"), str):
        fields["pooling_type"] = fields["pooling_type"].upper()
    return fields
