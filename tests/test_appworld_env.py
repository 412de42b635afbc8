"""AppWorld on generated worlds: real app code in real AppWorld servers (own venv), our HTTP client.

Needs `.venv-appworld` (`make appworld-setup`); every test that uses it skips with that reason when
it is absent. One module-scoped build (5 tasks, one per template) and one server pool serve all
tests; the built data lives in a pytest temp folder, never in the repository.
"""

import importlib.util
import json
import os
import re
import signal
import time

import pytest

from envs.appworld import server as appworld_server
from envs.appworld.env import AppWorldEnv, extract_code, task_from_row
from envs.appworld.server import ServerError
from coevolve_jax.types import Action

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _appworld_python() -> str | None:
  try:
    python = appworld_server.venv_python()
  except FileNotFoundError:
    return None
  site = os.path.dirname(os.path.dirname(python))
  unpacked = any(
    os.path.exists(os.path.join(root, "appworld", "apps", "simple_note", "apis.py"))
    for root, _, _ in os.walk(os.path.join(site, "lib"))
    if root.endswith("packages")
  )
  return python if unpacked else None


PYTHON = _appworld_python()
needs_appworld = pytest.mark.skipif(
  PYTHON is None,
  reason="no AppWorld environment with unpacked apps (.venv-appworld): run `make appworld-setup`",
)


def _act(code: str, thinking: str = "") -> Action:
  return Action(text=f"{thinking}I will run this.\n```python\n{code}\n```")


def test_extract_code_skips_reasoning_and_needs_a_block():
  text = (
    "<think>```python\nprint('hidden')\n```</think>Sure.\n```python\nprint(1)\n```\n```\nx\n```"
  )
  assert extract_code(text) == "print(1)"
  assert extract_code("```\nprint(2)\n```") == "print(2)"
  assert extract_code("no code here, apis.supervisor.complete_task()") is None
  assert extract_code("<think>unfinished ```python\nprint(3)\n```") is None
  assert extract_code("```python\n\n```") is None


def _config(seed=3):
  spec = importlib.util.spec_from_file_location(
    "_cfg_appworld", os.path.join(ROOT, "configs", "appworld.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("cpu")
  c.seed = seed
  c.appworld.build.update(
    num_scenarios=7, tasks_per_scenario=1, eval_scenarios=1, num_people=2, num_notes=4
  )
  c.engine.num_slots = 1  # pool of 2 servers
  return c


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
  if PYTHON is None:
    pytest.skip("no .venv-appworld")
  from envs.appworld.suite import AppWorldSuite  # noqa: PLC0415

  s = AppWorldSuite(_config(), str(tmp_path_factory.mktemp("run")))
  yield s
  s.close()


@pytest.fixture(scope="module")
def world(suite):
  rows = appworld_server.build_worlds(
    suite.root,
    PYTHON,
    num_scenarios=7,
    tasks_per_scenario=1,
    eval_scenarios=1,
    seed=3,
    num_people=2,
    num_notes=4,
  )
  return suite.root, {r["template"]: r for r in rows}, suite.pool


def _episode(pool, row, actions, **kw):
  env = AppWorldEnv(task_from_row(row), pool, experiment="test", **kw)
  try:
    first = env.reset()
    result = None
    for a in actions:
      result = env.step(a)
      if result.done:
        break
    return first, result, env
  finally:
    env.close()


@needs_appworld
def test_built_layout_and_splits(world):
  root, rows, _ = world
  data = os.path.join(root, "data")
  for row in rows.values():
    task = os.path.join(data, "tasks", row["task_id"])
    assert os.path.isfile(os.path.join(task, "specs.json"))
    assert os.path.isfile(os.path.join(task, "dbs", "simple_note.db"))
    for name in ("evaluation.py", "answer.json", "test_data.json", "metadata.json"):
      assert os.path.isfile(os.path.join(task, "ground_truth", name)), name
  with open(os.path.join(data, "datasets", "test_normal.txt"), encoding="utf-8") as f:
    eval_ids = f.read().split()
  with open(os.path.join(data, "datasets", "train.txt"), encoding="utf-8") as f:
    train_ids = f.read().split()
  assert len(eval_ids) == 1 and len(train_ids) == 6 and not set(eval_ids) & set(train_ids)
  for app in ("simple_note", "todoist"):
    assert os.path.isfile(os.path.join(data, "api_docs", "standard", f"{app}.json"))
  assert {app for row in rows.values() for app in row["apps"]} == {"simple_note", "todoist"}


@needs_appworld
@pytest.mark.parametrize(
  "template",
  [
    "count_notes",
    "count_tagged",
    "latest_title",
    "create_note",
    "delete_note",
    "count_open_todos",
    "complete_todo",
  ],
)
def test_ground_truth_solution_scores_one_and_noop_scores_zero(world, template):
  _, rows, pool = world
  row = rows[template]
  first, result, _ = _episode(pool, row, [_act(row["solution"])])
  assert row["instruction"] in first.messages[0]["content"]
  assert result.done and result.reward == 1.0, result.info
  assert result.info["end"] == "completed" and result.info["success"]
  assert result.info["per_turn_calls"] == [[row["solution"].strip()]]  # the code step
  assert f"{row['apps'][0]}.login" in result.info["tool_names"]  # the APIs it names
  # Completing at once without doing anything (or with a wrong answer) fails the evaluation.
  _, result, _ = _episode(pool, row, [_act("apis.supervisor.complete_task(answer=12345)")])
  assert result.done and result.reward == 0.0 and not result.info["success"]


@needs_appworld
def test_pass_fraction_reward_and_step_limit(world):
  _, rows, pool = world
  row = rows["count_notes"]  # two tests: the answer, and no note changed
  _, result, _ = _episode(
    pool, row, [_act("apis.supervisor.complete_task(answer=-1)")], reward="pass_fraction"
  )
  assert result.reward == pytest.approx(0.5) and (
    result.info["passed"],
    result.info["num_tests"],
  ) == (1, 2)
  _, result, env = _episode(
    pool, row, [Action(text="thinking aloud, no code"), _act("x = 1")], max_steps=2
  )
  assert result.done and result.info["end"] == "max_steps" and result.reward == 0.0
  assert env.code == ["x = 1"]


@needs_appworld
def test_observation_truncated_and_errors_are_observations(world):
  _, rows, pool = world
  env = AppWorldEnv(task_from_row(rows["count_notes"]), pool, max_obs_chars=50)
  try:
    env.reset()
    out = env.step(_act("print('y' * 500)")).messages[0]["content"]
    assert out.startswith("y" * 50) and "truncated 451 characters" in out
    out = env.step(_act("print(1/0)")).messages[0]["content"]
    assert out.startswith("Execution failed. Traceback:")
    out = env.step(Action(text="no block")).messages[0]["content"]
    assert "No code was run" in out
  finally:
    env.close()


@needs_appworld
def test_code_past_the_servers_memory_limit_is_a_memory_error_in_its_episode(world):
  """The servers run under `appworld.server_memory_mib` (RLIMIT_AS, 4096 MiB by default): code
  that maps 6 GiB gets MemoryError as its observation (without a limit it went through), and
  the server and its episode go on."""
  _, rows, pool = world
  env = AppWorldEnv(task_from_row(rows["count_notes"]), pool)
  try:
    env.reset()
    with open(f"/proc/{env.server.proc.pid}/limits") as f:
      limit = next(line for line in f if line.startswith("Max address space"))
    assert limit.split()[3] == str(appworld_server.DEFAULT_MEMORY_MIB << 20), limit
    out = env.step(_act("x = bytearray(6 << 30)\nprint(len(x))")).messages[0]["content"]
    assert "MemoryError" in out, out
    assert env.step(_act("print(6 * 7)")).messages[0]["content"].strip() == "42"
  finally:
    env.close()
  assert all(s.healthy() for s in pool.idle)


@needs_appworld
def test_safety_guard_blocks_shell_access(world, tmp_path):
  _, rows, pool = world
  marker = tmp_path / "pwned"
  env = AppWorldEnv(task_from_row(rows["count_notes"]), pool)
  try:
    env.reset()
    out = env.step(_act(f"import os\nos.system('touch {marker}')")).messages[0]["content"]
    assert "not allowed" in out
    out = env.step(_act("import subprocess")).messages[0]["content"]
    assert "not allowed" in out
  finally:
    env.close()
  assert not marker.exists()


@needs_appworld
def test_dead_or_hung_server_fails_only_its_episode_and_is_restarted(world):
  _, rows, pool = world
  row = rows["count_notes"]
  victim = AppWorldEnv(task_from_row(row), pool)
  other = AppWorldEnv(task_from_row(row), pool)
  victim.reset()
  other.reset()
  old_pid = victim.server.proc.pid
  os.killpg(old_pid, signal.SIGKILL)  # the server dies mid-episode
  victim.server.proc.wait(timeout=10)
  with pytest.raises(ServerError):
    victim.step(_act("print(1)"))
  victim.close()  # hands the server back; the pool restarts it
  result = other.step(_act(row["solution"]))  # the concurrent episode goes on
  assert result.done and result.reward == 1.0
  other.close()
  restarted = [s for s in pool.idle if s.proc and s.proc.pid != old_pid]
  assert len(pool.idle) == 2 and all(s.healthy() for s in pool.idle) and restarted
  # A hung server (stopped process): the request times out, the episode fails, restart follows.
  hung = AppWorldEnv(task_from_row(row), pool, exec_timeout_s=1)
  hung.reset()
  saved_timeout, pool.timeout_s = pool.timeout_s, 1.0
  try:
    os.killpg(hung.server.proc.pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(ServerError, match="no usable answer"):
      hung.step(_act("print(1)"))
    assert time.monotonic() - start < 10
  finally:
    pool.timeout_s = saved_timeout
    hung.close()
  assert len(pool.idle) == 2 and all(s.healthy() for s in pool.idle)


def test_missing_appworld_venv_names_the_setup_command(tmp_path):
  with pytest.raises(FileNotFoundError, match="make appworld-setup"):
    appworld_server.venv_python(str(tmp_path / "nope"))


@needs_appworld
def test_suite_d0_warmstart_demo_api_discovery_and_feedback_round(suite):
  import types  # noqa: PLC0415

  import numpy as np  # noqa: PLC0415

  from coevolve_jax.agent import QwenChat  # noqa: PLC0415
  from coevolve_jax.feedback import synthesis  # noqa: PLC0415
  from envs.appworld.env import code_reply  # noqa: PLC0415
  from envs.appworld.synthesis import FAMILY_APIS  # noqa: PLC0415

  rng = np.random.default_rng(0)
  d0, counts = synthesis.initial_tasks(suite.synthesizer(None), suite.train_tasks, 10, rng)
  # the 6 training worlds, each tried once: their family solutions pass, completing at once fails
  assert counts == {"attempted": 6, "abstracted": 6, "accepted": 6, "rejected": 0}
  assert all(t.source == "explore" and t.env == "appworld" for t in d0)
  assert {t.task_id for t in d0}.isdisjoint(t.task_id for t in suite.eval_tasks)
  chat = QwenChat(enable_thinking=False)
  demo = suite.demonstration(d0[0], chat, "demo0")
  assert demo.reward == 1.0 and demo.finish == "done"
  reply_ids = chat.encode(code_reply(d0[0].initial_config["solution"])) + [chat.im_end_id]
  assert demo.num_generated == len(reply_ids) and demo.token_ids[-len(reply_ids) :] == reply_ids
  inventory = suite.discover_apis()  # read in a live world through apis.api_docs
  assert {"login", "search_notes", "create_note", "delete_note"} <= set(inventory["simple_note"])
  assert sorted(suite.families()) == sorted(FAMILY_APIS)
  events = [
    types.SimpleNamespace(task=d0[0], signal="boundary"),
    types.SimpleNamespace(task=d0[1], signal="forgetting"),
  ]
  result = synthesis.synthesize_round(suite.synthesizer(None), events, rng, 1)
  assert result.synthesized == 2 and len(result.tasks) + len(result.rejected) == 2
  assert len(result.tasks) == 2, result.rejected  # each new world's solution passes, no-op fails
  for task, event in zip(
    sorted(result.tasks, key=lambda t: t.provenance["parent"]),
    sorted(events, key=lambda e: e.task.task_id),
  ):
    assert task.source == "synth" and task.provenance["parent"] == event.task.task_id
    assert task.provenance["template"] == event.task.provenance["template"]
    assert task.task_id not in {t.task_id for t in d0}
  assert sum(v["validated"] for v in result.per_signal.values()) == 2
  trajs = [
    types.SimpleNamespace(task_id=t.task_id, info={"success": i == 0}) for i, t in enumerate(d0[:2])
  ]
  assert suite.metrics(trajs)["tgc"] == 50.0


@needs_appworld
def test_official_source_loads_splits_and_never_writes_into_the_data(suite, tmp_path):
  import types  # noqa: PLC0415

  import numpy as np  # noqa: PLC0415

  from coevolve_jax.feedback import synthesis  # noqa: PLC0415
  from envs.appworld.suite import AppWorldSuite  # noqa: PLC0415

  c = _config()
  c.appworld.update(
    source="official", data_root=suite.root, split="train", eval_split="test_normal", d0="official"
  )
  official = AppWorldSuite(c, str(tmp_path))  # the built root in the official layout
  try:
    assert [t.task_id for t in official.train_tasks] == [t.task_id for t in suite.train_tasks]
    assert [t.task_id for t in official.eval_tasks] == [t.task_id for t in suite.eval_tasks]
    assert all(not t.initial_config["solution"] for t in official.eval_tasks)
    synth = official.synthesizer(None)
    d0, counts = synthesis.initial_tasks(synth, official.train_tasks, 3, np.random.default_rng(0))
    assert len(d0) == 3 and counts == {
      "attempted": 3,
      "abstracted": 3,
      "accepted": 3,
      "rejected": 0,
    }
    assert {t.task_id for t in d0} <= {t.task_id for t in official.train_tasks}  # as they are
    before = sorted(os.listdir(os.path.join(suite.root, "data", "tasks")))
    event = types.SimpleNamespace(task=d0[0], signal="boundary")
    result = synthesis.synthesize_round(synth, [event], np.random.default_rng(0), 1)
    assert result.tasks == [] and result.synthesized == 0  # nothing is built on official data
    assert sorted(os.listdir(os.path.join(suite.root, "data", "tasks"))) == before
    assert not official.pool.idle and not official.pool.busy  # servers start only on demand
  finally:
    official.close()
  # An official-style task (instruction only) runs and is graded in the same servers.
  task = official.eval_tasks[0]
  env = suite.make_env(task, "e0")
  try:
    assert task.turns[0] in env.reset().messages[0]["content"]
    result = env.step(_act("apis.supervisor.complete_task()"))
    assert result.done and result.reward == 0.0 and result.info["num_tests"] >= 2
  finally:
    env.close()


# ---------------------------------------------------------------- the LLM path (paper Sec. 3)


@pytest.fixture
def stub_llm(monkeypatch):
  """The real `openai` client against the loopback stub, whose default responder explores Simple
  Note, abstracts one task with its answer, and replays the hints when it attempts a task."""
  from coevolve_jax.feedback.openai_llm import OpenAILLM, OpenAISettings  # noqa: PLC0415
  from coevolve_jax.testing.openai_stub import OpenAIStub  # noqa: PLC0415

  monkeypatch.setenv("COEVOLVE_TEST_KEY", "sk-test")
  with OpenAIStub() as server:
    settings = OpenAISettings(base_url=server.api_url, api_key_env="COEVOLVE_TEST_KEY", model="s")
    yield OpenAILLM(settings), server


def _run(suite, task, code):
  reward, info = suite.run_code(task, code)
  return reward, info["passed"], info["num_tests"]


@needs_appworld
def test_derived_task_is_graded_by_its_reference_changes_and_answer(world):
  root, rows, _ = world
  base = rows["count_notes"]["task_id"]
  login = (
    'pw = {a["account_name"]: a["password"] for a in apis.supervisor.show_account_passwords()}\n'
    "me = apis.supervisor.show_profile()\n"
    'token = apis.simple_note.login(username=me["email"], password=pw["simple_note"])'
    '["access_token"]'
  )
  add = 'apis.simple_note.create_note(access_token=token, title="T1", content="C1")'
  count = "print(len(apis.simple_note.search_notes(access_token=token, page_limit=20)))"

  def spec(n, steps, answer_step=None):
    return {
      "task_id": f"dd00001_{n}",
      "base_task_id": base,
      "instruction": f"derived task {n}",
      "steps": steps,
      "answer_step": answer_step,
    }

  specs = [
    spec(1, [login, add, count], answer_step=2),
    spec(2, [login, "apis.simple_note.no_such_api()"]),
    spec(3, [login, count]),  # answers nothing, changes nothing
    spec(4, [login, add, "apis.supervisor.complete_task()"]),
    spec(5, ["import os\nos.system('true')"]),
    spec(6, [login, add], answer_step=1),  # the answer step prints nothing
  ]
  out = appworld_server.derive_worlds(root, specs, PYTHON)
  assert [r["task_id"] for r in out] == [s["task_id"] for s in specs]
  made, *failed = out
  assert made["error"] is None and made["changed"] == ["simple_note.Note"], made
  n = made["answer"]  # what the count step printed in the derived world, after the new note
  assert n == 4 + 1  # the world fixture gives the supervisor num_notes=4 notes
  assert made["solution"].endswith(f"{count}\napis.supervisor.complete_task(answer={n})\n")
  assert "step 1 failed" in failed[0]["error"]
  assert "neither answers anything nor changes" in failed[1]["error"]
  assert "completed the task itself" in failed[2]["error"]
  assert "os.system" in failed[3]["error"] and "printed nothing" in failed[4]["error"]
  tasks = os.path.join(root, "data", "tasks")
  assert os.path.isdir(os.path.join(tasks, "dd00001_1"))
  assert not any(os.path.exists(os.path.join(tasks, f"dd00001_{i}")) for i in range(2, 7))
  with open(os.path.join(tasks, "dd00001_1", "specs.json")) as f:
    assert json.load(f)["instruction"] == "derived task 1"
  from envs.appworld.suite import AppWorldSuite  # noqa: PLC0415

  suite = AppWorldSuite.__new__(AppWorldSuite)  # only run_code's episode factory is needed
  suite.aw, suite.pool = _config().appworld, world[2]
  task = task_from_row(made)
  assert _run(suite, task, made["solution"]) == (1.0, 2, 2)
  assert _run(suite, task, "apis.supervisor.complete_task()") == (0.0, 0, 2)
  # Right answer, world unchanged; the right change, a wrong answer; the right change twice.
  assert _run(suite, task, f"apis.supervisor.complete_task(answer={n})")[1:] == (1, 2)
  wrong = f"{login}\n{add}\napis.supervisor.complete_task(answer={n + 1})"
  assert _run(suite, task, wrong)[1:] == (1, 2)
  twice = f"{login}\n{add}\n{add}\napis.supervisor.complete_task(answer={n})"
  assert _run(suite, task, twice)[1:] == (1, 2)


@pytest.mark.slow  # about 50 s; make test keeps the LLM-free D0 and round, and the scripted
# explorer's derivation, abstraction and judge on real worlds (the tests below)
@needs_appworld
def test_llm_d0_and_feedback_round_on_generated_worlds(suite, stub_llm, monkeypatch):
  import numpy as np  # noqa: PLC0415

  from coevolve_jax.feedback import synthesis  # noqa: PLC0415
  from coevolve_jax.feedback.signals import SignalEvent  # noqa: PLC0415

  llm, server = stub_llm
  monkeypatch.setitem(suite.explore_args, "max_calls", 6)  # the stub's 3-step task fits
  rng = np.random.default_rng(1)
  d0, counts = synthesis.initial_tasks(suite.synthesizer(llm), suite.train_tasks, 2, rng)
  got = {k: counts[k] for k in ("attempted", "abstracted", "accepted", "rejected")}
  assert got == {"attempted": 2, "abstracted": 2, "accepted": 2, "rejected": 0}, counts
  train_ids = {t.task_id for t in suite.train_tasks}
  for task in d0:
    assert task.source == "explore" and task.provenance["abstraction"] == "llm"
    assert task.provenance["parent"] in train_ids  # a training world, not its instruction
    assert task.turns[0].startswith("Add a Simple Note note titled")
    assert task.provenance["validation"]["reward"] == 1.0  # the attempt passed the evaluator
    # The answer is what the count printed in the derived world (4 notes + the new one).
    assert task.initial_config["solution"].endswith("apis.supervisor.complete_task(answer=5)\n")
  # The explorer never saw the base task's human-written instruction.
  base = next(t for t in suite.train_tasks if t.task_id == d0[0].provenance["parent"])
  assert not any(base.turns[0] in json.dumps(r["body"]) for r in server.requests)
  event = SignalEvent(d0[0], "boundary", [["simple_note.login"]], 0.0, [["ok"]])
  result = synthesis.synthesize_round(suite.synthesizer(llm), [event], rng, 1)
  assert result.synthesized == 1 and len(result.tasks) == 1, result.rejected
  (task,) = result.tasks
  assert task.source == "synth" and task.provenance["signal"] == "boundary"
  assert task.provenance["parent"] == d0[0].task_id  # re-explored in the marked task's world
  assert result.per_signal == {"boundary": {"events": 1, "synthesized": 1, "validated": 1}}
  assert any(r["ok"] and "create_note" in r["action"] for r in result.trace)
  assert result.llm_usage["requests"] >= 5
  assert _run(suite, task, task.initial_config["solution"])[0] == 1.0
  assert _run(suite, task, "apis.supervisor.complete_task()")[0] == 0.0
  # The generated held-out set is D0's skeleton over the held-out worlds: new tasks derived in
  # those worlds (their own ids, source "explore_eval"), never the worlds' own tasks.
  held = {t.task_id for t in suite.eval_tasks}
  generated = synthesis.generated_eval_tasks(
    suite.synthesizer(llm), suite.eval_tasks, 1, np.random.default_rng(2)
  )
  assert len(generated) == 1 and generated[0].source == "explore_eval"
  assert generated[0].provenance["parent"] in held and generated[0].task_id not in held
  assert _run(suite, generated[0], generated[0].initial_config["solution"])[0] == 1.0


@needs_appworld
def test_official_data_is_overlaid_and_derived_tasks_go_to_the_workdir(suite, tmp_path):
  from envs.appworld.suite import AppWorldSuite  # noqa: PLC0415

  c = _config()
  c.appworld.update(source="official", data_root=suite.root, split="train")
  official = AppWorldSuite(c, str(tmp_path))  # the built root in the official layout
  data = os.path.join(suite.root, "data", "tasks")
  before = sorted(os.listdir(data))
  try:
    assert official.root == os.path.join(str(tmp_path), "appworld_root")
    assert os.path.islink(os.path.join(official.root, "data", "tasks", before[0]))
    spec = {
      "task_id": "ov00001_1",
      "base_task_id": official.train_tasks[0].task_id,
      "instruction": "Add a note.",
      "steps": [
        'pw = {a["account_name"]: a["password"] for a in '
        "apis.supervisor.show_account_passwords()}\nme = apis.supervisor.show_profile()\n"
        'token = apis.simple_note.login(username=me["email"], password=pw["simple_note"])'
        '["access_token"]\napis.simple_note.create_note(access_token=token, title="t", content="c")'
      ],
    }
    (row,) = appworld_server.derive_worlds(official.root, [spec], PYTHON)
    assert row["error"] is None and row["answer"] is None and row["changed"] == ["simple_note.Note"]
    assert sorted(os.listdir(data)) == before  # the data folder is never written to
    derived = os.path.join(official.root, "data", "tasks", "ov00001_1")
    assert os.path.isdir(derived) and not os.path.islink(derived)
  finally:
    official.close()


def test_official_data_with_the_programmatic_explorer_is_refused():
  from envs.appworld.suite import validate_config  # noqa: PLC0415

  c = _config()
  c.appworld.update(source="official", data_root="/nonexistent")
  with pytest.raises(ValueError, match="appworld.d0"):
    validate_config(c)
  c.appworld.d0 = "official"
  validate_config(c)
  c.explore.explorer = "openai"
  c.appworld.d0 = "explore"
  validate_config(c)


# ------------------------------------- what AppWorld trajectories carry into signals and stage 2


class _ScriptedLLM:
  """A `feedback.llm.TextLLM` whose reply to each job is `reply(system, prompt)`; it records
  every (system, prompt) it was sent."""

  name = "scripted"

  def __init__(self, reply):
    from coevolve_jax.feedback.llm import TokenBudget  # noqa: PLC0415

    self.budget, self.reply, self.prompts = TokenBudget(), reply, []

  def complete(self, system, prompt, *, json_output=False):
    self.prompts.append((system, prompt))
    return self.reply(system, prompt)

  def refresh(self):
    pass


def _rollouts(suite, jobs):
  """Episodes through the real agent loop (`AgentRunner`) on the suite's servers: `jobs` are
  (task, group id, [code of each reply]); one decode slot replays the replies in job order (an
  episode's script ends with complete_task or has `appworld.max_steps` replies)."""
  import jax  # noqa: PLC0415

  import kit  # noqa: PLC0415
  from coevolve_jax.agent import AgentRunner, EpisodeLimits  # noqa: PLC0415
  from coevolve_jax.rollout.sampling import SamplingParams  # noqa: PLC0415
  from envs.appworld.env import code_reply  # noqa: PLC0415

  chat = kit.FakeChat()  # token ids are the characters' codes; 0 ends a reply
  replies = [chat.encode(code_reply(code)) + [0] for _, _, codes in jobs for code in codes]
  runner = AgentRunner(
    kit.RunOnEngine(replies, filler=ord("x")),
    chat,
    lambda task, episode_id: suite.make_env(task, episode_id),
    EpisodeLimits(max_new_tokens=4096, max_model_steps=4),
    env_threads=1,
  )
  trajs = runner.run(
    [(t, g) for t, g, _ in jobs], SamplingParams(temperature=0.0), jax.random.key(0)
  )
  assert all(t.finish == "done" for t in trajs), [(t.finish, t.info) for t in trajs]
  return trajs


@needs_appworld
def test_rare_fires_on_a_recurring_rare_api_pattern_of_real_episodes(suite):
  """The rare signal counts AppWorld's action patterns: the APIs each code step names, in order
  over the steps (what the agent loop puts into `Trajectory.tool_names`). With the CPU preset's
  signal settings (theta 5%, N_min 16, a pattern must recur in 2 tasks), a pattern one task
  showed in an earlier step fires when another task shows it; a first-seen pattern, the same
  APIs in another order, a common pattern, and a task repeating its own pattern do not."""
  from coevolve_jax.feedback.rounds import signal_shares  # noqa: PLC0415
  from coevolve_jax.feedback.signals import SignalTracker  # noqa: PLC0415

  done = "apis.supervisor.complete_task()"  # no answer: every episode scores 0 (no boundary)
  common = [
    f"apis.supervisor.show_profile()\n{done}",
    f"apis.supervisor.show_account_passwords()\n{done}",
    f"apis.api_docs.show_app_descriptions()\n{done}",
  ]
  tasks = list(suite.train_tasks)
  assert len(tasks) == 6
  # Task i's own pattern; task 0's is two code steps: show_profile, then the app list.
  own = [["apis.supervisor.show_profile()", f"apis.api_docs.show_app_descriptions()\n{done}"]]
  own += [["apis.supervisor.show_profile()\n" * (i + 1) + done] for i in range(1, 6)]
  step1 = [(t, g, [code]) for g, t in enumerate(tasks) for code in common]
  step1 += [(t, g, own[g]) for g, t in enumerate(tasks)]
  trajs = _rollouts(suite, step1)
  first = trajs[len(tasks) * len(common)]  # task 0's own two-step episode
  assert first.tool_names == [
    "supervisor.show_profile",
    "api_docs.show_app_descriptions",
    "supervisor.complete_task",
  ]
  assert first.calls == [own[0]] and len(first.observations[0]) == 2  # code and output per step
  assert first.info["split"] == "train" and "tool_names" not in first.info
  tracker = SignalTracker.from_config(_config().signals)
  assert tracker.observe(trajs, tasks) == []  # nothing to compare with yet
  assert tracker.total == 6 * 4  # 24 (task, pattern) pairs: task 0's pattern has 1/24 < 5%
  step2 = [
    (tasks[1], 1, own[0]),  # task 0's rare pattern, shown by another task: rare
    # task 0's APIs in another order: a first-seen pattern
    (
      tasks[2],
      2,
      ["apis.api_docs.show_app_descriptions()", f"apis.supervisor.show_profile()\n{done}"],
    ),
    (tasks[3], 3, [f"apis.api_docs.show_api_descriptions(app_name='todoist')\n{done}"]),  # new
    (tasks[4], 4, [common[0]]),  # a common pattern (6 of 24)
    (tasks[0], 0, own[0]),  # task 0 again: its own pattern does not recur across tasks
  ]
  trajs = _rollouts(suite, step2)
  events = tracker.observe(trajs, tasks)
  assert [(e.signal, e.task.task_id) for e in events] == [("rare", tasks[1].task_id)]
  assert events[0].calls == [own[0]]
  # feedback.jsonl's signal_events / signal_shares are these figures of the round's events.
  assert signal_shares(events) == {
    "events": {"forgetting": 0, "boundary": 0, "rare": 1},
    "shares": {"forgetting": 0.0, "boundary": 0.0, "rare": 1.0},
  }


@needs_appworld
def test_the_stage2_summary_sees_each_code_step_and_its_output(suite):
  """A marked AppWorld trajectory keeps each code step and what it printed (here a traceback):
  the signal event carries both, and the LLM's context summary prompt shows them; the
  explorer's focus is the APIs the code names."""
  import numpy as np  # noqa: PLC0415

  from coevolve_jax.feedback import synthesis  # noqa: PLC0415
  from coevolve_jax.feedback.signals import SignalTracker  # noqa: PLC0415

  task = next(t for t in suite.train_tasks if t.provenance.get("template") == "count_notes")
  bad = "notes = apis.simple_note.no_such_api()"
  failing = [bad, "apis.supervisor.complete_task(answer=-1)"]
  trajs = _rollouts(suite, [(task, 0, [task.initial_config["solution"]]), (task, 0, failing)])
  assert [t.reward for t in trajs] == [1.0, 0.0]
  events = SignalTracker(rare_min_total=1000).observe(trajs, [task])
  assert [e.signal for e in events] == ["boundary", "boundary"]  # one solved, one failed
  event = events[1]
  error = "No API named 'no_such_api' found in the simple_note app."
  assert event.calls == [failing] and error in event.observations[0][0]

  def reply(system, prompt):
    if system.startswith("You analyse"):
      return json.dumps({"summary": "s", "focus_pattern": [], "exploration_objectives": []})
    if system.startswith("You explore"):
      return "STOP"
    return json.dumps({"tasks": []})

  llm = _ScriptedLLM(reply)
  result = synthesis.synthesize_round(suite.synthesizer(llm), [event], np.random.default_rng(0), 1)
  assert result.tasks == [] and result.per_signal["boundary"]["events"] == 1
  (summary_prompt,) = [p for s, p in llm.prompts if s.startswith("You analyse")]
  steps = json.loads(summary_prompt)["agent_steps"]
  assert [s["call"] for s in steps[0]] == failing
  assert error in steps[0][0]["observation"] and error in summary_prompt
  explorer_prompts = [p for s, p in llm.prompts if s.startswith("You explore")]
  assert explorer_prompts and all(
    'Focus APIs: ["simple_note.no_such_api", "supervisor.complete_task"]' in p
    for p in explorer_prompts
  )


def test_the_summary_cuts_a_long_output_in_the_middle():
  """The stage-2 summary shows `llm_jobs.OBS_CHARS` characters of each step's output: its start
  and its end around a marker of what was cut, so an error printed last stays in view."""
  from coevolve_jax.feedback import llm_jobs  # noqa: PLC0415

  assert llm_jobs.cut_middle("short", 10) == "short"
  assert llm_jobs.cut_middle("abcdefghijkl", 5) == "abc\n... [7 characters cut] ...\nkl"
  assert llm_jobs.cut_middle("abcdef", 1) == "a\n... [5 characters cut] ...\n"


@needs_appworld
def test_the_stage2_summary_sees_a_traceback_after_a_long_output(suite, monkeypatch):
  """A code step whose traceback is long (AppWorld shows only the traceback of a failed step,
  here of a long one-line statement) ends with the error: at the full config's observation
  length the episode records all of it, and the context summary prompt keeps its start and the
  error at its end (the summary's cut is not a prefix)."""
  import numpy as np  # noqa: PLC0415

  from coevolve_jax.feedback import llm_jobs, synthesis  # noqa: PLC0415
  from coevolve_jax.feedback.signals import SignalTracker  # noqa: PLC0415

  full = importlib.util.spec_from_file_location("_cfg_aw_full", f"{ROOT}/configs/appworld.py")
  module = importlib.util.module_from_spec(full)
  full.loader.exec_module(module)
  monkeypatch.setitem(suite.aw, "max_obs_chars", module.get_config("").appworld.max_obs_chars)
  task = next(t for t in suite.train_tasks if t.provenance.get("template") == "count_notes")
  titles = ", ".join(f'"note title {i}"' for i in range(60))
  long_then_bad = f"titles = [{titles}]; notes = apis.simple_note.no_such_api(titles=titles)"
  failing = [long_then_bad, "apis.supervisor.complete_task(answer=-1)"]
  trajs = _rollouts(suite, [(task, 0, [task.initial_config["solution"]]), (task, 0, failing)])
  error = "No API named 'no_such_api' found in the simple_note app."
  recorded = trajs[1].observations[0][0]
  assert recorded.startswith("Execution failed. Traceback:") and recorded.endswith(error), recorded
  assert len(recorded) > 2000 > llm_jobs.OBS_CHARS
  events = SignalTracker(rare_min_total=1000).observe(trajs, [task])
  assert [e.signal for e in events] == ["boundary", "boundary"]

  def reply(system, prompt):
    if system.startswith("You analyse"):
      return json.dumps({"summary": "s", "focus_pattern": [], "exploration_objectives": []})
    if system.startswith("You explore"):
      return "STOP"
    return json.dumps({"tasks": []})

  llm = _ScriptedLLM(reply)
  synthesis.synthesize_round(suite.synthesizer(llm), [events[1]], np.random.default_rng(0), 1)
  (summary_prompt,) = [p for s, p in llm.prompts if s.startswith("You analyse")]
  shown = json.loads(summary_prompt)["agent_steps"][0][0]["observation"]
  assert shown.startswith("Execution failed. Traceback:") and shown.endswith(error)
  assert f"[{len(recorded) - llm_jobs.OBS_CHARS} characters cut]" in shown


@needs_appworld
def test_a_twelve_step_task_is_explored_derived_and_validated_with_the_full_values(
  suite, monkeypatch
):
  """The full config's exploration values (runs of `explore.steps_per_round` steps, tasks of up
  to `explore.max_calls` code steps; the paper's AppWorld example has 11) reach the explorer,
  the abstraction and the validating attempt: a 12-step task found in a run is derived in its
  world and passes validation by an agent that runs one step per reply (13 replies, more than
  `appworld.max_steps`), graded by the task's own evaluator (the judge says no)."""
  import numpy as np  # noqa: PLC0415

  from coevolve_jax.feedback import synthesis  # noqa: PLC0415

  full = importlib.util.spec_from_file_location("_cfg_aw_full", f"{ROOT}/configs/appworld.py")
  module = importlib.util.module_from_spec(full)
  full.loader.exec_module(module)
  ex = module.get_config("").explore
  for key in ("steps_per_round", "min_calls", "max_calls"):
    monkeypatch.setitem(suite.explore_args, key, int(ex[key]))
  monkeypatch.setitem(suite.explore_args, "rounds", 1)  # one run is enough here
  steps = [
    'pw = {a["account_name"]: a["password"] for a in apis.supervisor.show_account_passwords()}',
    "me = apis.supervisor.show_profile()",
    'token = apis.simple_note.login(username=me["email"], password=pw["simple_note"])'
    '["access_token"]',
    "before = apis.simple_note.search_notes(access_token=token, page_limit=20)",
    'titles = [n["title"] for n in before]',
    'apis.simple_note.create_note(access_token=token, title="Long A", content="a")',
    'apis.simple_note.create_note(access_token=token, title="Long B", content="b")',
    "after = apis.simple_note.search_notes(access_token=token, page_limit=20)",
    "n = len(after)",
    "added = n - len(titles)",
    "print(added)",
    "print(n)",
  ]
  assert suite.aw.max_steps < len(steps) + 1 <= ex.max_calls + 1

  def reply(system, prompt):
    if system.startswith("You explore"):
      k = int(re.search(r"Step (\d+) of", prompt).group(1))
      return f"```python\n{steps[k - 1]}\n```" if k <= len(steps) else "STOP"
    if system.startswith("You turn"):
      task = {"run_id": 0, "steps": list(range(12)), "query": "Add two notes; how many now?"}
      return json.dumps({"tasks": [{**task, "answer_step": 11, "completion": "count given"}]})
    if system.startswith("You judge"):
      return json.dumps({"success": False, "reason": "scripted: no"})
    done = prompt.split("Your steps so far, each with its output:\n", 1)[1].count("\n-> ")
    code = steps[done] if done < len(steps) else "apis.supervisor.complete_task(answer=n)"
    return f"```python\n{code}\n```"

  llm = _ScriptedLLM(reply)
  base = next(t for t in suite.train_tasks if t.provenance.get("template") == "count_notes")
  d0, counts = synthesis.initial_tasks(
    suite.synthesizer(llm), [base], 1, np.random.default_rng(0), max_attempts=1
  )
  assert counts["accepted"] == 1, (counts, [p[:300] for _, p in llm.prompts[-2:]])
  (task,) = d0
  assert task.provenance["validation"]["reward"] == 1.0  # by the evaluator, not the judge
  assert task.initial_config["solution"].count("\n") >= len(steps)
  explorer = [p for s, p in llm.prompts if s.startswith("You explore")]
  assert f"Step 1 of {ex.steps_per_round}:" in explorer[0] and len(explorer) == len(steps) + 1
  (abstraction,) = [p for s, p in llm.prompts if s.startswith("You turn")]
  assert f"At most {ex.max_calls} steps" in abstraction
  attempts = [p for s, p in llm.prompts if "Hints (a known solution)" in p]
  assert len(attempts) == len(steps) + 1  # one reply per step, then complete_task


@needs_appworld
def test_the_judge_sees_the_abstracted_tasks_description(suite, monkeypatch):
  """Validation (paper Sec. 3.3, Fig. 13): a derived task whose attempt the evaluator fails goes
  to the LLM judge, whose prompt carries the task's query, the description and the completion
  criterion the abstraction wrote, the reference solution, the attempt's code and its end."""
  import numpy as np  # noqa: PLC0415

  from coevolve_jax.feedback import synthesis  # noqa: PLC0415

  assert suite.judge  # explore.judge, on in every variant
  monkeypatch.setitem(suite.explore_args, "max_calls", 6)
  monkeypatch.setitem(suite.explore_args, "rounds", 1)
  steps = [
    'pw = {a["account_name"]: a["password"] for a in apis.supervisor.show_account_passwords()}',
    "me = apis.supervisor.show_profile()",
    'token = apis.simple_note.login(username=me["email"], password=pw["simple_note"])'
    '["access_token"]',
    "print(len(apis.simple_note.search_notes(access_token=token, page_limit=20)))",
  ]
  description = "logging in to Simple Note and counting the supervisor's notes"
  completion = "the number of notes is given as the answer"
  wrong = "apis.supervisor.complete_task(answer=-1)"

  def reply(system, prompt):
    if system.startswith("You explore"):
      k = int(re.search(r"Step (\d+) of", prompt).group(1))
      return f"```python\n{steps[k - 1]}\n```" if k <= len(steps) else "STOP"
    if system.startswith("You turn"):
      task = {"run_id": 0, "steps": [0, 1, 2, 3], "query": "How many notes do I have?"}
      task.update(answer_step=3, description=description, completion=completion)
      return json.dumps({"tasks": [task]})
    if system.startswith("You judge"):
      return json.dumps({"success": False, "reason": "scripted: the answer is wrong"})
    return f"```python\n{wrong}\n```"  # the attempt answers at once, wrongly

  llm = _ScriptedLLM(reply)
  base = next(t for t in suite.train_tasks if t.provenance.get("template") == "count_notes")
  # Seed 7: the derived world's scenario id (a seeded hash) is not the 12-step test's.
  d0, counts = synthesis.initial_tasks(
    suite.synthesizer(llm), [base], 1, np.random.default_rng(7), max_attempts=1
  )
  assert d0 == [] and (counts["abstracted"], counts["rejected"]) == (1, 1), counts
  (judged,) = [json.loads(p) for s, p in llm.prompts if s.startswith("You judge")]
  assert judged["description"] == description and judged["completion"] == completion
  assert judged["query"] == ["How many notes do I have?"]
  assert judged["reference_solution"].startswith(steps[0])
  assert judged["attempt_code"] == [wrong]
  assert json.loads(judged["final_observation"])["end"] == "completed"
