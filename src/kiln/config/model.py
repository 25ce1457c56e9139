"""``ModelConfig``: what model to serve and how to read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.config.checks import check
from kiln.config.pooler import POOLING_TYPES, RUNNERS, parse_pooler_config

DTYPES = ("auto", "float32", "float16", "bfloat16")
"""Values of ``model.dtype``."""

QUANTIZATION_METHODS = ("auto", "gguf", "int8", "int4", "none")
"""Values of ``model.quantization`` (None means ``"auto"``)."""

MODEL_IMPLS = ("auto", "kiln", "transformers")
"""Values of ``model.model_impl`` (``kiln.model_executor.registry``)."""


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
    model_impl: str = field(default="auto", metadata={"choices": MODEL_IMPLS})
    """Which implementation runs the architecture: kiln (a class in Kiln's model registry, native
    or a plugin's), transformers (transformers' own modeling code on Kiln's paged attention, for
    causal LMs Kiln has no class for; no quantization or parallelism), or auto (kiln where the
    registry has the architecture, else transformers). The start-up banner says which ran."""
    runner: str = field(default="generate", metadata={"choices": RUNNERS})
    """What the model is served for: generate (completions and chat) or pooling (embeddings:
    ``/v1/embeddings``, ``/pooling``, ``/score``; no generation). Pooling requests run through
    the same scheduler and KV cache and finish after their last prompt token."""
    pooling_type: str = field(
        default="LAST",
        metadata={"flag": "pooler_config", "metavar": "JSON", "parse": parse_pooler_config},
    )
    """The pooling runner's pooler, ``--pooler-config '{"pooling_type": "MEAN", "normalize":
    true}'``: pooling_type LAST (the last prompt token's final hidden state, the default), MEAN
    (the mean over the prompt) or CLS (the first token); normalize (default true) L2-normalises
    each embedding."""
    pooling_normalize: bool = field(default=True, metadata={"set_by": "pooler_config"})
    """L2-normalise embeddings unless a request says otherwise (``--pooler-config``)."""

    def __post_init__(self) -> None:
        check(self.runner in RUNNERS, "model.runner", self.runner, f"one of {list(RUNNERS)}")
        check(
            self.pooling_type in POOLING_TYPES,
            "model.pooling_type",
            self.pooling_type,
            f"one of {list(POOLING_TYPES)} (--pooler-config pooling_type)",
        )
        check(
            isinstance(self.pooling_normalize, bool),
            "model.pooling_normalize",
            self.pooling_normalize,
            "true or false (--pooler-config normalize)",
        )
        check(self.dtype in DTYPES, "model.dtype", self.dtype, f"one of {list(DTYPES)}")
        check(
            self.model_impl in MODEL_IMPLS,
            "model.model_impl",
            self.model_impl,
            f"one of {list(MODEL_IMPLS)}",
        )
        check(
            self.quantization is None or self.quantization in QUANTIZATION_METHODS,
            "model.quantization",
            self.quantization,
            f"None or one of {list(QUANTIZATION_METHODS)}",
        )
        check(
            self.max_model_len is None or self.max_model_len > 0,
            "model.max_model_len",
            self.max_model_len,
            "a positive integer or None",
        )
        check(self.max_logprobs >= 0, "model.max_logprobs", self.max_logprobs, "an integer >= 0")
        check(
            isinstance(self.batch_invariant, bool),
            "model.batch_invariant",
            self.batch_invariant,
            "True or False",
        )
