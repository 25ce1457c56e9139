"""kiln.tokenizer: the default model's tokenizer against transformers', BOS policy, templates."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import kiln.tokenizer_cache
from kiln.model_executor.loader.default_model import default_model_path
from kiln.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "Hello world!",
    "  leading spaces, trailing\n\n",
    "café, naïve, 日本語, emoji 🔥 and Ω",
    "def f(x):\n    return x ** 2  # code\n",
    "numbers 1234567 and 3.14159",
]
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def hf_smollm() -> Any:
    from transformers import AutoTokenizer

    folder, name = os.path.split(default_model_path())
    return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)


@pytest.mark.slow
def test_encode_decode_match_transformers(smollm: Tokenizer, hf_smollm: Any) -> None:
    for text in [*TEXTS, "<|im_start|>user\nhi<|im_end|>"]:
        ids = smollm.encode(text)
        assert ids == hf_smollm.encode(text), text
        assert smollm.decode(ids, skip_special_tokens=False) == text
    for text in TEXTS:
        assert smollm.decode(smollm.encode(text)) == text
    assert smollm.encode("Hello world!") == [19556, 905, 17]
    ids = smollm.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm.decode(ids) == "hi"  # special tokens skipped by default
    assert smollm.convert_ids_to_tokens([19556, 905]) == ["Hello", "Ġworld"]


@pytest.mark.slow
def test_default_model_special_tokens(smollm: Tokenizer) -> None:
    assert (smollm.bos_token_id, smollm.eos_token_id) == (1, 2)
    assert smollm.eos_token_ids == {2}
    assert smollm.vocab_size == 49152
    assert {0, 1, 2} <= set(smollm.all_special_ids)
    # SmolLM2's GGUF says add_bos_token = false: its chat template writes <|im_start|> itself.
    assert not smollm.adds_bos
    assert smollm.encode("hi")[0] != smollm.bos_token_id


@pytest.mark.slow
def test_chat_template_renders_im_start_format(smollm: Tokenizer, hf_smollm: Any) -> None:
    prompt = smollm.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == (
        f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    for add_generation_prompt in (True, False):
        expected = hf_smollm.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        got = smollm.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
        assert got == expected
    assert not smollm.apply_chat_template(conversation, add_generation_prompt=False).endswith(
        "assistant\n"
    )
    ids = smollm.apply_chat_template(conversation, tokenize=True)
    assert ids == smollm.encode(smollm.apply_chat_template(conversation), add_special_tokens=False)
    assert ids[0] == 1  # <|im_start|>


@pytest.mark.slow
def test_text_parts_are_joined(smollm: Tokenizer) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    prompt = smollm.apply_chat_template([{"role": "user", "content": parts}])
    assert "<|im_start|>user\nfirst\nsecond<|im_end|>" in prompt
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(ValueError, match="'image_url'"):
        smollm.apply_chat_template([{"role": "user", "content": image}])


# The messages agents send back, each in OpenAI's shape: an assistant turn with only tool calls
# (content null, as the SDK gives it, or missing), their arguments as JSON text, a tool result
# with its call's id and name, and content as text parts.
FUNCTION = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
CALL = {"id": "call_1", "type": "function", "function": FUNCTION}
AGENT_TURNS = {
    "content null": {"role": "assistant", "content": None, "tool_calls": [CALL]},
    "content missing": {"role": "assistant", "tool_calls": [CALL]},
    "content empty": {"role": "assistant", "content": "", "tool_calls": [CALL]},
    "tool result": {
        "role": "tool",
        "tool_call_id": "call_1",
        "name": "get_weather",
        "content": "22 C",
    },
    "text parts": {"role": "tool", "content": [{"type": "text", "text": "22 C"}]},
}
WHAT_RENDERS = {
    "content null": "<|im_start|>assistant\n<|im_end|>\n",
    "content missing": "<|im_start|>assistant\n<|im_end|>\n",
    "content empty": "<|im_start|>assistant\n<|im_end|>\n",
    "tool result": "<|im_start|>tool\n22 C<|im_end|>\n",
    "text parts": "<|im_start|>tool\n22 C<|im_end|>\n",
}


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(AGENT_TURNS))
def test_agent_turns_render_with_the_default_template(smollm: Tokenizer, shape: str) -> None:
    # SmolLM2's template writes message['content'] into a string: null must render as "" (as
    # vLLM renders it), never fail, never print "None".
    turn = AGENT_TURNS[shape]
    question = {"role": "user", "content": "Weather in Paris?"}
    prompt = smollm.apply_chat_template([question, turn, question], add_generation_prompt=False)
    assert WHAT_RENDERS[shape] in prompt
    assert "None" not in prompt


# A template in the style of those that iterate a call's arguments (they need the object).
ARGUMENTS_TEMPLATE = (
    "{% for m in messages %}{% for call in m.tool_calls or [] %}{{ call.function.name }}("
    "{% for key, value in call.function.arguments.items() %}{{ key }}={{ value }}{% endfor %})"
    "{% endfor %}{% endfor %}"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('{"city": "Paris"}', "get_weather(city=Paris)"),
        ({"city": "Rome"}, "get_weather(city=Rome)"),
        ("", "get_weather()"),
        (None, "get_weather()"),
    ],
)
def test_json_text_arguments_reach_the_template_as_objects(
    smollm: Tokenizer, arguments: Any, expected: str
) -> None:
    turn = {
        **AGENT_TURNS["content null"],
        "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": arguments}}],
    }
    assert (
        smollm.apply_chat_template(
            [turn], add_generation_prompt=False, chat_template=ARGUMENTS_TEMPLATE
        )
        == expected
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("turn", "field"),
    [
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
            "messages[1].tool_calls[0].function.arguments must be JSON text of an object",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
            "messages[1].tool_calls[0].function.arguments must be a JSON object, got list",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "f", "arguments": "[" * 10**5}}],
            },
            "messages[1].tool_calls[0].function.arguments must be JSON text of an object",
        ),
        (
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]},
            "messages[1].content[1]: content part of type 'image_url' is not supported",
        ),
        ({"role": "user", "content": 5}, "messages[1].content must be a string"),
    ],
)
def test_bad_agent_turns_name_the_field(smollm: Tokenizer, turn: dict, field: str) -> None:
    question = {"role": "user", "content": "Weather in Paris?"}
    with pytest.raises(ValueError) as info:
        smollm.apply_chat_template([question, turn])
    assert str(info.value).startswith(field)


def _write_tokenizer_gguf(path: Path, **overrides: Any) -> None:
    """A GGUF holding the default model's tokenizer metadata with some keys changed."""
    from gguf import GGUFValueType, GGUFWriter

    from kiln.model_executor.loader.gguf_loader import open_gguf

    fields = open_gguf(default_model_path()).fields
    writer = GGUFWriter(str(path), "llama")
    for key, field in fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = overrides.pop(key, field.contents())
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, field.types[0])
    for key, (value, vtype) in overrides.items():
        writer.add_key_value(key, value, vtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow
def test_gguf_bos_policy_and_stop_tokens(tmp_path: Path) -> None:
    from gguf import GGUFValueType

    path = tmp_path / "bos.gguf"
    _write_tokenizer_gguf(
        path,
        **{
            "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.eot_token_id": (0, GGUFValueType.UINT32),
        },
    )
    tokenizer = load_tokenizer(str(path))
    assert tokenizer.encode("Hello world!") == [1, 19556, 905, 17]
    assert tokenizer.encode("Hello world!", add_special_tokens=False) == [19556, 905, 17]
    assert tokenizer.adds_bos
    assert tokenizer.eos_token_ids == {0, 2}


def _write_tokenizer_folder(
    folder: Path,
    *,
    post_processor_bos: bool,
    add_bos_token: bool | None,
    chat_template: str | None = None,
    generation_eos: list[int] | None = None,
) -> str:
    """A word-level tokenizer: <s>=0, </s>=1, [UNK]=2, hello=3, world=4."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers, processors

    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if post_processor_bos:
        raw.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 0)]
        )
    folder.mkdir(parents=True, exist_ok=True)
    raw.save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "[UNK]",
    }
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return str(folder)


@pytest.mark.parametrize(
    ("post_processor_bos", "add_bos_token", "expect_bos"),
    [(True, None, True), (True, False, False), (False, True, True), (False, None, False)],
)
def test_folder_bos_policy(
    tmp_path: Path, post_processor_bos: bool, add_bos_token: bool | None, expect_bos: bool
) -> None:
    folder = _write_tokenizer_folder(
        tmp_path, post_processor_bos=post_processor_bos, add_bos_token=add_bos_token
    )
    tokenizer = load_tokenizer(folder)
    assert tokenizer.encode("hello world") == ([0] if expect_bos else []) + [3, 4]
    assert tokenizer.encode("hello world", add_special_tokens=False) == [3, 4]
    assert tokenizer.adds_bos is expect_bos
    assert tokenizer.decode([0, 3, 4, 1]) == "hello world"


def test_folder_stop_tokens_and_template_helpers(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}"
        "{% endif %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% generation %}[{{ m.role }}]{{ m.content }}{% endgeneration %}\n"
        "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
        "{% if add_generation_prompt %}{{ bos_token }}{% endif %}"
    )
    folder = _write_tokenizer_folder(
        tmp_path,
        post_processor_bos=False,
        add_bos_token=None,
        chat_template=template,
        generation_eos=[1, 4],
    )
    tokenizer = load_tokenizer(folder)
    assert tokenizer.eos_token_ids == {1, 4}
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": None},
    ]
    tools = [{"name": "<b>é"}]
    rendered = tokenizer.apply_chat_template(messages, tools=tools)
    # trim_blocks drops the newline after a block tag; content=None is left out (not "None");
    # tojson keeps "<" and "é" unescaped.
    assert rendered == '[user]hello[assistant][{"name": "<b>é"}]<s>'
    assert rendered == tokenizer.hf_tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.apply_chat_template(messages[:1], add_generation_prompt=False) == (
        "[user]hello"
    )
    with pytest.raises(ValueError, match="no bad roles"):
        tokenizer.apply_chat_template([{"role": "bad", "content": ""}])
    assert tokenizer.apply_chat_template([], chat_template="{{ 'override' }}") == "override"


def test_no_template_and_bad_sources(tmp_path: Path) -> None:
    folder = _write_tokenizer_folder(tmp_path / "t", post_processor_bos=False, add_bos_token=None)
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(folder).apply_chat_template([{"role": "user", "content": "hello"}])
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "missing"))
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF"):
        load_tokenizer(str(not_gguf))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path / "empty"))


# -- the cache of converted GGUF tokenizers ------------------------------------------------------
SPECIALS = "<|im_start|>user\nhi<|im_end|>"


def _assert_same_as_transformers(tokenizer: Tokenizer, hf_smollm: Any) -> None:
    for text in [*TEXTS, SPECIALS]:
        ids = tokenizer.encode(text)
        assert ids == hf_smollm.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.hf_tokenizer.get_vocab() == hf_smollm.get_vocab()
    assert tokenizer.all_special_ids == list(hf_smollm.all_special_ids)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages) == hf_smollm.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tokenizer cache of the test's own."""
    monkeypatch.setenv("KILN_TOKENIZER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if not p.name.startswith("."))


@pytest.mark.slow
def test_a_converted_gguf_tokenizer_is_kept_and_read_back_the_same(
    cache: Path, hf_smollm: Any
) -> None:
    converted = load_tokenizer(default_model_path())
    [entry] = _entries(cache)
    assert (entry / "tokenizer.json").is_file()
    assert converted.hf_tokenizer.name_or_path != str(entry)  # converted from the GGUF
    cached = load_tokenizer(default_model_path())
    assert cached.hf_tokenizer.name_or_path == str(entry)  # read from the cache
    assert type(cached.hf_tokenizer) is type(converted.hf_tokenizer)
    _assert_same_as_transformers(converted, hf_smollm)
    _assert_same_as_transformers(cached, hf_smollm)
    assert _entries(cache) == [entry]
    assert not list(cache.glob(".partial-*"))


@pytest.mark.slow
def test_a_damaged_or_stale_entry_is_converted_again(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hf_smollm: Any
) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(Path(default_model_path()).read_bytes())
    load_tokenizer(str(gguf))
    [entry] = _entries(cache)
    # A torn tokenizer.json (a crash, a full disk) is a miss; the entry is written anew.
    (entry / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    _assert_same_as_transformers(load_tokenizer(str(gguf)), hf_smollm)
    assert load_tokenizer(str(gguf)).hf_tokenizer.name_or_path == str(entry)
    # A file changed in place gets an entry of its own.
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    converted = load_tokenizer(str(gguf))
    assert converted.hf_tokenizer.name_or_path != str(entry)
    assert len(_entries(cache)) == 2
    [later] = [p for p in _entries(cache) if p != entry]
    # Past the bound, the least recently used entries go: the first, read again, stays.
    monkeypatch.setattr(kiln.tokenizer_cache, "TOKENIZER_CACHE_ENTRIES", 2)
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert load_tokenizer(str(gguf)).hf_tokenizer.name_or_path == str(entry)
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
    load_tokenizer(str(gguf))  # a third entry: the second, least recently used, goes
    kept = _entries(cache)
    assert len(kept) == 2 and entry in kept and later not in kept


def test_no_cache_when_it_is_off_or_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KILN_TOKENIZER_CACHE", "0")
    assert load_tokenizer(default_model_path()).encode("Hello world!") == [19556, 905, 17]
    assert not (tmp_path / "home").exists()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("KILN_TOKENIZER_CACHE", str(blocked / "cache"))
    assert load_tokenizer(default_model_path()).encode("Hello world!") == [19556, 905, 17]
