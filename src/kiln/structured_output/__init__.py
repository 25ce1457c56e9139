"""Structured outputs: output constrained to a JSON schema, regex, choice or grammar while sampling.

The front end checks a request's ``StructuredOutputsParams`` at admission
(``validate_structured_outputs``); the engine core compiles its grammar off the loop and fills a
token bitmask per step (``StructuredOutputManager``); the runner applies the bitmask to the logits
(the ``apply_token_bitmask`` op in ``kiln.sampling.bitmask``). See ``docs/architecture.md``.
"""

from kiln.structured_output.backends import BACKENDS, choose_backend
from kiln.structured_output.manager import StructuredOutputManager, validate_structured_outputs

__all__ = [
    "BACKENDS",
    "StructuredOutputManager",
    "choose_backend",
    "validate_structured_outputs",
]
