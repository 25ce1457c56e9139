"""What the tool-calling tests share: a tool, the Hermes-style chat template Kiln ships for
ChatML models (``examples/tool_chat_template_chatml_hermes.jinja``: SmolLM2's own template does
not render tools), and a conversation with which the default model calls the tool greedily."""

from __future__ import annotations

import json
import pathlib
from typing import Any

TEMPLATE = pathlib.Path(__file__).parents[3] / "examples" / "tool_chat_template_chatml_hermes.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _call(city: str, index: int) -> dict[str, Any]:
    arguments = json.dumps({"city": city})
    function = {"name": "get_weather", "arguments": arguments}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": f"call_{index}", "type": "function", "function": function}],
    }


# Two examples of the call format: with them the 135M default model calls the tool, greedily.
FEW_SHOT = [
    {"role": "system", "content": "Answer every question with a tool call."},
    {"role": "user", "content": "Weather in Rome?"},
    _call("Rome", 1),
    {"role": "user", "content": "Weather in Berlin?"},
    _call("Berlin", 2),
    {"role": "user", "content": "Weather in Paris?"},
]
