"""Engine arguments with vLLM's names: the flags of ``kiln serve`` and the keywords of ``LLM``.

``EngineArgs`` is flat (what a user types); ``create_config()`` turns it into the per-domain
``KilnConfig``, whose dataclasses validate every value.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kiln.config import (
    QUANTIZATION_METHODS,
    CacheConfig,
    DeviceConfig,
    KilnConfig,
    ModelConfig,
    ParallelConfig,
    PluginConfig,
    SchedulerConfig,
)
from kiln.plugins.config import parse_plugin_config


@dataclass
class EngineArgs:
    model: str | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    load_format: str = "auto"
    seed: int = 0
    chat_template: str | None = None
    max_logprobs: int = 20
    batch_invariant: bool = False
    quantization: str | None = None
    block_size: int = 16
    kv_cache_memory: float | str | None = None
    """GiB (``2``, ``0.5``) or a percentage of free memory (``"40%"``)."""
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_num_waiting: int | None = None
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    platform: str | None = None
    graph_capture_sizes: list[int] | str | None = None
    """Decode buckets the graph wrapper captures: a list or ``"1,2,4"`` (``""``: none);
    None: the platform's choice."""
    plugin_config: str | dict[str, Any] | None = field(default=None)

    def create_config(self) -> KilnConfig:
        """The ``KilnConfig`` these arguments describe.

        Raises:
            ValueError: an invalid value (the message names the field and what is allowed).
        """
        sections = (
            self.plugin_config
            if isinstance(self.plugin_config, dict)
            else parse_plugin_config(self.plugin_config)
        )
        return KilnConfig(
            model=ModelConfig(
                model=self.model,
                served_model_name=self.served_model_name,
                tokenizer=self.tokenizer,
                dtype=self.dtype,
                max_model_len=self.max_model_len,
                load_format=self.load_format,
                seed=self.seed,
                chat_template=self.chat_template,
                max_logprobs=self.max_logprobs,
                batch_invariant=self.batch_invariant,
                quantization=self.quantization,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                **parse_kv_cache_memory(self.kv_cache_memory),
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                enable_chunked_prefill=self.enable_chunked_prefill,
                max_num_waiting=self.max_num_waiting,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
            ),
            device=DeviceConfig(
                platform=self.platform,
                graph_capture_sizes=parse_graph_capture_sizes(self.graph_capture_sizes),
            ),
            plugins=PluginConfig(sections=sections),
        )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Build from keywords, refusing unknown ones with the allowed names.

        Raises:
            ValueError: an unknown keyword.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; allowed: {sorted(names)}")
        return cls(**kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add the engine flags (vLLM's names) to ``parser``."""
        g = parser.add_argument_group("model")
        g.add_argument(
            "model",
            nargs="?",
            default=None,
            help="a GGUF file, a Hugging Face folder or hub id (default: SmolLM2-135M-Instruct)",
        )
        g.add_argument("--served-model-name", default=None, help="the name clients use")
        g.add_argument("--tokenizer", default=None, help="tokenizer source, if not the model's")
        g.add_argument(
            "--dtype",
            default="auto",
            choices=["auto", "float32", "float16", "bfloat16"],
            help="compute dtype (auto: the platform's preferred)",
        )
        g.add_argument("--max-model-len", type=int, default=None, help="context length")
        g.add_argument("--load-format", default="auto", help="auto, gguf, safetensors, hub")
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--chat-template", default=None, help="a Jinja template file or text")
        g.add_argument("--max-logprobs", type=int, default=20, help="most logprobs a request gets")
        g.add_argument(
            "--batch-invariant",
            action="store_true",
            help="each request's tokens do not depend on the rest of the batch (costs "
            "throughput; cpu platform: bfloat16 only)",
        )
        g.add_argument(
            "--quantization",
            "-q",
            default=None,
            choices=list(QUANTIZATION_METHODS),
            help="weights in memory: auto (a quantized GGUF stays quantized where the platform "
            "supports it), gguf, int8 / int4 (quantize a float model on load), none (dense)",
        )
        g = parser.add_argument_group("cache")
        g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
        g.add_argument(
            "--kv-cache-memory",
            default=None,
            metavar="GIB|PCT%",
            help="KV-cache size: GiB (e.g. 2 or 0.5) or a share of free memory (e.g. 40%%); "
            "default: 40%% of free memory, at most 4 GiB",
        )
        g.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="reuse KV blocks of shared prompt prefixes",
        )
        g = parser.add_argument_group("scheduler")
        g.add_argument("--max-num-seqs", type=int, default=64, help="most requests per step")
        g.add_argument(
            "--max-num-batched-tokens", type=int, default=2048, help="token budget per step"
        )
        g.add_argument(
            "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
        )
        g.add_argument(
            "--max-num-waiting",
            type=int,
            default=None,
            help="most queued requests before new ones get HTTP 503 (default: unbounded)",
        )
        g = parser.add_argument_group("parallel")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        g.add_argument(
            "--distributed-executor-backend", default="uni", choices=["uni", "mp", "ray"]
        )
        g = parser.add_argument_group("plugins")
        g.add_argument("--platform", default=None, help="force a platform (also KILN_PLATFORM)")
        g.add_argument(
            "--graph-capture-sizes",
            default=None,
            metavar="N,N,...",
            help="decode batch sizes the platform's graph wrapper captures at start-up (each "
            "decode step is padded to the next one; '' for none; default: the platform's)",
        )
        g.add_argument(
            "--plugin-config",
            default=None,
            metavar="JSON",
            help='plugin settings, e.g. \'{"name": {"key": 1}}\' (see `kiln plugins`)',
        )


def parse_kv_cache_memory(value: float | str | None) -> dict[str, float | None]:
    """``--kv-cache-memory``: a number is GiB, ``"N%"`` a share of free memory.

    Raises:
        ValueError: neither form (the message shows both).
    """
    if value is None:
        return {"kv_cache_memory": None, "kv_cache_memory_fraction": None}
    text = str(value).strip()
    try:
        if text.endswith("%"):
            return {"kv_cache_memory_fraction": float(text[:-1]) / 100}
        return {"kv_cache_memory": float(text)}
    except ValueError:
        raise ValueError(
            f"kv_cache_memory={value!r} is invalid; allowed: a size in GiB like 2 or 0.5, or a "
            "share of free memory like 40%"
        ) from None


def parse_graph_capture_sizes(
    value: list[int] | tuple[int, ...] | str | None,
) -> tuple[int, ...] | None:
    """``--graph-capture-sizes``: ``"1,2,4"`` or a list of ints; ``""`` is no sizes.

    Raises:
        ValueError: an entry is not an integer >= 1.
    """
    if value is None:
        return None
    items = [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else value
    sizes = []
    for item in items:
        size = int(item) if isinstance(item, int) or str(item).isdigit() else 0
        if size < 1:
            raise ValueError(
                f"graph_capture_sizes={value!r} is invalid; allowed: batch sizes >= 1 like "
                "'1,2,4,8' or [1, 2, 4, 8], or '' for none"
            )
        sizes.append(size)
    return tuple(sizes)
