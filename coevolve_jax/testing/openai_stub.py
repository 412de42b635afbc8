"""A loopback HTTP server that answers like an OpenAI-compatible chat-completions endpoint.

For tests and offline demos: point `OpenAISettings.base_url` at `server.url + "/v1"` and the
real `openai` client code runs end to end (request building, auth header, retries, timeouts,
response parsing). Binds 127.0.0.1 only. Same scripting as `gemini_stub.GeminiStub` (a queue of
`Reply`, then the `responder`, by default `feedback_responder`), on the OpenAI wire format.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from coevolve_jax.testing.gemini_stub import GeminiStub, Reply, feedback_responder


def chat_body(text: str | None, prompt_tokens: int = 10, output_tokens: int = 5) -> str:
  """A chat.completion body whose one choice says `text` (None: content null)."""
  return json.dumps(
    {
      "id": "chatcmpl-stub",
      "object": "chat.completion",
      "created": 0,
      "model": "stub",
      "choices": [
        {
          "index": 0,
          "message": {"role": "assistant", "content": text},
          "finish_reason": "stop",
        }
      ],
      "usage": {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": output_tokens,
        "total_tokens": prompt_tokens + output_tokens,
      },
    }
  )


def openai_error_body(message: str = "stub error", kind: str = "server_error") -> str:
  return json.dumps({"error": {"message": message, "type": kind, "code": None}})


class OpenAIStub(GeminiStub):
  """Threaded loopback chat-completions server; use as a context manager.

  Attributes (besides GeminiStub's):
    api_url: the base URL to give the client (`url` + "/v1").
  """

  def __init__(self, responder: Callable[[str, str], str] = feedback_responder):
    super().__init__(responder)
    self.api_url = f"{self.url}/v1"

  def _reply(self, path: str, body: dict) -> Reply:
    if path.rstrip("/") != "/v1/chat/completions":
      return Reply(404, openai_error_body(f"no such route {path}", "invalid_request_error"))
    messages = body.get("messages", [])
    system = " ".join(m.get("content", "") for m in messages if m.get("role") == "system")
    prompt = " ".join(m.get("content", "") for m in messages if m.get("role") == "user")
    return Reply(200, chat_body(self.responder(system, prompt)))
