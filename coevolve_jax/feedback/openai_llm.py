"""An OpenAI-compatible chat endpoint as explorer, abstractor and judge (`TextLLM`).

Any server that speaks the OpenAI chat-completions API works: the paper's explorer (Qwen3-Max
through its provider's OpenAI-compatible mode), a local vLLM or SGLang server, or OpenAI itself.
The official `openai` client does the HTTP work: retries with exponential backoff on connection
errors, 408, 409, 429 and 5xx (`attempts` - 1 retries), and a per-request timeout. The key comes
only from the environment variable the settings name (`api_key_env`, default OPENAI_API_KEY),
never from the config; nothing here logs, reprs or returns it. A server on your own machine that
needs no key (vLLM, SGLang) can be used with the variable unset when `base_url` is given.

Every failure reaches the caller as `LLMError` (or `BudgetExhausted` when the round's token
budget is spent), never as an `openai` exception.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

from coevolve_jax.feedback.llm import LLMError, TokenBudget, sanitize_text

log = logging.getLogger(__name__)

# The key sent to a keyless server (vLLM and SGLang accept any key unless started with one).
NO_KEY = "EMPTY"


@dataclasses.dataclass(frozen=True)
class OpenAISettings:
  """Settings of an OpenAI-compatible endpoint (no credentials: the key is read from the
  environment variable `api_key_env`).

  Attributes:
    model: the model id the server knows, e.g. "qwen3-max" or a vLLM served name.
    base_url: the API root, e.g. "http://127.0.0.1:8000/v1" ("" = the client's default, which
      also reads OPENAI_BASE_URL).
    api_key_env: name of the environment variable holding the key.
    timeout_s: per-request timeout in seconds (each attempt gets the full timeout).
    attempts: tries per request, the first included (1 = no retries).
    temperature: sampling temperature. max_output_tokens: cap per reply.
    tokens_per_round: the TokenBudget limit (0 = unlimited).
    json_mode: send `response_format={"type": "json_object"}` when a JSON reply is wanted
      (servers without it answer 400: set False, the prompts ask for JSON anyway).
  """

  model: str = "qwen3-max"
  base_url: str = ""
  api_key_env: str = "OPENAI_API_KEY"
  timeout_s: float = 60.0
  attempts: int = 5
  temperature: float = 0.7
  max_output_tokens: int = 1024
  tokens_per_round: int = 200_000
  json_mode: bool = True


class OpenAILLM:
  """A chat-completions endpoint through the `openai` client (implements TextLLM).

  Raises (constructor):
    LLMError: no key in `api_key_env` and no `base_url` (the message names the variable, never
      a value).
  """

  def __init__(self, settings: OpenAISettings = OpenAISettings()):
    import openai  # pylint: disable=g-import-not-at-top

    self.settings = settings
    self.name = f"openai:{settings.model}"
    self.budget = TokenBudget(settings.tokens_per_round)
    key = os.environ.get(settings.api_key_env, "")
    if not key:
      if not settings.base_url:
        raise LLMError(
          f"no API key: set {settings.api_key_env} in the environment, or give "
          "explore.openai.base_url for a server that needs none"
        )
      key = NO_KEY
    self._openai = openai
    self._client = openai.OpenAI(
      api_key=key,
      base_url=settings.base_url or None,
      timeout=settings.timeout_s,
      max_retries=max(0, settings.attempts - 1),
    )

  def __repr__(self) -> str:
    s = self.settings
    return f"OpenAILLM(model={s.model!r}, base_url={s.base_url!r})"

  def refresh(self) -> None:
    """Nothing to reload: the model is remote."""

  def complete(self, system: str, prompt: str, *, json_output: bool = False) -> str:
    """One chat completion (retried by the client on connection errors, 408/409/429/5xx).

    Args:
      system: the system message.
      prompt: the user message.
      json_output: ask for a JSON object (`response_format`, when `json_mode`).

    Returns:
      The reply text.

    Raises:
      BudgetExhausted: the round's token budget is spent (checked before sending).
      EndpointUnreachable: the last requests could not reach the endpoint (checked before
        sending; `TokenBudget.check`).
      LLMError: an HTTP error after the last retry, a timeout, a refused connection, a
        malformed or empty response.
    """
    self.budget.check()
    s = self.settings
    extra: dict[str, Any] = {}
    if json_output and s.json_mode:
      extra["response_format"] = {"type": "json_object"}
    errors = self._openai
    try:
      response = self._client.chat.completions.create(
        model=s.model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": prompt}],
        temperature=s.temperature,
        max_tokens=s.max_output_tokens,
        **extra,
      )
    except errors.APITimeoutError:
      why = f"{self.name}: timeout after {s.timeout_s:g} s"
      self.budget.unreachable_request(why)
      raise LLMError(why) from None
    except errors.APIStatusError as e:
      self.budget.reached()
      raise LLMError(f"{self.name}: HTTP {e.status_code}") from None
    except errors.APIConnectionError as e:
      where = s.base_url or "the client's default endpoint"
      why = f"{self.name}: connection error to {where} ({type(e.__cause__).__name__})"
      self.budget.unreachable_request(why)
      raise LLMError(why) from None
    except (errors.APIError, ValueError) as e:  # a body the client could not parse
      raise LLMError(f"{self.name}: malformed response ({type(e).__name__})") from None
    choices = getattr(response, "choices", None) or []
    message = getattr(choices[0], "message", None) if choices else None
    text = getattr(message, "content", None) if message is not None else None
    usage = getattr(response, "usage", None)
    tokens = getattr(usage, "total_tokens", 0) or 0
    if not tokens:  # no usage reported: charge an estimate (4 characters per token)
      tokens = (len(system) + len(prompt) + len(text or "")) // 4
    self.budget.charge(tokens)
    if not isinstance(text, str) or not text:
      raise LLMError(f"{self.name}: empty response (no message content)")
    return sanitize_text(text, self.name)


if TYPE_CHECKING:  # mypy checks OpenAILLM against the TextLLM protocol
  from coevolve_jax.feedback.llm import TextLLM

  def _conforms(llm: OpenAILLM) -> TextLLM:
    return llm
