"""Bounded BFCL execution (envs/bfcl/backends.py): calls that never finish or exhaust memory are
stopped with an error observation, the worker is replaced, episodes go on, normal results are
unchanged, and no worker process outlives its pool."""

import os
import subprocess
import sys
import time

import pytest

from coevolve_jax.types import Action, Task, ToolCall
from envs.bfcl import execution
from envs.bfcl import backends
from envs.bfcl.backends import BackendPool, BackendUnavailable, Bounds
from envs.bfcl.env import load_bfcl_tasks, make_env, parse_call_string
from envs.bfcl.sandbox import Sandbox

WALL_S = 2.0
# MathAPI calls with literal arguments that never finish in-process (issue 18): a C-level
# big-number power, and decimal / mpmath arithmetic at a billion digits.
NEVER_FINISH = [
  ToolCall("power", {"base": 10, "exponent": 10**12}),
  ToolCall("square_root", {"number": 2, "precision": 10**9}),
  ToolCall("logarithm", {"value": 2, "base": 10, "precision": 10**9}),
]
# Ground truths that together use all eight backends.
EIGHT_BACKENDS = (11, 50, 91, 100, 144, 177)


@pytest.fixture(scope="module")
def tasks():
  return load_bfcl_tasks("multi_turn_base")


@pytest.fixture(scope="module")
def math_task(tasks):
  task = tasks[15]
  assert set(task.involved_classes) == {"GorillaFileSystem", "MathAPI"}
  return task


@pytest.fixture(scope="module")
def pool():
  """One worker, so that every episode of a test shares the worker a stopped call replaces."""
  with BackendPool(Bounds(call_wall_s=WALL_S, workers=1)) as p:
    yield p


def _step(env, name, **arguments):
  start = time.monotonic()
  result = env.step(Action(tool_calls=[ToolCall(name, arguments)]))
  return result, time.monotonic() - start


def _zombie_children() -> list[int]:
  """Our child processes that have exited but were not reaped."""
  out = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
      continue
    if fields[0] == "Z" and int(fields[1]) == os.getpid():
      out.append(int(pid))
  return out


@pytest.mark.parametrize(
  "call, official_loop",
  [(NEVER_FINISH[0], False), (NEVER_FINISH[1], True), (NEVER_FINISH[2], False)],
  ids=["power", "square_root-official_loop", "logarithm"],
)
def test_calls_that_never_finish_are_stopped_and_the_episode_goes_on(
  pool, math_task, call, official_loop
):
  env = make_env(math_task, "hang", backends=pool, official_loop=official_loop)
  env.reset()
  try:
    result, _ = _step(env, "mkdir", dir_name="kept")
    assert "error" not in result.messages[0]["content"].lower()
    first_pid = pool.started_pids[-1]
    start = time.monotonic()
    result = env.step(Action(tool_calls=[call]))
    elapsed = time.monotonic() - start
    assert not result.done and len(result.messages) == 1
    text = result.messages[0]["content"]
    assert text.startswith("Error during execution: the call did not finish within 2 s")
    assert execution.is_error_result(text)  # so explorers and validation count it as failed
    assert elapsed < WALL_S + 2.0, elapsed
    assert pool.started_pids[-1] != first_pid  # the worker was replaced
    # The episode goes on, on its state from before the stopped call (rebuilt by replay).
    result, _ = _step(env, "add", a=1, b=2)
    assert result.messages[0]["content"] == '{"result": 3}'
    result, _ = _step(env, "ls")
    assert "kept" in result.messages[0]["content"]
    assert env._session.replays == 1
    # The stopped call is not among the executed calls the checker replays.
    assert env.calls == [[["mkdir(dir_name='kept')"], ["add(a=1, b=2)"], ["ls()"]]]
  finally:
    env.close()
  assert not _zombie_children()


def test_memory_exhaustion_is_stopped_and_the_episode_goes_on(math_task):
  with BackendPool(Bounds(call_wall_s=60.0, worker_memory_mib=512, workers=1)) as small:
    env = make_env(math_task, "memory", backends=small)
    env.reset()
    _step(env, "add", a=1, b=1)
    # libmpdec allocates the billion-digit operands up front: far past 512 MiB at once.
    result, elapsed = _step(env, "square_root", number=2, precision=10**9)
    assert not result.done
    assert result.messages[0]["content"] == (
      "Error during execution: the call needed more than 512 MiB of memory and was stopped; "
      "it had no effect."
    )
    assert elapsed < 30.0
    result, _ = _step(env, "square_root", number=2, precision=5)
    assert result.messages[0]["content"] == "{'result': Decimal('1.4142')}"
    assert len(small.started_pids) == 2
    assert env.calls == [[["add(a=1, b=1)"], ["square_root(number=2, precision=5)"]]]
    env.close()
    pids = list(small.started_pids)
  assert not _zombie_children()
  assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def test_other_episodes_on_a_replaced_worker_still_score_one(pool, tasks, math_task):
  """An episode that shares the worker a stopped call replaces keeps its state (replayed) and
  the official checker still scores its ground truth 1.0."""
  task = tasks[0]
  victim = make_env(task, "victim", backends=pool)
  hanger = make_env(math_task, "hanger", backends=pool)
  victim.reset()
  hanger.reset()
  try:
    for turn_index, turn in enumerate(task.ground_truth):
      for call in turn:
        result = victim.step(Action(tool_calls=[parse_call_string(call, task.involved_classes)]))
        assert "Error during execution" not in result.messages[0]["content"]
      if turn_index == 1:
        result, _ = _step(hanger, "power", base=10, exponent=10**12)
        assert "did not finish" in result.messages[0]["content"]
      result = victim.step(Action())
    assert result.done and result.reward == 1.0, result.info["checker"]
    assert victim._session.replays == 1
  finally:
    victim.close()
    hanger.close()


def test_an_episode_whose_state_cannot_be_rebuilt_ends_cleanly(pool, math_task):
  env = make_env(math_task, "lost", backends=pool)
  env.reset()
  try:
    _step(env, "mkdir", dir_name="x")
    env._session._digests[0] = b"not what the replay gives"
    worker = env._session._worker
    with worker.lock:
      worker._replace()  # what a call stopped in another episode does
    result, _ = _step(env, "ls")
    assert result.done and result.reward == 0.0
    assert result.info["checker"]["error_type"] == "env:backend_lost"
    assert "gave different results" in result.messages[0]["content"]
  finally:
    env.close()


def test_normal_results_are_unchanged_and_ground_truths_score_one(tasks):
  """Every result equals BFCL's in-process one, on entries that use all eight backends."""
  entries = [tasks[i] for i in EIGHT_BACKENDS]
  assert len({c for t in entries for c in t.involved_classes}) == 8
  with BackendPool(Bounds(workers=2)) as two:
    for task in entries:
      name = execution.new_model_name("inproc")
      expected = [
        r for turn in task.ground_truth for r in execution.execute_calls(turn, task, name)[0]
      ]
      execution.cleanup(name)
      env = make_env(task, "same", backends=two, max_obs_chars=10**6)
      env.reset()
      got = []
      for turn in task.ground_truth:
        for call in turn:
          action = Action(tool_calls=[parse_call_string(call, task.involved_classes)])
          got.append(env.step(action).messages[0]["content"])
        result = env.step(Action())
      assert got == expected, task.task_id
      assert result.done and result.reward == 1.0, (task.task_id, result.info["checker"])
      env.close()
    assert not two.instance_names()


def test_sandbox_and_checker_are_bounded(pool, math_task):
  with Sandbox(math_task.initial_config, math_task.involved_classes, pool=pool) as box:
    assert box.run(ToolCall("mkdir", {"dir_name": "seen"}))[0] == "mkdir(dir_name='seen')"
    before = box.public_state()
    start = time.monotonic()
    text, result = box.run(NEVER_FINISH[0])
    assert time.monotonic() - start < WALL_S + 2.0
    assert text == "" and result.startswith("Error during execution: the call did not finish")
    assert execution.is_error_result(result)  # run_ok: ("", None)
    assert box.public_state() == before
    assert box.run_ok(ToolCall("add", {"a": 2, "b": 2})) == ("add(a=2, b=2)", '{"result": 4}')
  # The checker replays the model's calls: one that never finishes stops the whole check within
  # call_wall_s x (1 + calls executed), and scores 0.
  task = Task(
    task_id="multi_turn_base_9000",
    env="bfcl",
    turns=["add"],
    ground_truth=[["add(a=1, b=2)"]],
    initial_config={},
    involved_classes=["MathAPI"],
  )
  assert backends.score_calls(task, [[["add(a=1, b=2)"]]], pool=pool)[0] == 1.0
  start = time.monotonic()
  reward, info = backends.score_calls(task, [[["power(base=10, exponent=10**12)"]]], pool=pool)
  assert time.monotonic() - start < 3 * WALL_S + 2.0
  assert reward == 0.0 and info["checker"]["error_type"] == "checker:stopped"
  assert not pool.instance_names()


def test_bounds_are_validated():
  for bad in (
    {"call_wall_s": 0},
    {"call_wall_s": float("inf")},
    {"call_wall_s": True},
    {"worker_memory_mib": 100},
    {"worker_memory_mib": 1024.0},
    {"workers": 0},
  ):
    with pytest.raises(ValueError, match=next(iter(bad))):
      Bounds(**bad)


def test_closed_pool_refuses_and_leaves_no_process(math_task):
  pool = BackendPool(Bounds(workers=2))
  env = make_env(math_task, "closing", backends=pool)
  env.reset()
  _step(env, "add", a=1, b=1)
  pids = list(pool.started_pids)
  pool.close()
  env.close()  # never raises
  assert not any(os.path.exists(f"/proc/{pid}") for pid in pids) and not _zombie_children()
  with pytest.raises(BackendUnavailable, match="closed"):
    env.reset()


def test_workers_end_with_the_interpreter():
  """A pool never closed by its owner is closed at exit (atexit): no worker outlives it."""
  code = (
    "from envs.bfcl.backends import BackendPool\n"
    "from envs.bfcl.env import load_bfcl_tasks\n"
    "s = BackendPool().session(load_bfcl_tasks('multi_turn_base')[15])\n"
    "s.open()\n"
    "print(s._worker.proc.pid)\n"
  )
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": root}
  out = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr
  pid = int(out.stdout.split()[-1])
  assert not os.path.exists(f"/proc/{pid}")
