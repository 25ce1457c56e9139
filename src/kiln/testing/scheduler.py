"""Schedulers and requests for tests that drive a ``Scheduler`` with hand-made runner outputs, no
model (the scheduler, structured-output and speculation tests; a plugin's scheduler can use them
too).

The defaults are small so that budgets, blocks and contexts run out within a few steps: 64 blocks
of 4 slots, a 256-token context, up to 8 requests and 64 tokens a step, chunked prefill and prefix
caching on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kiln.config import (
    CacheConfig,
    KilnConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from kiln.sampling_params import SamplingParams
from kiln.scheduler.request import Request
from kiln.scheduler.scheduler import Scheduler

BLOCK_SIZE = 4
EOS_TOKEN_ID = 2


def make_scheduler(
    num_blocks: int = 64,
    *,
    block_size: int = BLOCK_SIZE,
    max_model_len: int | None = 256,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    speculative: SpeculativeConfig | None = None,
    structured_outputs: StructuredOutputsConfig | None = None,
    kv_transfer: KVTransferConfig | None = None,
    bytes_per_block: int = 1024,
    tokenizer: Any = None,
) -> Scheduler:
    """A ``Scheduler`` over ``num_blocks`` KV blocks of ``block_size`` slots.

    Args:
        kv_transfer: a KV connector's config (none by default).
        bytes_per_block: what the engine core would have measured (``cache.bytes_per_block``,
            which sizes a connector's CPU tier in blocks).
        tokenizer: handed to the structured-output manager, which otherwise loads the model's
            tokenizer itself (as the engine core does); needed only by grammar requests.
    """
    config = KilnConfig(
        model=ModelConfig(max_model_len=max_model_len),
        cache=CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            bytes_per_block=bytes_per_block,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
        ),
        speculative=speculative or SpeculativeConfig(),
        structured_outputs=structured_outputs or StructuredOutputsConfig(),
        kv_transfer=kv_transfer or KVTransferConfig(),
    )
    scheduler = Scheduler(config, num_blocks)
    if tokenizer is not None:
        scheduler.structured_output_manager._load_tokenizer = lambda config: tokenizer
    return scheduler


def make_request(
    request_id: str,
    prompt: Sequence[int] | int,
    *,
    eos_token_id: int | None = EOS_TOKEN_ID,
    priority: int = 0,
    arrival_time: float = 0.0,
    **params: Any,
) -> Request:
    """A waiting ``Request`` of ``prompt`` (token ids, or a length: ids ``10 + i % 7``).

    ``params`` are ``SamplingParams`` fields; ``max_tokens`` defaults to 4.
    """
    if isinstance(prompt, int):
        prompt = [10 + (i % 7) for i in range(prompt)]
    params.setdefault("max_tokens", 4)
    return Request(
        request_id,
        list(prompt),
        SamplingParams(**params),
        eos_token_id=eos_token_id,
        arrival_time=arrival_time,
        priority=priority,
    )
