"""The Gemini backend through the real google-genai client against a loopback Gemini REST server,
and the LLM explorer / abstraction / judge on real BFCL backends."""

import json
import time

import numpy as np
import pytest

from coevolve_jax.testing import gemini_stub
from coevolve_jax.testing.gemini_stub import Reply, error_body, ok_body
from coevolve_jax.feedback.exploration import ExplorationContext
from coevolve_jax.feedback.llm_jobs import abstract_with_llm
from coevolve_jax.feedback.llm import (
  BudgetExhausted,
  GeminiLLM,
  GeminiSettings,
  LLMError,
  parse_json_reply,
)
from envs.bfcl.llm_explorer import LLMExplorer, attempt_and_judge, parse_call_reply
from envs.bfcl.sandbox import Sandbox
from coevolve_jax.types import Task
from envs.bfcl.data import load_bfcl_tasks

FAKE_KEY = "AIzaFAKE-test-key-0123456789"


@pytest.fixture
def stub(gemini_stub):
  return gemini_stub  # conftest.py: a running GeminiStub()


@pytest.fixture(autouse=True)
def fake_key(monkeypatch):
  monkeypatch.delenv("GOOGLE_API_KEY", raising=False)
  monkeypatch.setenv("GEMINI_API_KEY", FAKE_KEY)


def make_llm(stub, **kw):
  kw.setdefault("attempts", 3)
  kw.setdefault("initial_delay_s", 0.01)
  kw.setdefault("max_delay_s", 0.02)
  kw.setdefault("timeout_s", 5.0)
  return GeminiLLM(GeminiSettings(model="gemini-test", base_url=stub.url, **kw))


def test_success_uses_env_key_and_charges_reported_tokens(stub):
  stub.script.append(Reply(200, ok_body("hello", prompt_tokens=7, output_tokens=4)))
  llm = make_llm(stub)
  assert llm.complete("sys", "hi", json_output=True) == "hello"
  (req,) = stub.requests
  assert req["path"].endswith("/models/gemini-test:generateContent")
  assert req["headers"]["x-goog-api-key"] == FAKE_KEY
  assert req["body"]["systemInstruction"]["parts"][0]["text"] == "sys"
  assert req["body"]["generationConfig"]["responseMimeType"] == "application/json"
  assert llm.budget.used == 11 and llm.budget.requests == 1
  assert FAKE_KEY not in repr(llm)


def test_429_then_success_is_retried(stub):
  stub.script.extend(
    [
      Reply(429, error_body(429, "RESOURCE_EXHAUSTED")),
      Reply(503, error_body(503, "UNAVAILABLE")),
      Reply(200, ok_body("ok")),
    ]
  )
  assert make_llm(stub).complete("s", "p") == "ok"
  assert len(stub.requests) == 3


def test_persistent_500_fails_after_all_attempts(stub):
  stub.script.extend(Reply(500, error_body(500, "INTERNAL")) for _ in range(5))
  with pytest.raises(LLMError, match="HTTP 500"):
    make_llm(stub, attempts=3).complete("s", "p")
  assert len(stub.requests) == 3


def test_400_is_not_retried(stub):
  stub.script.append(Reply(400, error_body(400, "INVALID_ARGUMENT")))
  with pytest.raises(LLMError, match="HTTP 400"):
    make_llm(stub).complete("s", "p")
  assert len(stub.requests) == 1


def test_malformed_json_body(stub):
  stub.script.append(Reply(200, '{"candidates": [ {"content": '))
  with pytest.raises(LLMError, match="malformed"):
    make_llm(stub).complete("s", "p")


def test_empty_candidates(stub):
  stub.script.append(Reply(200, '{"candidates": []}'))
  with pytest.raises(LLMError, match="empty"):
    make_llm(stub).complete("s", "p")


def test_timeout(stub):
  stub.script.extend(
    [Reply(200, ok_body("late"), delay_s=1.5), Reply(200, ok_body("late"), delay_s=1.5)]
  )
  start = time.perf_counter()
  with pytest.raises(LLMError, match="timeout"):
    make_llm(stub, timeout_s=0.3, attempts=2).complete("s", "p")
  assert time.perf_counter() - start < 1.4  # two 0.3 s attempts, not the server's 1.5 s
  assert len(stub.requests) == 2


def test_token_budget_stops_before_sending(stub):
  llm = make_llm(stub, tokens_per_round=20)
  llm.complete("s", "p")  # 15 tokens (stub default usage)
  llm.complete("s", "p")  # 30 >= 20 after this one
  with pytest.raises(BudgetExhausted):
    llm.complete("s", "p")
  assert len(stub.requests) == 2
  assert llm.budget.reset() == {"tokens": 30, "requests": 2}
  llm.complete("s", "p")  # a new round
  assert len(stub.requests) == 3


def test_missing_key_is_a_clear_error(monkeypatch, stub):
  monkeypatch.delenv("GEMINI_API_KEY")
  with pytest.raises(LLMError, match="GEMINI_API_KEY"):
    make_llm(stub)


def test_vertex_needs_a_project(monkeypatch, stub):
  monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
  with pytest.raises(LLMError, match="GOOGLE_CLOUD_PROJECT"):
    make_llm(stub, vertex=True)


def test_parse_json_reply_and_call_reply():
  assert parse_json_reply('```json\n{"a": 1}\n```') == {"a": 1}
  assert parse_json_reply('Sure: {"a": [1]} done') == {"a": [1]}
  assert parse_call_reply('{"stop": true}') is None
  call = parse_call_reply('{"name": "ls", "arguments": {"a": true}}')
  assert call.name == "ls" and call.arguments == {"a": True}
  for bad in ("no json here", '{"name": 3}', '{"name": "ls", "arguments": [1]}'):
    with pytest.raises(LLMError):
      parse_call_reply(bad)
  # A repeated key is refused (json would keep the last value and the call would run on a guess),
  # in a call as in every other reply.
  for dup in (
    '{"name": "cd", "arguments": {"folder": "a", "folder": "b"}}',
    'Sure: {"name": "cd", "name": "rm", "arguments": {}} done',
    '```json\n{"name": "post", "arguments": {"meta": {"k": 1, "k": 2}}}\n```',
  ):
    with pytest.raises(LLMError, match="repeats a key"):
      parse_call_reply(dup)
  with pytest.raises(LLMError, match="repeats a key"):
    parse_json_reply('{"a": 1, "a": 2}')


def test_an_explorer_reply_may_reason_before_its_one_action():
  """Paper Fig. 9: reasoning, then one action. The call is the reply's last JSON object (of its
  last fence when it has fences); braces and objects in the reasoning are not taken for it."""
  reasoned = (
    'The files {"a", "b"} are listed; {"name": "rm", "arguments": {}} would lose them. '
    'So: {"name": "ls", "arguments": {"a": true}}'
  )
  call = parse_call_reply(reasoned)
  assert call.name == "ls" and call.arguments == {"a": True}
  fenced = 'Earlier ```json\n{"stop": true}\n``` then ```json\n{"name": "pwd"}\n```'
  assert parse_call_reply(fenced).name == "pwd"
  assert parse_call_reply('Nothing left to try. {"stop": true}') is None
  # A rule-breaking value anywhere in the reply refuses it, even before a clean action.
  with pytest.raises(LLMError, match="repeats a key"):
    parse_call_reply('Not {"k": 1, "k": 2} but {"name": "ls", "arguments": {}}')
  with pytest.raises(LLMError, match="not JSON"):
    parse_call_reply("I would call ls {now")
  deep = "[" * 100_000 + '{"name": "ls"}'  # nesting past the recursion limit: no value found
  with pytest.raises(LLMError):
    parse_call_reply(deep)


# ------------------------------------------------------------------ LLM stages on real backends


@pytest.fixture(scope="module")
def message_task():
  task = next(t for t in load_bfcl_tasks("multi_turn_base") if "MessageAPI" in t.involved_classes)
  config = {"MessageAPI": task.initial_config.get("MessageAPI", {})}  # default state when absent
  return Task(task.task_id, "bfcl", [], [], config, ["MessageAPI"])


def _context(task, **kw):
  return ExplorationContext(
    task.task_id,
    task.initial_config,
    task.involved_classes,
    signal="boundary",
    summary={"summary": "s"},
    **kw,
  )


def test_explorer_executes_valid_calls_and_rejects_bad_ones(stub, message_task):
  evil = json.dumps({"name": "__import__('os').system('touch /tmp/pwned')", "arguments": {}})
  stub.script.extend(
    [
      Reply(200, ok_body(evil)),
      Reply(200, ok_body("not json at all")),
      Reply(200, ok_body(json.dumps({"name": "list_users", "arguments": {}}))),
    ]
  )
  explorer = LLMExplorer(make_llm(stub))
  triplets = explorer.explore(
    _context(message_task, rounds=2, steps_per_round=3), np.random.default_rng(0)
  )
  assert [t["ok"] for t in explorer.trace[:3]] == [False, False, True]
  assert len(explorer.trace) == 6 and {t["run"] for t in explorer.trace} == {0, 1}
  assert triplets and all(t.action.endswith(")") for t in triplets)
  with Sandbox(message_task.initial_config, message_task.involved_classes) as box:
    for t in triplets:  # real, reproducible results
      assert box.run_ok(t.action)[1] == t.observation
  assert "list_users" in triplets[0].action


def test_explorer_keeps_results_when_the_budget_runs_out(stub, message_task):
  explorer = LLMExplorer(make_llm(stub, tokens_per_round=45))  # three 15-token requests
  triplets = explorer.explore(
    _context(message_task, rounds=3, steps_per_round=2), np.random.default_rng(0)
  )
  assert len(stub.requests) == 3 and len(explorer.trace) == 3  # then no request is sent
  assert triplets and [t.action for t in triplets] == [
    r["action"] for r in explorer.trace if r["ok"]
  ]


def test_explorer_run_survives_a_failed_request(stub, message_task):
  stub.script.extend(Reply(500, error_body(500, "INTERNAL")) for _ in range(3))
  explorer = LLMExplorer(make_llm(stub))
  triplets = explorer.explore(
    _context(message_task, rounds=2, steps_per_round=2), np.random.default_rng(0)
  )
  assert explorer.trace[0]["run"] == 0 and not explorer.trace[0]["ok"]
  assert {t.run_id for t in triplets} == {1}  # run 0 ended, run 1 went on


def test_abstraction_and_attempt_and_judge(stub, message_task):
  llm = make_llm(stub)
  ctx = _context(message_task, rounds=1, steps_per_round=4)
  for name, args in [
    ("list_users", {}),
    ("get_user_id", {"user": "Alice"}),
    ("add_contact", {"user_name": "Zed"}),
    ("message_get_login_status", {}),
  ]:
    stub.script.append(Reply(200, ok_body(json.dumps({"name": name, "arguments": args}))))
  triplets = LLMExplorer(llm).explore(ctx, np.random.default_rng(0))
  assert len(triplets) == 4
  (choice,) = abstract_with_llm(llm, triplets, ctx, min_calls=3, max_calls=3)
  assert choice.calls == [[t.action for t in triplets[:3]]]
  assert choice.turns == ["Please do the stub task."]
  task = Task(
    "syn-x",
    "bfcl",
    choice.turns,
    choice.calls,
    ctx.initial_config,
    ctx.involved_classes,
    "synth",
  )
  accepted, info = attempt_and_judge(llm, task)
  assert accepted and info["checker_reward"] == 1.0 and info["judge"] is None

  # An out-of-range step choice is rejected rather than trusted.
  stub.script.append(
    Reply(200, ok_body(json.dumps({"run_id": 0, "steps": [0, 1, 99], "query": "q"})))
  )
  assert abstract_with_llm(llm, triplets, ctx, min_calls=3, max_calls=3) == []

  # Every task the log supports: a two-turn task (two phases), a one-turn one (the older
  # single-object form), and rejects: a repeat, unordered steps, too many turns, an empty query.
  turns = [{"query": "First list the users.", "steps": [0]}, {"query": "Then...", "steps": [1, 2]}]
  reply = {
    "tasks": [
      {"run_id": 0, "turns": turns, "description": "d", "completion": "c"},
      {"run_id": 0, "steps": [1, 2, 3], "query": "Add Zed."},
      {"run_id": 0, "turns": turns},
      {"run_id": 0, "turns": [{"query": "q", "steps": [2, 1, 3]}]},
      {"run_id": 0, "turns": [{"query": "q", "steps": [i]} for i in range(3)]},
      {"run_id": 0, "turns": [{"query": " ", "steps": [0, 1, 3]}]},
    ]
  }
  stub.script.append(Reply(200, ok_body(json.dumps(reply))))
  got = abstract_with_llm(llm, triplets, ctx, min_calls=3, max_calls=4, max_turns=2)
  actions = [t.action for t in triplets]
  assert [c.turns for c in got] == [["First list the users.", "Then..."], ["Add Zed."]]
  assert [c.calls for c in got] == [[actions[:1], actions[1:3]], [actions[1:4]]]
  assert (got[0].description, got[0].completion) == ("d", "c")


def test_judge_decides_when_the_checker_fails(stub, message_task):
  llm = make_llm(stub)
  task = Task(
    "syn-y",
    "bfcl",
    ["Add a contact."],
    [["add_contact(user_name='Zed')"]],
    message_task.initial_config,
    message_task.involved_classes,
    "synth",
  )
  task.provenance["completion"] = "Zed is a contact."
  task.provenance["description"] = "adding a contact by name"
  stub.script.extend(
    [
      # The agent reasons first (prose with braces), then gives its one action (paper Fig. 9).
      Reply(
        200,
        ok_body(
          'I should look around first: a {"stop": true} now would be early. Listing users '
          '(a call like {"name": "add_contact"} needs a name). Action:\n'
          '{"name": "list_users", "arguments": {}}'
        ),
      ),  # not what was asked
      Reply(200, ok_body('{"stop": true}')),
      Reply(200, ok_body('{"success": false, "reason": "no contact added"}')),
    ]
  )
  accepted, info = attempt_and_judge(llm, task)
  assert not accepted and info["checker_reward"] == 0.0
  assert info["judge"] == {"success": False, "reason": "no contact added"}
  # The judge saw the task, its description (paper Fig. 13) and completion criterion, the
  # attempt and its final observation.
  judged = json.loads(stub.requests[-1]["body"]["contents"][0]["parts"][0]["text"])
  assert judged["completion"] == "Zed is a contact."
  assert judged["description"] == "adding a contact by name"
  # The agent's requests ask for reasoning before the action and do not force a JSON-only reply.
  agent = stub.requests[0]["body"]
  assert "First reason briefly" in agent["systemInstruction"]["parts"][0]["text"]
  assert "responseMimeType" not in agent.get("generationConfig", {})
  assert judged["attempt_calls"] == [[["list_users()"]]]
  assert "user_list" in judged["final_observation"]
  assert gemini_stub.feedback_responder("You judge x", "")  # default judge answer exists


def test_vertex_without_credentials_is_a_clear_error(monkeypatch, stub, tmp_path):
  monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
  try:
    llm = make_llm(stub, vertex=True, project="p", location="us-central1")
  except LLMError as e:
    assert "application-default" in str(e)
  else:  # the client may defer reading credentials to the first request
    with pytest.raises(LLMError):
      llm.complete("s", "p")


def test_a_process_other_than_the_primary_needs_no_credentials(monkeypatch):
  """Only the primary makes LLM calls (distributed.on_primary), so another process of the job
  builds no client: no key needed, the same name for provenance, and a call is an error."""
  import importlib.util
  import os

  from coevolve_jax.feedback import factory
  from coevolve_jax.feedback.llm import PrimaryOnlyLLM

  path = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "bfcl.py")
  spec = importlib.util.spec_from_file_location("_cfg_bfcl", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  explore = module.get_config().explore  # the run config's own explorer settings

  monkeypatch.delenv("GEMINI_API_KEY", raising=False)
  monkeypatch.delenv("GOOGLE_API_KEY", raising=False)
  monkeypatch.delenv("OPENAI_API_KEY", raising=False)
  for kind, name in (
    ("gemini", f"gemini:{explore.gemini.model}"),
    ("openai", f"openai:{explore.openai.model}"),
  ):
    llm = factory.make_llm(kind, explore, primary=False)
    assert isinstance(llm, PrimaryOnlyLLM) and llm.name == name
    with pytest.raises(RuntimeError, match="other than the primary"):
      llm.complete("s", "p")
  with pytest.raises(LLMError, match="GEMINI_API_KEY"):  # the primary still checks at start-up
    factory.make_llm("gemini", explore)
  monkeypatch.setenv("GEMINI_API_KEY", FAKE_KEY)
  assert (
    factory.make_llm("gemini", explore).name
    == factory.make_llm("gemini", explore, primary=False).name
  )  # the primary's client names its tasks as the others do
