"""What one ``kiln serve`` decides and shares across its routes: the operator's request limits
(``ServerOptions``, from ``kiln serve`` flags) and the routes' shared state (``ServerState``: the
engine, served names, LoRA adapters, requests in flight, the tokenizer threads)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.chat_tools import ToolServerOptions
from kiln.lora.request import LoRARequest

MAX_WARNED_FIELDS = 64
"""Unknown request field names remembered (and logged once each); later ones are not logged."""


@dataclass(frozen=True)
class ServerOptions:
    """What the operator decides about requests (``kiln serve`` flags)."""

    trust_request_chat_template: bool = False
    """Render a ``chat_template`` sent in a request (Jinja from any client: off by default)."""
    max_n: int = 128
    """The most completions (``n``) one request may ask for (OpenAI's cap)."""
    max_response_logprobs: int = 2**20
    """The most logprob values one response may hold (``response_logprobs``), so a small
    request cannot ask for a response of hundreds of MB."""
    tokenizer_threads: int = 4
    """Worker threads that tokenize and render chat templates off the event loop."""
    tools: ToolServerOptions = field(default_factory=ToolServerOptions)
    """Tool-call and reasoning parsing (``--enable-auto-tool-choice``, ``--tool-call-parser``,
    ``--reasoning-parser``)."""
    allow_runtime_lora_updating: bool = False
    """Serve ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``."""
    max_lora_adapters: int = 256
    """The most adapters clients may name at once."""
    metrics_prefix: str = "vllm"
    """The prefix of the ``/metrics`` names (``--metrics-prefix``: vllm or kiln)."""
    engine_stall_timeout: float = 30.0
    """``/health`` is 503 while an engine with requests waiting is silent this long (0: off)."""
    responses_store_max_entries: int = 10_000
    """The most responses ``/v1/responses`` keeps (``store``), all API keys together."""
    responses_store_max_bytes: int = 256 * 2**20
    """The most bytes (as JSON) of stored responses and their conversations."""
    responses_store_ttl: float = 3600.0
    """Seconds a stored response is kept."""


@dataclass
class ServerState:
    """What the routes of one server share."""

    llm: AsyncLLM
    model_name: str
    """The name clients send in ``model`` (``--served-model-name`` or the model's)."""
    model_path: str
    """Where the weights come from (``root`` in ``/v1/models``)."""
    draining: bool = False
    """Shutting down: new generation requests get 503."""
    active_request_ids: set[str] = field(default_factory=set)
    """Engine request ids of the generation requests in flight (aborted at shutdown)."""
    options: ServerOptions = field(default_factory=ServerOptions)
    lora_requests: dict[str, LoRARequest] = field(default_factory=dict)
    """The LoRA adapters clients may name in ``model``, by name (``--lora-modules`` and
    ``/v1/load_lora_adapter``)."""
    next_lora_id: int = 1
    """The ``lora_int_id`` of the next adapter loaded; ids are never reused, so an adapter
    loaded again under an old name shares no prefix-cache blocks with its predecessor."""
    warned_fields: set[str] = field(default_factory=set)
    """Unknown field names already logged (at most ``MAX_WARNED_FIELDS``)."""
    executor: ThreadPoolExecutor = field(init=False)
    """Where tokenizing and template rendering run."""

    def __post_init__(self) -> None:
        self.executor = ThreadPoolExecutor(
            self.options.tokenizer_threads, thread_name_prefix="kiln-tokenize"
        )
