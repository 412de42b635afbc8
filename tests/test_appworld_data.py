"""AppWorld splits and TGC/SGC: a fabricated official data layout, and AppWorld's own code as the
reference (run in .venv-appworld; those checks skip without it)."""

import json
import os
import random
import subprocess

import pytest

from envs.appworld import server as appworld_server
from envs.appworld.data import OFFICIAL_SPLITS, goal_completion, load_split, scenario_of

try:
  AW_PYTHON = appworld_server.venv_python()
except FileNotFoundError:
  AW_PYTHON = None
needs_appworld = pytest.mark.skipif(
  AW_PYTHON is None, reason="no .venv-appworld: run `make appworld-setup`"
)


def _fake_official(root, per_split=3):
  """The official layout: data/datasets/<split>.txt (ids, some tagged) and data/tasks/<id>/."""
  os.makedirs(root / "data" / "datasets")
  expected = {}
  for s, split in enumerate(OFFICIAL_SPLITS):
    lines, ids = [], []
    for k in range(per_split):
      task_id = f"{s:03d}a{k:03d}_{k % 2 + 1}"
      (root / "data" / "tasks" / task_id).mkdir(parents=True)
      (root / "data" / "tasks" / task_id / "specs.json").write_text(
        json.dumps({"instruction": f"do {task_id}", "db_version": "0.1.0"})
      )
      lines.append(f"{task_id}:tagged" if k == 0 else task_id)
      ids.append(task_id)
    (root / "data" / "datasets" / f"{split}.txt").write_text("\n".join(lines) + "\n\n")
    expected[split] = ids
  return expected


def test_official_splits_load_with_tags_dropped(tmp_path):
  expected = _fake_official(tmp_path)
  for split in OFFICIAL_SPLITS:
    tasks = load_split(str(tmp_path), split)
    assert [t.task_id for t in tasks] == expected[split]
    assert tasks[1].turns == [f"do {expected[split][1]}"] and tasks[1].env == "appworld"
    assert tasks[1].initial_config["scenario"] == expected[split][1].split("_")[0]
    assert tasks[1].initial_config["split"] == split


def test_missing_split_or_task_is_a_clear_error(tmp_path):
  expected = _fake_official(tmp_path)
  with pytest.raises(FileNotFoundError, match="appworld download data"):
    load_split(str(tmp_path), "nope")
  os.remove(tmp_path / "data" / "tasks" / expected["dev"][2] / "specs.json")
  with pytest.raises(FileNotFoundError, match=expected["dev"][2]):
    load_split(str(tmp_path), "dev")


def test_goal_completion_by_hand():
  results = {
    "aaa_1": True,
    "aaa_2": True,
    "aaa_3": False,  # scenario aaa: not all pass
    "bbb_1": True,
    "bbb_2": True,  # scenario bbb: all pass
    "ccc_1": False,
  }
  m = goal_completion(results)
  assert m["tgc"] == round(100 * round(4 / 6, 4), 1) == 66.7
  assert m["sgc"] == round(100 * round(1 / 3, 4), 1) == 33.3
  assert (m["tasks"], m["scenarios"]) == (6, 3)
  assert goal_completion({})["tgc"] == 0.0
  with pytest.raises(ValueError):
    scenario_of("no-underscore")


@needs_appworld
def test_goal_completion_matches_appworld_metric_and_official_loader(tmp_path):
  rng = random.Random(0)
  cases = []
  for _ in range(20):
    ids = {
      f"{rng.randrange(16**7):07x}_{n}"
      for _ in range(rng.randint(1, 6))
      for n in range(1, rng.randint(2, 4))
    }
    cases.append({i: rng.random() < 0.6 for i in sorted(ids)})
  expected = _fake_official(tmp_path)
  script = """
import json, sys
from appworld.evaluator import Metric
from appworld.task import load_task_ids
cases = json.loads(sys.stdin.read())
out = [Metric._compute_metrics({k: {"success": v, "passes": [], "failures": []}
                                for k, v in c.items()})["aggregate"] for c in cases]
splits = {s: load_task_ids(s) for s in SPLITS}
print(json.dumps({"metrics": out, "splits": splits}))
""".replace("SPLITS", repr(list(OFFICIAL_SPLITS)))
  env = {**os.environ, "APPWORLD_ROOT": str(tmp_path)}
  done = subprocess.run(
    [AW_PYTHON, "-c", script],
    input=json.dumps(cases),
    capture_output=True,
    text=True,
    env=env,
    cwd=str(tmp_path),
    timeout=120,
    check=True,
  )
  reference = json.loads(done.stdout.strip().splitlines()[-1])
  for case, ref in zip(cases, reference["metrics"]):
    ours = goal_completion(case)
    assert (ours["tgc"], ours["sgc"]) == (
      ref["task_goal_completion"],
      ref["scenario_goal_completion"],
    )
  assert reference["splits"] == expected
  for split in OFFICIAL_SPLITS:
    assert [t.task_id for t in load_split(str(tmp_path), split)] == reference["splits"][split]


def _eval_suite(rows):
  """An AppWorldSuite holding only its held-out tasks (what `metrics` reads; no servers)."""
  from envs.appworld.env import task_from_row  # noqa: PLC0415
  from envs.appworld.suite import AppWorldSuite  # noqa: PLC0415

  suite = AppWorldSuite.__new__(AppWorldSuite)
  suite.eval_tasks = [task_from_row({"instruction": "do it", **r}) for r in rows]
  return suite


def test_tgc_and_sgc_per_split_of_hand_made_trajectories():
  """The paper's Table 1 reports test_normal and test_challenge apart: each split gets its own
  TGC / SGC (computed here by hand), and the figure over both is named a blend. A trajectory
  whose episode failed before grading (no info) counts, as a failure, in its task's split."""
  from coevolve_jax.types import Trajectory  # noqa: PLC0415

  normal = {"aaa_1": True, "aaa_2": True, "bbb_1": True, "bbb_2": False}
  challenge = {"ccc_1": False, "ccc_2": True, "ddd_1": False, "eee_1": False}
  rows = [{"task_id": k, "split": "test_normal"} for k in normal]
  rows += [{"task_id": k, "split": "test_challenge"} for k in challenge]
  suite = _eval_suite(rows)
  trajs = [
    Trajectory(k, i, info={"success": ok, "split": split})
    for i, (k, ok, split) in enumerate(
      [(k, ok, "test_normal") for k, ok in normal.items()]
      + [(k, ok, "test_challenge") for k, ok in challenge.items() if k != "ddd_1"]
    )
  ]
  trajs.append(Trajectory("ddd_1", 99, finish="error", info={"error": "reset: ServerError()"}))
  m = suite.metrics(trajs)
  # test_normal: 3 of 4 tasks; scenario aaa passes, bbb does not -> 75.0 / 50.0
  assert (m["test_normal/tgc"], m["test_normal/sgc"]) == (75.0, 50.0)
  assert (m["test_normal/tasks"], m["test_normal/scenarios"]) == (4, 2)
  # test_challenge: 1 of 4 tasks; none of ccc, ddd, eee passes whole -> 25.0 / 0.0
  assert (m["test_challenge/tgc"], m["test_challenge/sgc"]) == (25.0, 0.0)
  assert (m["test_challenge/tasks"], m["test_challenge/scenarios"]) == (4, 3)
  # both together: 4 of 8 tasks, 1 of 5 scenarios; never under the one-split names
  assert (m["blend/tgc"], m["blend/sgc"], m["blend/tasks"]) == (50.0, 20.0, 8)
  assert "tgc" not in m and "sgc" not in m
  # One split: its figures, and the same under the plain names (there is no blend).
  only = suite.metrics(trajs[:4])
  assert (only["tgc"], only["sgc"]) == (only["test_normal/tgc"], only["test_normal/sgc"])
  assert (only["tgc"], only["sgc"]) == (75.0, 50.0) and "blend/tgc" not in only


def test_eval_rows_name_the_split_only_where_the_task_or_episode_does():
  from coevolve_jax.evaluation import eval_row  # noqa: PLC0415
  from coevolve_jax.types import Task, Trajectory  # noqa: PLC0415

  aw = eval_row(
    Trajectory("ccc_1", 0, reward=1.0, info={"success": True, "split": "test_challenge"})
  )
  assert aw["split"] == "test_challenge" and aw["task_id"] == "ccc_1" and aw["reward"] == 1.0
  bfcl = eval_row(Trajectory("multi_turn_base_0", 0, calls=[["ls()"]], info={"checker": {}}))
  assert set(bfcl) == {"task_id", "reward", "finish", "model_steps", "parse_errors", "calls"}
  task = Task("multi_turn_base_0", "bfcl", ["q"], [["ls()"]], {"GorillaFileSystem": {}})
  errored = Trajectory("multi_turn_base_0", 0, finish="error", info={"error": "reset: x"})
  assert "split" not in eval_row(errored, task)  # a task whose state names no split


def test_eval_rows_of_episodes_that_failed_before_grading_name_their_tasks_split(tmp_path):
  """A held-out episode that failed before grading (a server that did not start, a step that
  raised, the step or context limit) has no info from its environment; its row in
  eval_<tag>.jsonl still names its task's split, as `metrics` counts it there."""
  from coevolve_jax.evaluation import Evaluator  # noqa: PLC0415
  from coevolve_jax.types import Trajectory  # noqa: PLC0415

  rows = [
    {"task_id": "aaa_1", "split": "test_normal"},
    {"task_id": "ccc_1", "split": "test_challenge"},
    {"task_id": "ccc_2", "split": "test_challenge"},
  ]
  suite = _eval_suite(rows)
  graded = Trajectory("aaa_1", 0, reward=1.0, finish="done")
  graded.info = {"success": True, "split": "test_normal"}
  errored = Trajectory("ccc_1", 1, finish="error", info={"error": "reset: ServerError()"})
  cut = Trajectory("ccc_2", 2, finish="max_model_steps")

  def rollouts(jobs, eval=False, greedy=False):
    assert eval and [t.task_id for t, _ in jobs] == ["aaa_1", "ccc_1", "ccc_2"]
    return [graded, errored, cut]

  figures = {}
  evaluator = Evaluator(str(tmp_path), suite, rollouts, max_tasks=3, success_threshold=0.5)
  evaluator.evaluate("after", figures)
  with open(tmp_path / "eval_after.jsonl") as f:
    written = [json.loads(line) for line in f]
  assert [(r["task_id"], r["finish"], r.get("split")) for r in written] == [
    ("aaa_1", "done", "test_normal"),
    ("ccc_1", "error", "test_challenge"),
    ("ccc_2", "max_model_steps", "test_challenge"),
  ]
  assert figures["after"]["test_challenge/tasks"] == 2  # the figures count them there too
