"""``GET /v1/models``, ``POST /tokenize`` and ``POST /detokenize``.

``/v1/models``: ``{"object": "list", "data": [{"id", "object": "model", "created", "owned_by",
"root", "parent", "max_model_len", "permission": []}]}``.
``/tokenize``: ``{"count", "max_model_len", "tokens", "token_strs"}`` for a ``prompt`` (BOS policy
of the model unless ``add_special_tokens`` is false) or for chat ``messages`` (rendered as
``/v1/chat/completions`` renders them). ``/detokenize``: ``{"prompt": text}``.
"""

from __future__ import annotations

import time
from typing import Any

from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from kiln.entrypoints.openai.serving_engine import OpenAIServing, ServerState


class OpenAIServingModels(OpenAIServing):
    def __init__(self, state: ServerState) -> None:
        super().__init__(state)
        self.created = int(time.time())

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
        return {"object": "list", "data": [card]}


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


__all__ = ["OpenAIServingModels", "OpenAIServingTokenization"]
