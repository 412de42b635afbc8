"""Text LLMs for the feedback loop (explorer, context summary, abstraction, judge).

One small interface, `TextLLM.complete(system, prompt) -> str`, with two backends:

* `GeminiLLM`: Gemini through the google-genai client, with a Gemini API key or Vertex AI.
  Retries with exponential backoff and jitter on 408/429/5xx and transport errors (the client's
  own `HttpRetryOptions`, tenacity underneath), a per-request timeout, and a token budget per
  feedback round (`TokenBudget`). Credentials come only from the environment (GEMINI_API_KEY or
  GOOGLE_API_KEY) or from Google application default credentials (Vertex AI); they are never
  taken from the config, and nothing here logs, reprs or returns them.
* `LocalLLM` (coevolve_jax.feedback.local_llm): a checkpoint served by our own engine.

Every failure reaches the caller as `LLMError` (or `BudgetExhausted`), never as a client-library
exception, so the explorer can stop a run cleanly and keep what it has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

log = logging.getLogger(__name__)

API_KEY_VARS = ("GEMINI_API_KEY", "GOOGLE_API_KEY")


class LLMError(RuntimeError):
  """A request that failed for good (after retries): HTTP error, timeout, malformed response."""


class RoundStopped(LLMError):
  """No further request is sent this round: the caller (D0 or a feedback round) stops early."""


class BudgetExhausted(RoundStopped):
  """The round's token budget is spent; no further request is sent this round."""


class EndpointUnreachable(RoundStopped):
  """UNREACHABLE_AFTER requests in a row could not reach the endpoint (each after its client's
  retries: refused connection, timeout, transport error); no further request is sent this
  round, instead of every remaining context waiting out its own retries."""


UNREACHABLE_AFTER = 3  # consecutive unreachable requests that stop a round (TokenBudget)

# A code point U+D800-U+DFFF left alone in a str (a JSON escape such as "\ud83d" without its
# pair decodes to one): it has no UTF-8 encoding, so writing it to a log or the pool would raise
# UnicodeEncodeError. Pairs are combined by the JSON decoder, so any left here is lone.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_sanitized = [0]  # lone surrogates replaced in this process (`sanitized_count`)
_sanitized_lock = threading.Lock()


def sanitize_text(text: str, source: str = "explorer LLM") -> str:
  """`text` with every lone surrogate replaced by U+FFFD, so it can reach a file or the pool;
  logs one warning per text that had any, with this text's and the process's counts."""
  clean, n = _LONE_SURROGATE.subn("\ufffd", text)
  if n:
    with _sanitized_lock:
      _sanitized[0] += n
      total = _sanitized[0]
    log.warning(
      "%s text: %d lone surrogate(s) replaced with U+FFFD (%d in this run)", source, n, total
    )
  return clean


def sanitize_value(value: Any, source: str = "explorer LLM") -> Any:
  """`sanitize_text` on every string (keys too) of a parsed JSON value."""
  if isinstance(value, str):
    return sanitize_text(value, source)
  if isinstance(value, dict):
    return {sanitize_value(k, source): sanitize_value(v, source) for k, v in value.items()}
  if isinstance(value, list):
    return [sanitize_value(v, source) for v in value]
  return value


def sanitized_count() -> int:
  """Lone surrogates replaced in LLM text so far in this process."""
  return _sanitized[0]


class TokenBudget:
  """Tokens (prompt + output, as the API reports them) allowed per feedback round; thread-safe.

  The limit is checked before each request, and between contexts by D0 and a round
  (`feedback.synthesis`): inside a context in progress (`in_context`) a spent limit stops no
  request, so the context is finished and its tasks kept; D0 or the round then stops before its
  next context. A round may so overrun its limit by at most one context's cost (one BFCL context
  costs about 50-90k tokens at full scale: configs/base.py). An unreachable endpoint stops
  requests inside a context too.

  Args:
    limit: tokens per round; 0 or less means unlimited.
  """

  def __init__(self, limit: int = 0):
    self.round_limit = int(limit)  # the feedback rounds' limit; `reset(limit=...)` sets another
    self.limit = self.round_limit
    self.used = 0
    self.requests = 0
    self.unreachable = 0  # consecutive requests that could not reach the endpoint
    self.last_unreachable = ""
    self._contexts = 0  # contexts in progress (`in_context`)
    self._lock = threading.Lock()

  def spent(self) -> bool:
    """Whether the limit is reached (never with an unlimited budget)."""
    with self._lock:
      return self.limit > 0 and self.used >= self.limit

  def check(self) -> None:
    """Raises BudgetExhausted when the round's budget is already spent and no context is in
    progress, EndpointUnreachable when the last UNREACHABLE_AFTER requests could not reach the
    endpoint."""
    with self._lock:
      if self.limit > 0 and self.used >= self.limit and not self._contexts:
        raise BudgetExhausted(f"token budget of {self.limit} spent ({self.used} used)")
      if self.unreachable >= UNREACHABLE_AFTER:
        raise EndpointUnreachable(
          f"{self.unreachable} requests in a row could not reach the endpoint (last: "
          f"{self.last_unreachable}); no more requests this round"
        )

  @contextlib.contextmanager
  def in_context(self) -> Iterator[None]:
    """A context in progress: until it ends a spent limit stops none of its requests."""
    with self._lock:
      self._contexts += 1
    try:
      yield
    finally:
      with self._lock:
        self._contexts -= 1

  def reached(self) -> None:
    """The endpoint answered (an HTTP error too): the count of unreachable requests restarts."""
    with self._lock:
      self.unreachable = 0

  def unreachable_request(self, why: str) -> None:
    """Counts a request that could not reach the endpoint (a reply of any kind resets it)."""
    with self._lock:
      self.unreachable += 1
      self.last_unreachable = why

  def charge(self, tokens: int) -> None:
    with self._lock:
      self.used += max(0, int(tokens))
      self.requests += 1
      self.unreachable = 0

  def reset(self, limit: int | None = None) -> dict[str, int]:
    """Starts a new round (or D0) with `limit` tokens (None: the rounds' limit, `round_limit`);
    returns the finished one's {"tokens", "requests"}."""
    with self._lock:
      out = {"tokens": self.used, "requests": self.requests}
      self.used, self.requests, self.unreachable = 0, 0, 0
      self.limit = self.round_limit if limit is None else int(limit)
      return out


class TextLLM(Protocol):
  """A text-in, text-out model. `name` goes into task provenance."""

  name: str
  budget: TokenBudget

  def complete(self, system: str, prompt: str, *, json_output: bool = False) -> str:
    """Returns the model's reply text. Raises LLMError (or BudgetExhausted)."""
    ...

  def refresh(self) -> None:
    """Called at the start of each feedback round: a client serving the policy being trained
    reloads its weights here; a remote model has nothing to do."""
    ...


@dataclasses.dataclass(frozen=True)
class GeminiSettings:
  """Gemini client settings (no credentials: those come from the environment or ADC).

  Attributes:
    model: model id, e.g. "gemini-2.5-flash".
    vertex: use Vertex AI (project/location from the arguments or GOOGLE_CLOUD_PROJECT /
      GOOGLE_CLOUD_LOCATION, credentials from ADC) instead of a Gemini API key.
    project / location: Vertex AI project and region ("" = from the environment).
    base_url: endpoint override ("" = the client's default); used by tests and proxies.
    timeout_s: per-request timeout in seconds (each retry attempt gets the full timeout).
    attempts: tries per request, the first included (1 = no retries).
    initial_delay_s / max_delay_s: exponential backoff bounds (seconds; jittered, base 2).
    temperature: sampling temperature. max_output_tokens: cap per reply.
    tokens_per_round: the TokenBudget limit (0 = unlimited).
  """

  model: str = "gemini-2.5-flash"
  vertex: bool = False
  project: str = ""
  location: str = ""
  base_url: str = ""
  timeout_s: float = 60.0
  attempts: int = 5
  initial_delay_s: float = 1.0
  max_delay_s: float = 30.0
  temperature: float = 0.7
  max_output_tokens: int = 1024
  tokens_per_round: int = 200_000


def api_key_from_env() -> str | None:
  """The Gemini API key from GEMINI_API_KEY or GOOGLE_API_KEY (first set wins), else None."""
  for var in API_KEY_VARS:
    if os.environ.get(var):
      return os.environ[var]
  return None


class PrimaryOnlyLLM:
  """What a process other than the primary holds in place of a remote explorer LLM (TextLLM).

  Every LLM call of a job runs on the primary process (`distributed.on_primary` broadcasts its
  result), so only the primary builds the client and needs its credentials: a launcher need
  not copy an API key to every host. The other processes keep the name (task provenance) and
  a budget that nothing charges.

  Raises:
    RuntimeError: from `complete`: a call on a non-primary process is a bug in the caller.
  """

  def __init__(self, name: str):
    self.name = name
    self.budget = TokenBudget(0)

  def complete(self, system: str, prompt: str, *, json_output: bool = False) -> str:
    raise RuntimeError(
      f"{self.name} was called on a process other than the primary: the job's LLM calls run "
      "on process 0 only (distributed.on_primary)"
    )

  def refresh(self) -> None:
    pass


class GeminiLLM:
  """Gemini via google-genai (implements TextLLM).

  Raises (constructor):
    LLMError: no API key in the environment (and `vertex` is False), or Vertex AI without a
      project; the message names the variables to set, never a value.
  """

  def __init__(self, settings: GeminiSettings = GeminiSettings()):
    from google import genai  # pylint: disable=g-import-not-at-top
    from google.genai import types  # pylint: disable=g-import-not-at-top

    self.settings = settings
    self.name = f"gemini:{settings.model}"
    self.budget = TokenBudget(settings.tokens_per_round)
    self._types = types
    http = types.HttpOptions(
      base_url=settings.base_url or None,
      timeout=int(round(settings.timeout_s * 1000)),  # milliseconds
      retry_options=types.HttpRetryOptions(
        attempts=max(1, settings.attempts),
        initial_delay=settings.initial_delay_s,
        max_delay=settings.max_delay_s,
        exp_base=2.0,
        jitter=1.0,
      ),
    )
    if settings.vertex:
      project = settings.project or os.environ.get("GOOGLE_CLOUD_PROJECT", "")
      location = settings.location or os.environ.get("GOOGLE_CLOUD_LOCATION", "us-central1")
      if not project:
        raise LLMError(
          "Vertex AI needs a project: set explore.gemini.project or "
          "GOOGLE_CLOUD_PROJECT (credentials come from application default "
          "credentials)"
        )
      try:  # reads application default credentials
        self._client = genai.Client(
          vertexai=True, project=project, location=location, http_options=http
        )
      except Exception as e:  # google.auth errors: no ADC, bad ADC file, ...
        raise LLMError(
          f"cannot create the Vertex AI client ({type(e).__name__}: {e}); run "
          "`gcloud auth application-default login` or set "
          "GOOGLE_APPLICATION_CREDENTIALS"
        ) from None
    else:
      key = api_key_from_env()
      if key is None:
        raise LLMError(
          f"no Gemini API key: set one of {', '.join(API_KEY_VARS)} in the "
          "environment (or use Vertex AI with explore.gemini.vertex=True)"
        )
      self._client = genai.Client(api_key=key, http_options=http)

  def __repr__(self) -> str:
    return f"GeminiLLM(model={self.settings.model!r}, vertex={self.settings.vertex})"

  def refresh(self) -> None:
    """Nothing to reload: the model is remote."""

  def complete(self, system: str, prompt: str, *, json_output: bool = False) -> str:
    """One request (retried by the client on 408/429/5xx and transport errors).

    Args:
      system: the system instruction.
      prompt: the user message.
      json_output: ask for a JSON reply (response MIME type application/json).

    Returns:
      The reply text.

    Raises:
      BudgetExhausted: the round's token budget is spent (checked before sending).
      EndpointUnreachable: the last requests could not reach the endpoint (checked before
        sending; `TokenBudget.check`).
      LLMError: an HTTP error after the last retry, a timeout, a malformed or empty response.
    """
    from google.genai import errors  # pylint: disable=g-import-not-at-top

    self.budget.check()
    s = self.settings
    config = self._types.GenerateContentConfig(
      system_instruction=system,
      temperature=s.temperature,
      max_output_tokens=s.max_output_tokens,
      response_mime_type="application/json" if json_output else None,
    )
    try:
      response = self._client.models.generate_content(model=s.model, contents=prompt, config=config)
    except errors.APIError as e:
      self.budget.reached()
      raise LLMError(f"Gemini HTTP {e.code} {e.status or ''}".strip()) from None
    except ValueError as e:  # the client's json.loads of a malformed body
      raise LLMError(f"malformed Gemini response: {e}") from None
    except Exception as e:  # transport errors (timeouts, refused connections) of the client
      kind = "timeout" if "Timeout" in type(e).__name__ else "transport error"
      why = f"Gemini {kind}: {type(e).__name__}"
      self.budget.unreachable_request(why)
      raise LLMError(why) from None
    usage = response.usage_metadata
    tokens = (usage.total_token_count or 0) if usage is not None else 0
    text = response.text
    if not tokens:  # no usage reported: charge an estimate (4 characters per token)
      tokens = (len(system) + len(prompt) + len(text or "")) // 4
    self.budget.charge(tokens)
    if not text:
      raise LLMError("empty Gemini response (no candidate text)")
    return sanitize_text(text, "Gemini")


_refused = [0]  # LLM replies refused by parse_json_reply's strict rules (`refused_count`)
_refused_lock = threading.Lock()


def refused_count() -> int:
  """Explorer-LLM replies `parse_json_reply` refused for breaking the strict JSON rules (a
  repeated key, a non-finite number, a number with too many digits) so far in this process."""
  return _refused[0]


def parse_json_reply(text: str, *, last: bool = False) -> Any:
  """The JSON value in an LLM reply (bare, or inside a ```json fence), read under the rules of
  model-written tool calls (`coevolve_jax.chat.STRICT_DECODER`): no object repeats a key (plain
  `json` keeps the last value, so a summary, a task or a verdict would rest on a guess), no
  number is NaN, Infinity, -Infinity or overflows a float, and no number has more than
  `chat.MAX_NUMBER_DIGITS` digits.

  Args:
    text: the reply.
    last: the reply may reason first (paper Fig. 9: reasoning, then one action): the value is
      the last top-level JSON object or array of the reply (of its last fence, if it has any);
      text around it, braces in prose included, is not read.

  Returns:
    The value, every string in it passed through `sanitize_text` (a "\\ud83d" escape without
    its pair would otherwise put a lone surrogate into the logs and the pool).

  Raises:
    LLMError: no parseable JSON value, or a value that breaks a rule (counted in
      `refused_count`, with a warning).
  """
  from coevolve_jax.chat import STRICT_DECODER, StrictJSONError  # noqa: PLC0415

  fences = re.findall(r"```(?:json)?\s*(.*?)```", text, re.S)
  body = ((fences[-1] if last else fences[0]) if fences else text).strip()
  try:
    if last:
      return sanitize_value(_last_json_value(body))
    try:
      return sanitize_value(STRICT_DECODER.decode(body))
    except StrictJSONError:
      raise
    except (ValueError, RecursionError):
      pass
    if (start := _next_open(body, 0)) >= 0:
      try:
        return sanitize_value(STRICT_DECODER.raw_decode(body[start:])[0])
      except StrictJSONError:
        raise
      except (ValueError, RecursionError):
        pass
  except StrictJSONError as e:
    with _refused_lock:
      _refused[0] += 1
    why = f"reply {e.summary} ({e}; {e.rule}): {text[:120]!r}"
    log.warning("explorer LLM %s", why)
    raise LLMError(why) from None
  except ValueError:
    pass
  raise LLMError(f"reply is not JSON: {text[:120]!r}")


def _last_json_value(body: str) -> Any:
  """The last top-level JSON object or array in `body` (`parse_json_reply(last=True)`).

  Raises:
    StrictJSONError: some value in `body` breaks a rule of the strict decoder (the reply is
      refused, even when a later value is clean: never a guess).
    ValueError: no JSON value.
  """
  from coevolve_jax.chat import STRICT_DECODER, StrictJSONError  # noqa: PLC0415

  found, refusal, pos = None, None, 0
  while (start := _next_open(body, pos)) >= 0:
    try:
      value, pos = STRICT_DECODER.raw_decode(body, start)
      found = (value,)
    except StrictJSONError as e:
      refusal, pos = refusal or e, start + 1
    except RecursionError:  # nesting past Python's limit: the values inside it would be too
      break
    except ValueError:
      pos = start + 1
  if refusal is not None:
    raise refusal
  if found is None:
    raise ValueError("no JSON value")
  return found[0]


def _next_open(text: str, pos: int) -> int:
  """The index of the first "{" or "[" at or after `pos` (-1: none)."""
  return min((i for i in (text.find("{", pos), text.find("[", pos)) if i >= 0), default=-1)


if TYPE_CHECKING:  # mypy checks GeminiLLM against the TextLLM protocol

  def _conforms(llm: GeminiLLM) -> TextLLM:
    return llm
