"""Kiln's configuration: per-domain frozen dataclasses composed into ``KilnConfig``.

Every field has a default and a docstring right under it. Invalid values raise ``ValueError`` that
names the field, the value and what is allowed. Configs are immutable: a change is a new config
made with ``KilnConfig.replace(section__field=value)`` (``config.replace(device__worker_cls=
"pkg.worker.MyWorker")``), which is how a platform's
``check_and_update_config`` hands back what it changed and how Kiln records the difference for
``kiln plugins``.

The engine flags (``kiln serve``, ``LLM``'s keywords) are made from these fields by
``kiln.engine.arg_utils``: name, type, default and the docstring as help. A field's ``metadata``
says only what differs from that: ``choices``, ``aliases`` (``-q``), ``metavar``, ``positional``,
``flag`` (another name), ``parse`` (a converter from the user's form, ``"40%"``, to
``{field: value}`` of the section) and ``set_by`` (no flag of its own: the named flag's ``parse``
sets it), ``internal`` (no flag: Kiln sets it per process, e.g. a worker's rank). The class
fields a platform fills (``kiln.plugins.interfaces.CLASS_FIELDS``) are not
flags.

This module knows nothing about platforms or plugins beyond the names of the fields a platform
fills.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

AUTO = "auto"
"""A class field left for the platform to fill."""

DTYPES = ("auto", "float32", "float16", "bfloat16")
"""Values of ``model.dtype``."""

QUANTIZATION_METHODS = ("auto", "gguf", "int8", "int4", "none")
"""Values of ``model.quantization`` (None means ``"auto"``)."""

EXECUTOR_BACKENDS = ("uni", "mp", "ray")
"""Values of ``parallel.distributed_executor_backend``."""


def _check(condition: bool, name: str, value: Any, allowed: str) -> None:
    if not condition:
        raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")


# -- converters from a flag's user form to the config fields it sets (``metadata["parse"]``) ------


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
            return {"kv_cache_memory": None, "kv_cache_memory_fraction": float(text[:-1]) / 100}
        return {"kv_cache_memory": float(text), "kv_cache_memory_fraction": None}
    except ValueError:
        raise ValueError(
            f"kv_cache_memory={value!r} is invalid; allowed: a size in GiB like 2 or 0.5, or a "
            "share of free memory like 40%"
        ) from None


def parse_graph_capture_sizes(
    value: list[int] | tuple[int, ...] | str | None,
) -> dict[str, tuple[int, ...] | None]:
    """``--graph-capture-sizes``: ``"1,2,4"`` or a list of ints; ``""`` is no sizes.

    Raises:
        ValueError: an entry is not an integer >= 1.
    """
    if value is None:
        return {"graph_capture_sizes": None}
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
    return {"graph_capture_sizes": tuple(sizes)}


def parse_plugin_config(
    value: str | dict[str, dict[str, Any]] | None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """``--plugin-config``: JSON (or, from Python, a dict) of sections by plugin name.

    Raises:
        ValueError: not JSON, or not an object of objects.
    """
    if not value:
        return {"sections": {}}
    try:
        data = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as exc:
        raise ValueError(f"--plugin-config is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(
            '--plugin-config must be a JSON object of sections, like \'{"name": {"key": 1}}\''
        )
    return {"sections": data}


@dataclass(frozen=True)
class ModelConfig:
    """What model to serve and how to read it."""

    model: str | None = field(default=None, metadata={"positional": True})
    """A GGUF file, a local Hugging Face folder, or a hub id; None serves the embedded default."""
    served_model_name: str | None = None
    """The name clients use in ``model``; defaults to the model's own name."""
    tokenizer: str | None = None
    """Where to read the tokenizer from when it is not beside the weights."""
    dtype: str = field(default="auto", metadata={"choices": DTYPES})
    """Compute dtype: auto (the platform's preferred), float32, float16 or bfloat16."""
    max_model_len: int | None = None
    """Context length (prompt + output); None takes the model's own, capped by the platform."""
    load_format: str = "auto"
    """A registered loader name (gguf, safetensors, hub) or auto to pick by the model reference."""
    seed: int = 0
    """Seed of the random state of every process."""
    chat_template: str | None = None
    """A Jinja chat template (a file path or the template text) replacing the model's."""
    max_logprobs: int = 20
    """The largest ``logprobs`` / ``top_logprobs`` a request may ask for."""
    batch_invariant: bool = False
    """Compute every request's tokens the same whatever else is in the batch: greedy output, and
    seeded sampling, equal a run of the request alone. Costs throughput; a platform that cannot
    honour it refuses it (the cpu platform: bfloat16 only). See ``SamplingParams.seed`` for what
    else changes numerics (chunked prompts, prefix-cache hits, preemption)."""
    quantization: str | None = field(
        default=None, metadata={"choices": QUANTIZATION_METHODS, "aliases": ("-q",)}
    )
    """How weights are kept in memory. None or auto: a quantized GGUF file stays quantized where
    the platform supports "gguf" (``Platform.supported_quantization``), else it is dequantized at
    load; gguf: keep GGUF blocks (an error where the platform cannot); int8 / int4: quantize a
    float model's linear weights on load (per output channel int8 / int4 in groups of 32), where
    the platform supports it; none: dense weights in ``dtype``."""

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPES, "model.dtype", self.dtype, f"one of {list(DTYPES)}")
        _check(
            self.quantization is None or self.quantization in QUANTIZATION_METHODS,
            "model.quantization",
            self.quantization,
            f"None or one of {list(QUANTIZATION_METHODS)}",
        )
        _check(
            self.max_model_len is None or self.max_model_len > 0,
            "model.max_model_len",
            self.max_model_len,
            "a positive integer or None",
        )
        _check(self.max_logprobs >= 0, "model.max_logprobs", self.max_logprobs, "an integer >= 0")
        _check(
            isinstance(self.batch_invariant, bool),
            "model.batch_invariant",
            self.batch_invariant,
            "True or False",
        )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    """Token slots per KV-cache block."""
    kv_cache_memory: float | None = field(
        default=None, metadata={"metavar": "GIB|PCT%", "parse": parse_kv_cache_memory}
    )
    """KV-cache size in GiB (2, or 0.25 for 256 MiB); as a flag or keyword also a share of the
    memory free after the model loads ("40%", which sets ``kv_cache_memory_fraction``). Neither
    set: the worker's default, 40% of free memory, at most 4 GiB."""
    kv_cache_memory_fraction: float | None = field(
        default=None, metadata={"set_by": "kv_cache_memory"}
    )
    """KV-cache size as a fraction of the memory free after the model loads, in (0, 1]."""
    enable_prefix_caching: bool = True
    """Share full blocks between requests whose prompts start the same way."""

    def __post_init__(self) -> None:
        _check(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256),
            "cache.block_size",
            self.block_size,
            "a power of two from 1 to 256",
        )
        _check(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            "cache.kv_cache_memory",
            self.kv_cache_memory,
            "a size in GiB above 0, or None",
        )
        _check(
            self.kv_cache_memory_fraction is None or 0 < self.kv_cache_memory_fraction <= 1,
            "cache.kv_cache_memory_fraction",
            self.kv_cache_memory_fraction,
            "a fraction in (0, 1], or None",
        )
        _check(
            self.kv_cache_memory is None or self.kv_cache_memory_fraction is None,
            "cache.kv_cache_memory_fraction",
            self.kv_cache_memory_fraction,
            "None when cache.kv_cache_memory is set (give a size or a fraction, not both)",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64
    """Most requests in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget: the most tokens one step computes."""
    enable_chunked_prefill: bool = True
    """Split a long prompt over several steps instead of waiting for a step with room."""
    max_num_waiting: int | None = None
    """Most requests queued before new ones are refused (HTTP 503); None is unbounded."""

    def __post_init__(self) -> None:
        _check(
            self.max_num_seqs >= 1, "scheduler.max_num_seqs", self.max_num_seqs, "an integer >= 1"
        )
        _check(
            self.max_num_batched_tokens >= 1,
            "scheduler.max_num_batched_tokens",
            self.max_num_batched_tokens,
            "an integer >= 1",
        )
        _check(
            self.max_num_waiting is None or self.max_num_waiting >= 0,
            "scheduler.max_num_waiting",
            self.max_num_waiting,
            "an integer >= 0 or None",
        )


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over devices and processes."""

    tensor_parallel_size: int = field(default=1, metadata={"aliases": ("-tp",)})
    """Devices one copy of the model is split over."""
    pipeline_parallel_size: int = field(default=1, metadata={"aliases": ("-pp",)})
    """Stages one copy of the model's layers is split over, one rank each, run in turn (the
    first embeds, the last samples); not yet combined with tensor_parallel_size > 1."""
    ray_address: str | None = None
    """The Ray cluster of the ray backend (its head's host:port, or "auto"); None: the
    ``RAY_ADDRESS`` environment variable, else a local cluster Kiln starts and stops."""
    data_parallel_size: int = field(default=1, metadata={"aliases": ("-dp",)})
    """Engine cores, each with its own copy of the model (its ranks), scheduler and KV cache,
    behind one API server; each request goes to the engine with the fewest unfinished requests.
    The cores (and the KV-cache memory) are split between them."""
    distributed_executor_backend: str | None = field(
        default=None, metadata={"choices": EXECUTOR_BACKENDS}
    )
    """uni (the worker in the engine core), mp (a process per rank) or ray (many machines); None:
    uni for one rank, mp for more."""
    data_parallel_rank: int = field(default=0, metadata={"internal": True})
    """This engine core's index among the ``data_parallel_size`` (set by the front end that starts
    the engines; not a flag)."""
    rank: int = field(default=0, metadata={"internal": True})
    """This worker's rank among its engine's ``world_size`` ranks (set by the executor; not a
    flag)."""

    @property
    def world_size(self) -> int:
        """Ranks (worker processes) of one engine core."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        _check(
            self.tensor_parallel_size >= 1,
            "parallel.tensor_parallel_size",
            self.tensor_parallel_size,
            "an integer >= 1",
        )
        _check(
            self.pipeline_parallel_size >= 1,
            "parallel.pipeline_parallel_size",
            self.pipeline_parallel_size,
            "an integer >= 1",
        )
        _check(
            self.pipeline_parallel_size == 1 or self.tensor_parallel_size == 1,
            "parallel.pipeline_parallel_size",
            self.pipeline_parallel_size,
            f"1 with tensor_parallel_size={self.tensor_parallel_size} (pipeline and tensor "
            "parallelism are not combined yet)",
        )
        _check(
            self.data_parallel_size >= 1,
            "parallel.data_parallel_size",
            self.data_parallel_size,
            "an integer >= 1",
        )
        _check(
            self.distributed_executor_backend is None
            or self.distributed_executor_backend in EXECUTOR_BACKENDS,
            "parallel.distributed_executor_backend",
            self.distributed_executor_backend,
            f"None or one of {list(EXECUTOR_BACKENDS)}",
        )
        _check(
            self.distributed_executor_backend != "uni" or self.world_size == 1,
            "parallel.distributed_executor_backend",
            self.distributed_executor_backend,
            f"'mp' or 'ray' (or None) with {self.world_size} ranks: one process holds one rank",
        )
        _check(
            0 <= self.data_parallel_rank < self.data_parallel_size,
            "parallel.data_parallel_rank",
            self.data_parallel_rank,
            f"0..{self.data_parallel_size - 1}",
        )
        _check(
            0 <= self.rank < self.world_size,
            "parallel.rank",
            self.rank,
            f"0..{self.world_size - 1}",
        )


@dataclass(frozen=True)
class DeviceConfig:
    """Which platform runs the model, and the classes it names."""

    platform: str | None = None
    """Force a platform by name (also ``KILN_PLATFORM``); None selects by detection."""
    worker_cls: str = AUTO
    """Dotted path of the worker class (filled by the platform)."""
    model_runner_cls: str = AUTO
    """Dotted path of the model runner class (filled by the platform)."""
    scheduler_cls: str = AUTO
    """Dotted path of the scheduler class (filled by the platform; Kiln's by default)."""
    attention_backend: str = AUTO
    """Dotted path of the attention backend class (filled by the platform)."""
    communicator_cls: str = AUTO
    """Dotted path of the device communicator class (filled by the platform)."""
    graph_wrapper_cls: str = AUTO
    """Dotted path of the graph-capture wrapper class (filled by the platform)."""
    proposer_cls: str = AUTO
    """Dotted path of the speculative-decoding proposer class (filled by the platform)."""
    rejection_sampler_cls: str = AUTO
    """Dotted path of the speculative-decoding rejection sampler class (filled by the platform)."""
    graph_capture_sizes: tuple[int, ...] | None = field(
        default=None, metadata={"metavar": "N,N,...", "parse": parse_graph_capture_sizes}
    )
    """Decode batch sizes (buckets) the graph wrapper captures at start-up; a decode step of
    ``n`` requests is padded to the smallest bucket ``>= n``, and other steps (prefill, mixed,
    above the largest bucket) run eagerly. ``None``: the platform's choice, which is none where it
    captures nothing (``supports_graph_capture = False``), else 1, 2, 4, 8, 16, then every 16, up
    to ``max_num_seqs`` (see ``kiln.worker.graph.graph_capture_sizes``); ``()``: no capture. As a
    flag: "1,2,4,8" ("" for none)."""

    def __post_init__(self) -> None:
        sizes = self.graph_capture_sizes
        _check(
            sizes is None or all(isinstance(s, int) and s >= 1 for s in sizes),
            "device.graph_capture_sizes",
            sizes,
            "None or a tuple of integers >= 1",
        )


@dataclass(frozen=True)
class PluginConfig:
    """Settings for plugins: raw sections by plugin name, validated against what each declares."""

    sections: dict[str, dict[str, Any]] = field(
        default_factory=dict,
        metadata={"flag": "plugin_config", "metavar": "JSON", "parse": parse_plugin_config},
    )
    """Settings by plugin name, ``{"plugin-name": {"key": 1}}``, as JSON on the command line;
    each plugin declares and validates its own (see ``kiln plugins``)."""


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving: PEFT adapters chosen per request, several of them in one batch."""

    enable_lora: bool = False
    """Serve LoRA adapters: ``--lora-modules``, ``LoRARequest`` offline, a request's ``model``."""
    max_loras: int = 1
    """Most distinct adapters in one batch (the slots of stacked adapter weights); a request for
    another adapter waits until a slot's requests finish."""
    max_lora_rank: int = 16
    """Largest adapter rank served; an adapter of a higher rank is refused when loaded. Every
    slot is this wide, so it sets the cost of the LoRA matmuls."""

    def __post_init__(self) -> None:
        _check(self.max_loras >= 1, "lora.max_loras", self.max_loras, "an integer >= 1")
        _check(self.max_lora_rank >= 1, "lora.max_lora_rank", self.max_lora_rank, "an integer >= 1")


STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar", "guidance")
"""Values of ``structured_outputs.backend`` (``"guidance"`` is llguidance, as in vLLM)."""


def parse_structured_outputs_config(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """``--structured-outputs-config``: JSON (or, from Python, a dict) of
    ``StructuredOutputsConfig`` fields, ``'{"backend": "xgrammar"}'``.

    Raises:
        ValueError: not JSON, not an object, or a key that is no field (names the allowed ones).
    """
    if not value:
        return {}
    try:
        data = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as exc:
        raise ValueError(f"--structured-outputs-config is not valid JSON: {exc}") from exc
    allowed = [
        f.name for f in dataclasses.fields(StructuredOutputsConfig) if f.name != "reasoning_parser"
    ]
    if not isinstance(data, dict) or not set(data) <= set(allowed):
        raise ValueError(
            f"structured_outputs_config={value!r} is invalid; allowed: a JSON object with keys in "
            f'{allowed}, like \'{{"backend": "xgrammar"}}\''
        )
    return data


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Structured outputs (JSON schema, regex, choice, grammar): the grammar engine and its bounds.

    The grammar fields are set by one flag, ``--structured-outputs-config '{"backend":
    "guidance"}'``; ``reasoning_parser`` by its own, ``--reasoning-parser`` (vLLM's flags)."""

    backend: str = field(
        default="auto",
        metadata={
            "flag": "structured_outputs_config",
            "metavar": "JSON",
            "parse": parse_structured_outputs_config,
        },
    )
    """Grammar engine: "xgrammar", "guidance" (llguidance), or "auto": xgrammar, and llguidance for
    a spec xgrammar does not support."""
    max_compile_seconds: float = field(
        default=30.0, metadata={"set_by": "structured_outputs_config"}
    )
    """A request whose grammar has not compiled after this long finishes with finish reason
    "error" (compiles run in a thread pool, never on the engine loop)."""
    enable_in_reasoning: bool = field(
        default=False, metadata={"set_by": "structured_outputs_config"}
    )
    """With a reasoning parser, constrain the thinking too: the grammar applies from the first
    token instead of after the thinking (vLLM's option of that name)."""
    reasoning_parser: str | None = field(default=None, metadata={"metavar": "NAME"})
    """The model thinks before it answers, in this parser's format: qwen3 (<think>...</think>) or
    a name a plugin registered. The chat route splits the thinking into reasoning_content, and a
    structured output constrains only the answer after it, as in vLLM."""

    def __post_init__(self) -> None:
        _check(
            self.backend in STRUCTURED_OUTPUT_BACKENDS,
            "structured_outputs.backend",
            self.backend,
            str(STRUCTURED_OUTPUT_BACKENDS),
        )
        _check(
            isinstance(self.max_compile_seconds, (int, float)) and self.max_compile_seconds > 0,
            "structured_outputs.max_compile_seconds",
            self.max_compile_seconds,
            "a number of seconds > 0",
        )


SPECULATIVE_METHODS = ("ngram", "draft_model")
"""Values of ``speculative.method`` (None: no speculation)."""

MAX_NUM_SPECULATIVE_TOKENS = 32
"""Most drafts per request per step: each is a verified position (and, with a draft model, one
more sequential draft forward), and runs that long are essentially never all accepted."""

_SPECULATIVE_EXAMPLE = '\'{"method": "ngram", "num_speculative_tokens": 4}\''


def parse_speculative_config(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """``--speculative-config``: JSON (or, from Python, a dict) of ``SpeculativeConfig`` fields.

    As vLLM: with ``ngram``, a missing ``prompt_lookup_min`` / ``prompt_lookup_max`` takes the
    other's value, and both missing are 5; a ``model`` without a ``method`` is ``draft_model``.

    Raises:
        ValueError: not JSON, not an object, or a key that is no field (names the allowed ones).
    """
    if not value:
        return {}
    try:
        data = json.loads(value) if isinstance(value, str) else dict(value)
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise ValueError(f"--speculative-config is not valid JSON: {exc}") from exc
    allowed = [f.name for f in dataclasses.fields(SpeculativeConfig)]
    if not isinstance(data, dict) or not set(data) <= set(allowed):
        raise ValueError(
            f"speculative_config={value!r} is invalid; allowed: a JSON object with keys in "
            f"{allowed}, like {_SPECULATIVE_EXAMPLE}"
        )
    if data.get("model") is not None and data.get("method") is None:
        data["method"] = "draft_model"
    if data.get("method") == "ngram":
        lookup_min, lookup_max = data.get("prompt_lookup_min"), data.get("prompt_lookup_max")
        if lookup_min is None and lookup_max is None:
            lookup_min = lookup_max = 5
        data["prompt_lookup_min"] = lookup_max if lookup_min is None else lookup_min
        data["prompt_lookup_max"] = lookup_min if lookup_max is None else lookup_max
    return data


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a cheap proposer drafts tokens that the model verifies in one forward,
    keeping exactly the model's output distribution (greedy output token for token).

    All fields are set by one flag, ``--speculative-config`` (``LLM(speculative_config={...})``),
    as vLLM: ``'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'`` or
    ``'{"method": "draft_model", "model": "small.gguf", "num_speculative_tokens": 3}'``."""

    method: str | None = field(
        default=None,
        metadata={
            "flag": "speculative_config",
            "metavar": "JSON",
            "parse": parse_speculative_config,
        },
    )
    """None: no speculation; "ngram": prompt lookup (drafts are the tokens that followed the
    latest earlier occurrence of the request's last n tokens, prompt and output); "draft_model":
    a smaller model with the same vocabulary (``model``) drafts, with its own KV cache."""
    num_speculative_tokens: int = field(default=0, metadata={"set_by": "speculative_config"})
    """Most draft tokens a request verifies per step (1 to ``MAX_NUM_SPECULATIVE_TOKENS`` when
    ``method`` is set)."""
    prompt_lookup_min: int = field(default=5, metadata={"set_by": "speculative_config"})
    """ngram: the shortest suffix n-gram looked up."""
    prompt_lookup_max: int = field(default=5, metadata={"set_by": "speculative_config"})
    """ngram: the longest suffix n-gram looked up (the longest that matches wins)."""
    model: str | None = field(default=None, metadata={"set_by": "speculative_config"})
    """draft_model: the draft (a GGUF file or a Hugging Face folder, as ``model.model``), loaded
    with the target's dtype; its vocabulary must be the target's."""
    quantization: str | None = field(default=None, metadata={"set_by": "speculative_config"})
    """draft_model: the draft's ``model.quantization`` (None: "auto", as for the target)."""

    def __post_init__(self) -> None:
        _check(
            self.method is None or self.method in SPECULATIVE_METHODS,
            "speculative.method",
            self.method,
            f"None or one of {list(SPECULATIVE_METHODS)}",
        )
        if self.method is None:
            _check(
                self.num_speculative_tokens == 0,
                "speculative.num_speculative_tokens",
                self.num_speculative_tokens,
                "0 without a method (set speculative.method)",
            )
            return
        _check(
            _is_int(self.num_speculative_tokens)
            and 1 <= self.num_speculative_tokens <= MAX_NUM_SPECULATIVE_TOKENS,
            "speculative.num_speculative_tokens",
            self.num_speculative_tokens,
            f"an integer in [1, {MAX_NUM_SPECULATIVE_TOKENS}] with method {self.method!r}, like "
            f"{_SPECULATIVE_EXAMPLE}",
        )
        is_draft_model = self.method == "draft_model"
        _check(
            (isinstance(self.model, str) and bool(self.model)) == is_draft_model,
            "speculative.model",
            self.model,
            "a GGUF file or Hugging Face folder with method 'draft_model' (and only with it)",
        )
        _check(
            self.quantization is None
            or (is_draft_model and self.quantization in QUANTIZATION_METHODS),
            "speculative.quantization",
            self.quantization,
            f"None or one of {list(QUANTIZATION_METHODS)} with method 'draft_model'",
        )
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, f"speculative.{name}", value, "an integer >= 1")
        _check(
            self.prompt_lookup_min <= self.prompt_lookup_max,
            "speculative.prompt_lookup_min",
            self.prompt_lookup_min,
            f"at most prompt_lookup_max ({self.prompt_lookup_max})",
        )

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs after its scheduled tokens, for a draft model's keys and
        values of its drafts (``num_speculative_tokens`` with "draft_model", else 0; vLLM's
        name)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


@dataclass(frozen=True)
class KilnConfig:
    """Everything one engine needs, by domain."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    plugins: PluginConfig = field(default_factory=PluginConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def replace(self, **changes: Any) -> KilnConfig:
        """A copy with fields changed, named ``section__field`` (``device__worker_cls="x.Y"``).

        Raises:
            ValueError: an unknown section or field (names the allowed ones), or an invalid value.
        """
        by_section: dict[str, dict[str, Any]] = {}
        for key, value in changes.items():
            section, sep, name = key.partition("__")
            if not sep or section not in SECTIONS:
                raise ValueError(
                    f"{key!r} is not a config field; use section__field with a section in "
                    f"{list(SECTIONS)}"
                )
            allowed = [f.name for f in dataclasses.fields(SECTIONS[section])]
            if name not in allowed:
                raise ValueError(f"{section}.{name} is not a config field; allowed: {allowed}")
            by_section.setdefault(section, {})[name] = value
        return dataclasses.replace(
            self,
            **{
                section: dataclasses.replace(getattr(self, section), **values)
                for section, values in by_section.items()
            },
        )

    def flat(self) -> dict[str, Any]:
        """Every field as ``{"section.field": value}``."""
        return {
            f"{section}.{f.name}": getattr(getattr(self, section), f.name)
            for section in SECTIONS
            for f in dataclasses.fields(SECTIONS[section])
        }

    def diff(self, other: KilnConfig) -> list[tuple[str, Any, Any]]:
        """``[(field, old, new)]`` for every field that differs from ``self`` in ``other``."""
        mine, theirs = self.flat(), other.flat()
        return [(key, mine[key], theirs[key]) for key in mine if mine[key] != theirs[key]]


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "device": DeviceConfig,
    "lora": LoRAConfig,
    "plugins": PluginConfig,
    "structured_outputs": StructuredOutputsConfig,
    "speculative": SpeculativeConfig,
}
"""``KilnConfig``'s sections by name, in order."""


_current_config: contextvars.ContextVar[KilnConfig | None] = contextvars.ContextVar(
    "kiln_current_config", default=None
)


@contextlib.contextmanager
def set_current_config(config: KilnConfig) -> Iterator[KilnConfig]:
    """Make ``config`` readable with ``get_current_config()`` inside the block.

    The model runner builds the model inside it, so layers (attention picks its backend from
    ``device.attention_backend``) can read the config without it threading through every model's
    constructor.
    """
    token = _current_config.set(config)
    try:
        yield config
    finally:
        _current_config.reset(token)


def get_current_config() -> KilnConfig | None:
    """The config set by the enclosing ``set_current_config`` block, or None outside one."""
    return _current_config.get()
