"""Run diagnostics, alert rules, the rollout log and backtests (coevolve_jax/diagnostics.py,
coevolve_jax/backtest.py) on scripted steps: every figure against a count done by hand."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from coevolve_jax import backtest, diagnostics, grpo
from coevolve_jax.cli import backtest as backtest_cli
from coevolve_jax.feedback.signals import SignalEvent
from coevolve_jax.hooks import StepRecord
from coevolve_jax.types import Reply, Task, Trajectory

_CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")


def _base_config():
  """configs/bfcl.py's CPU preset (what `make run` trains)."""
  path = os.path.join(_CONFIGS, "bfcl.py")
  spec = importlib.util.spec_from_file_location("diag_bfcl_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config("cpu")


def _task(i, source="bfcl", signal=None, turns=None, gt=None):
  prov = {"signal": signal} if signal else {}
  return Task(
    f"t{i}", "bfcl", turns or [f"task number {i}"], gt or [[]], source=source, provenance=prov
  )


def _traj(group, reward, finish="done", calls=(), logprobs=(-1.0, -3.0), steps=1, parse=0, obs=""):
  t = Trajectory(f"t{group}", group, reward=reward, finish=finish, model_steps=steps)
  t.extend([1, 2], sampled=False)
  t.extend([3] * len(logprobs), sampled=True, logprobs=list(logprobs))
  t.calls = [list(calls)]
  t.tool_names = [c.split("(")[0] for c in calls]
  t.parse_errors = parse
  t.replies = [Reply(2, 2 + len(logprobs), observation=obs)]
  return t


def _record(step, tasks, trajs, keep=None, events=(), eval_tasks=()):
  rewards = np.array([t.reward for t in trajs], np.float32)
  keep = np.ones(len(trajs), bool) if keep is None else np.asarray(keep)
  return StepRecord(
    step,
    tasks,
    trajs,
    rewards,
    keep,
    np.zeros(len(trajs), np.float32),
    list(events),
    {"train/kl": 0.0},  # a metric of the step's row (the loop's rows have many)
    list(eval_tasks),
  )


def _three_groups():
  """g0 mixed with different calls, g1 all solved with the same call, g2 all failed (one cut by
  the KV cache, one an environment error)."""
  tasks = [_task(0), _task(1, "synth", "boundary"), _task(2)]
  trajs = [
    _traj(0, 1.0, calls=["a()"], logprobs=(-0.5, -0.5), steps=2, parse=1),
    _traj(0, 0.0, calls=["b()"]),
    _traj(1, 1.0, calls=["a()"]),
    _traj(1, 1.0, calls=["a()"]),
    _traj(2, 0.0, finish="context", steps=3),
    _traj(2, 0.0, finish="error"),
  ]
  events = [SignalEvent(tasks[1], k, [], 1.0) for k in ("boundary", "boundary", "rare")]
  return tasks, trajs, events


def test_each_diagnostic_against_a_hand_count():
  tasks, trajs, events = _three_groups()
  got = diagnostics.compute(_record(1, tasks, trajs, events=events), diagnostics.Settings())
  want = {
    "diag/reward_std": (0.5 + 0 + 0) / 3,
    "diag/dead_groups": 2 / 3,
    "diag/dead_solved": 1 / 3,
    "diag/dead_failed": 1 / 3,
    "diag/solution_diversity": (1 + 0 + 0) / 3,
    # 5 rollouts sample two tokens at -1 and -3, one at -0.5 and -0.5: -21 nats over 12 tokens
    "diag/sampled_logprob": -21 / 12,
    "diag/turns_per_episode": (2 + 1 + 1 + 1 + 3 + 1) / 6,
    "diag/tokens_per_episode": 2.0,
    "diag/parse_error_rate": 1 / 9,
    "diag/error_rate": 1 / 6,
    "diag/truncation_rate": 1 / 6,
    "diag/origin/d0": 2 / 3,
    "diag/origin/synth_boundary": 1 / 3,
    "diag/signal/boundary": 2 / 3,
    "diag/signal/rare": 1 / 3,
    "diag/signal/forgetting": 0.0,
  }
  assert got == pytest.approx(want)  # no eval split: the leak detectors report nothing
  # Dropping the two cut/failed episodes (train.drop_from_loss) leaves g2 with no kept rollout.
  keep = [True, True, True, True, False, False]
  got = diagnostics.compute(
    _record(1, tasks, trajs, keep), diagnostics.Settings(), ["reward_spread"]
  )
  assert got["diag/dead_groups"] == pytest.approx(2 / 3)
  assert got["diag/dead_failed"] == pytest.approx(1 / 3)


def test_a_diagnostic_from_a_users_module_runs_in_the_hook(tmp_path, monkeypatch, capsys):
  from coevolve_jax import config  # noqa: PLC0415

  (tmp_path / "user_diag_mod.py").write_text(
    "from coevolve_jax import diagnostics\n"
    "@diagnostics.register('test_user_episodes')\n"
    "def f(record, settings):\n"
    "  return {'user_episodes': len(record.trajectories)}\n"
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  cfg = _base_config()
  cfg.diagnostics.modules = ("user_diag_mod",)
  cfg.diagnostics.names = ("test_user_episodes",)
  cfg.diagnostics.alerts = ("user_episodes >= 6", "nope_figure > 0")
  cfg.diagnostics.relative = ()
  config.validate(cfg)  # imports the module, so the name is known
  tasks, trajs, _ = _three_groups()
  row = diagnostics.Diagnostics(cfg).on_step(_record(1, tasks, trajs))
  assert row["diag/user_episodes"] == 6 and row["alert/user_episodes"] == 1
  assert "no figure for ['nope_figure > 0']" in capsys.readouterr().out  # a typo is said once
  cfg.diagnostics.modules = ("no_such_user_module",)
  with pytest.raises(ValueError, match="diagnostics.modules: cannot import"):
    config.validate(cfg)


def test_dead_rows_match_zero_grpo_advantages():
  rewards = np.array([1, 0, 1, 1, 0, 0, 0.5, 0.5, 0.2], np.float32)
  groups = np.array([0, 0, 1, 1, 2, 2, 3, 3, 3])
  keep = np.array([1, 1, 1, 1, 1, 1, 1, 1, 0], bool)
  dead = grpo.dead_rows(rewards, groups, keep)
  assert dead.tolist() == [False, False, True, True, True, True, True, True, True]
  adv = grpo.compute_advantages(rewards, groups, keep_n=keep)
  assert np.all(adv[dead] == 0) and np.all(adv[~dead] != 0)


def test_the_loss_rows_drop_cut_episodes_then_dead_groups():
  """`grpo.loss_rows`, the loop's `keep`: train.drop_from_loss first, then with
  train.drop_dead_groups every group left without reward spread (here g0 once its cut episode is
  gone, and the all-solved g1)."""
  finishes = ["done", "context", "done", "done", "done", "done"]
  rewards = np.array([1, 0, 1, 1, 1, 0], np.float32)
  groups = np.array([0, 0, 1, 1, 2, 2])
  assert grpo.loss_rows(finishes, rewards, groups).all()
  assert grpo.loss_rows(finishes, rewards, groups, ("context",)).tolist() == [1, 0, 1, 1, 1, 1]
  got = grpo.loss_rows(finishes, rewards, groups, ("context",), drop_dead_groups=True)
  assert got.tolist() == [0, 0, 0, 0, 1, 1]


def test_a_user_diagnostic_registers_in_a_few_lines():
  @diagnostics.register("test_long_episodes")
  def long_episodes(record, settings):
    return {"long_episodes": sum(t.model_steps > 1 for t in record.trajectories)}

  tasks, trajs, _ = _three_groups()
  got = diagnostics.compute(
    _record(1, tasks, trajs), diagnostics.Settings(), ["test_long_episodes"]
  )
  assert got == {"diag/long_episodes": 2.0}
  with pytest.raises(ValueError, match="already registered"):
    diagnostics.register("test_long_episodes")(long_episodes)
  with pytest.raises(ValueError, match="unknown diagnostics"):
    diagnostics.compute(_record(1, tasks, trajs), diagnostics.Settings(), ["no_such"])


def _dead_step(step):
  tasks = [_task(0), _task(1)]
  return _record(step, tasks, [_traj(0, 0.0), _traj(0, 0.0), _traj(1, 1.0), _traj(1, 0.0)])


def _all_dead_step(step):
  tasks = [_task(0), _task(1)]
  return _record(step, tasks, [_traj(0, 0.0), _traj(0, 0.0), _traj(1, 1.0), _traj(1, 1.0)])


def test_the_dead_group_alert_fires_after_its_steps_once_and_survives_a_resume(capsys):
  cfg = _base_config()
  cfg.diagnostics.alerts = ("dead_groups >= 0.9 for 3", "train/kl > 0.5")
  hook = diagnostics.Diagnostics(cfg)
  assert "alert/dead_groups" not in hook.on_step(_dead_step(1))  # half the groups dead
  for step in (2, 3):
    assert "alert/dead_groups" not in hook.on_step(_all_dead_step(step))
  resumed = diagnostics.Diagnostics(cfg)  # a resume from the checkpoint after step 3
  resumed.load_state_dict(json.loads(json.dumps(hook.state_dict())))
  capsys.readouterr()
  row = resumed.on_step(_all_dead_step(4))
  assert row["alert/dead_groups"] == 1 and row["alerts"] == ["dead_groups >= 0.9 for 3"]
  assert capsys.readouterr().out.strip() == "alert (step 4): dead_groups >= 0.9 for 3 (now 1)"
  assert resumed.on_step(_all_dead_step(5))["alert/dead_groups"] == 1  # still holds: no line
  assert capsys.readouterr().out == ""
  assert "alert/dead_groups" not in resumed.on_step(_dead_step(6))  # the run of steps is broken
  # A rule on a metric of the row (not a diag/ figure) reads the step's metrics.
  record = _dead_step(7)
  record.metrics["train/kl"] = 0.7
  assert resumed.on_step(record)["alert/train/kl"] == 1


def test_inflation_is_measured_against_the_first_steps():
  cfg = _base_config()
  cfg.diagnostics.baseline_steps = 2
  cfg.diagnostics.alerts = ("turns_per_episode_vs_start >= 2",)
  hook = diagnostics.Diagnostics(cfg)
  rows = []
  for step, turns in enumerate([2, 4, 9], 1):
    tasks = [_task(0)]
    rows.append(
      hook.on_step(_record(step, tasks, [_traj(0, 1.0, steps=turns), _traj(0, 0.0, steps=turns)]))
    )
  assert [r["diag/turns_per_episode_vs_start"] for r in rows] == pytest.approx([1.0, 4 / 3, 3.0])
  assert [r.get("alert/turns_per_episode_vs_start") for r in rows] == [None, None, 1]


@pytest.mark.parametrize(
  "rule",
  [
    "dead_groups",
    "dead_groups >= ",
    "dead_groups => 1",
    "dead_groups >= x",
    "a > 1 for 0",
    "a > nan",
  ],
)
def test_a_malformed_alert_rule_is_refused_by_the_config(rule):
  from coevolve_jax import config  # noqa: PLC0415

  cfg = _base_config()
  cfg.diagnostics.alerts = (rule,)
  with pytest.raises(ValueError, match="diagnostics.alerts"):
    config.validate(cfg)


def test_the_leak_detectors_fire_on_a_planted_leak_and_not_on_clean_data():
  secret = "quarterly budget approved for the north office"
  evaluation = [
    Task(
      "multi_turn_base_7",
      "bfcl",
      ["send the approval of the quarterly budget to the north office team lead"],
      [[f"send_message(receiver_id='USR002', message='{secret}')"]],
    )
  ]
  clean_tasks = [_task(0, turns=["list the files in the documents folder and sort them"])]
  clean = _record(
    1, clean_tasks, [_traj(0, 1.0, obs="['a.txt', 'b.txt']"), _traj(0, 0.0)], eval_tasks=evaluation
  )
  got, found = diagnostics.leaks(clean, diagnostics.Settings())
  assert found == [] and got["leak_near_eval"] == 0
  assert got["leak_answer_in_observation"] == 0
  # A synthesized task that rewords the evaluation task, and an observation that hands the agent
  # an evaluation answer (EvoTrainer's leak through the environment).
  near = _task(
    1,
    "synth",
    "boundary",
    turns=["send the approval of the quarterly budget to the north office team lead now"],
    gt=evaluation[0].ground_truth,
  )
  leaky_obs = f"inbox: 1 message from admin: '{secret}'"
  leaky = _record(2, [near], [_traj(1, 1.0, obs=leaky_obs), _traj(1, 0.0)], eval_tasks=evaluation)
  got, found = diagnostics.leaks(leaky, diagnostics.Settings())
  assert got["leak_near_eval"] == 1 and got["leak_answer_in_observation"] == 1
  assert got["eval_similarity_max"] >= 0.5
  assert sorted(found) == [
    ("t1", "answer_in_observation", "multi_turn_base_7"),
    ("t1", "near_eval", "multi_turn_base_7"),
  ]
  # What any episode may see is no answer: a call without arguments, a value the task's own
  # query states, and an episode's own call echoed back in its observation.
  task = Task(
    "e",
    "bfcl",
    ["open the folder named quarterly_reports"],
    [["list_users()", "cd(folder='quarterly_reports')"]],
  )
  assert diagnostics.eval_answers(task, 12) == ["cd(folder='quarterly_reports')"]
  echo = _traj(
    1,
    0.0,
    calls=[evaluation[0].ground_truth[0][0]],
    obs=f"ran {evaluation[0].ground_truth[0][0]}: ok",
  )
  echoed = _record(3, [_task(1)], [echo], eval_tasks=evaluation)
  got, _ = diagnostics.leaks(echoed, diagnostics.Settings())
  assert got["leak_answer_in_observation"] == 0
  # Through the hook: both default alerts fire on the step, and the row says what leaked.
  row = diagnostics.Diagnostics(_base_config()).on_step(leaky)
  assert row["alert/leak_near_eval"] == 1 and row["alert/leak_answer_in_observation"] == 1
  assert sorted(row["leaks"]) == [list(f) for f in sorted(found)]


def _scripted_run(workdir, cfg, steps=4):
  """A run's rollout log without a model: per step g0 = [1 done, 0 context, 0 context] (dead
  once the cut episodes leave the loss), g1 = [1 done, 0 done, 0 context] (mixed either way),
  g2 = [1, 1, 1] (solved by all: dead)."""
  cfg.rollout.tasks_per_step, cfg.rollout.group_size = 3, 3
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(cfg.to_json_best_effort())
  log = diagnostics.RolloutLog(str(workdir), max_mb=1.0)
  log.on_resume(-1)
  hook = diagnostics.Diagnostics(cfg)
  drop = set(cfg.train.drop_from_loss)
  rows = []
  for step in range(1, steps + 1):
    tasks = [_task(0), _task(1, "synth", "rare"), _task(2)]
    trajs = [
      _traj(0, 1.0, calls=["ls()"]),
      _traj(0, 0.0, "context"),
      _traj(0, 0.0, "context"),
      _traj(1, 1.0, calls=["cd(folder='a')"]),
      _traj(1, 0.0),
      _traj(1, 0.0, "context"),
      _traj(2, 1.0, calls=["pwd()"]),
      _traj(2, 1.0, calls=["pwd()"]),
      _traj(2, 1.0, calls=["pwd()"]),
    ]
    record = _record(step, tasks, trajs, keep=[t.finish not in drop for t in trajs])
    log.on_step(record)
    rows.append(hook.on_step(record))
  return rows


def test_a_backtest_of_a_filter_reports_the_groups_it_revives_and_the_successes_it_drops(tmp_path):
  cfg = _base_config()
  cfg.train.drop_from_loss = ("context",)
  rows = _scripted_run(tmp_path, cfg)
  assert [r["diag/dead_groups"] for r in rows] == pytest.approx([2 / 3] * 4)
  assert not any("alerts" in r for r in rows)  # 2 of 3 dead is under the default 0.9
  # Keeping the cut episodes as failures revives g0 in each of the 4 steps.
  report = backtest.backtest(str(tmp_path), {"train.drop_from_loss": []})
  assert (report.revived, report.killed, report.successes_filtered) == (4, 0, 0)
  assert report.baseline.dead_groups == 8 and report.intervention.dead_groups == 4
  assert report.intervention.kept - report.baseline.kept == 4 * 3
  # DAPO's filter drops both dead groups: g0's kept success and g2's three, every step.
  report = backtest.backtest(str(tmp_path), {"train.drop_dead_groups": True})
  assert (report.revived, report.killed, report.successes_filtered) == (0, 0, 4 * 4)
  assert report.baseline.rank_violations == report.intervention.rank_violations == 0
  table = report.table()
  assert "successes filtered out of the loss: 16" in table and "dead groups revived: 0" in table


def test_a_backtest_replays_the_signals_and_the_feedback_clock(tmp_path):
  cfg = _base_config()
  cfg.feedback.every = 2
  cfg.signals.rare_min_total = 1
  _scripted_run(tmp_path, cfg)
  same = backtest.backtest(str(tmp_path), {"feedback.every": 2})
  assert same.baseline.events == same.intervention.events and same.revived == 0
  assert same.baseline.rounds == 2  # after steps 2 and 4
  fewer = backtest.backtest(str(tmp_path), {"feedback.every": 4, "feedback.kinds": ["forgetting"]})
  assert fewer.intervention.rounds == 1
  assert fewer.intervention.events == fewer.baseline.events  # the same events fire ...
  assert fewer.intervention.round_events["boundary"] == 0  # ... but no round reads a boundary one
  assert fewer.baseline.round_events["boundary"] == fewer.baseline.events["boundary"] > 0
  # What cannot be replayed from logged rollouts is refused, with what can.
  with pytest.raises(ValueError, match="cannot be replayed"):
    backtest.backtest(str(tmp_path), {"train.lr": 1e-5})
  with pytest.raises(ValueError, match="signals"):
    backtest.backtest(str(tmp_path), {"signals.window": 0})


def test_the_backtest_command_line(tmp_path):
  """The command in a process of its own (its absl flags would clash with coevolve_jax.main's
  in this one): the report, its JSON, and one error line for a bad --set."""
  cfg = _base_config()
  cfg.train.drop_from_loss = ("context",)
  _scripted_run(tmp_path, cfg, steps=2)
  out = tmp_path / "report.json"
  cmd = [sys.executable, "-m", "coevolve_jax.cli.backtest", f"--workdir={tmp_path}"]
  ok = subprocess.run(
    [*cmd, "--set=train.drop_from_loss=[]", f"--json={out}"], capture_output=True, text=True
  )
  assert ok.returncode == 0, ok.stderr
  assert "dead groups revived: 2" in ok.stdout
  assert json.loads(out.read_text())["revived"] == 2
  bad = subprocess.run([*cmd, "--set=signals.window=abc"], capture_output=True, text=True)
  assert bad.returncode == 2 and bad.stdout == ""
  assert bad.stderr.strip().splitlines()[-1].startswith("error: signals.window: want a value")
  with pytest.raises(ValueError, match="field=JSON"):
    backtest_cli.parse_sets(["no_equals_sign"])


def test_the_rollout_log_is_cut_back_on_resume_and_stops_at_its_size(tmp_path, capsys):
  cfg = _base_config()
  _scripted_run(tmp_path, cfg, steps=3)
  path = tmp_path / "rollouts.jsonl"
  assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1] * 9 + [2] * 9 + [
    3
  ] * 9
  log = diagnostics.RolloutLog(str(tmp_path), max_mb=len(path.read_bytes()) / 2**20 + 1e-6)
  log.on_resume(2)  # the run resumes from step 2's checkpoint
  assert len(path.read_text().splitlines()) == 18
  tasks, trajs, _ = _three_groups()
  assert log.on_step(_record(3, tasks, trajs)) == {}  # fits
  assert log.on_step(_record(4, tasks, trajs)) == {"diag/rollout_log_full": 1}
  assert "rollout_log_max_mb" in capsys.readouterr().out
  assert len(path.read_text().splitlines()) == 24
  with pytest.raises(FileNotFoundError, match="rollout_log = True"):
    backtest.load_rollouts(str(tmp_path / "nothing.jsonl"))
  with open(path, "a") as f:
    f.write('{"step": 5, "task_')  # a write cut by a kill
  steps, notes = backtest.load_rollouts(str(path), rows_per_step=9)
  assert list(steps) == [1, 2]  # step 3 logged 6 episodes (another batch): left out
  assert [n.split(": ", 1)[1] for n in notes] == [
    "not JSON (a write cut by a kill): left out",
    "6 rows, not 9: left out",
  ]
  with open(path, "a") as f:
    f.write('\n{"step": 6, "group": [1]}\n')  # not a row this code writes: refused
  with pytest.raises(ValueError, match="not a rollout row"):
    backtest.load_rollouts(str(path))


def _gate_source(path, step=3):
  """A run folder to branch from: its config, a checkpoint step folder and a metrics row."""
  os.makedirs(path / "checkpoints" / str(step))
  (path / "config.json").write_text(_base_config().to_json_best_effort())
  row = {
    "step": step,
    "reward/mean": 0.0,
    "diag/dead_groups": 0.9,
    "alerts": ["dead_groups >= 0.9 for 3"],
  }
  (path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
  (path / "eval_generated.jsonl").write_text(_task(9).to_json() + "\n")
  return str(path)


# What each scripted branch scores: (generated held-out success = the selection split,
# eval_after = the reported split, mean diag/dead_groups over its steps).
_OUTCOMES = {
  "baseline": (0.25, 0.5, 0.6),
  "reported_only": (0.125, 0.75, 0.3),  # better on the reported split, worse where the gate looks
  "both": (0.375, 0.625, 0.2),
  "no_target_gain": (0.5, 0.5, 0.7),
}


def _scripted_fit(calls):
  def fit(cfg, workdir):
    name = os.path.basename(workdir).rsplit("-", 1)[0]
    calls.append((name, cfg.train.steps, cfg.train.drop_dead_groups, cfg.train.lr))
    selection, reported, dead = _OUTCOMES[name]
    summary = {"eval_after": reported, "eval_generated_after": {"success": selection}}
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f)
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
      for step in (4, 5):
        f.write(json.dumps({"step": step, "reward/mean": 0.0, "diag/dead_groups": dead}) + "\n")
    return summary

  return fit


def test_the_gate_promotes_on_the_selection_split_never_the_reported_one(tmp_path, capsys):
  from coevolve_jax import gate  # noqa: PLC0415

  sources = [_gate_source(tmp_path / "s0"), _gate_source(tmp_path / "s1")]
  cands = [
    gate.Candidate("reported_only", {"train.lr": 1e-5}, "dead_groups"),
    gate.Candidate("both", {"train.drop_dead_groups": True}, "dead_groups"),
    gate.Candidate("no_target_gain", {"train.lr": 2e-6}, "dead_groups"),
  ]
  calls, out = [], str(tmp_path / "gate")
  record = gate.run_gate(sources, cands, 2, out, fit=_scripted_fit(calls))
  # Every branch trains 2 steps past the source's checkpoint 3, with its own overrides.
  assert sorted(c[:2] for c in calls) == sorted([(n, 5) for n in _OUTCOMES] * 2)
  lr = _base_config().train.lr  # the source's, where a candidate does not change it
  assert ("both", 5, True, lr) in calls and ("reported_only", 5, False, 1e-5) in calls
  assert all(
    os.path.exists(os.path.join(out, f"{n}-{i}", "checkpoints", "3"))
    for n in _OUTCOMES
    for i in (0, 1)
  )
  got = {d["candidate"]: d for d in record["decisions"]}
  assert (
    not got["reported_only"]["passed"]
    and "selection score regressed by 0.125" in got["reported_only"]["reason"]
  )
  assert got["both"]["promoted"] and got["both"]["selection_gain"] == pytest.approx(0.125)
  assert got["both"]["target_gain"] == pytest.approx(0.4)
  assert (
    not got["no_target_gain"]["passed"] and "did not move lower" in got["no_target_gain"]["reason"]
  )
  skills = diagnostics.read_skills(os.path.join(out, "skills.jsonl"))
  assert [(s["candidate"], s["decision"]) for s in skills] == [
    ("reported_only", "refused"),
    ("both", "promoted"),
    ("no_target_gain", "refused"),
  ]
  assert skills[1]["intervention"] == {"train.drop_dead_groups": True}
  assert skills[1]["trigger"]["alerts"] == ["dead_groups >= 0.9 for 3"]
  # A rerun resumes (the branches exist) and replaces this gate's records, keeping another's.
  with open(os.path.join(out, "skills.jsonl"), "a") as f:
    f.write(json.dumps({"gate": "/elsewhere", "candidate": "x", "decision": "refused"}) + "\n")
  gate.run_gate(sources, cands, 2, out, fit=_scripted_fit([]))
  again = diagnostics.read_skills(os.path.join(out, "skills.jsonl"))
  assert [(s["candidate"], s["decision"]) for s in again][0] == ("x", "refused")
  assert sorted(s["candidate"] for s in again[1:]) == sorted(c.name for c in cands)
  gate.run_gate(sources, cands[:1], 2, out, fit=_scripted_fit([]))  # one candidate again
  kept = diagnostics.read_skills(os.path.join(out, "skills.jsonl"))
  assert sorted(s["candidate"] for s in kept) == sorted(["x", *(c.name for c in cands)])
  # Branches from another start are never compared: the source trained on, or a candidate
  # changed under its name.
  os.makedirs(os.path.join(sources[1], "checkpoints", "5"))
  with pytest.raises(RuntimeError, match="was branched as"):
    gate.run_gate(sources, cands, 2, out, fit=_scripted_fit([]))
  changed = [gate.Candidate("both", {"train.drop_dead_groups": False}, "dead_groups")]
  with pytest.raises(RuntimeError, match="another --out"):
    gate.run_gate(sources[:1], changed, 2, out, fit=_scripted_fit([]))
  # A later run reads the skills: its dead-group alert names the promoted intervention.
  cfg = _base_config()
  cfg.diagnostics.skills = os.path.join(out, "skills.jsonl")
  cfg.diagnostics.alerts = ("dead_groups >= 0.9",)
  capsys.readouterr()
  diagnostics.Diagnostics(cfg).on_step(_all_dead_step(1))
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 2 and '{"train.drop_dead_groups": true} was promoted' in lines[1]


def test_a_target_gain_within_min_gain_promotes_nothing():
  """Two branches whose target figures differ by float noise (the CPU preset's example: the same
  mean diversity summed in another order) or by less than min_gain pass no candidate."""
  from coevolve_jax import gate  # noqa: PLC0415

  def branches(value):
    return [
      gate.Branch("baseline", "s", 0.0, {"c": 0.29166666666666663}),
      gate.Branch("c", "s", 0.0, {"c": value}),
    ]

  cand = gate.Candidate("c", {"sampling.temperature": 1.1}, "solution_diversity", "higher")
  for value in (0.29166666666666669, 0.30):
    (d,) = gate.decide([cand], branches(value))
    assert not d.passed and "by more than 0.01" in d.reason
  (d,) = gate.decide([cand], branches(0.35))
  assert d.promoted and d.target_gain == pytest.approx(0.35 - 0.29166666666666663)


def test_the_gate_refuses_bad_candidates_and_sources(tmp_path):
  from coevolve_jax import gate  # noqa: PLC0415
  from coevolve_jax.cli import gate as gate_cli  # noqa: PLC0415

  good = {"name": "x", "overrides": {"train.lr": 1e-5}, "target": "dead_groups"}
  for bad, match in [
    ({**good, "name": "baseline"}, "not 'baseline'"),
    ({**good, "name": "a/b"}, "letters, digits"),
    ({**good, "overrides": {}}, "no overrides"),
    ({**good, "better": "up"}, "better must be"),
    ({**good, "min_gain": -1}, "min_gain must be"),
    ({"name": "x"}, "want name, overrides"),
  ]:
    with pytest.raises(ValueError, match=match):
      gate.Candidate.from_dict(bad)
  assert gate_cli.parse_candidates([json.dumps([good, {**good, "name": "y"}])])[1].name == "y"
  with pytest.raises(ValueError, match="not JSON"):
    gate_cli.parse_candidates(["{name"])
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    gate.run_gate(
      [str(tmp_path / "empty")], [gate.Candidate.from_dict(good)], 1, str(tmp_path / "g")
    )
  # Everything is checked before any branch trains: a bad override of the last candidate, a
  # target the source never reported, a gate folder inside the source (which would copy
  # itself), a tolerance that is no number.
  src, calls, out = _gate_source(tmp_path / "s"), [], str(tmp_path / "g")
  ok = gate.Candidate("ok", {"train.lr": 1e-5}, "dead_groups")
  for cands, kw, match in [
    ([ok, gate.Candidate("x", {"train.nope": 1}, "dead_groups")], {}, "branch x .*no such field"),
    (
      [ok, gate.Candidate("x", {"sampling.temperature": -1.0}, "dead_groups")],
      {},
      "branch x .*temperature",
    ),
    (
      [gate.Candidate("x", {"train.lr": 1e-5}, "solution_diversty")],
      {},
      "never reported diag/solution_diversty",
    ),
    ([ok], {"tolerance": float("nan")}, "tolerance must be"),
  ]:
    with pytest.raises(ValueError, match=match):
      gate.run_gate([src], cands, 1, out, fit=_scripted_fit(calls), **kw)
  with pytest.raises(ValueError, match="inside the source"):
    gate.run_gate([src], [ok], 1, os.path.join(src, "gate"), fit=_scripted_fit(calls))
  assert calls == [] and not os.path.exists(out) and not os.path.exists(os.path.join(src, "gate"))
  # A --skills file that is not one is never rewritten.
  other = tmp_path / "metrics_copy.jsonl"
  other.write_text('{"step": 1, "reward/mean": 0.5}\n')
  with pytest.raises(ValueError, match="not a skills file"):
    gate.run_gate([src], [ok], 1, out, skills=str(other), fit=_scripted_fit(calls))
  assert other.read_text() == '{"step": 1, "reward/mean": 0.5}\n' and calls == []


def test_a_run_older_than_a_config_group_branches_with_its_defaults(tmp_path):
  """config.json of a run made before `diagnostics` existed, laid over the config file as loaded
  now: the run's own values win, the new group takes its defaults."""
  cfg = _base_config()
  cfg.train.lr = 7e-6
  old = json.loads(cfg.to_json_best_effort())
  del old["diagnostics"], old["train"]["drop_dead_groups"]
  (tmp_path / "config.json").write_text(json.dumps(old))
  assert "diagnostics" not in backtest.run_config_of(str(tmp_path))
  got = backtest.run_config_of(str(tmp_path), _base_config())
  assert got.train.lr == 7e-6 and got.diagnostics.enabled and got.train.drop_dead_groups is False
  assert got.train.drop_from_loss == () and isinstance(got.feedback.kinds, tuple)
  from coevolve_jax import config  # noqa: PLC0415
  from coevolve_jax.cli import gate as gate_cli  # noqa: PLC0415

  config.validate(got)
  # The gate's command line without --config: configs/base.py's shared groups fill the gaps.
  base = backtest.run_config_of(str(tmp_path), gate_cli.load_config_file(gate_cli.BASE_CONFIG))
  assert base.train.lr == 7e-6 and base.diagnostics.modules == () and base.env == "bfcl"
  config.validate(base)
  with pytest.raises(ValueError, match="--config .*base.py:cpu"):
    gate_cli.load_config_file(gate_cli.BASE_CONFIG + ":cpu")  # base.py has no variants
