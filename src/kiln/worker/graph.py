"""Graph wrappers: how a platform runs small steps (decodes) without per-op Python overhead.

The model runner wraps its model with the platform's ``graph_wrapper_cls`` and routes every step
of up to the largest bucket's tokens through it, padded to a few fixed token counts (buckets), so
a wrapper can prepare one static graph per bucket at start-up (record, compile or fuse it) and
replay it for every such step.

Contract between the runner (``kiln.worker.model_runner``) and a wrapper:

- ``wrapper_cls(runnable, config)`` once, after the model is loaded. ``runnable`` is the model:
  ``runnable(input_ids [T], positions [T]) -> hidden_states [T, hidden]``; attention layers read
  the step's metadata from the forward context (``kiln.forward_context``) at run time, so what a
  step computes besides attention depends on ``T`` only.
- ``capture(sizes)`` once at start-up, after the KV cache is bound, with the buckets in ascending
  order (``graph_capture_sizes``). Then the runner calls the wrapper once per bucket, largest
  first, with a dummy decode step of that many requests whose keys and values go to the reserved
  null block (``kiln.scheduler.kv_cache.NULL_BLOCK_ID``): a wrapper that records or compiles on
  first call does it there, so no step while serving pays for it.
- ``wrapper(input_ids, positions)`` for every step of at most the largest bucket's tokens, padded
  to the smallest bucket that holds them, whatever its requests are: one-token decodes, a
  speculative verification's ``1 + k`` tokens per request, a short prompt or a mix. ``T`` is a
  bucket, the first ``num_actual_tokens`` rows (the attention metadata's) are the step's tokens,
  the rest are padding (token 0 at position 0). Padding rows have no KV-cache slot: attention
  writes only the first ``num_actual_tokens`` keys and values and returns zeros past them
  (``AttentionImpl.forward``), so padding never touches a real request's cache or rows. The
  runner reads only the real rows of the result. Rows must equal the eager model's up to the
  rounding of a different kernel order. A graph must therefore not bake in anything of the
  metadata it was captured with (request count, query lengths): attention stays an op that reads
  it at run time.
- A step of more tokens than the largest bucket runs the model eagerly without the wrapper, so a
  wrapper never sees a shape it did not capture. A wrapper called with another size anyway must
  run ``runnable`` eagerly.

``EagerGraphWrapper`` (the reference ``cpu`` platform's) captures nothing: every call runs the
model directly, and with ``graph_capture_sizes=None`` the runner does not pad at all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from kiln.config import KilnConfig

DEFAULT_SMALL_SIZES = (1, 2, 4, 8, 16)
"""Default buckets below ``DEFAULT_SIZE_STEP``; past it, every ``DEFAULT_SIZE_STEP`` requests."""
DEFAULT_SIZE_STEP = 16


def graph_capture_sizes(config: KilnConfig, supports_graph_capture: bool) -> list[int]:
    """The buckets small steps are padded to, ascending; empty: no capture, no padding.

    ``device.graph_capture_sizes`` when set; else none when the platform captures nothing, else
    1, 2, 4, 8, 16, then every 16 up to ``max_num_seqs``, and ``max_num_seqs`` itself (so every
    decode step fits). Sizes above ``max_num_seqs * (1 + num_speculative_tokens)`` are dropped:
    no step of decodes and verifications has more tokens. With ``k`` speculative tokens the
    multiples of ``1 + k`` up to the largest size are added (``n`` requests verifying ``k``
    drafts each are ``n * (1 + k)`` tokens, which then need no padding), as vLLM aligns its
    capture sizes.
    """
    max_num_seqs = config.scheduler.max_num_seqs
    tokens_per_request = 1 + config.speculative.num_speculative_tokens
    sizes = config.device.graph_capture_sizes
    if sizes is None:
        if not supports_graph_capture:
            return []
        sizes = (
            *DEFAULT_SMALL_SIZES,
            *range(2 * DEFAULT_SIZE_STEP, max_num_seqs, DEFAULT_SIZE_STEP),
        )
        sizes = (*sizes, max_num_seqs)
    kept = {s for s in sizes if s <= max_num_seqs * tokens_per_request}
    if kept and tokens_per_request > 1:
        kept.update(range(tokens_per_request, max(kept) + 1, tokens_per_request))
    return sorted(kept)


def no_capture_reason(config: KilnConfig) -> str | None:
    """Why the runner captures no graph for ``config``, whatever ``graph_capture_sizes`` says
    (set by a user or a platform); None where it may.

    Under tensor or pipeline parallelism a graph would record the model's collectives (the
    all-reduces, the stage transfers), which a trace cannot record (``torch.jit.trace`` fails on
    every rank: "unsupported input list type: Tensor[]"): every step runs eagerly there. With
    LoRA a step's adapter slots are an input no captured graph knows about. The runner logs the
    reason when it drops buckets it was given.
    """
    parallel = config.parallel
    if parallel.tensor_parallel_size > 1:
        return (
            f"tensor_parallel_size={parallel.tensor_parallel_size}: a graph would record the "
            "model's all-reduces, which a trace cannot replay"
        )
    if parallel.pipeline_parallel_size > 1:
        return (
            f"pipeline_parallel_size={parallel.pipeline_parallel_size}: a graph would record "
            "the stage transfers"
        )
    if config.lora.enable_lora:
        return "LoRA: a step's adapter slots are an input no captured graph knows about"
    return None


def padded_size(sizes: Sequence[int], num_tokens: int) -> int | None:
    """The smallest bucket of ``sizes`` (ascending) that holds ``num_tokens``, or None."""
    for size in sizes:
        if size >= num_tokens:
            return size
    return None


class GraphWrapper(ABC):
    """Runs the model's small steps from captured graphs; see the module docstring."""

    @abstractmethod
    def __init__(self, runnable: Callable[..., Any], config: KilnConfig) -> None: ...

    @abstractmethod
    def capture(self, num_tokens: Sequence[int]) -> None:
        """Prepare graphs for these padded token counts (a no-op where nothing is captured).

        The runner follows it with one dummy decode call per size, largest first.
        """

    @abstractmethod
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``runnable(*args, **kwargs)``, from the captured graph of the input's size if any."""


class EagerGraphWrapper(GraphWrapper):
    """No capture: every call runs ``runnable`` eagerly."""

    def __init__(self, runnable: Callable[..., Any], config: KilnConfig) -> None:
        self.runnable = runnable
        self.config = config

    def capture(self, num_tokens: Sequence[int]) -> None:
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.runnable(*args, **kwargs)
