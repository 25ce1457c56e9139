"""Per-request pooling parameters (vLLM's ``PoolingParams``): what to make of a pooled vector.

Contract: a plain dataclass of plain values, so it round-trips through msgspec unchanged; the
constructor checks each value (``ValueError`` naming the field). A pooling request carries one
in ``EngineCoreRequest.pooling_params``; the runner's pooling stage (``kiln.worker.pooling``)
pools the prompt's final hidden states with the server's ``--pooler-config`` pooling type, cuts
the vector to ``dimensions`` and then L2-normalises it when ``normalize`` says so. Whether
``dimensions`` fits the model (at most its hidden size) is the input processor's check.

What it must not know: models, tokenizers, scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """How one request's pooled vector is finished."""

    dimensions: int | None = None
    """Keep the first ``dimensions`` values (Matryoshka truncation), before normalising; None:
    the model's hidden size."""
    normalize: bool | None = None
    """L2-normalise the vector; None: the server's ``--pooler-config`` ``normalize``."""

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int)
            or isinstance(self.dimensions, bool)
            or self.dimensions < 1
        ):
            raise ValueError(
                f"dimensions={self.dimensions!r} is invalid; allowed: a positive integer or None"
            )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(
                f"normalize={self.normalize!r} is invalid; allowed: true, false or None"
            )

    def clone(self) -> PoolingParams:
        return PoolingParams(self.dimensions, self.normalize)
