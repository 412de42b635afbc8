"""BfclEnv on real BFCL data: official-checker rewards, isolation, cleanup, safe call building."""

import threading

import pytest

from coevolve_jax.types import Action, ToolCall
from envs.bfcl.env import (
  BfclEnv,
  ToolCallError,
  call_to_string,
  load_bfcl_tasks,
  make_env,
  parse_call_string,
  score_calls,
  split_tasks,
  tool_schemas,
)
from envs.bfcl.data import schemas_by_name
from envs.bfcl.backends import default_pool


@pytest.fixture(scope="module")
def tasks():
  return load_bfcl_tasks("multi_turn_base")


def _gt_action(call: str, task) -> Action:
  """Test-only: a ground-truth call string -> an Action with a parsed ToolCall."""
  return Action(tool_calls=[parse_call_string(call, task.involved_classes)])


def _play(env: BfclEnv, turns) -> object:
  result = env.reset()
  for turn in turns:
    for call in turn:
      result = env.step(_gt_action(call, env.task))
      assert result.messages and result.messages[0]["role"] == "tool"
    result = env.step(Action())
  return result


def _instances():
  """Every cached backend instance, in every worker process of the default pool."""
  return default_pool().instance_names()


def test_load_tasks(tasks):
  assert len(tasks) == 200
  t = tasks[0]
  assert t.task_id == "multi_turn_base_0" and t.source == "bfcl"
  assert len(t.turns) == len(t.ground_truth) == 4 and "final_report.pdf" in t.turns[0]
  assert t.initial_config["GorillaFileSystem"] and set(t.involved_classes) == {
    "TwitterAPI",
    "GorillaFileSystem",
  }
  for category in ("multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context"):
    assert len(load_bfcl_tasks(category)) == 200
  assert "missed_function" in load_bfcl_tasks("multi_turn_miss_func")[0].provenance


def test_split_is_seeded_and_disjoint(tasks):
  train, held = split_tasks(tasks, 50, seed=0)
  assert len(held) == 50 and len(train) == 150
  assert not {t.task_id for t in train} & {t.task_id for t in held}
  assert [t.task_id for t in split_tasks(tasks, 50, seed=0)[1]] == [t.task_id for t in held]
  assert [t.task_id for t in split_tasks(tasks, 50, seed=1)[1]] != [t.task_id for t in held]


@pytest.mark.parametrize("index", [0, 1, 7, 42, 99, 150, 199])
def test_ground_truth_replay_scores_one(tasks, index):
  env = make_env(tasks[index], f"gt{index}")
  result = _play(env, tasks[index].ground_truth)
  assert result.done and result.reward == 1.0, result.info["checker"]
  calls, observations = result.info["per_turn_calls"], result.info["per_turn_observations"]
  assert [len(turn) for turn in calls] == [len(turn) for turn in tasks[index].ground_truth]
  # One output per call that ran, as the model saw it (the context summary's evidence).
  assert [len(turn) for turn in observations] == [len(turn) for turn in calls]
  assert all(isinstance(o, str) and o for turn in observations for o in turn)
  assert len(result.info["calls"]) == len(tasks[index].ground_truth)
  env.close()
  assert not env.cached_instance_names()


def test_wrong_sequence_scores_zero(tasks):
  task = tasks[0]
  wrong = [list(t) for t in task.ground_truth]
  wrong[0] = wrong[0][:-1]  # Skip the move.
  env = make_env(task, "wrong")
  result = _play(env, wrong)
  assert result.done and result.reward == 0.0
  env.close()
  reward, info = score_calls(task, [[[c] for c in turn] for turn in task.ground_truth])
  assert reward == 1.0 and info["checker"]["valid"]
  assert score_calls(task, [[]] * len(task.ground_truth))[0] == 0.0


def test_parse_error_and_bad_call_do_not_crash(tasks):
  env = make_env(tasks[0], "errors", max_obs_chars=50)
  env.reset()
  r = env.step(Action(error="malformed JSON"))
  assert not r.done and r.messages[0]["role"] == "tool" and "Error" in r.messages[0]["content"]
  r = env.step(Action(tool_calls=[ToolCall("rm_rf", {}), ToolCall("ls", {"a": True})]))
  assert len(r.messages) == 2 and "invalid tool call" in r.messages[0]["content"]
  assert "Error" not in r.messages[1]["content"] and len(r.messages[1]["content"]) <= 50 + 40
  assert env.calls == [[["ls(a=True)"]]]
  env.close()


def test_isolation_between_concurrent_episodes(tasks):
  task = tasks[0]
  a, b = make_env(task, "same"), make_env(task, "same")
  a.reset()
  b.reset()
  out = {}

  def mutate():
    a.step(Action(tool_calls=[ToolCall("cd", {"folder": "document"})]))
    a.step(Action(tool_calls=[ToolCall("mkdir", {"dir_name": "only_in_a"})]))
    out["a"] = a.step(Action(tool_calls=[ToolCall("ls", {})])).messages[0]["content"]

  def look():
    b.step(Action(tool_calls=[ToolCall("cd", {"folder": "document"})]))
    out["b"] = b.step(Action(tool_calls=[ToolCall("ls", {})])).messages[0]["content"]

  threads = [threading.Thread(target=mutate), threading.Thread(target=look)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert "only_in_a" in out["a"] and "only_in_a" not in out["b"]
  assert a.cached_instance_names() and b.cached_instance_names()
  a.close()
  assert not a.cached_instance_names() and b.cached_instance_names()
  b.close()


def test_close_removes_checker_globals(tasks):
  before = set(_instances())
  env = make_env(tasks[1], "cleanup")
  _play(env, tasks[1].ground_truth)
  assert any(k.startswith(env.model_name) for k in _instances())
  env.close()
  assert set(_instances()) == before
  assert not env.cached_instance_names()


def test_tool_schemas_format():
  full = tool_schemas(["GorillaFileSystem"])
  compact = tool_schemas(["GorillaFileSystem"], "compact")
  fn = {s["function"]["name"]: s["function"] for s in full}["mv"]
  assert full[0]["type"] == "function" and fn["parameters"]["type"] == "object"
  assert "response" not in fn and "This tool belongs" in fn["description"]
  c = {s["function"]["name"]: s["function"] for s in compact}["mv"]
  assert not c["description"].startswith("This tool belongs") and c["description"].endswith(".")
  assert all("description" not in p for p in c["parameters"]["properties"].values())
  math = {s["function"]["name"]: s["function"] for s in tool_schemas(["MathAPI"])}
  assert math["add"]["parameters"]["properties"]["a"]["type"] == "number"
  assert "cp" not in {
    s["function"]["name"] for s in tool_schemas(["GorillaFileSystem"], excluded=["cp"])
  }


SCHEMAS = schemas_by_name(tool_schemas(["GorillaFileSystem", "MessageAPI", "TwitterAPI"]))


@pytest.mark.parametrize(
  "call",
  [
    ToolCall("__import__('os')", {}),
    ToolCall("os.system", {}),
    ToolCall("ls()", {}),
    ToolCall("eval", {"a": 1}),
    ToolCall("mv", {"source": "a"}),  # missing required
    ToolCall("mv", {"source": "a", "destination": "b", "force": True}),  # undeclared
    ToolCall("ls", {"a)": True}),
    ToolCall("ls", {"__class__": True}),
    ToolCall("cd", {"folder": float("nan")}),
    ToolCall("cd", {"folder": object()}),
    ToolCall("cd", {"folder": ("a",)}),
    ToolCall("cd", {"folder": {1: "x"}}),
  ],
)
def test_call_to_string_rejects(call):
  with pytest.raises(ToolCallError):
    call_to_string(call, SCHEMAS)


def test_call_to_string_accepts_literals():
  assert (
    call_to_string(ToolCall("mv", {"source": "a.txt", "destination": "temp"}), SCHEMAS)
    == "mv(source='a.txt', destination='temp')"
  )
  text = call_to_string(ToolCall("cd", {"folder": "__import__('os').system('x')"}), SCHEMAS)
  assert text == "cd(folder=\"__import__('os').system('x')\")"
  tweet = call_to_string(
    ToolCall("post_tweet", {"content": "hi", "tags": ["#a", "#b"], "mentions": []}), SCHEMAS
  )
  assert tweet == "post_tweet(content='hi', tags=['#a', '#b'], mentions=[])"
  nested = {"k": [1, -2.5, None, True, {"x": "y"}]}
  assert call_to_string(ToolCall("cd", {"folder": nested}), SCHEMAS) == f"cd(folder={nested!r})"
  with pytest.raises(ToolCallError):
    parse_call_string("cd(folder=__import__('os'))", ["GorillaFileSystem"])


def test_observations_are_cut_in_tokens_when_asked():
  """The paper cuts observations at 4,096 tokens: `max_obs_tokens` counts Qwen tokens (the
  characters limit then does not apply); the marker says how many characters were dropped."""
  from envs.base import truncate_observation  # noqa: PLC0415
  from coevolve_jax.tokenizer import get_tokenizer  # noqa: PLC0415

  text = " ".join(f"word{i}" for i in range(300))
  n = len(get_tokenizer().encode(text))
  cut = truncate_observation(text, max_chars=10, max_tokens=50)
  kept = cut.split("... [truncated ")[0]
  assert text.startswith(kept) and len(get_tokenizer().encode(kept)) == 50
  assert cut.endswith(f"[truncated {len(text) - len(kept)} characters]")
  assert truncate_observation(text, max_chars=10, max_tokens=n) == text
  assert truncate_observation(text, max_chars=10) == text[:10] + (
    f"... [truncated {len(text) - 10} characters]"
  )
