"""``GET /v1/models``, ``POST /tokenize`` and ``POST /detokenize``.

``/v1/models``: ``{"object": "list", "data": [{"id", "object": "model", "created", "owned_by",
"root", "parent", "max_model_len", "permission": []}]}``: the served model, then each LoRA adapter
(``root`` its folder, ``parent`` the served model).
``/v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) and ``/v1/unload_lora_adapter``
(``{"lora_name"}``), as vLLM, when runtime updates are allowed: an adapter is checked against the
model before it is listed (400 otherwise), a name in use is a 400, an unknown one a 404. Unloading
only stops new requests from naming it; requests already running finish with it.
``/tokenize``: ``{"count", "max_model_len", "tokens", "token_strs"}`` for a ``prompt`` (BOS policy
of the model unless ``add_special_tokens`` is false) or for chat ``messages`` (rendered as
``/v1/chat/completions`` renders them). ``/detokenize``: ``{"prompt": text}``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.protocol import (
    DetokenizeRequest,
    OpenAIBaseModel,
    TokenizeRequest,
)
from kiln.entrypoints.openai.server_state import ServerState
from kiln.entrypoints.openai.serving_engine import OpenAIServing
from kiln.lora.request import LoRARequest


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """``--lora-modules``: ``name=path`` items, or vLLM's JSON form ``{"name": ..., "path": ...}``
    (``base_model_name`` is accepted and ignored: the parent is the served model).

    Raises:
        ValueError: an item in neither form.
    """
    modules = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                data = json.loads(value)
                modules.append((str(data["name"]), str(data["path"])))
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f"--lora-modules {value!r} is invalid; allowed: name=path or "
                    '\'{"name": "sql", "path": "/adapters/sql"}\''
                ) from None
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r} is invalid; allowed: name=path")
        modules.append((name, path))
    return modules


class OpenAIServingModels(OpenAIServing):
    def __init__(self, state: ServerState) -> None:
        super().__init__(state)
        self.created = int(time.time())

    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Check the adapter at ``path`` and let clients name it ``name`` (blocking: reads the
        folder; the route runs the check in a worker thread).

        Raises:
            OpenAIError: 400 for a name in use or an adapter the engine cannot serve.
        """
        lora_request = self._new_lora(name, path)
        self.check_lora(lora_request, "lora_path")
        return self._register(lora_request)

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        lora_request = self._new_lora(request.lora_name, request.lora_path)
        await self.run_in_worker(self.check_lora, lora_request, "lora_path")
        self._register(lora_request)
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    def _new_lora(self, name: str, path: str) -> LoRARequest:
        """A ``LoRARequest`` with a fresh id (ids are never reused; see ``ServerState``)."""
        self._check_name_free(name)
        try:
            lora_request = LoRARequest(name, self.state.next_lora_id, path)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="lora_name" if not name else "lora_path") from None
        self.state.next_lora_id += 1
        return lora_request

    def _check_name_free(self, name: str) -> None:
        """Refuse a name in use, or any name once ``max_lora_adapters`` are loaded."""
        if name == self.state.model_name or name in self.state.lora_requests:
            raise OpenAIError(
                f"The lora adapter '{name}' has already been loaded.", param="lora_name"
            )
        limit = self.state.options.max_lora_adapters
        if len(self.state.lora_requests) >= limit:
            raise OpenAIError(
                f"{limit} LoRA adapters are loaded, this server's limit (--max-lora-adapters); "
                "unload one first",
                param="lora_name",
            )

    def _register(self, lora_request: LoRARequest) -> LoRARequest:
        self._check_name_free(lora_request.lora_name)  # another load may have taken it meanwhile
        self.state.lora_requests[lora_request.lora_name] = lora_request
        return lora_request

    def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        if self.state.lora_requests.pop(request.lora_name, None) is None:
            raise OpenAIError(
                f"The lora adapter '{request.lora_name}' cannot be found.", 404, param="lora_name"
            )
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

    def list_models(self) -> dict[str, Any]:
        card = {
            "id": self.state.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kiln",
            "root": self.state.model_path,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [],
        }
        adapters = [
            {
                **card,
                "id": name,
                "root": lora_request.lora_path,
                "parent": self.state.model_name,
            }
            for name, lora_request in self.state.lora_requests.items()
        ]
        return {"object": "list", "data": [card, *adapters]}


class OpenAIServingTokenization(OpenAIServing):
    request_fields = frozenset(TokenizeRequest.model_fields)

    async def tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        self.check_model(request.model)
        if request.messages is not None:
            add_special = bool(request.add_special_tokens)
            prompt = await self.render_chat(
                request.messages,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                add_special_tokens=add_special,
                chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs,
            )
            token_ids = prompt.token_ids
        else:
            assert request.prompt is not None
            add_special = request.add_special_tokens is not False
            token_ids = await self.encode(request.prompt, add_special)
        return {
            "count": len(token_ids),
            "max_model_len": self.max_model_len,
            "tokens": token_ids,
            "token_strs": (
                self.tokenizer.convert_ids_to_tokens(token_ids)
                if request.return_token_strs
                else None
            ),
        }

    async def detokenize(self, request: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(request.model)
        try:
            self.frontend.input_processor.check_token_ids(request.tokens, "tokens")
        except ValueError as exc:
            raise OpenAIError(str(exc), param="tokens") from None
        text = await self.run_in_worker(self.tokenizer.decode, request.tokens, False)
        return {"prompt": text}


__all__ = [
    "LoadLoRAAdapterRequest",
    "OpenAIServingModels",
    "OpenAIServingTokenization",
    "UnloadLoRAAdapterRequest",
    "parse_lora_modules",
]
