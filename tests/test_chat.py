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
