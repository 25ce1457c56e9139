"""The model's tokenizer and chat template, behind one small interface.

Contract: ``load_tokenizer(source)`` reads a ``.gguf`` file or a folder with ``tokenizer.json`` /
``tokenizer_config.json`` through the Hugging Face libraries and returns a ``Tokenizer`` whose
``encode`` / ``decode`` / ``apply_chat_template`` behave as the model's authors intended:

- BOS is added by ``encode(..., add_special_tokens=True)`` exactly when the model asks for it:
  GGUF ``tokenizer.ggml.add_bos_token`` (absent: llama.cpp's default, true only for SentencePiece
  vocabularies), or ``add_bos_token`` in ``tokenizer_config.json``; a folder that does not say
  keeps what its ``tokenizer.json`` post-processor does.
- The chat template is the model's own Jinja template (GGUF ``tokenizer.chat_template`` or the
  folder's), rendered in a sandbox configured as ``transformers`` does.

A GGUF's vocabulary is converted to a fast tokenizer once per file (``kiln.tokenizer_cache``).

The engine knows nothing about tokenization; this module knows nothing about the engine.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, overload

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class Tokenizer:
    """A Hugging Face tokenizer plus the model's BOS policy, chat template and stop tokens.

    Args:
        hf_tokenizer: a ``transformers`` tokenizer (fast).
        add_bos: True/False to force the model's BOS policy onto ``encode``; None to keep what
            ``hf_tokenizer`` does.
        chat_template: the model's Jinja chat template (a string), or named templates (a dict,
            ``"default"`` used unless ``apply_chat_template`` names another), or None.
        eos_token_ids: extra ids that end generation besides ``eos_token_id`` (e.g. GGUF
            ``eot_token_id``).
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        add_bos: bool | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.chat_template = chat_template
        eos = {int(i) for i in eos_token_ids}
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        # What encode() must change in the HF output: prepend BOS, drop the post-processor's BOS,
        # or nothing. Found by probing, so it holds whatever the post-processor is.
        self._bos_fix: str | None = None
        bos = hf_tokenizer.bos_token_id
        if add_bos is not None and bos is not None:
            with_special = hf_tokenizer.encode("a", add_special_tokens=True)
            without = hf_tokenizer.encode("a", add_special_tokens=False)
            hf_adds_bos = with_special[:1] == [bos] and with_special[1:] == without
            if add_bos and not hf_adds_bos:
                self._bos_fix = "add"
            elif not add_bos and hf_adds_bos:
                self._bos_fix = "drop"

    @property
    def bos_fix(self) -> str | None:
        """How ``encode`` differs from ``hf_tokenizer``'s: ``"add"`` (prepends BOS), ``"drop"``
        (drops the BOS it adds) or None (the same ids)."""
        return self._bos_fix

    @property
    def bos_token_id(self) -> int | None:
        return self.hf_tokenizer.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.hf_tokenizer.eos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return len(self.hf_tokenizer)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token covers: the longest token string
        in the vocabulary (byte-level tokens spell one character per byte, so it bounds those
        too). A text longer than ``n * max_token_chars`` has more than ``n`` tokens."""
        return max((len(token) for token in self.hf_tokenizer.get_vocab()), default=1)

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.hf_tokenizer.all_special_ids)

    @property
    def adds_bos(self) -> bool:
        """Whether ``encode(text)`` starts with BOS."""
        bos = self.bos_token_id
        return bos is not None and self.encode("a")[:1] == [bos]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the model's BOS policy applies."""
        ids: list[int] = self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if add_special_tokens and self._bos_fix == "add":
            ids = [self.hf_tokenizer.bos_token_id, *ids]
        elif add_special_tokens and self._bos_fix == "drop":
            ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self.hf_tokenizer.convert_ids_to_tokens(list(ids))

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = ...,
        tokenize: Literal[False] = ...,
        chat_template: str | None = ...,
        **kwargs: Any,
    ) -> str: ...

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = ...,
        *,
        tokenize: Literal[True],
        chat_template: str | None = ...,
        **kwargs: Any,
    ) -> list[int]: ...

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = ...,
        tokenize: bool = ...,
        chat_template: str | None = ...,
        **kwargs: Any,
    ) -> str | list[int]: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the model's chat template.

        Args:
            messages: ``{"role": ..., "content": ...}`` dicts, in OpenAI's shapes; the template
                gets them as ``normalise_message`` makes them (content a string, even when null
                or missing; the JSON-text ``arguments`` of ``tool_calls`` as objects).
            add_generation_prompt: end with the header of an assistant turn.
            tokenize: return token ids (the template writes its own special tokens, so no BOS is
                added) instead of the string.
            chat_template: a template string, or the name of one of the model's named templates,
                to use instead of the model's default.
            **kwargs: extra template variables (``tools``, ``documents``, ``enable_thinking``...).

        Raises:
            ValueError: no template; a message ``normalise_message`` refuses (naming the field);
                a template that fails in any way (the template is code the model or a user
                supplied, so its failure is an input error).
        """
        template = self._resolve_template(chat_template)
        normalised = [normalise_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
        special = {
            name: getattr(self.hf_tokenizer, name, None)
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        try:
            text = _compile(template).render(
                messages=normalised,
                add_generation_prompt=add_generation_prompt,
                **{**special, **kwargs},
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template rejected the messages: {exc}") from exc
        except (MemoryError, RecursionError):
            raise
        except Exception as exc:  # e.g. {% include %} without a loader: TypeError
            raise ValueError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _resolve_template(self, chat_template: str | None) -> str:
        named = self.chat_template if isinstance(self.chat_template, Mapping) else {}
        if chat_template is not None:
            return named.get(chat_template, chat_template)
        if isinstance(self.chat_template, str):
            return self.chat_template
        if "default" in named:
            return named["default"]
        raise ValueError(
            "this model has no chat template (none in its GGUF metadata or tokenizer files); "
            "pass chat_template= or use a completion instead of a chat request"
        )


def normalise_message(message: Mapping[str, Any], where: str = "message") -> dict[str, Any]:
    """``message`` in the shape chat templates expect, as vLLM gives it to them.

    - ``content`` is always a string: null or missing is ``""`` (an assistant turn with only
      ``tool_calls``, as OpenAI clients send it back, must render with a template that writes
      ``message['content']``), and text parts are joined with newlines.
    - Other keys set to None are left out, as transformers does: templates test ``is defined``.
    - The ``arguments`` of each of ``tool_calls`` (JSON text in OpenAI's form) become the object
      templates write with ``tojson`` or iterate.

    Args:
        where: the message's name in error messages (``messages[2]``).

    Raises:
        ValueError: naming the field: content that is not a string, text parts or null; a part
            that is not text; arguments that are not JSON of an object.
    """
    normalised = {key: value for key, value in message.items() if value is not None}
    normalised["content"] = message_text(message.get("content"), f"{where}.content")
    calls = normalised.get("tool_calls")
    if isinstance(calls, list):
        normalised["tool_calls"] = [
            _normalise_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(calls)
        ]
    return normalised


def message_text(content: Any, where: str = "content") -> str:
    """A message's ``content`` as one string: null is ``""``, ``{"type": "text"}`` parts are
    joined with newlines (as vLLM joins them).

    Raises:
        ValueError: naming ``where``: not a string, a list of parts or null; a part that is not
            text (the only kind supported), or whose ``text`` is not a string.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(
            f"{where} must be a string, a list of text parts or null, got {type(content).__name__}"
        )
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind != "text":
            raise ValueError(
                f"{where}[{i}]: content part of type {kind!r} is not supported; allowed: ['text']"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(
                f"{where}[{i}]: a content part of type 'text' needs a string 'text', got "
                f"{type(text).__name__}"
            )
        texts.append(text)
    return "\n".join(texts)


def tool_call_arguments(arguments: Any, where: str = "arguments") -> dict[str, Any]:
    """A call's arguments as the object chat templates expect: JSON text (OpenAI's form) is
    parsed, an object kept, empty text or null is ``{}``.

    Raises:
        ValueError: naming ``where``: not valid JSON, or JSON of something else than an object.
    """
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise ValueError(f"{where} must be JSON text of an object: {reason}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(arguments).__name__}")
    return arguments


def _normalise_call(call: Any, where: str) -> Any:
    # A call in another shape than OpenAI's is the template's business.
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    function["arguments"] = tool_call_arguments(
        function.get("arguments"), f"{where}.function.arguments"
    )
    return {**call, "function": function}


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks in HF):
    rendered as its body, since Kiln only needs the text."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    # Same environment as transformers' chat templates, so templates written for it render the same.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def load_tokenizer(source: str) -> Tokenizer:
    """The tokenizer of a ``.gguf`` file or of a folder with Hugging Face tokenizer files.

    Reads only local files (no hub access).

    Raises:
        FileNotFoundError: ``source`` does not exist.
        ValueError: a file that is not GGUF, or a folder without tokenizer files.
    """
    if os.path.isdir(source):
        return _load_folder(source)
    if os.path.isfile(source):
        from kiln.model_executor.loader.gguf_loader import GGUFLoader

        if not GGUFLoader.can_load(source):
            raise ValueError(f"tokenizer source {source!r} is a file but not a GGUF file")
        return _load_gguf(source)
    raise FileNotFoundError(f"tokenizer source {source!r} does not exist")


def _load_gguf(path: str) -> Tokenizer:
    from kiln.model_executor.loader.gguf_loader import open_gguf
    from kiln.tokenizer_cache import gguf_fast_tokenizer

    path = os.path.abspath(path)
    hf = gguf_fast_tokenizer(path)
    fields = open_gguf(path).fields

    def meta(key: str) -> Any:
        return fields[key].contents() if key in fields else None

    add_bos = meta("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        # llama.cpp's default when a file does not say: BOS for SentencePiece ("llama") vocabs.
        add_bos = meta("tokenizer.ggml.model") == "llama"
    stop_ids = [meta(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    return Tokenizer(
        hf,
        add_bos=bool(add_bos),
        chat_template=meta("tokenizer.chat_template"),
        eos_token_ids=[i for i in stop_ids if i is not None],
    )


def _load_folder(folder: str) -> Tokenizer:
    from transformers import AutoTokenizer

    if not any(
        os.path.isfile(os.path.join(folder, name))
        for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        raise ValueError(f"{folder!r} has no tokenizer.json or tokenizer_config.json")
    hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tokenizer_config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    add_bos = tokenizer_config.get("add_bos_token")
    # generation_config.json lists every id that ends a turn (Llama 3: eos and eot).
    generation_eos = _read_json(os.path.join(folder, "generation_config.json")).get("eos_token_id")
    if generation_eos is None:
        generation_eos = []
    elif isinstance(generation_eos, int):
        generation_eos = [generation_eos]
    return Tokenizer(
        hf,
        add_bos=add_bos if isinstance(add_bos, bool) else None,
        chat_template=hf.chat_template,
        eos_token_ids=generation_eos,
    )


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


__all__ = [
    "Tokenizer",
    "load_tokenizer",
    "message_text",
    "normalise_message",
    "tool_call_arguments",
]
