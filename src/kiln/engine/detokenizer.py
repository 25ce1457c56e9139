"""Incremental detokenization and stop strings: token ids in, text pieces out, one token at a time.

Contract:
- ``IncrementalDecoder`` turns a stream of token ids into text pieces whose concatenation equals the
  tokenizer's decode of all the ids (``flush()`` included), and never emits half a character: a
  byte-fallback token that is the first bytes of a multi-byte character (an emoji, a CJK character)
  emits nothing until a later token completes it. Each step decodes only a short window of ids
  (vLLM's prefix / read offsets), so the cost per token does not grow with the text.
- ``IncrementalDetokenizer`` is one request's text: it applies stop strings (the matched one and
  what follows are cut; ``include_stop_str_in_output`` keeps the stop string) and holds back the
  end of the text while it may be the start of a stop string, so that streamed text never shows
  part of a stop string. ``StopStringMatcher`` finds them at a cost per new character that does
  not grow with the number or the length of the stop strings.

Text is decoded by the Hugging Face ``tokenizers`` backend without the Python layer's
``clean_up_tokenization_spaces`` (a non-incremental, English-only post-pass; vLLM skips it too).
``spaces_between_special_tokens`` is passed to slow (pure Python) tokenizers only: a fast
tokenizer's decoder decides the spacing around special tokens itself, in HF and in vLLM alike.

What it must not know: the engine, scheduling, requests' other fields, output kinds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kiln.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as left context for the first generated token: SentencePiece decoders drop
# the leading space of the first token of a text, which a generated token must keep.
_NUM_CONTEXT_TOKENS = 6
# Drop decoded ids from the front of the buffer once this many are behind the decode window.
_TRIM_THRESHOLD = 256

DecodeFn = Callable[[Sequence[int]], str]


def make_decode_fn(
    tokenizer: Any, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
) -> DecodeFn:
    """A function ``ids -> text`` for ``tokenizer`` (a Kiln ``Tokenizer`` or an HF tokenizer)."""
    hf = getattr(tokenizer, "hf_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
    return lambda ids: hf.decode(
        list(ids),
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )


class IncrementalDecoder:
    """Decodes token ids one at a time into text pieces, never splitting a character.

    Args:
        tokenizer: a Kiln ``Tokenizer`` or a Hugging Face tokenizer.
        prompt_token_ids: the prompt; its last few tokens are left context for the first generated
            token (they are never emitted).
        skip_special_tokens: leave special tokens out of the text.
        spaces_between_special_tokens: see the module docstring.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._decode = make_decode_fn(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        context = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        prefix_text = self._decode(context) if context else ""
        if prefix_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: as context it would merge with the output.
            context, prefix_text = [], ""
        # _ids[_prefix_offset:_read_offset] is the window already emitted (context for the next
        # token), _ids[_read_offset:] what is not emitted yet; _prefix_text decodes the former.
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = prefix_text

    def decode_next(self, token_id: int) -> str:
        """Add one token id; return the text it completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """The text of the ids not emitted yet, incomplete characters included (as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        return self._advance(self._decode(self._ids[self._prefix_offset :]))

    def _advance(self, text: str) -> str:
        new_text = text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        if self._prefix_offset > _TRIM_THRESHOLD:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text


class StopStringMatcher:
    """Finds stop strings in a text that grows at its end: an Aho-Corasick automaton over the stop
    strings, so each new character costs the same however many and however long they are.

    "First" is the match that ends earliest (the one that would have fired first had the text
    arrived one character at a time, so the result does not depend on how text splits into
    tokens); on a tie, the one that starts earliest (the longest).

    Args:
        stop: the stop strings (non-empty).
    """

    def __init__(self, stop: Sequence[str]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        word: list[str | None] = [None]
        for stop_str in stop:
            node = 0
            for char in stop_str:
                child = goto[node].get(char)
                if child is None:
                    child = len(goto)
                    goto[node][char] = child
                    goto.append({})
                    depth.append(depth[node] + 1)
                    word.append(None)
                node = child
            word[node] = stop_str
        fail = [0] * len(goto)
        # The longest stop string that ends at each node: its own, else its failure node's.
        match = list(word)
        order = list(goto[0].values())
        for node in order:  # breadth first: a failure node is always shallower
            for char, child in goto[node].items():
                f = fail[node]
                while f and char not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(char, 0) if node else 0
                if match[child] is None:
                    match[child] = match[fail[child]]
                order.append(child)
        self._goto, self._fail, self._depth, self._match = goto, fail, depth, match
        self._state = 0

    def feed(self, text: str, start: int, check_from: int) -> tuple[str, int] | None:
        """Scan ``text``, the characters of the whole text from index ``start`` on.

        Returns:
            ``(stop_string, start_index)`` of the first stop string that completes at an end
            index above ``check_from`` (earlier ends are ignored: ``min_tokens``), or None.
        """
        goto, fail, match = self._goto, self._fail, self._match
        state = self._state
        for offset, char in enumerate(text):
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
            found = match[state]
            if found is not None and start + offset + 1 > check_from:
                self._state = state
                return found, start + offset + 1 - len(found)
        self._state = state
        return None

    @property
    def partial_length(self) -> int:
        """Length of the longest end of the text fed so far that is the start (not all) of a
        stop string."""
        node = self._state
        while node and not self._goto[node]:  # a leaf is a whole stop string
            node = self._fail[node]
        return self._depth[node]


class IncrementalDetokenizer:
    """One request's output text: incremental decoding plus stop strings.

    Args:
        tokenizer: a Kiln ``Tokenizer`` or a Hugging Face tokenizer.
        params: the request's sampling params (``stop``, ``include_stop_str_in_output``,
            ``min_tokens``, ``skip_special_tokens``, ``spaces_between_special_tokens``).
        prompt_token_ids: the prompt, used as left context only.
    """

    def __init__(
        self, tokenizer: Any, params: SamplingParams, prompt_token_ids: Sequence[int] = ()
    ) -> None:
        self._decoder = IncrementalDecoder(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        self.stop: list[str] = list(params.stop or [])
        self._stop_matcher = StopStringMatcher(self.stop) if self.stop else None
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.output_text = ""
        self.num_output_tokens = 0
        self.num_tokens_after_stop = 0
        """Of the last ``update``'s tokens, how many came after the one that completed the stop
        string (several tokens arrive per step with speculative decoding): the caller drops them."""
        self._num_sent_chars = 0
        # Whether streamed text must hold back a possible start of a stop string.
        self._holds_back = bool(self.stop) and not self.include_stop_str_in_output

    def update(
        self, new_token_ids: Sequence[int], stop_terminated: bool = False, finished: bool = False
    ) -> str | None:
        """Decode ``new_token_ids`` into ``output_text`` and look for stop strings.

        Args:
            new_token_ids: the request's newly generated ids.
            stop_terminated: the engine core stopped the request on its last token (EOS or a stop
                token id): that token's text is left out unless ``include_stop_str_in_output``,
                and stop strings are not checked.
            finished: the request has no more tokens to come: incomplete characters are flushed.

        Returns:
            The stop string that matched (``output_text`` is then cut after it or before it), or
            None. Stop strings are not looked for until more than ``min_tokens`` tokens exist.
        """
        num_tokens_before = self.num_output_tokens
        self.num_output_tokens += len(new_token_ids)
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        start = check_from = len(self.output_text)
        pieces = []
        for i, token_id in enumerate(new_token_ids):
            piece = self._decoder.decode_next(token_id)
            pieces.append(piece)
            if num_tokens_before + i + 1 <= self.min_tokens:
                check_from += len(piece)
        if finished:
            pieces.append(self._decoder.flush())
        new_text = "".join(pieces)
        self.output_text += new_text
        if stop_terminated or self._stop_matcher is None:
            return None
        match = self._stop_matcher.feed(new_text, start, check_from)
        if match is None:
            return None
        stop_str, match_start = match
        # The token whose text completes the stop string; those after it are not output.
        end = start
        for i, piece in enumerate(pieces[: len(new_token_ids)]):
            end += len(piece)
            if end >= match_start + len(stop_str):
                self.num_tokens_after_stop = len(new_token_ids) - i - 1
                break
        start = match_start
        end = start + len(stop_str) if self.include_stop_str_in_output else start
        self.output_text = self.output_text[:end]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to send: all of it (``delta=False``) or what was not sent yet.

        Until ``finished``, the end of the text that may be the start of a stop string is held
        back (it is sent once known not to be, and never if a stop string completes).
        """
        end = len(self.output_text)
        if self._holds_back and not finished and self._stop_matcher is not None:
            end -= self._stop_matcher.partial_length
        if not delta:
            return self.output_text[:end]
        start = self._num_sent_chars
        if end <= start:
            return ""
        self._num_sent_chars = end
        return self.output_text[start:end]


__all__ = [
    "IncrementalDecoder",
    "IncrementalDetokenizer",
    "StopStringMatcher",
    "make_decode_fn",
]
