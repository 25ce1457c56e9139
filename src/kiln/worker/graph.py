"""Graph-capture wrappers: how a platform replays a model step without Python overhead.

The model runner wraps its model with the platform's ``graph_wrapper_cls``; ``capture`` records one
graph per batch size the runner will pad to, and ``__call__`` replays the matching graph or runs
eagerly. CPUs have nothing to capture: ``EagerGraphWrapper`` calls the model directly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from kiln.config import KilnConfig


class GraphWrapper(ABC):
    @abstractmethod
    def __init__(self, runnable: Callable[..., Any], config: KilnConfig) -> None: ...

    @abstractmethod
    def capture(self, num_tokens: Sequence[int]) -> None:
        """Record graphs for these padded token counts (a no-op where nothing is captured)."""

    @abstractmethod
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


class EagerGraphWrapper(GraphWrapper):
    """No capture: every call runs ``runnable`` eagerly."""

    def __init__(self, runnable: Callable[..., Any], config: KilnConfig) -> None:
        self.runnable = runnable
        self.config = config

    def capture(self, num_tokens: Sequence[int]) -> None:
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.runnable(*args, **kwargs)
