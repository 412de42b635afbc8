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
not escape HTML or non-ASCII characters, `raise_exception`, and messages with `None` values dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from coevolve_jax import tokenizer as tokenizer_lib
from coevolve_jax.types import Action, ToolCall

Message = Mapping[str, Any]

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
  if hasattr(value, "item"):  # numpy scalars
    return _plain(value.item())
  raise TypeError(f"cannot pass {type(value).__name__} to the chat template")


def _normalize_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
  out = []
  for m in messages:
    if not isinstance(m, Mapping):
      raise TypeError(f"chat messages must be mappings, got {type(m).__name__}")
    m = {k: v for k, v in m.items() if v is not None}  # as transformers: None keys are dropped
    reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
    if reasoning is not None:
      m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    out.append(_plain(m))
  return out


def render(
  messages: Sequence[Message],
  tools: Sequence[Mapping[str, Any]] | None = None,
  *,
  add_generation_prompt: bool = False,
  enable_thinking: bool | None = None,
  template: str | None = None,
  **kwargs: Any,
) -> str:
  """Renders a conversation with the Qwen chat template.

  Args:
    messages: chat dicts with `role` ("system" | "user" | "assistant" | "tool") and `content`;
      assistant messages may carry `tool_calls` ([{"type": "function", "function": {"name",
      "arguments"}}] or [{"name", "arguments"}]; `arguments` a dict or a JSON string) and
      `reasoning_content`.
    tools: tool schemas in the Qwen/OpenAI form ({"type": "function", "function": {...}}), or None.
    add_generation_prompt: append `<|im_start|>assistant\\n`.
    enable_thinking: None leaves it undefined (thinking on); False appends an empty think block to
      the generation prompt.
    template: a chat template string; default: the Qwen3 template of the shipped tokenizer.
    **kwargs: further template variables.

  Returns:
    The rendered text, byte-identical to transformers' `apply_chat_template(tokenize=False)`.

  Raises:
    jinja2.exceptions.TemplateError: the template rejects the conversation.
    TypeError: a message is not a mapping or holds a non-JSON value.
  """
  if template is None:
    template = tokenizer_lib.get_tokenizer().chat_template
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


def prompt_ids(
  messages: Sequence[Message],
  tools: Sequence[Mapping[str, Any]] | None = None,
  *,
  enable_thinking: bool | None = None,
) -> list[int]:
  """Token ids of the rendered conversation followed by the generation prompt.

  Returns:
    list of int ids ending with the ids of `<|im_start|>assistant\\n` (plus an empty think block
    when `enable_thinking` is False).
  """
  text = render(messages, tools, add_generation_prompt=True, enable_thinking=enable_thinking)
  return tokenizer_lib.get_tokenizer().encode(text)


@functools.lru_cache(maxsize=1024)
def _continuation_text_cached(
  new_messages_json: str, enable_thinking: bool | None, template: str
) -> str:
  new_messages = json.loads(new_messages_json)
  context = [{"role": "user", "content": "."}, {"role": "assistant", "content": _SENTINEL}]
  marker = _SENTINEL + tokenizer_lib.IM_END
  full = render(
    context + new_messages,
    add_generation_prompt=True,
    enable_thinking=enable_thinking,
    template=template,
  )
  without = render(context, add_generation_prompt=False, template=template)
  if full.count(marker) != 1 or without.count(marker) != 1:
    raise ValueError(
      "chat template does not end an assistant message with <|im_end|> right after "
      "its content; cannot derive continuations"
    )
  return full[full.index(marker) + len(marker) :]


def continuation_text(
  new_messages: Sequence[Message],
  *,
  enable_thinking: bool | None = None,
  template: str | None = None,
) -> str:
  """Text the template puts after an assistant reply's `<|im_end|>`, for `new_messages`.

  Consecutive tool messages are grouped by the template into one user block with
  `<tool_response>` tags; the text ends with the generation prompt.

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
  if not new_messages:
    raise ValueError("continuation needs at least one new message")
  for m in new_messages:
    if m.get("role") == "assistant":
      raise ValueError("continuations hold tool/user/system messages, not assistant replies")
  if template is None:
    template = tokenizer_lib.get_tokenizer().chat_template
  key = json.dumps(_normalize_messages(new_messages), sort_keys=True, ensure_ascii=False)
  return _continuation_text_cached(key, enable_thinking, template)


def continuation_ids(
  new_messages: Sequence[Message], *, enable_thinking: bool | None = None
) -> list[int]:
  """Ids to append after a sampled assistant reply (ending in `<|im_end|>`) for `new_messages`.

  Returns:
    list of int ids; starts with the newline that follows `<|im_end|>`, ends with the generation
    prompt `<|im_start|>assistant\\n`.
  """
  return tokenizer_lib.get_tokenizer().encode(
    continuation_text(new_messages, enable_thinking=enable_thinking)
  )


def assistant_text(content: str, tool_calls: Sequence[Mapping[str, Any]] = ()) -> str:
  """An assistant reply as the template renders it in history (between header and `<|im_end|>`).

  Useful to build the text a model would sample for a given tool call (tests, teacher forcing).
  Derived from the template by rendering [user, assistant, user].
  """
  msgs = [
    {"role": "user", "content": "."},
    {"role": "assistant", "content": content, "tool_calls": list(tool_calls) or None},
    {"role": "user", "content": "."},
  ]
  full = render(msgs)
  head = tokenizer_lib.IM_START + "assistant\n"
  start = full.index(head) + len(head)
  end = full.index(tokenizer_lib.IM_END, start)
  return full[start:end]


# --------------------------------------------------------------------------------------------
# Tool-call parsing.

_BLOCK_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def strip_thinking(text: str) -> str:
  """Removes reasoning: everything up to the last `</think>`, or from an unclosed `<think>` on."""
  if THINK_CLOSE in text:
    return text.rsplit(THINK_CLOSE, 1)[1]
  if THINK_OPEN in text:
    return text.split(THINK_OPEN, 1)[0]
  return text


def _parse_one(body: str, index: int) -> ToolCall | str:
  """Parses one `<tool_call>` body; returns a ToolCall or an error message."""
  where = f"tool call #{index + 1}"
  try:
    obj = json.loads(body)
  except (json.JSONDecodeError, RecursionError) as e:
    msg = e.msg if isinstance(e, json.JSONDecodeError) else "nesting too deep"
    return f"{where}: invalid JSON ({msg}): {body.strip()[:200]!r}"
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
      args = json.loads(args) if args.strip() else {}
    except (json.JSONDecodeError, RecursionError):
      return f'{where} ({name}): "arguments" is a string that is not valid JSON'
  if not isinstance(args, dict):
    return f'{where} ({name}): "arguments" must be a JSON object, got {type(args).__name__}'
  return ToolCall(name=name.strip(), arguments=args)


def parse_tool_calls(text: str, *, truncated: bool = False) -> Action:
  """Parses an assistant reply into an `Action`; never raises, never evaluates code.

  Reasoning (`<think>...</think>`) is stripped first. Each `<tool_call>{json}</tool_call>` block
  must hold {"name": str, "arguments": object or JSON string of an object}; "arguments" may be
  omitted (no-argument call).

  Args:
    text: the decoded assistant reply (with or without the trailing `<|im_end|>`).
    truncated: the reply hit the token limit (no end-of-turn token was sampled).

  Returns:
    `Action(tool_calls=[...], text=text)` for well-formed calls, in order;
    `Action(tool_calls=[], text=text)` when there is no tool call (the turn ends);
    `Action(error=message, text=text)` (and no tool calls) for a truncated reply, malformed JSON,
    a missing name, non-object arguments, unexpected keys, or unbalanced tags.
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
    blocks = list(_BLOCK_RE.finditer(body))
    for i, m in enumerate(blocks):
      inner = m.group(1)
      if TOOL_CALL_OPEN in inner:
        errors.append(
          f"tool call #{i + 1}: {TOOL_CALL_OPEN} opened twice without {TOOL_CALL_CLOSE}"
        )
        continue
      parsed = _parse_one(inner, i)
      if isinstance(parsed, str):
        errors.append(parsed)
      else:
        calls.append(parsed)
    rest = _BLOCK_RE.sub("", body)
    if TOOL_CALL_OPEN in rest:
      errors.append(f"{TOOL_CALL_OPEN} without a closing {TOOL_CALL_CLOSE}")
    if TOOL_CALL_CLOSE in rest:
      errors.append(f"{TOOL_CALL_CLOSE} without an opening {TOOL_CALL_OPEN}")
    if errors:
      return Action(error="could not parse the tool calls: " + "; ".join(errors), text=text)
    return Action(tool_calls=calls, text=text)
  except Exception as e:  # pylint: disable=broad-except  # defensive: parsing must never crash
    return Action(error=f"could not parse the tool calls: {type(e).__name__}: {e}", text=text)
