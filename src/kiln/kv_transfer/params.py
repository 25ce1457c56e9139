"""``kv_transfer_params``: what a client asks of the KV connector, and what it gets back.

vLLM's request extension for disaggregated prefill: a prefill instance gets
``{"do_remote_decode": true}`` and answers, with the finished request, where its KV waits
(``remote_host``, ``remote_port``, ``remote_request_id``, ``remote_block_ids``, ...); the decode
instance gets those with ``"do_remote_prefill": true`` and pulls the KV instead of computing it.

``check_kv_transfer_params`` is the one gate for hostile input: the API server calls it on every
request body (a ``ValueError`` becomes an HTTP 400), so a connector reads fields of the right
types and bounded sizes. Keys it does not know pass through (other connectors' own keys).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, TypeGuard

import numpy as np

MAX_PARAMS_CHARS = 1 << 20
"""The most characters ``kv_transfer_params`` may take as JSON."""
MAX_REMOTE_BLOCKS = 1 << 17
"""The most ``remote_block_ids`` (a 2M-token prompt in blocks of 16)."""
MAX_STRING_CHARS = 256
"""The most characters of each string field."""

_BOOLS = ("do_remote_decode", "do_remote_prefill")
_STRINGS = ("remote_host", "remote_request_id", "remote_prompt_hash")


def _invalid(field: str, allowed: str, value: Any) -> ValueError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ValueError(f"kv_transfer_params.{field}={shown} is invalid; allowed: {allowed}")


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def check_kv_transfer_params(value: Any) -> dict[str, Any] | None:
    """``value`` when it is a valid ``kv_transfer_params`` (None: none).

    Raises:
        ValueError: not a JSON object, too large, or a known field of the wrong type or out of
            range; the message names the field and what is allowed.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"kv_transfer_params must be a JSON object or null, got {value!r:.80}")
    if len(json.dumps(value)) > MAX_PARAMS_CHARS:
        raise ValueError(f"kv_transfer_params must take at most {MAX_PARAMS_CHARS} characters")
    for name in _BOOLS:
        if name in value and not isinstance(value[name], bool):
            raise _invalid(name, "true or false", value[name])
    for name in _STRINGS:
        item = value.get(name)
        if name in value and (not isinstance(item, str) or not 0 < len(item) <= MAX_STRING_CHARS):
            raise _invalid(name, f"a string of 1 to {MAX_STRING_CHARS} characters", item)
    port = value.get("remote_port")
    if "remote_port" in value and not (_is_int(port) and 0 < port < 65536):
        raise _invalid("remote_port", "a TCP port, 1 to 65535", port)
    num_tokens = value.get("remote_num_tokens")
    if "remote_num_tokens" in value and not (_is_int(num_tokens) and num_tokens >= 0):
        raise _invalid("remote_num_tokens", "an integer >= 0", num_tokens)
    block_ids = value.get("remote_block_ids")
    if "remote_block_ids" in value and not (
        isinstance(block_ids, list)
        and len(block_ids) <= MAX_REMOTE_BLOCKS
        and all(_is_int(b) and 0 <= b < 2**31 for b in block_ids)
    ):
        raise _invalid(
            "remote_block_ids", f"a list of at most {MAX_REMOTE_BLOCKS} block ids", block_ids
        )
    return value


def prompt_hash(token_ids: list[int]) -> str:
    """A digest of ``token_ids``: a decode instance loads remote KV only for the same tokens."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()[:32]


__all__ = ["MAX_PARAMS_CHARS", "MAX_REMOTE_BLOCKS", "check_kv_transfer_params", "prompt_hash"]
