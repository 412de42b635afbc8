"""The calls of one BFCL reply share one wall-clock budget (issue 47, item 4): a reply of many slow
calls ends within the budget plus one call's bound, its later calls are refused with an
observation saying so, the earlier calls' results are kept, and the episode goes on."""

import time

import pytest

from coevolve_jax.types import Action, ToolCall
from envs.bfcl import backends, execution
from envs.bfcl.backends import BackendPool, Bounds
from envs.bfcl.env import load_bfcl_tasks, make_env

CALL_WALL_S = 1.0
NEVER_FINISH = ToolCall("power", {"base": 10, "exponent": 10**12})  # stopped at call_wall_s


@pytest.fixture(scope="module")
def math_task():
  task = load_bfcl_tasks("multi_turn_base")[15]
  assert set(task.involved_classes) == {"GorillaFileSystem", "MathAPI"}
  return task


@pytest.fixture(scope="module")
def pool():
  with BackendPool(Bounds(call_wall_s=CALL_WALL_S, workers=1)) as p:
    yield p


def _timed_step(env, calls):
  start = time.monotonic()
  result = env.step(Action(tool_calls=calls))
  return result, time.monotonic() - start


def test_a_reply_of_many_never_finishing_calls_is_cut_at_its_budget(pool, math_task):
  """Eight calls that each run into call_wall_s: without a shared budget the reply takes eight
  stops, worker restarts and replays (~20 s here); with a 0.5 s budget one is stopped and the
  rest are refused."""
  env = make_env(math_task, "many-slow", backends=pool, reply_wall_s=0.5)
  env.reset()
  try:
    env.step(Action(tool_calls=[ToolCall("mkdir", {"dir_name": "kept"})]))  # starts the worker
    reply = [ToolCall("add", {"a": 1, "b": 2})] + [NEVER_FINISH] * 8 + [ToolCall("ls", {})]
    result, elapsed = _timed_step(env, reply)
    assert elapsed < 0.5 + CALL_WALL_S + 1.5, elapsed  # budget + one call's bound + slack
    assert not result.done and len(result.messages) == 10
    texts = [m["content"] for m in result.messages]
    assert texts[0] == '{"result": 3}'  # the earlier call's result is kept
    assert texts[1].startswith("Error during execution: the call did not finish within 1 s")
    refusal = backends.budget_observation(0.5)
    assert texts[2:] == [refusal] * 8
    assert "budget of 0.5 s" in refusal and "not run" in refusal
    assert execution.is_error_result(refusal)  # explorers and validation count it as failed
    assert env.calls == [[["mkdir(dir_name='kept')"], ["add(a=1, b=2)"]]]
    # The episode goes on, on its state from before the stopped call (rebuilt by replay).
    result, _ = _timed_step(env, [ToolCall("ls", {})])
    assert "kept" in result.messages[0]["content"]
  finally:
    env.close()


def test_slow_calls_that_finish_share_the_budget(pool, math_task, monkeypatch):
  """Twelve calls whose worker takes 0.3 s to answer each (3.6 s in all) with a 1 s budget: at
  most four run (each adds >= 0.3 s), their results kept; the rest are refused, in order."""
  real_request = backends._Worker.request

  def slow_request(self, op, args, deadline_s):
    if op == "exec":
      time.sleep(0.3)
    return real_request(self, op, args, deadline_s)

  env = make_env(math_task, "slow-finish", backends=pool, reply_wall_s=1.0)
  env.reset()
  try:
    env.step(Action(tool_calls=[ToolCall("add", {"a": 0, "b": 0})]))  # opens the instances
    monkeypatch.setattr(backends._Worker, "request", slow_request)
    reply = [ToolCall("add", {"a": i, "b": 1}) for i in range(12)]
    result, elapsed = _timed_step(env, reply)
    assert elapsed < 1.0 + 0.3 + 1.0, elapsed  # budget + one call + slack
    texts = [m["content"] for m in result.messages]
    ran = [t for t in texts if t != backends.budget_observation(1.0)]
    assert 1 <= len(ran) <= 4, texts
    assert ran == [f'{{"result": {i + 1}}}' for i in range(len(ran))]
    assert texts[len(ran) :] == [backends.budget_observation(1.0)] * (12 - len(ran))
    assert env.calls[0][1] == [f"add(a={i}, b=1)" for i in range(len(ran))]
  finally:
    monkeypatch.undo()
    env.close()


def test_the_budget_is_validated(math_task):
  for bad in (0, -1.0, float("inf"), float("nan"), True, "20"):
    with pytest.raises(ValueError, match="reply_wall_s"):
      make_env(math_task, "bad", reply_wall_s=bad)
