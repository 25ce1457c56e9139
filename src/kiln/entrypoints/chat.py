"""``kiln chat``: an interactive terminal chat, streamed, against a server URL or a local model.

``kiln chat --url http://127.0.0.1:8000`` talks to any OpenAI-compatible server through
``/v1/chat/completions``; ``kiln chat [MODEL]`` loads the model in this process (``kiln.LLM``; no
MODEL: the embedded default). The conversation is kept and sent whole every turn. Lines starting
with ``/`` are commands: ``/exit`` (or ``/quit``, or end of input) leaves, ``/reset`` forgets the
conversation (the system prompt stays), ``/help`` lists them.

Both back ends yield text deltas; the loop (``run_chat``) knows nothing about where they come from,
and reads lines from any callable, so a pipe on stdin drives it as well as a terminal.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TextIO

Messages = list[dict[str, str]]

HELP = "commands: /reset (forget the conversation), /exit (leave), /help"
DEFAULT_MAX_TOKENS = 512
DEFAULT_KV_CACHE_GIB = 1.0


class ChatError(RuntimeError):
    """A turn failed (the server answered an error, or the model refused the conversation)."""


class ChatBackend(Protocol):
    model_name: str

    def stream(self, messages: Messages) -> Iterator[str]:
        """Yield the assistant reply to ``messages`` as text deltas. Raises ``ChatError``."""
        ...


class RemoteChat:
    """A running OpenAI-compatible server.

    Args:
        url: the server root, with or without ``/v1``.
        model: model name; None: the first of ``GET /v1/models``.
        timeout: seconds to wait for each read from the server.

    Raises:
        ChatError: the server does not answer ``/v1/models`` or lists no model.
    """

    def __init__(
        self,
        url: str,
        model: str | None = None,
        api_key: str | None = None,
        max_tokens: int | None = DEFAULT_MAX_TOKENS,
        temperature: float | None = None,
        timeout: float = 600.0,
    ) -> None:
        import httpx

        root = url.rstrip("/")
        self.root = root[: -len("/v1")] if root.endswith("/v1") else root
        self.max_tokens = max_tokens
        self.temperature = temperature
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=timeout, trust_env=False)
        if model is None:
            try:
                response = self.client.get(f"{self.root}/v1/models")
                response.raise_for_status()
                model = response.json()["data"][0]["id"]
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                raise ChatError(f"cannot list the models of {self.root}: {exc}") from exc
        self.model_name: str = model

    def stream(self, messages: Messages) -> Iterator[str]:
        import httpx

        body: dict[str, Any] = {"model": self.model_name, "messages": messages, "stream": True}
        if self.max_tokens is not None:
            body["max_completion_tokens"] = self.max_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        try:
            with self.client.stream(
                "POST", f"{self.root}/v1/chat/completions", json=body
            ) as response:
                if response.status_code != 200:
                    raise ChatError(_error_message(response.read(), response.status_code))
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:") :].strip()
                    if payload == "[DONE]":
                        return
                    data = json.loads(payload)
                    if "error" in data:
                        raise ChatError(_error_message(payload.encode(), None))
                    for choice in data.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            yield content
        except httpx.HTTPError as exc:
            raise ChatError(f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        self.client.close()


def _error_message(body: bytes, status: int | None) -> str:
    prefix = f"HTTP {status}: " if status is not None else ""
    try:
        error = json.loads(body)["error"]
        return prefix + (error["message"] if isinstance(error, dict) else str(error))
    except (ValueError, KeyError, TypeError):
        return prefix + body.decode(errors="replace")[:500]


class LocalChat:
    """A model loaded in this process (``kiln.LLM``), streamed step by step.

    Args:
        model: a GGUF file, a Hugging Face folder or hub id; None: the embedded default.
        engine_kwargs: ``kiln serve`` flags with underscores (``max_model_len=2048``).
    """

    def __init__(
        self,
        model: str | None = None,
        max_tokens: int | None = DEFAULT_MAX_TOKENS,
        temperature: float | None = None,
        **engine_kwargs: Any,
    ) -> None:
        from kiln.entrypoints.llm import LLM

        self.llm = LLM(model, **engine_kwargs)
        self.model_name = self.llm.llm_engine.frontend.model_name
        self.max_tokens = max_tokens
        self.temperature = temperature
        self._ids = itertools.count()

    def stream(self, messages: Messages) -> Iterator[str]:
        from kiln.sampling_params import RequestOutputKind, SamplingParams

        engine = self.llm.llm_engine
        fields: dict[str, Any] = {"max_tokens": self.max_tokens}
        if self.temperature is not None:
            fields["temperature"] = self.temperature
        request_id = f"chat-{next(self._ids)}"
        try:
            params = SamplingParams(**fields, output_kind=RequestOutputKind.DELTA)
            prompt = engine.frontend.render_chat(messages)
            engine.add_request(request_id, prompt, params)
        except ValueError as exc:
            raise ChatError(str(exc)) from exc
        is_finished = False
        try:
            while not is_finished and engine.has_unfinished_requests():
                for output in engine.step():
                    if output.request_id != request_id:
                        continue
                    is_finished = output.finished
                    if output.outputs and output.outputs[0].text:
                        yield output.outputs[0].text
        finally:
            if not is_finished:  # interrupted (Ctrl-C) or abandoned: free its KV blocks
                engine.abort_request([request_id])

    def close(self) -> None:
        self.llm.llm_engine.shutdown()


def run_chat(
    backend: ChatBackend,
    read_line: Callable[[str], str] = input,
    out: TextIO = sys.stdout,
    system_prompt: str | None = None,
) -> None:
    """The chat loop: read a line, stream the reply, keep the conversation, until ``/exit``/EOF.

    A failed turn prints the error to stderr and leaves the conversation as it was before it.
    Ctrl-C during a reply stops the reply (what arrived is kept); at the prompt it leaves.
    """
    initial: Messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages = list(initial)
    while True:
        try:
            line = read_line("> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command = text.split()[0].lower()
            if command in ("/exit", "/quit"):
                return
            if command == "/reset":
                messages = list(initial)
                out.write("(conversation reset)\n")
            else:
                out.write(f"{HELP}\n")
            out.flush()
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            for delta in backend.stream(messages):
                out.write(delta)
                out.flush()
                reply.append(delta)
        except ChatError as exc:
            out.write("\n")
            print(f"error: {exc}", file=sys.stderr)
            messages.pop()
            continue
        except KeyboardInterrupt:
            out.write(" (interrupted)")
        out.write("\n")
        out.flush()
        messages.append({"role": "assistant", "content": "".join(reply)})


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a model to load in this process (default: the embedded default model)",
    )
    parser.add_argument(
        "--url", default=None, help="chat with a running server instead, e.g. http://127.0.0.1:8000"
    )
    parser.add_argument("--model-name", default=None, help="with --url: the model to ask for")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="with --url: bearer token (default: $OPENAI_API_KEY)",
    )
    parser.add_argument("--system-prompt", default=None, help="a system message to start with")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="longest reply in tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--temperature", type=float, default=None, help="default: the server's / engine's"
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=float,
        default=DEFAULT_KV_CACHE_GIB,
        metavar="GIB",
        help="local model: KV-cache size in GiB (default: %(default)s; one conversation needs "
        "little, and a smaller cache starts faster)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="local model: context length"
    )
    parser.add_argument(
        "-q", "--quick", default=None, metavar="MESSAGE", help="send one message, print the reply"
    )


def main(args: argparse.Namespace) -> int:
    if args.url and args.model:
        print("kiln chat: give a MODEL or --url, not both", file=sys.stderr)
        return 2
    backend: RemoteChat | LocalChat
    try:
        if args.url:
            backend = RemoteChat(
                args.url, args.model_name, args.api_key, args.max_tokens, args.temperature
            )
        else:
            engine_kwargs: dict[str, Any] = {"kv_cache_memory": args.kv_cache_memory}
            if args.max_model_len is not None:
                engine_kwargs["max_model_len"] = args.max_model_len
            backend = LocalChat(args.model, args.max_tokens, args.temperature, **engine_kwargs)
    except (ChatError, ValueError, FileNotFoundError) as exc:
        print(f"kiln chat: {exc}", file=sys.stderr)
        return 1
    try:
        if args.quick is not None:
            lines = iter([args.quick])

            def read_line(_: str) -> str:
                return next(lines, "/exit")

            run_chat(backend, read_line, system_prompt=args.system_prompt)
        else:
            interactive = sys.stdin.isatty()
            if interactive:
                print(f"chatting with {backend.model_name}; {HELP}")
            run_chat(
                backend,
                input if interactive else _read_piped_line,
                system_prompt=args.system_prompt,
            )
    finally:
        backend.close()
    return 0


def _read_piped_line(prompt: str) -> str:
    """``input()`` for a pipe: no prompt echoed into the output, EOF at the end."""
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")
