"""kiln-x86's graph wrappers: small steps (decodes, verifications) replayed per bucket.

``TracedGraphWrapper`` (the default, ``x86.graph = "trace"``): ``torch.jit.trace`` records each
bucket's decode step once at start-up (about a second each), as a graph of dispatcher ops that
TorchScript's C++ interpreter replays: the model's modules, the op registry's dispatch and the
Python bindings around each kernel are gone from a step, while every op runs the kernel it ran
eagerly (``kiln.model_executor.custom_op.is_capturing`` makes them record their
``torch.ops.*`` form), so the rows equal the eager model's bit for bit. Attention is one opaque
op (``torch.ops.kiln.unified_attention``) whose Python kernel runs the backend with the step's
metadata at run time, so a bucket's trace (recorded on a dummy decode step) serves any step of
that many tokens: decodes, speculative verifications, a short prompt. A trace is exact for the
shapes it saw, hence one per bucket; any other size runs eagerly.

``CompiledGraphWrapper`` (``x86.graph = "inductor"``): ``capture(sizes)`` makes one
``torch.compile`` of the model (inductor's C++ backend, static shapes, the whole forward as one
graph); the runner's dummy decode at each size then compiles that size's graph, so start-up pays
for every bucket and serving pays for none. A call whose token count is a captured size runs its
graph; any other call runs the model eagerly, never compiling at run time.

What the graph holds: every op of the model except attention, which stays one opaque op
(``torch.ops.kiln.unified_attention``: its metadata changes every step) and runs the platform's
backend eagerly; ops with kiln-x86 kernels trace as their ``torch.ops.kiln_x86`` ops. Inductor
fuses the rest (norms, rotary, SiLU-and-mul, residual adds) into C++ loops and calls oneDNN for
the matmuls; with ``freezing`` it also packs the weights for oneDNN once, which the eager bf16
path does on its own (``kiln.platforms.cpu_ops``).

Compile cache: compiled graphs go to ``$KILN_X86_CACHE_DIR/inductor`` (default
``~/.cache/kiln-x86/inductor``, see ``kiln_x86.kernels.cache_dir``) unless
``TORCHINDUCTOR_CACHE_DIR`` is set; a later start with the same model, dtype and sizes finds them
there (inductor's FX graph cache) and only re-traces.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.plugin_api import GraphWrapper, KilnConfig
from kiln_x86.kernels import cache_dir

logger = logging.getLogger(__name__)

INDUCTOR_OPTIONS: dict[str, Any] = {"freezing": True}
"""Inductor settings of every bucket's graph; see the module docstring for why freezing."""


def inductor_cache_dir() -> str:
    """Where compiled graphs go: ``TORCHINDUCTOR_CACHE_DIR``, else under the plugin's cache."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(cache_dir() / "inductor")


class CompiledGraphWrapper(GraphWrapper):
    """``torch.compile`` per bucket; eager for every other shape. See the module docstring."""

    def __init__(self, runnable: Callable[..., Any], config: KilnConfig) -> None:
        self.runnable = runnable
        self.config = config
        self.sizes: frozenset[int] = frozenset()
        self._compiled: Callable[..., Any] | None = None
        self._compiled_sizes: set[int] = set()

    def capture(self, num_tokens: Sequence[int]) -> None:
        # Read by inductor when it first touches its cache, which is after this.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
        # One compiled graph per size on the same code object: allow them all.
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, len(num_tokens) + 1)
        self.sizes = frozenset(num_tokens)
        self._compiled = torch.compile(
            self.runnable, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS
        )
        logger.info(
            "kiln-x86: compiling decode graphs for batch sizes %s (cache: %s)",
            sorted(self.sizes),
            os.environ["TORCHINDUCTOR_CACHE_DIR"],
        )

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        size = input_ids.shape[0]
        if self._compiled is None or size not in self.sizes:
            return self.runnable(input_ids, positions)
        if size not in self._compiled_sizes:  # the runner's capture call: compile now
            self._compiled_sizes.add(size)
            return self._compiled(input_ids, positions)
        # A guard that fails while serving (inputs unlike the capture's) must not compile for
        # minutes in the middle of a step: dynamo runs that call eagerly instead.
        with torch.compiler.set_stance("eager_on_recompile"):
            return self._compiled(input_ids, positions)


class TracedGraphWrapper(GraphWrapper):
    """``torch.jit.trace`` per bucket, replayed by TorchScript; eager for every other shape.
    See the module docstring."""

    def __init__(self, runnable: Callable[..., Any], config: KilnConfig) -> None:
        self.runnable = runnable
        self.config = config
        self.sizes: frozenset[int] = frozenset()
        self._graphs: dict[int, Callable[..., Any]] = {}

    def capture(self, num_tokens: Sequence[int]) -> None:
        self.sizes = frozenset(num_tokens)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        size = input_ids.shape[0]
        graph = self._graphs.get(size)
        if graph is None:
            if size not in self.sizes:
                return self.runnable(input_ids, positions)
            graph = self._graphs[size] = self._trace(input_ids, positions)  # the capture call
            # TorchScript's executor profiles a graph's first run and optimizes it in the second
            # (about 0.1 s here): both belong to start-up, not to the bucket's first real step.
            graph(input_ids, positions)
        return graph(input_ids, positions)

    def _trace(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Callable[..., Any]:
        runnable = self.runnable

        # A function, not the module: tracing a module also builds a ScriptModule of its whole
        # hierarchy, seconds of Python per bucket that replay does not need.
        def decode_step(input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
            return runnable(input_ids, positions)

        start = time.perf_counter()
        with warnings.catch_warnings():
            # Shape-based branches (which kernel serves this many rows) are meant to be fixed
            # per bucket: the tracer's warnings about them say nothing here.
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            # NOTE: torch.jit.trace is deprecated in favour of torch.compile / torch.export, whose
            # compile takes minutes here (CompiledGraphWrapper); torch is pinned (2.13.0).
            warnings.simplefilter("ignore", DeprecationWarning)
            graph = torch.jit.trace(decode_step, (input_ids, positions), check_trace=False)
        logger.info(
            "kiln-x86: traced the decode step of %d token(s) in %.1f s",
            input_ids.shape[0],
            time.perf_counter() - start,
        )
        return graph
