"""Tests for coevolve_jax.tokenizer and coevolve_jax.chat."""

from __future__ import annotations

import importlib.util
import json

import pytest

from coevolve_jax import chat
from coevolve_jax import tokenizer as tokenizer_lib
from coevolve_jax.types import Action, ToolCall

TOOLS = [
  {
    "type": "function",
    "function": {
      "name": "cd",
      "description": "Change directory. <b>HTML</b> & unicode: é ü 中文",
      "parameters": {
        "type": "object",
        "properties": {"folder": {"type": "string"}},
        "required": ["folder"],
      },
    },
  },
  {
    "type": "function",
    "function": {
      "name": "mv",
      "description": "Move a file.",
      "parameters": {
        "type": "object",
        "properties": {"source": {"type": "string"}, "destination": {"type": "string"}},
      },
    },
  },
]

CALL_CD = {"type": "function", "function": {"name": "cd", "arguments": {"folder": "document"}}}
CALL_MV = {
  "type": "function",
  "function": {"name": "mv", "arguments": '{"source": "a.txt", "destination": "b/"}'},
}

CONVERSATIONS = {
  "system_tools_user": (
    [
      {"role": "system", "content": "You are a file agent."},
      {"role": "user", "content": "Go to document."},
    ],
    TOOLS,
  ),
  "user_only_no_system": ([{"role": "user", "content": "Hello 世界"}], None),
  "system_no_tools": (
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    None,
  ),
  "assistant_tool_calls": (
    [
      {"role": "system", "content": "You are a file agent."},
      {"role": "user", "content": "Go to document then move a.txt."},
      {"role": "assistant", "content": "", "tool_calls": [CALL_CD, CALL_MV]},
      {"role": "tool", "content": '{"current_working_directory": "document"}'},
      {"role": "tool", "content": '{"result": "moved"}'},
      {"role": "tool", "content": "third"},
    ],
    TOOLS,
  ),
  "multi_turn": (
    [
      {"role": "system", "content": "sys"},
      {"role": "user", "content": "first"},
      {"role": "assistant", "content": "Sure.", "tool_calls": [CALL_CD]},
      {"role": "tool", "content": "ok"},
      {"role": "assistant", "content": "Done with the first."},
      {"role": "user", "content": "second"},
      {
        "role": "assistant",
        "content": "<think>\nhmm\n</think>\n\nWorking.",
        "tool_calls": [CALL_MV],
      },
      {"role": "tool", "content": "moved"},
      {"role": "assistant", "content": "All done."},
    ],
    TOOLS,
  ),
  "reasoning_content_and_none": (
    [
      {"role": "user", "content": "q"},
      {"role": "assistant", "content": "a", "reasoning_content": "think hard", "tool_calls": None},
      {"role": "tool", "content": "r"},
    ],
    TOOLS,
  ),
}


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.get_tokenizer()


def test_tokenizer_ids(tok):
  assert tok.eos_id == tok.im_end_id == 151645
  assert tok.pad_id == 151643
  assert tok.im_start_id == 151644
  assert tok.vocab_size == 151669
  assert tok.vocab_size <= tokenizer_lib.QWEN3_PADDED_VOCAB_SIZE
  assert tok.token_to_id("<tool_call>") == 151657
  assert tokenizer_lib.get_tokenizer() is tok  # cached per process


def test_encode_decode_roundtrip(tok):
  text = '<|im_start|>user\nhé 中文 <tool_call>\n{"a": 1}\n</tool_call><|im_end|>\n'
  ids = tok.encode(text)
  assert ids[0] == tok.im_start_id
  assert tok.im_end_id in ids
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids) == text
  assert tok.encode("hello") == tok.encode_batch(["hello"])[0]
  assert tok.encode("") == []


# ------------------------------------------------------------------ parity with transformers


@pytest.fixture(scope="module")
def hf_tok():
  if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers not installed")
  transformers = pytest.importorskip("transformers")
  return transformers.AutoTokenizer.from_pretrained(
    tokenizer_lib.tokenizer_dir(), local_files_only=True
  )


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("thinking", [None, False])
def test_render_matches_transformers(hf_tok, name, gen, thinking):
  messages, tools = CONVERSATIONS[name]
  kwargs = {} if thinking is None else {"enable_thinking": thinking}
  want = hf_tok.apply_chat_template(
    messages, tools=tools, add_generation_prompt=gen, tokenize=False, **kwargs
  )
  got = chat.render(messages, tools, add_generation_prompt=gen, enable_thinking=thinking)
  assert got == want


def test_encode_matches_transformers(hf_tok, tok):
  messages, tools = CONVERSATIONS["multi_turn"]
  text = chat.render(messages, tools)
  assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
  assert chat.prompt_ids(messages[:2], tools) == hf_tok.apply_chat_template(
    messages[:2], tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
  )


def test_render_does_not_mutate_inputs():
  messages, tools = CONVERSATIONS["reasoning_content_and_none"]
  before = json.dumps([messages, tools])
  chat.render(messages, tools)
  assert json.dumps([messages, tools]) == before


# ------------------------------------------------------------------ token-in / token-out


def _decoded_equal(tok, ids, text):
  assert tok.decode(ids) == text


@pytest.mark.parametrize("thinking", [None])
def test_token_accumulation_matches_full_render(tok, thinking):
  """prompt + sampled assistant + continuation == tokenize(render(full conversation))."""
  m0 = [
    {"role": "system", "content": "You are a file agent."},
    {"role": "user", "content": "Go to document, then move a.txt."},
  ]
  a1 = {"role": "assistant", "content": "I will cd first.", "tool_calls": [CALL_CD]}
  t1 = [
    {"role": "tool", "content": '{"cwd": "document"}'},
    {"role": "tool", "content": "second tool output"},
  ]
  a2 = {"role": "assistant", "content": "", "tool_calls": [CALL_MV]}
  t2 = [{"role": "tool", "content": "moved"}]
  a3 = {"role": "assistant", "content": "All done."}
  u2 = [{"role": "user", "content": "Now list files."}]

  ids = chat.prompt_ids(m0, TOOLS)
  conv = list(m0)
  for reply, new in ((a1, t1), (a2, t2), (a3, u2)):
    sampled = tok.encode(chat.assistant_text(reply["content"], reply.get("tool_calls", ())))
    sampled.append(tok.im_end_id)
    ids = ids + sampled + chat.continuation_ids(new)
    conv = conv + [reply] + new
    full = chat.render(conv, TOOLS, add_generation_prompt=True)
    _decoded_equal(tok, ids, full)
    assert ids == tok.encode(full)


def test_continuation_groups_tool_messages():
  text = chat.continuation_text(
    [{"role": "tool", "content": "A"}, {"role": "tool", "content": "B"}]
  )
  assert text == (
    "\n<|im_start|>user\n<tool_response>\nA\n</tool_response>\n<tool_response>\nB"
    "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
  )
  assert chat.continuation_text([{"role": "user", "content": "next"}]) == (
    "\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"
  )
  assert chat.continuation_text([{"role": "user", "content": "x"}], enable_thinking=False).endswith(
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
  )


def test_continuation_rejects_bad_input():
  with pytest.raises(ValueError):
    chat.continuation_text([])
  with pytest.raises(ValueError):
    chat.continuation_text([{"role": "assistant", "content": "x"}])


def test_continuation_ids_start_after_im_end(tok):
  ids = chat.continuation_ids([{"role": "tool", "content": "out"}])
  assert tok.decode(ids[:1]) == "\n"
  assert ids[-3:] == tok.encode("<|im_start|>assistant\n")


# ------------------------------------------------------------------ parse_tool_calls


def test_parse_single_call():
  text = '<tool_call>\n{"name": "cd", "arguments": {"folder": "document"}}\n</tool_call>'
  a = chat.parse_tool_calls(text)
  assert a == Action(tool_calls=[ToolCall("cd", {"folder": "document"})], text=text)


def test_parse_several_calls_with_text_and_im_end():
  text = (
    "Let me do both.\n"
    '<tool_call>\n{"name": "cd", "arguments": {"folder": "d"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "mv", "arguments": {"source": "a", "destination": "b"}}\n'
    "</tool_call><|im_end|>"
  )
  a = chat.parse_tool_calls(text)
  assert a.error is None
  assert [c.name for c in a.tool_calls] == ["cd", "mv"]
  assert a.tool_calls[1].arguments == {"source": "a", "destination": "b"}
  assert a.text == text


def test_parse_dict_and_list_arguments():
  text = (
    '<tool_call>{"name": "post", "arguments": {"tags": ["a", "b"], "meta": {"k": [1, 2.5]},'
    ' "flag": null}}</tool_call>'
  )
  a = chat.parse_tool_calls(text)
  assert a.error is None
  assert a.tool_calls[0].arguments == {"tags": ["a", "b"], "meta": {"k": [1, 2.5]}, "flag": None}


def test_parse_arguments_as_json_string():
  text = '<tool_call>{"name": "mv", "arguments": "{\\"source\\": \\"a\\"}"}</tool_call>'
  a = chat.parse_tool_calls(text)
  assert a.error is None and a.tool_calls == [ToolCall("mv", {"source": "a"})]


def test_parse_missing_arguments_is_empty_dict():
  a = chat.parse_tool_calls('<tool_call>{"name": "pwd"}</tool_call>')
  assert a.error is None and a.tool_calls == [ToolCall("pwd", {})]


def test_parse_no_tool_call_ends_turn():
  a = chat.parse_tool_calls("The answer is 42.<|im_end|>")
  assert a.error is None and a.tool_calls == [] and a.text == "The answer is 42.<|im_end|>"


@pytest.mark.parametrize(
  "text,fragment",
  [
    ('<tool_call>{"name": "cd", "arguments": {"folder": }</tool_call>', "invalid JSON"),
    ("<tool_call>cd(folder='x')</tool_call>", "invalid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "name"),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "name"),
    ('<tool_call>{"name": "cd", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "cd", "arguments": "not json"}</tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "cd", "arguments": "[1]"}</tool_call>', "must be a JSON object"),
    ('<tool_call>["cd"]</tool_call>', "JSON object"),
    ('<tool_call>{"name": "cd", "parameters": {"folder": "x"}}</tool_call>', "unexpected keys"),
    ('<tool_call>{"name": "cd", "arguments": {"folder": "x"}}', "without a closing"),
    (
      'ok <tool_call>{"name": "a", "arguments": {}}</tool_call> <tool_call>{"name": "b"',
      "without a closing",
    ),
    ('{"name": "cd"}</tool_call>', "without an opening"),
    ('<tool_call><tool_call>{"name": "a"}</tool_call>', "opened twice"),
    ("<tool_call>" + "[" * 100000 + "</tool_call>", "invalid JSON"),
  ],
)
def test_parse_errors(text, fragment):
  a = chat.parse_tool_calls(text)
  assert a.error is not None and fragment in a.error, a.error
  assert a.tool_calls == []
  assert a.text == text


def test_parse_truncated():
  text = '<tool_call>{"name": "cd", "arguments": {"folder": "x"}}</tool_call>'
  a = chat.parse_tool_calls(text, truncated=True)
  assert a.error is not None and "token limit" in a.error and a.tool_calls == []


def test_parse_strips_think_block():
  text = (
    '<think>\nmaybe <tool_call>{"name": "rm", "arguments": {}}</tool_call>? no.\n</think>\n\n'
    '<tool_call>{"name": "cd", "arguments": {"folder": "x"}}</tool_call>'
  )
  a = chat.parse_tool_calls(text)
  assert a.error is None and a.tool_calls == [ToolCall("cd", {"folder": "x"})]
  # Unclosed think (only reasoning, no end): no call inside it counts.
  a = chat.parse_tool_calls('<think>\n<tool_call>{"name": "rm"}</tool_call>')
  assert a.error is None and a.tool_calls == []
  # Broken JSON inside thinking does not matter.
  a = chat.parse_tool_calls("<think><tool_call>{bad</think>No call needed.")
  assert a.error is None and a.tool_calls == []


def test_parse_roundtrip_of_rendered_call():
  text = chat.assistant_text("Moving.", [CALL_CD, CALL_MV])
  a = chat.parse_tool_calls(text)
  assert a.tool_calls == [
    ToolCall("cd", {"folder": "document"}),
    ToolCall("mv", {"source": "a.txt", "destination": "b/"}),
  ]


# ------------------------------------------------------------------ tags and keys inside call JSON


@pytest.mark.parametrize(
  "tag", ["</tool_call>", "<tool_call>", "</think>", "<think>", "<|im_end|>"]
)
def test_parse_tag_inside_a_string_argument_is_argument_text(tag):
  """The JSON is decoded, not cut at the next tag: the issue's input is one call."""
  text = (
    '<tool_call>{"name": "echo", "arguments": {"content": "x ' + tag + ' y"}}</tool_call>'
    '<tool_call>{"name": "cd", "arguments": {"folder": "' + tag + '"}}</tool_call>'
  )
  a = chat.parse_tool_calls(text)
  assert a.error is None, a.error
  assert a.tool_calls == [
    ToolCall("echo", {"content": f"x {tag} y"}),
    ToolCall("cd", {"folder": tag}),
  ]
  # The same inside "arguments" given as a JSON string, and after a reasoning block.
  inner = json.dumps({"content": f"x {tag} y"})
  text = '<think>\nok\n</think>\n\n<tool_call>{"name": "echo", "arguments": ' + json.dumps(inner)
  a = chat.parse_tool_calls(text + "}</tool_call><|im_end|>")
  assert a.error is None and a.tool_calls == [ToolCall("echo", {"content": f"x {tag} y"})]


def test_parse_close_tag_inside_an_argument_of_a_broken_call_is_an_error():
  text = '<tool_call>{"name": "echo", "arguments": {"content": "x </tool_call> y"}</tool_call>'
  a = chat.parse_tool_calls(text)
  assert a.error is not None and a.tool_calls == []


@pytest.mark.parametrize(
  "text",
  [
    '<tool_call>{"name": "cd", "arguments": {"folder": "a", "folder": "b"}}</tool_call>',
    '<tool_call>{"name": "cd", "name": "rm", "arguments": {"folder": "a"}}</tool_call>',
    '<tool_call>{"name": "post", "arguments": {"meta": {"k": 1, "k": 2}}}</tool_call>',
    '<tool_call>{"name": "post", "arguments": {"tags": [{"k": 1, "k": 1}]}}</tool_call>',
    '<tool_call>{"name": "cd", "arguments": "{\\"folder\\": \\"a\\", \\"folder\\": \\"b\\"}"}'
    "</tool_call>",
    # a tag inside a string does not hide the duplicate (the block is delimited by the JSON)
    '<tool_call>{"name": "echo", "arguments": {"s": "</tool_call>", "s": "x"}}</tool_call>',
  ],
)
def test_parse_duplicate_keys_are_refused(text):
  """Python's json keeps the last value of a repeated key; a call must not run on a guess."""
  ok = '<tool_call>{"name": "pwd", "arguments": {}}</tool_call>'
  a = chat.parse_tool_calls(ok + text)
  assert a.error is not None and "duplicate key" in a.error, a.error
  assert a.tool_calls == []  # nothing of the reply runs, as for any other parse error


def test_parse_call_size_cap():
  def call(n):
    return '<tool_call>{"name": "echo", "arguments": {"content": "' + "x" * n + '"}}</tool_call>'

  overhead = len(call(0)) - len("<tool_call></tool_call>")
  at_cap = chat.parse_tool_calls(call(100 - overhead), max_call_chars=100)
  assert at_cap.error is None and len(at_cap.tool_calls[0].arguments["content"]) == 100 - overhead
  over = chat.parse_tool_calls(call(101 - overhead), max_call_chars=100)
  assert over.error is not None and "101 characters" in over.error and over.tool_calls == []
  # The default cap refuses a 10 MB argument, and the error quotes none of it.
  huge = call(10 * 1024 * 1024)
  a = chat.parse_tool_calls(huge)
  assert a.tool_calls == [] and "over the limit of" in a.error
  assert str(chat.DEFAULT_MAX_CALL_CHARS) in a.error and len(a.error) < 500
  assert a.text == huge  # the reply itself is kept (its tokens were sampled)


def test_qwen_chat_applies_its_call_size_cap():
  from coevolve_jax.agent import QwenChat  # noqa: PLC0415

  text = '<tool_call>{"name": "echo", "arguments": {"content": "' + "x" * 200 + '"}}</tool_call>'
  assert QwenChat(max_call_chars=100).parse_tool_calls(text).error is not None
  assert QwenChat().parse_tool_calls(text).error is None
  with pytest.raises(ValueError, match="max_call_chars"):
    QwenChat(max_call_chars=0)


# ------------------------------------------------------------------ render -> parse round trip

_TRICKY = [
  "</tool_call>",
  "<tool_call>",
  "<think>",
  "</think>",
  "<|im_end|>",
  "<|im_start|>",
  "<tool_response>",
  '"',
  "\\",
  "\n",
  "\t",
  "{",
  "}",
  "[",
  "]",
  ":",
  ",",
  "'",
  "é",
  "中文",
  "\U0001f600",
  "\x00",
  "\u2028",
  " ",
  "null",
  "true",
  "{{ x }}",
  "{% if %}",
]


def _random_string(rng):
  parts = []
  for _ in range(rng.integers(0, 6)):
    if rng.random() < 0.5:
      parts.append(_TRICKY[rng.integers(len(_TRICKY))])
    else:
      alphabet = "abcXYZ019 _-./"
      parts.append("".join(alphabet[i] for i in rng.integers(0, len(alphabet), rng.integers(1, 6))))
  return "".join(parts)


def _random_json(rng, depth=0):
  kind = rng.integers(0, 9 if depth < 4 else 6)
  if kind == 0:
    return None
  if kind == 1:
    return bool(rng.integers(0, 2))
  if kind == 2:
    return int(rng.integers(-(2**62), 2**62)) * int(rng.choice([1, 1, 10**30]))
  if kind == 3:
    return float(rng.normal() * 10.0 ** rng.integers(-300, 300))
  if kind in (4, 5):
    return _random_string(rng)
  if kind == 6 or kind == 7:
    return {_random_string(rng): _random_json(rng, depth + 1) for _ in range(rng.integers(0, 4))}
  return [_random_json(rng, depth + 1) for _ in range(rng.integers(0, 4))]


def _random_arguments(rng):
  return {_random_string(rng): _random_json(rng, 1) for _ in range(rng.integers(0, 5))}


def test_render_then_parse_gives_back_the_call_for_random_json_arguments():
  """A property over 600 seeded cases: any JSON-serialisable arguments, in every call shape the
  template takes (dict or JSON-string arguments, flat or under "function"), several calls per
  reply, with or without leading text, parse back to exactly the calls rendered."""
  import numpy as np  # noqa: PLC0415

  rng = np.random.default_rng(20260415)
  for case in range(600):
    calls = [(f"tool_{i}", _random_arguments(rng)) for i in range(rng.integers(1, 4))]
    shapes = []
    for name, args in calls:
      shape = rng.integers(0, 4)
      if shape == 0:
        shapes.append({"name": name, "arguments": args})
      elif shape == 1:
        shapes.append({"type": "function", "function": {"name": name, "arguments": args}})
      elif shape == 2:
        shapes.append({"function": {"name": name, "arguments": json.dumps(args)}})
      else:
        dumped = json.dumps(args, ensure_ascii=bool(rng.integers(0, 2)), indent=None)
        shapes.append({"type": "function", "function": {"name": name, "arguments": dumped}})
    content = ["", "Let me do that.", None][rng.integers(0, 3)]
    text = chat.assistant_text(content, shapes)
    a = chat.parse_tool_calls(text + "<|im_end|>", max_call_chars=10**9)
    assert a.error is None, (case, a.error, text)
    assert [(c.name, c.arguments) for c in a.tool_calls] == calls, (case, text)


# ------------------------------------------------------------------ every OpenAI message shape

_CALL_STR = {
  "id": "call_1",
  "type": "function",
  "function": {"name": "cd", "arguments": '{"folder": "document"}'},
}
_CALL_WRAPPED = {"function": {"name": "mv", "arguments": {"source": "a", "destination": "b"}}}
_CALL_FLAT_NO_ARGS = {"name": "pwd"}
_CALL_FLAT_NO_ARGS_CANON = {"name": "pwd", "arguments": {}}
TOOL_OK = {"role": "tool", "tool_call_id": "call_1", "content": "ok"}


def _conv(*middle, last=None):
  """system, user, *middle, [last]: the shapes under test sit in the middle of a conversation."""
  out = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}, *middle]
  return out + ([last] if last else [])


# name -> (messages as a caller may pass them, the same conversation in the shape the Qwen3
# template reads). Where transformers renders the first, ours must equal that; where it fails
# (the fault this covers), ours must equal transformers' rendering of the second.
SHAPES = {
  "assistant_content_null_with_tool_calls": (
    _conv(
      {"role": "assistant", "content": None, "tool_calls": [_CALL_STR]},
      TOOL_OK,
    ),
    _conv({"role": "assistant", "content": "", "tool_calls": [_CALL_STR]}, TOOL_OK),
  ),
  "assistant_content_missing_function_wrapper": (
    _conv({"role": "assistant", "tool_calls": [_CALL_WRAPPED]}, TOOL_OK),
    _conv({"role": "assistant", "content": "", "tool_calls": [_CALL_WRAPPED]}, TOOL_OK),
  ),
  "last_assistant_content_null": (
    _conv({"role": "assistant", "content": None, "tool_calls": [_CALL_STR]}),
    _conv({"role": "assistant", "content": "", "tool_calls": [_CALL_STR]}),
  ),
  "assistant_null_content_with_reasoning": (
    _conv(
      {"role": "assistant", "content": None, "reasoning_content": "hm", "tool_calls": [_CALL_STR]}
    ),
    _conv(
      {"role": "assistant", "content": "", "reasoning_content": "hm", "tool_calls": [_CALL_STR]}
    ),
  ),
  "assistant_refusal": (
    _conv({"role": "assistant", "content": None, "refusal": "I cannot do that."}),
    _conv({"role": "assistant", "content": "I cannot do that."}),
  ),
  "tool_call_without_arguments": (
    _conv({"role": "assistant", "content": "", "tool_calls": [_CALL_FLAT_NO_ARGS]}, TOOL_OK),
    _conv({"role": "assistant", "content": "", "tool_calls": [_CALL_FLAT_NO_ARGS_CANON]}, TOOL_OK),
  ),
  "tool_call_wrapped_without_arguments": (
    _conv({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "pwd"}}]}),
    _conv(
      {"role": "assistant", "content": "", "tool_calls": [{"function": _CALL_FLAT_NO_ARGS_CANON}]}
    ),
  ),
  "tool_content_null_and_missing": (
    _conv(
      {"role": "assistant", "content": "", "tool_calls": [_CALL_STR, _CALL_WRAPPED]},
      {"role": "tool", "content": None},
      {"role": "tool"},
    ),
    _conv(
      {"role": "assistant", "content": "", "tool_calls": [_CALL_STR, _CALL_WRAPPED]},
      {"role": "tool", "content": ""},
      {"role": "tool", "content": ""},
    ),
  ),
  "tool_content_parts_as_transformers_renders_them": (
    _conv(
      {"role": "assistant", "content": "", "tool_calls": [_CALL_STR]},
      {"role": "tool", "content": [{"type": "text", "text": "ok"}]},
    ),
    None,  # transformers renders it (the list's Python repr): ours must be the same
  ),
  "user_content_null": (
    [{"role": "user", "content": None}],
    [{"role": "user", "content": ""}],
  ),
  "user_content_missing_later_turn": (
    _conv({"role": "assistant", "content": "Done."}, last={"role": "user"}),
    _conv({"role": "assistant", "content": "Done."}, last={"role": "user", "content": ""}),
  ),
  "system_content_null": (
    [{"role": "system", "content": None}, {"role": "user", "content": "hi"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}],
  ),
  "content_parts_everywhere": (
    [
      {
        "role": "system",
        "content": [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}],
      },
      {"role": "user", "content": [{"type": "text", "text": "Go to "}, {"text": "document."}]},
      {
        "role": "assistant",
        "content": [{"type": "text", "text": "Sure."}],
        "tool_calls": [_CALL_STR],
      },
      TOOL_OK,
      {"role": "assistant", "content": [{"type": "refusal", "refusal": "No more."}]},
      {"role": "user", "content": [{"type": "text", "text": "<tool_response>x</tool_response>"}]},
    ],
    [
      {"role": "system", "content": "You are terse."},
      {"role": "user", "content": "Go to document."},
      {"role": "assistant", "content": "Sure.", "tool_calls": [_CALL_STR]},
      TOOL_OK,
      {"role": "assistant", "content": "No more."},
      {"role": "user", "content": "<tool_response>x</tool_response>"},
    ],
  ),
  "empty_parts_list": (
    [{"role": "user", "content": []}],
    [{"role": "user", "content": ""}],
  ),
  "tool_calls_empty_and_null": (
    _conv(
      {"role": "assistant", "content": "a", "tool_calls": []},
      {"role": "user", "content": "b"},
      {"role": "assistant", "content": "c", "tool_calls": None},
    ),
    None,
  ),
}


def _pydantic_conversation(messages):
  """The same messages as pydantic models, as the OpenAI client returns them."""
  import pydantic  # noqa: PLC0415  (installed with google-genai)

  class Function(pydantic.BaseModel):
    name: str
    arguments: str | dict | None = None

  class Call(pydantic.BaseModel):
    id: str | None = None
    type: str | None = None
    function: Function

  class Msg(pydantic.BaseModel):
    role: str
    content: str | list | None = None
    tool_calls: list[Call] | None = None
    tool_call_id: str | None = None

  return [Msg(**m) for m in messages]


def _hf_render(hf_tok, messages, tools, gen, thinking):
  kwargs = {} if thinking is None else {"enable_thinking": thinking}
  return hf_tok.apply_chat_template(
    messages, tools=tools, add_generation_prompt=gen, tokenize=False, **kwargs
  )


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("gen,thinking", [(False, None), (True, False)])
def test_every_message_shape_renders_as_transformers_does(hf_tok, name, tools, gen, thinking):
  messages, canonical = SHAPES[name]
  got = chat.render(messages, tools, add_generation_prompt=gen, enable_thinking=thinking)
  try:
    want = _hf_render(hf_tok, messages, tools, gen, thinking)
  except Exception:  # noqa: BLE001  # a shape the Qwen3 template fails on in transformers
    assert canonical is not None, f"transformers fails on {name}"
    want = _hf_render(hf_tok, canonical, tools, gen, thinking)
  assert got == want
  if canonical is not None:  # and the normalised form renders the same in both
    assert (
      chat.render(canonical, tools, add_generation_prompt=gen, enable_thinking=thinking) == want
    )


@pytest.mark.parametrize(
  "name",
  [
    "assistant_content_null_with_tool_calls",
    "last_assistant_content_null",
    "user_content_null",
    "tool_content_null_and_missing",
  ],
)
def test_message_objects_render_like_dicts(hf_tok, name):
  """pydantic models (the OpenAI client's message types) render as their dicts do."""
  messages, canonical = SHAPES[name]
  objects = _pydantic_conversation(messages)
  assert chat.render(objects, TOOLS) == chat.render(messages, TOOLS)
  assert chat.render(objects, TOOLS) == _hf_render(hf_tok, canonical, TOOLS, False, None)


def test_assistant_text_and_continuations_take_every_shape(tok):
  call = {"type": "function", "function": {"name": "cd", "arguments": '{"folder": "d"}'}}
  want = '<tool_call>\n{"name": "cd", "arguments": {"folder": "d"}}\n</tool_call>'
  assert chat.assistant_text(None, [call]) == chat.assistant_text("", [call]) == want
  assert chat.assistant_text(None, [{"function": {"name": "pwd"}}]) == (
    '<tool_call>\n{"name": "pwd", "arguments": {}}\n</tool_call>'
  )
  assert chat.parse_tool_calls(chat.assistant_text(None, [call])).tool_calls == [
    ToolCall("cd", {"folder": "d"})
  ]
  assert chat.continuation_text([{"role": "tool", "content": None}]) == chat.continuation_text(
    [{"role": "tool", "content": ""}]
  )
  assert chat.continuation_text(
    [{"role": "user", "content": [{"type": "text", "text": "next"}]}]
  ) == chat.continuation_text([{"role": "user", "content": "next"}])
  with pytest.raises(ValueError, match="assistant"):
    chat.continuation_text(_pydantic_conversation([{"role": "assistant", "content": "x"}]))


@pytest.mark.parametrize(
  "message,error,fragment",
  [
    (
      {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
      ValueError,
      "type 'image_url'",
    ),
    ({"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}, ValueError, "refusal"),
    ({"role": "user", "content": ["plain string part"]}, TypeError, "not an object"),
    ({"role": "user", "content": [{"type": "text", "text": 3}]}, TypeError, "string 'text'"),
    ({"role": "user", "content": 3}, TypeError, "content must be a string"),
    ({"role": "system", "content": {"text": "x"}}, TypeError, "content must be a string"),
    ("user: hi", TypeError, "must be mappings"),
  ],
)
def test_messages_the_template_cannot_show_are_clear_errors(message, error, fragment):
  with pytest.raises(error, match=fragment):
    chat.render([message, {"role": "user", "content": "ok"}])
