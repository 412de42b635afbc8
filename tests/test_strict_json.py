"""Model-written JSON is read under one set of rules (`chat.STRICT_DECODER`): the policy's tool
calls and every JSON reply of the explorer LLM (summaries, abstractions, verdicts, explorer
calls). No key repeats, no number is NaN / Infinity / -Infinity or overflows a float, no number
has more than `chat.MAX_NUMBER_DIGITS` digits; one reply makes at most `max_calls_per_reply`
calls. A tool call that breaks a rule is an error observation, never an exception; an LLM reply
that does is an `LLMError` the stages fall back from."""

import json
import time

import pytest

from coevolve_jax import chat
from coevolve_jax.feedback import llm as llm_lib
from coevolve_jax.feedback import llm_jobs
from coevolve_jax.feedback.exploration import ExplorationContext, Triplet
from coevolve_jax.feedback.llm import LLMError, TokenBudget, parse_json_reply
from coevolve_jax.types import Task


def _call(arguments_json: str, name: str = "echo") -> str:
  return f'<tool_call>{{"name": "{name}", "arguments": {arguments_json}}}</tool_call>'


# ------------------------------------------------------------------ non-finite numbers


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "-1E400"])
@pytest.mark.parametrize("as_string", [False, True])
def test_a_non_finite_number_in_a_tool_call_is_an_error_observation(literal, as_string):
  """Python's json reads NaN and +-Infinity (not JSON) and 1e999 as inf; a call must not run on
  them. Arguments given as a JSON string are read under the same rules."""
  args = f'{{"x": {literal}}}'
  text = _call(json.dumps(args) if as_string else args)
  a = chat.parse_tool_calls(text)
  assert a.tool_calls == [] and a.error is not None, a
  assert "non-finite number" in a.error and "must be finite" in a.error, a.error
  assert a.text == text


def test_a_non_finite_number_refuses_the_whole_reply_and_also_under_thinking():
  ok = '<tool_call>{"name": "pwd", "arguments": {}}</tool_call>'
  a = chat.parse_tool_calls("<think>plan</think>" + ok + _call('{"v": [1, {"w": NaN}]}'))
  assert a.tool_calls == [] and "tool call #2: non-finite number NaN" in a.error, a.error


def test_constant_names_inside_strings_are_text():
  """Only bare NaN / Infinity are refused: the same words as strings are ordinary arguments."""
  a = chat.parse_tool_calls(_call('{"s": "NaN", "t": "Infinity", "u": "-Infinity", "n": 1e308}'))
  assert a.error is None, a.error
  assert a.tool_calls[0].arguments == {"s": "NaN", "t": "Infinity", "u": "-Infinity", "n": 1e308}


# ------------------------------------------------------------------ digits per number


def test_a_100000_digit_number_gets_our_message_fast():
  """Python's own int() limit used to speak to the model ("sys.set_int_max_str_digits"); the
  number is refused on its text before any conversion."""
  text = _call('{"n": ' + "9" * 100_000 + "}")
  start = time.perf_counter()
  a = chat.parse_tool_calls(text, max_call_chars=10**9)
  elapsed = time.perf_counter() - start
  assert a.tool_calls == [] and a.error is not None
  assert "set_int_max_str_digits" not in a.error
  assert "a number of 100000 digits" in a.error, a.error
  assert f"at most {chat.MAX_NUMBER_DIGITS} digits" in a.error, a.error
  assert len(a.error) < 500 and elapsed < 1.0, (len(a.error), elapsed)


@pytest.mark.parametrize(
  "make",
  [
    lambda n: "9" * n,
    lambda n: "-" + "9" * n,
    lambda n: "0." + "1" * (n - 1),
    lambda n: "1." + "0" * (n - 2) + "e5",
  ],
)
def test_the_digit_cap_is_exact(make):
  cap = chat.MAX_NUMBER_DIGITS
  at_cap = chat.parse_tool_calls(_call('{"n": ' + make(cap) + "}"))
  assert at_cap.error is None, at_cap.error
  assert at_cap.tool_calls[0].arguments["n"] == json.loads(make(cap))
  over = chat.parse_tool_calls(_call('{"n": ' + make(cap + 1) + "}"))
  assert over.tool_calls == [] and f"a number of {cap + 1} digits" in over.error, over.error


def test_a_long_number_in_string_arguments_and_in_a_malformed_block():
  """The JSON-string form of "arguments", and a block whose JSON is followed by junk, give the
  same message, never Python's."""
  digits = "7" * 5000
  a = chat.parse_tool_calls(_call(json.dumps(f'{{"n": {digits}}}')))
  assert '"arguments" holds a number with too many digits' in a.error, a.error
  b = chat.parse_tool_calls('<tool_call>{"n": ' + digits + "} junk</tool_call>")
  assert "a number of 5000 digits" in b.error and "set_int_max_str_digits" not in b.error


# ------------------------------------------------------------------ calls per reply


def _reply_with(n: int) -> str:
  return "".join(
    f'<tool_call>{{"name": "rm", "arguments": {{"i": {i}}}}}</tool_call>' for i in range(n)
  )


def test_too_many_calls_in_one_reply_run_none():
  a = chat.parse_tool_calls(_reply_with(5), max_calls_per_reply=4)
  assert a.tool_calls == [] and a.error is not None
  assert a.error == (
    "the reply has 5 tool calls; at most 4 per reply are allowed, so none was run. Make fewer "
    "calls per reply."
  )
  ok = chat.parse_tool_calls(_reply_with(4), max_calls_per_reply=4)
  assert ok.error is None and [c.arguments["i"] for c in ok.tool_calls] == [0, 1, 2, 3]


def test_the_default_cap_admits_bfcls_longest_turn():
  """BFCL's longest ground-truth turn (multi_turn_long_context_38) makes 34 calls; one reply may
  make them all. One call past the default cap is refused."""
  cap = chat.DEFAULT_MAX_CALLS_PER_REPLY
  assert cap >= 34
  assert len(chat.parse_tool_calls(_reply_with(34)).tool_calls) == 34
  over = chat.parse_tool_calls(_reply_with(cap + 1))
  assert over.tool_calls == [] and f"has {cap + 1} tool calls; at most {cap}" in over.error


def test_qwen_chat_applies_its_calls_per_reply_cap():
  from coevolve_jax.agent import QwenChat  # noqa: PLC0415

  assert QwenChat(max_calls_per_reply=2).parse_tool_calls(_reply_with(3)).error is not None
  assert len(QwenChat(max_calls_per_reply=3).parse_tool_calls(_reply_with(3)).tool_calls) == 3
  assert QwenChat().max_calls_per_reply == chat.DEFAULT_MAX_CALLS_PER_REPLY
  for bad in (0, -1, True, 2.0):
    with pytest.raises(ValueError, match="max_calls_per_reply"):
      QwenChat(max_calls_per_reply=bad)


# ------------------------------------------------------------------ the explorer LLM's replies


BROKEN_REPLIES = [
  ('{"success": false, "success": true, "reason": "r"}', "repeats a key"),
  ('```json\n{"tasks": [{"run_id": 0, "run_id": 1}]}\n```', "repeats a key"),
  ('Sure: {"summary": NaN} done', "not finite"),
  ('{"score": Infinity}', "not finite"),
  ('{"score": -Infinity}', "not finite"),
  ('{"score": 1e999}', "not finite"),
  ('{"n": ' + "1" * 100_000 + "}", "too many digits"),
]


@pytest.mark.parametrize("text,why", BROKEN_REPLIES)
def test_parse_json_reply_refuses_what_a_tool_call_would(text, why):
  with pytest.raises(LLMError, match=why) as e:
    parse_json_reply(text)
  assert "set_int_max_str_digits" not in str(e.value)


def test_each_refused_reply_is_counted():
  before = llm_lib.refused_count()
  for text, _ in BROKEN_REPLIES:
    with pytest.raises(LLMError):
      parse_json_reply(text)
  with pytest.raises(LLMError):
    parse_json_reply("no json here")  # not JSON at all: an LLM failure, not a refusal
  assert llm_lib.refused_count() == before + len(BROKEN_REPLIES)


def test_parse_json_reply_reads_valid_replies_as_before():
  assert parse_json_reply('```json\n{"a": 1}\n```') == {"a": 1}
  assert parse_json_reply('Sure: {"a": [1, 2.5, "NaN"]} done') == {"a": [1, 2.5, "NaN"]}
  assert parse_json_reply("[1, -2e3]") == [1, -2000.0]
  with pytest.raises(LLMError, match="not JSON"):
    parse_json_reply("no json here")


class _Scripted:
  """A `TextLLM` that answers every request with `reply`."""

  name = "scripted"

  def __init__(self, reply: str):
    self.reply = reply
    self.budget = TokenBudget()
    self.prompts: list[str] = []

  def complete(self, system: str, prompt: str, *, json_output: bool = False) -> str:
    del system, json_output
    self.prompts.append(prompt)
    return self.reply

  def refresh(self) -> None:
    pass


_TASK = Task("t0", "bfcl", ["list the files"], [["ls()"]])
_SUMMARY = {
  "summary": "s",
  "failure_cause": "",
  "instability_pattern": "",
  "focus_pattern": [],
  "exploration_objectives": [],
  "do_not_repeat": [],
}


@pytest.mark.parametrize(
  "reply",
  [
    json.dumps(_SUMMARY)[:-1] + ', "summary": "the other one"}',
    json.dumps(_SUMMARY)[:-1] + ', "score": NaN}',
  ],
)
def test_a_broken_summary_falls_back_to_the_template(reply):
  fallback = {**_SUMMARY, "summary": "template"}
  out = llm_jobs.summarize_with_llm(_Scripted(reply), _TASK, "boundary", [["ls()"]], 0.0, fallback)
  assert out["by"] == "template" and out["summary"] == "template"
  good = llm_jobs.summarize_with_llm(
    _Scripted(json.dumps(_SUMMARY)), _TASK, "boundary", [["ls()"]], 0.0, fallback
  )
  assert good["by"] == "llm" and good["summary"] == "s"


_TRIPLETS = [Triplet("ls()", "a b", 0), Triplet("cd(folder='a')", "ok", 0)]
_ONE_TASK = {"run_id": 0, "turns": [{"query": "Go to a.", "steps": [0, 1]}], "description": "d"}


@pytest.mark.parametrize(
  "reply",
  [
    json.dumps({"tasks": [{**_ONE_TASK, "copy": 0}]}).replace('"copy"', '"run_id"'),
    json.dumps({"tasks": [{**_ONE_TASK, "weight": 0.5}]}).replace("0.5", "Infinity"),
  ],
)
def test_a_broken_abstraction_gives_no_task(reply):
  context = ExplorationContext("t0", {}, [])
  kwargs = {"min_calls": 1, "max_calls": 4, "max_turns": 1}
  assert llm_jobs.abstract_with_llm(_Scripted(reply), _TRIPLETS, context, **kwargs) == []
  good = llm_jobs.abstract_with_llm(
    _Scripted(json.dumps({"tasks": [_ONE_TASK]})), _TRIPLETS, context, **kwargs
  )
  assert [c.calls for c in good] == [[["ls()", "cd(folder='a')"]]]


@pytest.mark.parametrize(
  "reply",
  [
    '{"success": false, "reason": "wrong order", "success": true}',
    '{"success": true, "reason": "ok", "confidence": NaN}',
  ],
)
def test_a_broken_verdict_is_a_rejection(reply):
  success, verdict = llm_jobs.judge(_Scripted(reply), {"query": "q"})
  assert success is False and verdict["success"] is False
  assert verdict["reason"].startswith("judge failed: reply "), verdict
  assert llm_jobs.judge(_Scripted('{"success": true, "reason": "ok"}'), {"query": "q"})[0]
