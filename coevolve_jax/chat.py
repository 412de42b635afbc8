"""Qwen chat template rendering, token-in/token-out helpers and tool-call parsing.

The agent loop accumulates token ids instead of re-rendering the conversation (the Qwen3 template
rewrites history: earlier `<think>` blocks are dropped), so the ids trained on are exactly the ids
sampled:

    ids = prompt_ids(messages, tools)                 # system, tools, first user turn, gen prompt
    ids += sampled                                    # assistant reply, ending with <|im_end|>
    ids += continuation_ids(tool_messages)            # "\n<|im_start|>user\n<tool_response>..." +
                                                      # "<|im_start|>assistant\n"
    ...

`continuation_ids` is derived from the template itself (render with the new messages after a
sentinel assistant message and cut after that message's `<|im_end|>`), not hand-written.

Rendering mirrors `transformers.apply_chat_template(..., tokenize=False)`: an
`ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, a `tojson` filter that does
not escape HTML or non-ASCII characters, `raise_exception`, messages with `None` values dropped, and
message objects (dataclasses, pydantic models such as the OpenAI client's) turned into dicts. Where
the Qwen3 template fails on a message shape the OpenAI chat format allows, the message is first
brought into the shape the template reads (`_normalize_messages`): a system, user or assistant
message with `content` null or missing gets "" (an assistant's `refusal` text, when it has one),
a list of content parts becomes the concatenation of its text (and refusal) parts, and a tool call
without `arguments` gets {}. Every shape transformers renders renders to the same text here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from coevolve_jax import tokenizer as tokenizer_lib
from coevolve_jax.types import Action, ToolCall

Message = Mapping[str, Any]


def _tok(tokenizer: tokenizer_lib.QwenTokenizer | None) -> tokenizer_lib.QwenTokenizer:
  """`tokenizer`, or the default (Qwen3's shipped) one."""
  return tokenizer if tokenizer is not None else tokenizer_lib.get_tokenizer()


TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# A unique string standing in for an assistant reply when cutting continuations out of a render.
_SENTINEL = "\u2063COEVOLVE_ASSISTANT_SENTINEL\u2063"


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(
  x: Any,
  ensure_ascii: bool = False,
  indent: int | None = None,
  separators: tuple[str, str] | None = None,
  sort_keys: bool = False,
) -> str:
  # Same as transformers' override: Jinja's own tojson escapes HTML characters.
  return json.dumps(
    x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


def _strftime_now(fmt: str) -> str:
  return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def compile_template(template: str) -> jinja2.Template:
  """Compiles a chat template the way transformers does (cached per template string)."""
  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env.from_string(template)


def _plain(value: Any) -> Any:
  """Deep-copies template inputs into plain JSON types (dataclasses become dicts)."""
  if value is None or type(value) in (str, int, float, bool):
    return value
  if isinstance(value, str):
    return str.__str__(value)
  if isinstance(value, bool):
    return bool(value)
  if isinstance(value, int):
    return int.__int__(value)
  if isinstance(value, float):
    return float.__float__(value)
  if isinstance(value, Mapping):
    return {_plain(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if callable(getattr(value, "model_dump", None)):  # pydantic models (the OpenAI client's types)
    return _plain(value.model_dump())
  if hasattr(value, "item"):  # numpy scalars
    return _plain(value.item())
  raise TypeError(f"cannot pass {type(value).__name__} to the chat template")


_TEXT_ROLES = ("system", "user", "assistant")


def _text_of_parts(parts: list[Any], where: str, refusals: bool) -> str:
  """The text of a list of content parts: text parts ({"type": "text", "text"}, or {"text"}) and,
  for assistant messages, refusal parts ({"type": "refusal", "refusal"}), concatenated in order as
  Qwen's own templates join text parts.

  Raises:
    ValueError: a part of another type (image, audio, file: this is a text model's template).
    TypeError: a part that is not an object, or whose text is not a string.
  """
  texts = []
  for j, part in enumerate(parts):
    if not isinstance(part, Mapping):
      raise TypeError(f"{where}: content part #{j + 1} is a {type(part).__name__}, not an object")
    kind = part.get("type", "text" if "text" in part else None)
    key = {"text": "text", "refusal": "refusal" if refusals else None}.get(kind)
    if key is None:
      raise ValueError(
        f"{where}: content part #{j + 1} has type {kind!r}; this chat template renders only text"
        " parts (and refusal parts of assistant messages)"
      )
    if not isinstance(part.get(key), str):
      raise TypeError(f"{where}: content part #{j + 1} has no string {key!r}")
    texts.append(part[key])
  return "".join(texts)


def _normalize_call(call: Any) -> Any:
  """A tool call as the template reads it: `arguments` {} when missing (the parser's reading)."""
  if not isinstance(call, dict):
    return call
  inner = call.get("function") or None
  target = inner if isinstance(inner, dict) else call
  if "arguments" in target:
    return call
  if target is call:
    return {**call, "arguments": {}}
  assert isinstance(inner, dict)  # target is inner, which is a dict
  return {**call, "function": {**inner, "arguments": {}}}


def _normalize_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
  """Messages as plain dicts in the shapes the Qwen3 template reads (see the module docstring).

  Raises:
    TypeError: a message is neither a mapping nor a dataclass or pydantic model; a system, user
      or assistant `content` that is not a string, a list of parts or null.
    ValueError: a content part that is not text.
  """
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping):
      if not (dataclasses.is_dataclass(m) and not isinstance(m, type)) and not callable(
        getattr(m, "model_dump", None)
      ):
        raise TypeError(
          f"chat messages must be mappings, dataclasses or pydantic models, got {type(m).__name__}"
        )
      m = _plain(m)
    m = {k: v for k, v in m.items() if v is not None}  # as transformers: None keys are dropped
    m = _plain(m)
    role = m.get("role")
    where = f"message #{i + 1} ({role})"
    if role in _TEXT_ROLES:
      content = m.get("content")
      if content is None:  # OpenAI: an assistant turn with only tool calls (or a refusal)
        refusal = m.get("refusal") if role == "assistant" else None
        m["content"] = refusal if isinstance(refusal, str) else ""
      elif isinstance(content, list):
        m["content"] = _text_of_parts(content, where, refusals=role == "assistant")
      elif not isinstance(content, str):
        raise TypeError(
          f"{where}: content must be a string, a list of content parts or null, "
          f"got {type(content).__name__}"
        )
    if role == "assistant" and isinstance(m.get("tool_calls"), list):
      m["tool_calls"] = [_normalize_call(c) for c in m["tool_calls"]]
    reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
    if reasoning is not None:
      m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    out.append(m)
  return out


def render(
  messages: Sequence[Message],
  tools: Sequence[Mapping[str, Any]] | None = None,
  *,
  add_generation_prompt: bool = False,
  enable_thinking: bool | None = None,
  template: str | None = None,
  tokenizer: tokenizer_lib.QwenTokenizer | None = None,
  **kwargs: Any,
) -> str:
  """Renders a conversation with the Qwen chat template.

  Args:
    messages: chat dicts (or dataclasses, or pydantic models such as the OpenAI client's) with
      `role` ("system" | "user" | "assistant" | "tool") and `content` (a string, a list of text
      parts, or null / missing); assistant messages may carry `tool_calls` ([{"type": "function",
      "function": {"name", "arguments"}}], [{"function": {...}}] or [{"name", "arguments"}];
      `arguments` a dict, a JSON string rendered as given, or missing for {}) and
      `reasoning_content`. Tool-message content is rendered as transformers renders it.
    tools: tool schemas in the Qwen/OpenAI form ({"type": "function", "function": {...}}), or None.
    add_generation_prompt: append `<|im_start|>assistant\\n`.
    enable_thinking: None leaves it undefined (thinking on); False appends an empty think block to
      the generation prompt.
    template: a chat template string; default: `tokenizer`'s agent template.
    tokenizer: whose `chat_template` renders when `template` is None (default: the shipped Qwen3
      tokenizer's).
    **kwargs: further template variables.

  Returns:
    The rendered text, byte-identical to transformers' `apply_chat_template(tokenize=False)` for
    every conversation transformers renders; for the shapes above on which the template fails
    there, identical to transformers' rendering of the normalised messages.

  Raises:
    jinja2.exceptions.TemplateError: the template rejects the conversation.
    TypeError: a message is not a mapping, dataclass or pydantic model, holds a non-JSON value,
      or has system/user/assistant content that is not a string, a list of parts or null.
    ValueError: a content part that is not text (images, audio, files).
  """
  if template is None:
    template = _tok(tokenizer).chat_template
  variables = dict(kwargs)
  if enable_thinking is not None:
    variables["enable_thinking"] = enable_thinking
  return compile_template(template).render(
    messages=_normalize_messages(messages),
    tools=_plain(list(tools)) if tools is not None else None,
    documents=None,
    add_generation_prompt=add_generation_prompt,
    **_plain(variables),
  )


# --------------------------------------------------------------------------------------------
# Text from outside the model: rendered in place of placeholders, tokenized as plain text.

Segments = tuple[tuple[str, bool], ...]  # (text, external): the template's pieces and the rest


class _Holes:
  """Stands in for the external texts of a conversation while the template renders it.

  Each text becomes a placeholder `<marker><index><marker>` (ASCII, so no filter escapes it), and
  `split` turns the rendered text back into segments with the texts in place. The marker is
  chosen absent from `haystack` (the template and whatever else the render shows), so only
  placeholders match it."""

  def __init__(self, haystack: str):
    self.marker = "@coevolve-text@"
    while self.marker in haystack:
      self.marker += "@"
    self.texts: list[str] = []

  def __call__(self, text: str, shown: str | None = None) -> str:
    """The placeholder for `text`; `shown` is what the template would write for it (default
    `text`: rendered verbatim)."""
    self.texts.append(text if shown is None else shown)
    return f"{self.marker}{len(self.texts) - 1}{self.marker}"

  def split(self, rendered: str) -> list[tuple[str, bool]]:
    """`rendered` as (text, external) segments, each placeholder replaced by its text.

    Raises:
      ValueError: a placeholder does not appear in `rendered` (the template altered or dropped
        a text it should show verbatim).
    """
    pattern = re.compile(re.escape(self.marker) + r"(\d+)" + re.escape(self.marker))
    parts, pos, seen = [], 0, set()
    for m in pattern.finditer(rendered):
      parts.append((rendered[pos : m.start()], False))
      parts.append((self.texts[int(m.group(1))], True))
      seen.add(int(m.group(1)))
      pos = m.end()
    parts.append((rendered[pos:], False))
    if len(seen) != len(self.texts):
      raise ValueError("chat template does not show message contents and tool schemas verbatim")
    return [p for p in parts if p[0]]


def _hole_json(value: Any, holes: _Holes) -> Any:
  """A tool schema with every non-empty string (keys and values) a placeholder shown as the
  `tojson` filter writes it inside quotes."""
  if isinstance(value, str):
    return holes(value, json.dumps(value, ensure_ascii=False)[1:-1]) if value else value
  if isinstance(value, dict):
    return {_hole_json(k, holes): _hole_json(v, holes) for k, v in value.items()}
  if isinstance(value, list):
    return [_hole_json(v, holes) for v in value]
  return value


def _hole_calls(calls: list[Any], holes: _Holes) -> list[Any]:
  """Assistant tool calls (normalized) with each name and arguments a placeholder; arguments
  that are not a string are shown as `tojson` writes them."""
  out = []
  for call in calls:
    if not isinstance(call, dict):
      out.append(call)
      continue
    inner = call.get("function") or None  # as the template reads it
    target = dict(inner) if isinstance(inner, dict) else dict(call)
    if isinstance(target.get("name"), str) and target["name"]:
      target["name"] = holes(target["name"])
    args = target.get("arguments")
    if isinstance(args, str):
      target["arguments"] = holes(args) if args else args
    elif args is not None:
      target["arguments"] = holes(_tojson(args))  # a string: the template writes it as it is
    out.append({**call, "function": target} if isinstance(inner, dict) else target)
  return out


def _render_segments(
  messages: Sequence[Message],
  tools: Sequence[Mapping[str, Any]] | None,
  *,
  add_generation_prompt: bool,
  enable_thinking: bool | None,
  template: str | None = None,
) -> list[tuple[str, bool]]:
  """`render`'s text as (text, external) segments: system, user and tool message contents and
  the tool schemas are external; the rest is the template's (assistant messages included, as
  the model's own text). The template renders with the external texts as placeholders, so its
  structure cannot depend on them; for the shipped Qwen3 template the joined segments are
  `render`'s text whenever no external text holds special-token text."""
  if template is None:
    template = _tok(None).chat_template
  normalized = _normalize_messages(messages)
  holes = _Holes(template + json.dumps(normalized, ensure_ascii=False))
  shown = []
  for m in normalized:
    content = m.get("content")
    if m.get("role") in ("system", "user", "tool") and isinstance(content, str) and content:
      m = {**m, "content": holes(content)}
    shown.append(m)
  holed_tools = _hole_json(_plain(list(tools)), holes) if tools is not None else None
  text = render(
    shown,
    holed_tools,
    add_generation_prompt=add_generation_prompt,
    enable_thinking=enable_thinking,
    template=template,
  )
  return holes.split(text)


def prompt_ids(
  messages: Sequence[Message],
  tools: Sequence[Mapping[str, Any]] | None = None,
  *,
  enable_thinking: bool | None = None,
  tokenizer: tokenizer_lib.QwenTokenizer | None = None,
) -> list[int]:
  """Token ids of the rendered conversation followed by the generation prompt, by `tokenizer`
  (default: the shipped Qwen3 tokenizer) with its agent chat template.

  The contents of system, user and tool messages and the tool schemas come from outside the
  model: they are tokenized as plain text (`QwenTokenizer.encode_segments`), so a `<|im_end|>`
  or `<tool_call>` written in them is the ids of its characters; the template's own structure
  tokens keep their ids. Without special-token text in them, the ids are exactly those of
  tokenizing `render`'s text.

  Returns:
    list of int ids ending with the ids of `<|im_start|>assistant\\n` (plus an empty think block
    when `enable_thinking` is False).
  """
  tok = _tok(tokenizer)
  segments = _render_segments(
    messages,
    tools,
    add_generation_prompt=True,
    enable_thinking=enable_thinking,
    template=tok.chat_template,
  )
  return tok.encode_segments(segments)


@functools.lru_cache(maxsize=1024)
def _continuation_cached(new_messages_json: str, enable_thinking: bool | None, template: str):
  new_messages = json.loads(new_messages_json)
  context = [{"role": "user", "content": "."}, {"role": "assistant", "content": _SENTINEL}]
  marker = _SENTINEL + tokenizer_lib.IM_END
  full = _render_segments(
    context + new_messages,
    None,
    add_generation_prompt=True,
    enable_thinking=enable_thinking,
    template=template,
  )
  without = render(context, add_generation_prompt=False, template=template)
  at = [k for k, (text, external) in enumerate(full) if not external and marker in text]
  if len(at) != 1 or full[at[0]][0].count(marker) != 1 or without.count(marker) != 1:
    raise ValueError(
      "chat template does not end an assistant message with <|im_end|> right after "
      "its content; cannot derive continuations"
    )
  head = full[at[0]][0]
  rest = [(head[head.index(marker) + len(marker) :], False), *full[at[0] + 1 :]]
  return tuple((text, external) for text, external in rest if text)


def _continuation_segments(
  new_messages: Sequence[Message], enable_thinking: bool | None, template: str | None
) -> Segments:
  """`continuation_text` as (text, external) segments (see `_render_segments`)."""
  if not new_messages:
    raise ValueError("continuation needs at least one new message")
  normalized = _normalize_messages(new_messages)
  for m in normalized:
    if m.get("role") == "assistant":
      raise ValueError("continuations hold tool/user/system messages, not assistant replies")
  if template is None:
    template = _tok(None).chat_template
  key = json.dumps(normalized, sort_keys=True, ensure_ascii=False)
  return _continuation_cached(key, enable_thinking, template)


def continuation_text(
  new_messages: Sequence[Message],
  *,
  enable_thinking: bool | None = None,
  template: str | None = None,
) -> str:
  """Text the template puts after an assistant reply's `<|im_end|>`, for `new_messages`.

  Consecutive tool messages are grouped by the template into one user block with
  `<tool_response>` tags; the text ends with the generation prompt. The template renders the
  messages' contents as opaque text: what they say cannot change the structure around them.

  Args:
    new_messages: non-empty list of tool messages or a user message (roles "tool" / "user").
    enable_thinking: as in `render`.
    template: as in `render`.

  Returns:
    e.g. "\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n"
    "<|im_start|>assistant\\n".

  Raises:
    ValueError: `new_messages` is empty or holds an assistant message.
  """
  return "".join(
    text for text, _ in _continuation_segments(new_messages, enable_thinking, template)
  )


def continuation_ids(
  new_messages: Sequence[Message],
  *,
  enable_thinking: bool | None = None,
  tokenizer: tokenizer_lib.QwenTokenizer | None = None,
) -> list[int]:
  """Ids to append after a sampled assistant reply (ending in `<|im_end|>`) for `new_messages`.

  The messages' contents (tool outputs, user turns) are tokenized as plain text, as in
  `prompt_ids`: no text they hold can end the turn or open another.

  Returns:
    list of int ids; starts with the newline that follows `<|im_end|>`, ends with the generation
    prompt `<|im_start|>assistant\\n`.

  Raises:
    ValueError: `new_messages` is empty or holds an assistant message.
  """
  tok = _tok(tokenizer)
  segments = _continuation_segments(new_messages, enable_thinking, tok.chat_template)
  return tok.encode_segments(segments)


_PROBE_USER: Message = {"role": "user", "content": "."}


def _assistant_bounds(template: str) -> tuple[str, str]:
  """The text `render([user, assistant, user])` puts before and after the assistant's reply."""
  user_block = render([_PROBE_USER], template=template)
  return (
    user_block + tokenizer_lib.IM_START + "assistant\n",
    tokenizer_lib.IM_END + "\n" + user_block,
  )


def assistant_text(
  content: str | None,
  tool_calls: Sequence[Mapping[str, Any]] = (),
  tokenizer: tokenizer_lib.QwenTokenizer | None = None,
) -> str:
  """An assistant reply as the template renders it in history (between header and `<|im_end|>`).

  Useful to build the text a model would sample for a given tool call (tests, teacher forcing).
  `content` and `tool_calls` take every shape `render` takes (content None for calls only).
  Derived from the template by rendering [user, assistant, user] and removing the two user turns
  and the assistant header and end, so the reply may itself contain any special-token text.

  Raises:
    ValueError: the template does not render the conversation as header, reply, `<|im_end|>`.
  """
  msgs: list[Message] = [
    _PROBE_USER,
    {"role": "assistant", "content": content, "tool_calls": list(tool_calls) or None},
  ]
  template = _tok(tokenizer).chat_template
  full = render([*msgs, _PROBE_USER], template=template)
  head, tail = _assistant_bounds(template)
  if not (full.startswith(head) and full.endswith(tail)) or len(full) < len(head) + len(tail):
    raise ValueError("chat template does not render an assistant reply as header, text, <|im_end|>")
  return full[len(head) : len(full) - len(tail)]


def assistant_ids(
  content: str | None,
  tool_calls: Sequence[Mapping[str, Any]] = (),
  tokenizer: tokenizer_lib.QwenTokenizer | None = None,
) -> list[int]:
  """Token ids of a reply as the model should sample it to say `content` and make `tool_calls`
  (teacher-forced demonstrations), without the stop token.

  The template's structure (`<tool_call>`, `</tool_call>`) keeps its special ids; `content` and
  each call's name and arguments are tokenized as plain text, so an argument holding
  `<|im_end|>` cannot end the reply. `content` is used as given (the template's rewriting of a
  `<think>` block in history does not apply). For text without special-token strings the ids
  are `encode(assistant_text(content, tool_calls))`.

  Raises:
    ValueError: the template does not render the conversation as header, reply, `<|im_end|>`.
  """
  reply = _normalize_messages(
    [{"role": "assistant", "content": content, "tool_calls": list(tool_calls) or None}]
  )[0]
  tok = _tok(tokenizer)
  holes = _Holes(tok.chat_template + json.dumps(reply, ensure_ascii=False))
  if reply["content"]:
    reply["content"] = holes(reply["content"])
  if isinstance(reply.get("tool_calls"), list):
    reply["tool_calls"] = _hole_calls(reply["tool_calls"], holes)
  segments = holes.split(render([_PROBE_USER, reply, _PROBE_USER], template=tok.chat_template))
  head, tail = _assistant_bounds(tok.chat_template)
  first, last = segments[0][0], segments[-1][0]
  if segments[0][1] or segments[-1][1] or not first.startswith(head) or not last.endswith(tail):
    raise ValueError("chat template does not render an assistant reply as header, text, <|im_end|>")
  if len(segments) == 1:
    if len(first) < len(head) + len(tail):
      raise ValueError(
        "chat template does not render an assistant reply as header, text, <|im_end|>"
      )
    segments = [(first[len(head) : len(first) - len(tail)], False)]
  else:
    segments = [
      (first[len(head) :], False),
      *segments[1:-1],
      (last[: len(last) - len(tail)], False),
    ]
  return tok.encode_segments(segments)


# --------------------------------------------------------------------------------------------
# Tool-call parsing.

# Longest JSON text of one tool call (characters) `parse_tool_calls` accepts by default: about one
# full reply of 4096 tokens. The run config sets it from `episode.max_call_chars`.
DEFAULT_MAX_CALL_CHARS = 16384

# Most `<tool_call>` blocks one reply may hold by default. BFCL's longest ground-truth turn makes
# 34 calls (multi_turn_long_context_38 removes 32 files), all of which a model may make in one
# reply. The run config sets it from `episode.max_calls_per_reply`.
DEFAULT_MAX_CALLS_PER_REPLY = 64

# Most digits one JSON number may have in model-written JSON (tool calls, the explorer LLM's
# replies). Checked on the number's text before it is converted, so no huge int is ever built;
# far below Python's own 4300-digit limit on int(str), whose error would otherwise reach the model.
MAX_NUMBER_DIGITS = 1000

_JSON_WHITESPACE = re.compile(r"[ \t\n\r]*")


class StrictJSONError(ValueError):
  """Model-written JSON that breaks a rule of `STRICT_DECODER` (Python's json would read it, or
  fail with a message about its own internals).

  Attributes:
    summary: what the text does, as a verb phrase ("repeats a key"), for messages.
    rule: the rule it breaks, as a sentence fragment for the model or the log.
  """

  summary = "breaks the strict JSON rules"
  rule = ""


class DuplicateKeyError(StrictJSONError):
  """A JSON object names the same key twice (Python's json keeps the last value silently)."""

  summary = "repeats a key"
  rule = "every key may appear once in a JSON object"

  def __init__(self, key: str):
    super().__init__(f"duplicate key {key!r}")
    self.key = key


class NonFiniteNumberError(StrictJSONError):
  """NaN, Infinity or -Infinity (Python's json extensions, not JSON), or a number too large for a
  float (1e999 would read as inf)."""

  summary = "holds a number that is not finite"
  rule = "numbers must be finite; NaN, Infinity and -Infinity are not JSON"

  def __init__(self, literal: str):
    super().__init__(f"non-finite number {literal[:40]}")
    self.literal = literal


class NumberTooLongError(StrictJSONError):
  """A JSON number with more than MAX_NUMBER_DIGITS digits."""

  summary = "holds a number with too many digits"
  rule = f"a number may have at most {MAX_NUMBER_DIGITS} digits"

  def __init__(self, digits: int):
    super().__init__(f"a number of {digits} digits")
    self.digits = digits


def unique_object_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  """`object_pairs_hook` for `json.loads` / `json.JSONDecoder` that refuses duplicate keys.

  Raises:
    DuplicateKeyError: a key appears twice in one object.
  """
  out: dict[str, Any] = {}
  for key, value in pairs:
    if key in out:
      raise DuplicateKeyError(key)
    out[key] = value
  return out


def _refuse_constant(name: str) -> Any:
  """`parse_constant` hook: json calls it with "NaN", "Infinity" or "-Infinity"."""
  raise NonFiniteNumberError(name)


def _number_digits(literal: str) -> int:
  """Digits of a JSON number's text (sign, point and exponent marker not counted)."""
  return len(literal) - sum(map(literal.count, "-+.eE"))


def _bounded_int(literal: str) -> int:
  """`parse_int` hook: json calls it with the integer's text, before any conversion."""
  if len(literal) > MAX_NUMBER_DIGITS and _number_digits(literal) > MAX_NUMBER_DIGITS:
    raise NumberTooLongError(_number_digits(literal))
  return int(literal)


def _bounded_float(literal: str) -> float:
  """`parse_float` hook: json calls it with the text of a number with a point or an exponent."""
  if len(literal) > MAX_NUMBER_DIGITS and _number_digits(literal) > MAX_NUMBER_DIGITS:
    raise NumberTooLongError(_number_digits(literal))
  value = float(literal)
  if not math.isfinite(value):
    raise NonFiniteNumberError(literal)
  return value


# The one decoder of model-written JSON: tool calls here, every JSON reply of the explorer LLM
# (`coevolve_jax.feedback.llm.parse_json_reply`). It refuses a repeated key, NaN / Infinity /
# -Infinity and numbers that overflow a float, and numbers of more than MAX_NUMBER_DIGITS digits,
# each with a `StrictJSONError`; any other JSON decodes as with plain `json.loads`.
STRICT_DECODER = json.JSONDecoder(
  object_pairs_hook=unique_object_pairs,
  parse_constant=_refuse_constant,
  parse_int=_bounded_int,
  parse_float=_bounded_float,
)

# Finds where a JSON value ends without building it (numbers stay text, constants are allowed),
# so a block whose value breaks a strict rule is still delimited by its JSON, not by a tag.
_SPAN_DECODER = json.JSONDecoder(parse_constant=str, parse_int=str, parse_float=str)


def loads_strict(text: str) -> Any:
  """`json.loads` under `STRICT_DECODER`'s rules.

  Raises:
    StrictJSONError: a repeated key, a non-finite number or a number with too many digits.
    json.JSONDecodeError: `text` is not one JSON value.
    RecursionError: the value nests too deep.
  """
  return STRICT_DECODER.decode(text)


def _strict_message(e: StrictJSONError) -> str:
  return f"{e} ({e.rule})"


def _skip_ws(text: str, pos: int) -> int:
  m = _JSON_WHITESPACE.match(text, pos)
  assert m is not None  # the pattern matches the empty string, at any pos
  return m.end()


@dataclasses.dataclass
class _Block:
  """One `<tool_call>` block: text[start:end] from its opening tag through its closing tag.

  When the block is one JSON value followed by the closing tag, text[json_start:json_end] is that
  value and `value` its decoding (or `error` names the strict rule it breaks); otherwise json_end
  is 0 and `error` says what is wrong."""

  start: int
  end: int
  json_start: int = 0
  json_end: int = 0
  value: Any = None
  error: str | None = None


def _json_error(inner: str) -> str:
  """Why `inner` (the text between two tags) is not one JSON value."""
  try:
    loads_strict(inner)
  except StrictJSONError as e:
    return _strict_message(e)
  except json.JSONDecodeError as e:
    return f"invalid JSON ({e.msg}): {inner.strip()[:200]!r}"
  except RecursionError:
    return f"invalid JSON (nesting too deep): {inner.strip()[:200]!r}"
  return f"invalid JSON: {inner.strip()[:200]!r}"


def _read_block(text: str, open_at: int) -> _Block:
  """Reads the `<tool_call>` block opening at `open_at`.

  The JSON value after the opening tag is decoded first, so a `</tool_call>` (or any other tag)
  inside one of its strings belongs to the value; the block must then close right after it. When
  it does not, the block runs to the next `</tool_call>` (or the end of the text) and carries an
  error.
  """
  body = open_at + len(TOOL_CALL_OPEN)
  j = _skip_ws(text, body)
  value, end, refused = None, None, None
  try:
    value, end = STRICT_DECODER.raw_decode(text, j)
  except StrictJSONError as e:
    refused = e
    try:  # where the value ends, so the block is still delimited by the JSON, not by a tag
      end = _SPAN_DECODER.raw_decode(text, j)[1]
    except (json.JSONDecodeError, RecursionError):
      pass
  except (json.JSONDecodeError, RecursionError):
    pass
  if end is not None:
    close_at = _skip_ws(text, end)
    if text.startswith(TOOL_CALL_CLOSE, close_at):
      stop = close_at + len(TOOL_CALL_CLOSE)
      if refused is not None:
        return _Block(open_at, stop, j, end, error=_strict_message(refused))
      return _Block(open_at, stop, j, end, value)
  close_at = text.find(TOOL_CALL_CLOSE, body)
  if close_at < 0:
    return _Block(open_at, len(text), error=f"{TOOL_CALL_OPEN} without a closing {TOOL_CALL_CLOSE}")
  inner = text[body:close_at]
  if TOOL_CALL_OPEN in inner:
    error = f"{TOOL_CALL_OPEN} opened twice without {TOOL_CALL_CLOSE}"
  else:
    error = _json_error(inner)
  return _Block(open_at, close_at + len(TOOL_CALL_CLOSE), error=error)


def _well_formed_spans(text: str) -> list[tuple[int, int]]:
  """[start, end) of every `<tool_call>` block whose JSON value is followed by its closing tag."""
  spans, pos = [], 0
  while (open_at := text.find(TOOL_CALL_OPEN, pos)) >= 0:
    block = _read_block(text, open_at)
    if block.json_end:
      spans.append((block.start, block.end))
      pos = block.end
    else:
      pos = open_at + len(TOOL_CALL_OPEN)
  return spans


def _find_outside(text: str, tag: str, spans: list[tuple[int, int]]) -> list[int]:
  """Positions of `tag` in `text` that lie in none of `spans`."""
  out, pos = [], 0
  while (i := text.find(tag, pos)) >= 0:
    if not any(s <= i < e for s, e in spans):
      out.append(i)
    pos = i + len(tag)
  return out


def strip_thinking(text: str) -> str:
  """Removes reasoning: everything up to the last `</think>`, or from an unclosed `<think>` on.

  Tags inside the JSON of a well-formed `<tool_call>` block are argument text, not reasoning
  markers, and are left alone.
  """
  if THINK_CLOSE not in text and THINK_OPEN not in text:
    return text
  spans = _well_formed_spans(text) if TOOL_CALL_OPEN in text else []
  closes = _find_outside(text, THINK_CLOSE, spans)
  if closes:
    return text[closes[-1] + len(THINK_CLOSE) :]
  opens = _find_outside(text, THINK_OPEN, spans)
  if opens:
    return text[: opens[0]]
  return text


def _call_from_value(obj: Any, index: int) -> ToolCall | str:
  """Checks one decoded call object; returns a ToolCall or an error message."""
  where = f"tool call #{index + 1}"
  if not isinstance(obj, dict):
    return f'{where}: expected a JSON object with "name" and "arguments", got {type(obj).__name__}'
  name = obj.get("name")
  if not isinstance(name, str) or not name.strip():
    return f'{where}: missing or non-string "name"'
  extra = sorted(set(obj) - {"name", "arguments"})
  if extra:
    return f'{where} ({name}): unexpected keys {extra}; expected only "name" and "arguments"'
  args = obj.get("arguments", {})
  if isinstance(args, str):
    try:
      args = loads_strict(args) if args.strip() else {}
    except StrictJSONError as e:
      return f'{where} ({name}): "arguments" {e.summary}: {_strict_message(e)}'
    except (json.JSONDecodeError, RecursionError):
      return f'{where} ({name}): "arguments" is a string that is not valid JSON'
  if not isinstance(args, dict):
    return f'{where} ({name}): "arguments" must be a JSON object, got {type(args).__name__}'
  return ToolCall(name=name.strip(), arguments=args)


def parse_tool_calls(
  text: str,
  *,
  truncated: bool = False,
  max_call_chars: int = DEFAULT_MAX_CALL_CHARS,
  max_calls_per_reply: int = DEFAULT_MAX_CALLS_PER_REPLY,
) -> Action:
  """Parses an assistant reply into an `Action`; never raises, never evaluates code.

  Reasoning (`<think>...</think>`) is stripped first. Each `<tool_call>{json}</tool_call>` block
  must hold {"name": str, "arguments": object or JSON string of an object}; "arguments" may be
  omitted (no-argument call). The JSON is decoded, not cut at the next tag: a string argument may
  contain `</tool_call>`, `<think>` or any other text. The JSON is read by `STRICT_DECODER`: no
  object may repeat a key, no number may be NaN, Infinity, -Infinity or overflow a float, and no
  number may have more than MAX_NUMBER_DIGITS digits.

  A reply with more than `max_calls_per_reply` blocks runs none of them, like a reply with any
  other parse error: the model sees one error observation, nothing of the reply changes the
  environment, and the rollout does not depend on which calls would have fitted under the cap.

  Args:
    text: the decoded assistant reply (with or without the trailing `<|im_end|>`).
    truncated: the reply hit the token limit (no end-of-turn token was sampled).
    max_call_chars: the longest JSON text of one call, in characters (>= 1); a longer call is
      refused (the run sets it from `episode.max_call_chars`).
    max_calls_per_reply: the most `<tool_call>` blocks one reply may hold (>= 1; the run sets it
      from `episode.max_calls_per_reply`).

  Returns:
    `Action(tool_calls=[...], text=text)` for well-formed calls, in order;
    `Action(tool_calls=[], text=text)` when there is no tool call (the turn ends);
    `Action(error=message, text=text)` (and no tool calls) for a truncated reply, more than
    `max_calls_per_reply` calls, malformed JSON, a repeated key, a non-finite number, a number
    with too many digits, a call longer than `max_call_chars`, a missing name, non-object
    arguments, unexpected keys, or unbalanced tags. The message quotes at most 200 characters of
    a call.
  """
  if truncated:
    return Action(
      error="the reply was cut off at the token limit before it finished; no tool call "
      "was executed. Reply with shorter output.",
      text=text,
    )
  try:
    body = strip_thinking(text)
    if body.endswith(tokenizer_lib.IM_END):
      body = body[: -len(tokenizer_lib.IM_END)]
    errors: list[str] = []
    calls: list[ToolCall] = []
    pos = index = 0
    while True:
      open_at = body.find(TOOL_CALL_OPEN, pos)
      between = body[pos : open_at if open_at >= 0 else len(body)]
      if TOOL_CALL_CLOSE in between:
        errors.append(f"{TOOL_CALL_CLOSE} without an opening {TOOL_CALL_OPEN}")
      if open_at < 0:
        break
      block = _read_block(body, open_at)
      pos = block.end
      where = f"tool call #{index + 1}"
      index += 1
      if block.error is not None:
        errors.append(f"{where}: {block.error}")
        continue
      size = block.json_end - block.json_start
      if size > max_call_chars:
        errors.append(
          f"{where}: the call is {size} characters long, over the limit of {max_call_chars}; "
          "it was not run. Make shorter calls."
        )
        continue
      parsed = _call_from_value(block.value, index - 1)
      if isinstance(parsed, str):
        errors.append(parsed)
      else:
        calls.append(parsed)
    if index > max_calls_per_reply:
      return Action(
        error=f"the reply has {index} tool calls; at most {max_calls_per_reply} per reply are "
        "allowed, so none was run. Make fewer calls per reply.",
        text=text,
      )
    if errors:
      return Action(error="could not parse the tool calls: " + "; ".join(errors), text=text)
    return Action(tool_calls=calls, text=text)
  except Exception as e:  # pylint: disable=broad-except  # defensive: parsing must never crash
    return Action(error=f"could not parse the tool calls: {type(e).__name__}: {e}", text=text)


@runtime_checkable
class ChatFormat(Protocol):
  """How conversations become token ids and replies become actions, for the agent loop, the
  warm-start demonstrations and the replaying engine. Implemented by `QwenChat`.

  Token ids are Python ints in [0, vocab_size). Messages are chat dicts ({"role", "content"},
  plus "tool_calls" on assistant messages); tools are JSON-schema tool dicts.

  Attributes:
    im_end_id: the id that ends a reply in the template (`<|im_end|>`); the loop stops sampling
      on it and on the checkpoint's other end-of-sequence ids (`AgentRunner(stop_ids=...)`).
  """

  im_end_id: int

  def prompt_ids(self, messages: list[dict], tools: list[dict]) -> list[int]:
    """The first prompt: system/user `messages` and `tools` rendered and tokenized, ending with
    the assistant header the model replies after. The messages' contents and the tools come from
    outside the model: no text in them may produce a control token."""
    ...

  def continuation_ids(self, messages: list[dict]) -> list[int]:
    """Ids that follow a reply's stop token: `messages` (tool results or the next user message)
    and the next assistant header. As in `prompt_ids`, no text in the messages may produce a
    control token.

    Raises:
      ValueError: `messages` is empty or holds an assistant message.
    """
    ...

  def assistant_text(self, content: str, tool_calls: Sequence[dict] = ()) -> str:
    """A reply's text as the model should write it: `content` then each call ({"name",
    "arguments"}) in the template's tool-call format; without the stop token."""
    ...

  def assistant_ids(self, content: str, tool_calls: Sequence[dict] = ()) -> list[int]:
    """The ids of that reply as the model should sample them (teacher forcing), without the stop
    token: the format's tags as their tokens, `content`, names and arguments as plain text (no
    special-token text in them becomes a control token)."""
    ...

  def parse_tool_calls(self, text: str, truncated: bool = False) -> Action:
    """The action a reply's text (without its stop token) asks for; `truncated` means the reply
    was cut before its stop token. Malformed calls give `Action.error`, never an exception."""
    ...

  def encode(self, text: str) -> list[int]:
    """Token ids of `text` (no special tokens added)."""
    ...

  def decode(self, ids: list[int]) -> str:
    """Text of token ids (special tokens included as text)."""
    ...
