"""Perplexity of a model over a fixed text, through any engine config's prompt logprobs.

Contract: ``perplexity(llm, token_ids, window)`` splits ``token_ids`` into consecutive windows of
``window`` tokens (the last may be shorter), sends each as a prompt with ``prompt_logprobs=0``
and one output token, and returns ``exp(mean negative log-likelihood)`` over every token that has
a logprob (all but the first of each window), with the number of tokens scored. Windows are
independent prompts, so the figure depends on ``window`` but not on the engine's batching.

``DEFAULT_TEXT`` is Python's own ``LICENSE.txt`` (its history and licenses: English prose and
legal text, about 3,000 tokens for SmolLM2), which every CPython installation ships beside its
standard library. ``benchmarks/perplexity.py`` is the command line.
"""

from __future__ import annotations

import math
import os
import sysconfig
from typing import Any

from kiln.sampling_params import SamplingParams

DEFAULT_TEXT = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")
"""The text scored by default: CPython's ``LICENSE.txt`` in this interpreter's stdlib folder."""

DEFAULT_WINDOW = 1024
"""Tokens per prompt."""


def read_text(path: str = DEFAULT_TEXT) -> str:
    """The text at ``path``.

    Raises:
        FileNotFoundError: ``path`` does not exist (names it, and how to give another).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"text {path!r} does not exist; give another with --text PATH")
    with open(path, encoding="utf-8") as f:
        return f.read()


def perplexity(llm: Any, token_ids: list[int], window: int = DEFAULT_WINDOW) -> tuple[float, int]:
    """``(perplexity, tokens scored)`` of ``token_ids`` under ``llm`` (a ``kiln.LLM``).

    Raises:
        ValueError: ``window`` below 2, or fewer than 2 tokens.
    """
    if window < 2:
        raise ValueError(f"window={window} is invalid; allowed: an integer >= 2")
    if len(token_ids) < 2:
        raise ValueError(f"token_ids has {len(token_ids)} token(s); allowed: 2 or more")
    prompts = [
        {"prompt_token_ids": token_ids[i : i + window]}
        for i in range(0, len(token_ids), window)
        if len(token_ids[i : i + window]) >= 2
    ]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    nll, count = 0.0, 0
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = prompt["prompt_token_ids"]
        for position, logprobs in enumerate(output.prompt_logprobs or []):
            if logprobs is None:
                continue
            nll -= logprobs[ids[position]].logprob
            count += 1
    return math.exp(nll / count), count


__all__ = ["DEFAULT_TEXT", "DEFAULT_WINDOW", "perplexity", "read_text"]
