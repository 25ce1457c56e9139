"""Micro-benchmark: xgrammar vs llguidance on SmolLM2's tokenizer (vocabulary 49,152).

For each case (JSON schemas of growing size, a regex, a choice) it prints, per backend:

- cold compile: ms to turn the spec into a grammar ready for a matcher, nothing cached (a new
  compiler each time for xgrammar; llguidance builds its parser lazily, so its figure includes the
  matcher's creation and the first mask);
- mask: microseconds per generated token to fill the next-token bitmask and advance the matcher by
  the token, walking the tokens of a valid output (what the engine core does per request per step).

The two backends run interleaved, best of ``--repeats`` runs, so that load on a shared machine
hits both alike; the load average is printed with the figures.

Run: ``PYTHONPATH=src python benchmarks/structured_output_backends.py [--repeats N]``
"""

from __future__ import annotations

import argparse
import json
import os
import time

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar as xgr

from kiln.model_executor.loader.default_model import default_model_path
from kiln.tokenizer import load_tokenizer

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "status": {"enum": ["open", "paid", "shipped", "cancelled"]},
        "total": {"type": "number", "minimum": 0, "maximum": 10000},
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["sku", "quantity"],
            },
        },
        "customer": {
            "type": "object",
            "properties": {"email": {"type": "string"}, "vip": {"type": "boolean"}},
            "required": ["email"],
        },
    },
    "required": ["id", "status", "total", "items", "customer"],
}
ORDER_TEXT = json.dumps(
    {
        "id": "ABC-1234",
        "status": "paid",
        "total": 129.5,
        "items": [
            {"sku": "kettle-01", "quantity": 2, "tags": ["kitchen", "steel"]},
            {"sku": "mug-22", "quantity": 4},
        ],
        "customer": {"email": "ada@example.com", "vip": True},
    }
)
CASES = [
    ("json person", "json", PERSON, json.dumps({"name": "Ada Lovelace", "age": 36})),
    ("json order", "json", ORDER, ORDER_TEXT),
    ("regex date", "regex", r"\d{4}-\d{2}-\d{2}", "2024-02-29"),
    ("choice", "choice", ["positive", "negative", "neutral"], "negative"),
]


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec):
        compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(spec))
        if kind == "regex":
            return compiler.compile_regex(spec)
        grammar = "root ::= " + " | ".join(json.dumps(c) for c in spec)
        return compiler.compile_grammar(grammar)

    def walk(self, compiled, token_ids: list[int]) -> None:
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        for token_id in token_ids:
            matcher.fill_next_token_bitmask(bitmask, 0)
            assert matcher.accept_token(token_id), token_id
        matcher.fill_next_token_bitmask(bitmask, 0)


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec):
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in spec)
            )
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        bitmask = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)  # builds the parser
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def walk(self, grammar, token_ids: list[int]) -> None:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        bitmask = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)
        for token_id in token_ids:
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            assert matcher.consume_token(token_id), (token_id, matcher.get_error())
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(default_model_path())
    vocab_size = tokenizer.vocab_size
    backends = []
    for cls in (XGrammar, LLGuidance):
        start = time.perf_counter()
        backends.append(cls(tokenizer.hf_tokenizer, vocab_size))
        print(f"{cls.name}: tokenizer setup {(time.perf_counter() - start) * 1e3:.0f} ms")
    print(f"load average {os.getloadavg()[0]:.2f}; best of {args.repeats}, interleaved\n")
    print(
        f"{'case':<12} {'tokens':>6}  {'backend':<10} {'cold compile ms':>15} {'mask us/token':>13}"
    )
    for label, kind, spec, text in CASES:
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        rows = {backend.name: [float("inf"), float("inf")] for backend in backends}
        for _ in range(args.repeats):
            for backend in backends:
                row = rows[backend.name]
                start = time.perf_counter()
                compiled = backend.compile(kind, spec)
                row[0] = min(row[0], (time.perf_counter() - start) * 1e3)
                start = time.perf_counter()
                backend.walk(compiled, token_ids)
                walk_ms = (time.perf_counter() - start) * 1e3
                row[1] = min(row[1], walk_ms * 1e3 / (len(token_ids) + 1))
        for name, (compile_ms, mask_us) in rows.items():
            print(
                f"{label:<12} {len(token_ids):>6}  {name:<10} {compile_ms:>15.2f} {mask_us:>13.1f}"
            )


if __name__ == "__main__":
    main()
