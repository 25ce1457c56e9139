"""Incremental detokenization against the real tokenizer of the default model, and stop strings."""

import random
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders
from tokenizers.models import WordLevel

from kiln.engine.detokenizer import (
    IncrementalDecoder,
    IncrementalDetokenizer,
    StopStringMatcher,
)
from kiln.model_executor.loader.default_model import default_model_path
from kiln.sampling_params import SamplingParams
from kiln.tokenizer import load_tokenizer

REAL_TEXTS = [
    "Hello, world! How are you today?",
    "Emoji: 😀🎉 family 👨‍👩‍👧 flag 🇫🇷 and a 🦀 crab.",
    "中文测试：你好，世界。日本語のテキスト、한국어 텍스트.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "  leading spaces,\t\ttabs,   runs    of     spaces\n\n\n\nand newlines   \n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>",
    "Accents: naïve café résumé Ærøskøbing — “quotes” … ½ ∑ ∞ ≠",
    "mixed<|endoftext|>😀<|im_end|>世界<repo_name>",
    "\ufffd a literal replacement character, then text",
]

CHAR_POOL = (
    list("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,;:!?'\"()[]{}<>=+-_/\\\n\t")
    + ["  ", "    ", "\n\n"]
    + list("éüñçßøåæœ")
    + list("你好世界中文日本語한국어")
    + ["😀", "🎉", "👍🏽", "🦀", "👨‍👩‍👧", "🇯🇵", "∑", "∞", "€"]
    + ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def decode_incrementally(tokenizer, ids, skip_special_tokens=True, prompt_ids=()):
    decoder = IncrementalDecoder(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    pieces = [decoder.decode_next(token_id) for token_id in ids]
    return pieces, decoder.flush()


def random_texts(seed, count):
    rng = random.Random(seed)
    return ["".join(rng.choices(CHAR_POOL, k=rng.randint(1, 60))) for _ in range(count)]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", REAL_TEXTS)
def test_incremental_equals_full_decode_on_real_texts(tokenizer, text, skip_special_tokens):
    ids = tokenizer.encode(text)
    pieces, rest = decode_incrementally(tokenizer, ids, skip_special_tokens)
    assert "".join(pieces) + rest == tokenizer.decode(ids, skip_special_tokens)
    # Every text here is valid UTF-8 token by token in the end, so nothing is left to flush and
    # no piece may carry a replacement character the text itself does not have.
    assert rest == ""
    if "\ufffd" not in text:
        assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_equals_full_decode_on_random_texts(tokenizer, skip_special_tokens):
    for text in random_texts(seed=1234, count=150):
        ids = tokenizer.encode(text)
        pieces, rest = decode_incrementally(tokenizer, ids, skip_special_tokens)
        assert "".join(pieces) + rest == tokenizer.decode(ids, skip_special_tokens), text
        assert not any("\ufffd" in piece for piece in pieces), text


def test_half_of_a_character_emits_nothing_until_completed(tokenizer):
    ids = tokenizer.encode(" 😀")
    assert len(ids) == 2  # byte-level BPE: the emoji's four bytes span two tokens
    assert tokenizer.decode(ids[:1]).endswith("\ufffd")
    pieces, rest = decode_incrementally(tokenizer, ids)
    assert pieces == ["", " 😀"]
    assert rest == ""


def test_flush_emits_an_unfinished_character_as_full_decode_does(tokenizer):
    ids = tokenizer.encode("ok 世界")[:-1]  # cut inside the last character
    pieces, rest = decode_incrementally(tokenizer, ids)
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + rest == tokenizer.decode(ids)
    assert rest.endswith("\ufffd")


def test_random_token_ids_concatenate_to_full_decode(tokenizer):
    rng = random.Random(7)
    for skip_special_tokens in (True, False):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(2000)]
        pieces, rest = decode_incrementally(tokenizer, ids, skip_special_tokens)
        assert "".join(pieces) + rest == tokenizer.decode(ids, skip_special_tokens)


def test_prompt_context_does_not_leak_into_the_output(tokenizer):
    prompt = tokenizer.encode("<|im_start|>user\nSay hi 世界<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode("Hi! 😀 你好")
    for skip in (True, False):
        pieces, rest = decode_incrementally(tokenizer, ids, skip, prompt_ids=prompt)
        assert "".join(pieces) + rest == tokenizer.decode(ids, skip)
    # A prompt cut inside a character is not used as context (it would merge with the output).
    cut_prompt = tokenizer.encode("abc 😀")[:-1]
    pieces, rest = decode_incrementally(tokenizer, ids, prompt_ids=cut_prompt)
    assert "".join(pieces) + rest == tokenizer.decode(ids)


def test_sentencepiece_style_decoder_keeps_the_first_tokens_space():
    # Not the default model's kind of tokenizer: a Llama-2 style decoder (metaspace, byte fallback,
    # strip one leading space of the text). Alone, "▁world" decodes to "world"; after a prompt it
    # must be " world", and byte-fallback tokens must wait for the whole character.
    tokens = ["<unk>", "▁Hello", "▁world", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "!"]
    backend = Tokenizer(WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer = SimpleNamespace(backend_tokenizer=backend)
    pieces, rest = decode_incrementally(tokenizer, [2, 3, 4, 5, 6, 7], prompt_ids=[1])
    assert pieces == [" world", "", "", "", "😀", "!"] and rest == ""
    assert backend.decode([1, 2, 3, 4, 5, 6, 7]) == "Hello" + "".join(pieces)


def test_each_step_decodes_a_short_window(tokenizer):
    text = " ".join(REAL_TEXTS) * 8
    ids = tokenizer.encode(text)
    assert len(ids) > 1000
    decoder = IncrementalDecoder(tokenizer)
    window_lengths = []
    decode = decoder._decode
    decoder._decode = lambda window: window_lengths.append(len(window)) or decode(window)
    out = "".join(decoder.decode_next(token_id) for token_id in ids) + decoder.flush()
    assert out == tokenizer.decode(ids)
    assert max(window_lengths) <= 8
    assert len(decoder._ids) < 300  # decoded ids are trimmed from the buffer


def find_stop_string(text, num_new_chars, stop):
    """The first stop string completing in the last ``num_new_chars`` of ``text``, fed whole."""
    return StopStringMatcher(stop).feed(text, 0, len(text) - num_new_chars)


def partial_stop_length(text, stop):
    matcher = StopStringMatcher(stop)
    matcher.feed(text, 0, len(text))  # no match counts: only the partial end
    return matcher.partial_length


def test_find_stop_string_earliest_end_wins():
    # "lo" completes at index 5, "world" at 11: list order does not matter.
    assert find_stop_string("hello world", 11, ["world", "lo"]) == ("lo", 3)
    assert find_stop_string("hello world", 11, ["lo", "world"]) == ("lo", 3)
    # "bcd" completes before "abcde" although "abcde" starts first.
    assert find_stop_string("xabcde", 6, ["abcde", "bcd"]) == ("bcd", 2)
    # Same end: the one that starts first.
    assert find_stop_string("xabc", 4, ["bc", "abc"]) == ("abc", 1)
    # Only matches that end in the new characters count.
    assert find_stop_string("stop here", 4, ["stop"]) is None
    assert find_stop_string("stop here", 7, ["stop"]) == ("stop", 0)
    assert find_stop_string("text", 0, ["t"]) is None
    # Overlapping and shared prefixes (failure links).
    assert find_stop_string("aaab", 4, ["aab"]) == ("aab", 1)
    assert find_stop_string("abcabd", 6, ["abd", "bca"]) == ("bca", 1)
    assert find_stop_string("xyabcd", 6, ["abcdz", "bc"]) == ("bc", 3)


def test_stop_matcher_fed_piece_by_piece_matches_whole_text():
    text = "the quick brown fox jumps over the lazy dog, then the fox naps"
    stops = ["fox j", "lazy cat", "the f", "naps", "x"]
    whole = find_stop_string(text, len(text), stops)
    for size in (1, 2, 3, 7):
        matcher, found = StopStringMatcher(stops), None
        for start in range(0, len(text), size):
            found = matcher.feed(text[start : start + size], start, 0)
            if found:
                break
        assert found == whole == ("x", 18)


def test_partial_stop_length():
    assert partial_stop_length("hello <EN", ["<END>"]) == 3
    assert partial_stop_length("hello <END", ["<END>", "x"]) == 4
    assert partial_stop_length("hello", ["<END>"]) == 0
    assert partial_stop_length("abab", ["abac", "b"]) == 2
    assert partial_stop_length("ab", ["abcdef"]) == 2
    assert partial_stop_length("xaab", ["aabc"]) == 3


def test_stop_string_cost_does_not_grow_with_their_length():
    """100 stop strings of 4,000 characters sharing a long prefix, and a text that keeps almost
    matching them: each new character costs a bounded number of automaton lookups (counted, not
    timed), where slicing every prefix of every stop string cost millions per token."""
    stops = ["a" * 3990 + f"{i:03d}b" for i in range(100)]
    matcher = StopStringMatcher(stops)
    lookups = 0

    class Counting(dict):
        def __contains__(self, key):
            nonlocal lookups
            lookups += 1
            return super().__contains__(key)

        def get(self, key, default=None):
            nonlocal lookups
            lookups += 1
            return super().get(key, default)

    matcher._goto = [Counting(g) for g in matcher._goto]
    text = "a" * 5000
    for start in range(0, len(text), 4):  # token-sized pieces
        assert matcher.feed(text[start : start + 4], start, 0) is None
    assert lookups <= 4 * len(text)
    assert matcher.partial_length == 3990
    assert matcher.feed("042b", len(text), 0) == (stops[42], len(text) - 3990)


def detokenize(tokenizer, text, **params):
    detokenizer = IncrementalDetokenizer(tokenizer, SamplingParams(**params))
    for step, token_id in enumerate(tokenizer.encode(text)):
        stop = detokenizer.update([token_id])
        if stop is not None:
            return detokenizer.output_text, stop, step
    detokenizer.update([], finished=True)
    return detokenizer.output_text, None, None


def test_stop_string_inside_a_token_cuts_the_rest_of_the_token(tokenizer):
    # " world" is one token: the text after "wor" in it is cut.
    assert detokenize(tokenizer, "Hello world, everyone", stop=["wor"]) == ("Hello ", "wor", 1)
    text, stop, _ = detokenize(
        tokenizer, "Hello world, everyone", stop=["wor"], include_stop_str_in_output=True
    )
    assert (text, stop) == ("Hello wor", "wor")


def test_stop_string_spanning_tokens(tokenizer):
    assert detokenize(tokenizer, "Hello world, everyone", stop=["lo wo"]) == ("Hel", "lo wo", 1)
    assert detokenize(tokenizer, "a <EN b <END> tail", stop=["<END>"]) == ("a <EN b ", "<END>", 6)


def test_stop_strings_wait_for_min_tokens(tokenizer):
    text = "Hello world, world again"
    assert detokenize(tokenizer, text, stop=["world"], min_tokens=2) == (
        "Hello world, ",
        "world",
        3,
    )
    assert detokenize(tokenizer, text, stop=["world"], min_tokens=1)[0] == "Hello "


def test_stop_terminated_leaves_out_the_stop_token_text(tokenizer):
    ids = tokenizer.encode("Hi<|im_end|>")
    for include, expected in ((False, "Hi"), (True, "Hi<|im_end|>")):
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        detokenizer = IncrementalDetokenizer(tokenizer, params)
        detokenizer.update(ids, stop_terminated=True, finished=True)
        assert detokenizer.output_text == expected
