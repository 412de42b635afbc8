"""Tests for coevolve_jax.feedback.signals on hand-built histories."""

from __future__ import annotations

import json

import pytest

from coevolve_jax.feedback.signals import (
  BOUNDARY,
  FORGETTING,
  RARE,
  RolloutRecord,
  Signal,
  SignalEvent,
  SignalTracker,
)


def rec(task, score, idx, tools=("a",), group=None):
  return RolloutRecord(
    task_id=task,
    group_id=group if group is not None else task,
    score=score,
    tool_names=list(tools),
    trajectory_index=idx,
  )


def kinds(signals, kind):
  return sorted(s.trajectory_index for s in signals if s.kind == kind)


# ------------------------------------------------------------------ forgetting


def test_first_visit_never_forgets():
  tr = SignalTracker(rare_min_total=10**9)
  sig = tr.update([rec("t", 0.0, 0), rec("t", 0.0, 1)])
  assert kinds(sig, FORGETTING) == []
  assert tr.history["t"] == [(0, 0.0)]  # (step, best rollout score)


def test_forgetting_after_success():
  tr = SignalTracker(rare_min_total=10**9)
  tr.update([rec("t", 1.0, 0), rec("t", 1.0, 1)])  # visit mean 1.0
  sig = tr.update([rec("t", 0.0, 0), rec("t", 1.0, 1), rec("u", 0.0, 2)])
  assert kinds(sig, FORGETTING) == [0]  # only the failed rollout of t
  assert [s for s in sig if s.kind == FORGETTING] == [Signal(FORGETTING, "t", 0)]


def test_forgetting_edges_exactly_half():
  tr = SignalTracker(rare_min_total=10**9)
  tr.update([rec("t", 0.5, 0)])  # 0.5 counts as "was solved" (>= 0.5)
  assert kinds(tr.update([rec("t", 0.49, 0)]), FORGETTING) == [0]
  tr = SignalTracker(rare_min_total=10**9)
  tr.update([rec("t", 1.0, 0)])
  assert kinds(tr.update([rec("t", 0.5, 0)]), FORGETTING) == []  # 0.5 now is not < 0.5
  tr = SignalTracker(rare_min_total=10**9)
  tr.update([rec("t", 0.49, 0)])
  assert kinds(tr.update([rec("t", 0.0, 0)]), FORGETTING) == []  # earlier 0.49 is not >= 0.5


def test_forgetting_per_rollout_fires_on_2_of_8_then_0_of_8():
  """The issue's case: solved by 2 of 8 rollouts, then by none. Some earlier rollout scored
  >= 0.5, so all 8 failures fire (paper: "previously solved"); the per-visit mean (0.25) would
  not fire."""
  first = [rec("t", 1.0 if i < 2 else 0.0, i) for i in range(8)]
  then = [rec("t", 0.0, i) for i in range(8)]
  tr = SignalTracker(rare_min_total=10**9)
  tr.update(first)
  assert kinds(tr.update(then), FORGETTING) == list(range(8))
  tr = SignalTracker(rare_min_total=10**9, forgetting="visit_mean")
  tr.update(first)
  assert kinds(tr.update(then), FORGETTING) == []


def test_forgetting_visit_mean_option_uses_the_group_mean():
  tr = SignalTracker(rare_min_total=10**9, forgetting="visit_mean")
  tr.update([rec("t", 1.0, 0), rec("t", 0.0, 1), rec("t", 0.0, 2)])  # mean 1/3 < 0.5
  assert kinds(tr.update([rec("t", 0.0, 0)]), FORGETTING) == []
  tr.update([rec("t", 1.0, 0), rec("t", 0.0, 1)])  # mean 0.5 >= 0.5
  assert kinds(tr.update([rec("t", 0.0, 7)]), FORGETTING) == [7]


def test_current_step_does_not_count_as_earlier():
  tr = SignalTracker(rare_min_total=10**9)
  # Success and failure at the same (first) visit: no forgetting, only boundary.
  sig = tr.update([rec("t", 1.0, 0), rec("t", 0.0, 1)])
  assert kinds(sig, FORGETTING) == [] and kinds(sig, BOUNDARY) == [0, 1]


def test_forgetting_window_expires():
  tr = SignalTracker(window=2, rare_min_total=10**9)
  tr.update([rec("t", 1.0, 0)])
  tr.update([rec("t", 0.0, 0)])  # fires; history [1.0, 0.0]
  sig = tr.update([rec("t", 0.0, 0)])  # history [1.0, 0.0] still has 1.0 -> fires
  assert kinds(sig, FORGETTING) == [0]
  # history now [0.0, 0.0]: the success fell out of the window.
  assert kinds(tr.update([rec("t", 0.0, 0)]), FORGETTING) == []


@pytest.mark.parametrize(("window", "fires"), [(2, False), (3, True)])
def test_forgetting_window_counts_training_iterations_not_visits(window, fires):
  """Solved at step 0, not rolled out at steps 1-2, failed at step 3: the success is 3 steps
  old, inside a window of 3 iterations and outside one of 2 (a window of visits would hold it
  in both)."""
  tr = SignalTracker(window=window, rare_min_total=10**9)
  tr.update([rec("t", 1.0, 0)])
  tr.update([rec("u", 0.0, 0)])
  tr.update([rec("u", 0.0, 0)])
  assert kinds(tr.update([rec("t", 0.0, 0)]), FORGETTING) == ([0] if fires else [])


# ------------------------------------------------------------------ boundary


def test_boundary_mixed_group_marks_all():
  tr = SignalTracker(rare_min_total=10**9)
  sig = tr.update([rec("t", 1.0, 0), rec("t", 0.0, 1), rec("t", 0.0, 2), rec("u", 1.0, 3)])
  assert kinds(sig, BOUNDARY) == [0, 1, 2]
  assert all(s.task_id == "t" for s in sig if s.kind == BOUNDARY)


@pytest.mark.parametrize(
  "scores", [[1.0, 1.0, 1.0], [0.0, 0.0], [0.5, 0.5], [0.5, 1.0], [0.5, 0.0], [0.7]]
)
def test_boundary_no_fire(scores):
  tr = SignalTracker(rare_min_total=10**9)
  sig = tr.update([rec("t", s, i) for i, s in enumerate(scores)])
  assert kinds(sig, BOUNDARY) == []


def test_boundary_strict_half_with_both_sides():
  tr = SignalTracker(rare_min_total=10**9)
  sig = tr.update([rec("t", 0.5, 0), rec("t", 0.51, 1), rec("t", 0.49, 2)])
  assert kinds(sig, BOUNDARY) == [0, 1, 2]


def test_boundary_groups_by_task_across_group_ids():
  tr = SignalTracker(rare_min_total=10**9)
  sig = tr.update([rec("t", 1.0, 0, group="g1"), rec("t", 0.0, 1, group="g2")])
  assert kinds(sig, BOUNDARY) == [0, 1]


# ------------------------------------------------------------------ rare


def test_rare_needs_min_total():
  tr = SignalTracker(rare_min_total=50, rare_theta_percent=5.0, rare_count="trajectories")
  recs = [rec("t", 1.0, i, tools=("common",)) for i in range(48)] + [rec("t", 1.0, 48, ("odd",))]
  assert kinds(tr.update(recs), RARE) == []  # N = 49 < 50
  assert tr.total == 49
  sig = tr.update([rec("t", 1.0, 0, ("common",))])  # N = 50 now; odd has 1/50 = 2%
  assert kinds(sig, RARE) == []  # this step's trajectory is common
  sig = tr.update([rec("t", 1.0, 5, ("odd",)), rec("t", 1.0, 6, ("common",))])
  assert kinds(sig, RARE) == [5]  # odd: 2/52 < 5%


def test_rare_is_judged_before_the_step_is_counted_and_needs_a_recurring_pattern():
  tr = SignalTracker(rare_min_total=10, rare_theta_percent=10.0, rare_count="trajectories")
  recs = [rec("t", 0.0, i, ("x", "y")) for i in range(19)] + [rec("t", 0.0, 19, ("y", "x"))]
  assert kinds(tr.update(recs), RARE) == []  # judged against N = 0: nothing
  # Against N = 20: (y,x) 1/20 = 5% < 10% and seen before -> fires; z is new -> does not,
  # though 1/21 of the counts after this step; (x,y) 19/20 is common.
  sig = tr.update(
    [rec("t", 0.0, 0, ("z",)), rec("t", 0.0, 1, ("y", "x")), rec("t", 0.0, 2, ("x", "y"))]
  )
  assert kinds(sig, RARE) == [1]
  assert kinds(tr.update([rec("t", 0.0, 5, ("z",))]), RARE) == [5]  # z recurs: 1/23


def test_rare_counted_per_task_ignores_a_tasks_own_solution_and_fires_on_shared_patterns():
  """Default counting: each task counts once per pattern. 20 tasks each repeat their own
  sequence (8 rollouts, 3 steps): each sequence has share 1/22 < 5% but one task, so never
  fires. ("odd",) is then shown by task a, and by task b a step later: 2 tasks, share 1/22."""
  tr = SignalTracker(rare_min_total=1, rare_theta_percent=5.0)
  own = [rec(f"t{i}", 1.0, 8 * i + j, (f"tool{i}", "x")) for i in range(20) for j in range(8)]
  for _ in range(3):
    assert kinds(tr.update(own), RARE) == []
  assert tr.total == 20  # (task, pattern) pairs, not trajectories
  assert kinds(tr.update([rec("a", 0.0, 0, ("odd",)), rec("c", 0.0, 1, ("common",))]), RARE) == []
  assert kinds(tr.update([rec("a", 0.0, 3, ("odd",))]), RARE) == []  # still one task
  assert kinds(tr.update([rec("b", 0.0, 4, ("odd",)), rec("b", 0.0, 5, ("y",))]), RARE) == [4]
  assert tr.pattern_tasks['["odd"]'] == {"a", "b"}


@pytest.mark.parametrize(("least", "want"), [(2, [[], [0], [0]]), (3, [[], [], [0]])])
def test_rare_min_count_counts_tasks(least, want):
  """2 (default): a second task showing the pattern fires; 3: a third."""
  tr = SignalTracker(rare_min_total=1, rare_theta_percent=10.0, rare_min_count=least)
  tr.update([rec(f"c{i}", 0.0, i, (f"common{i % 2}",)) for i in range(30)])
  got = [kinds(tr.update([rec(task, 0.0, 0, ("odd",))]), RARE) for task in ("a", "b", "c")]
  assert got == want


def test_rare_tool_sequence_is_ordered_and_includes_empty():
  tr = SignalTracker(rare_min_total=0, rare_theta_percent=30.0, rare_count="trajectories")
  step = [
    rec("t", 0.0, 0, ("a", "b")),
    rec("t", 0.0, 1, ("a", "b")),
    rec("t", 0.0, 2, ("a", "b")),
    rec("t", 0.0, 3, ("b", "a")),
    rec("t", 0.0, 4, ()),
  ]
  assert kinds(tr.update(step), RARE) == []  # nothing counted before
  assert kinds(tr.update(step), RARE) == [3, 4]  # 1/5 = 20% < 30%; ("a","b") is 60%


def test_rare_ngram_patterns():
  tr = SignalTracker(
    rare_min_total=0, rare_theta_percent=20.0, pattern="ngram:2", rare_count="trajectories"
  )
  assert tr.patterns(["a", "b", "a", "b"]) == ['["a", "b"]', '["b", "a"]']  # distinct
  assert tr.patterns(["a"]) == ['["a"]']
  assert tr.patterns([]) == ["[]"]
  recs = [rec("t", 0.0, i, ("ls", "cd", "ls")) for i in range(4)]
  recs.append(rec("t", 0.0, 4, ("ls", "cd", "rm")))
  assert kinds(tr.update(recs), RARE) == []
  # counts: (ls,cd) 5, (cd,ls) 4, (cd,rm) 1; N = 10; (cd,rm) 10% < 20%.
  assert tr.total == 10
  assert tr.share('["cd", "rm"]') == pytest.approx(0.1)
  assert kinds(tr.update(recs), RARE) == [4]


def test_rare_theta_zero_never_fires():
  tr = SignalTracker(rare_min_total=0, rare_theta_percent=0.0, rare_count="trajectories")
  sig = tr.update([rec("t", 0.0, 0, ("a",))] + [rec("t", 0.0, i, ("b",)) for i in range(1, 50)])
  assert kinds(sig, RARE) == []


# ------------------------------------------------------------------ bookkeeping


def test_all_three_kinds_and_counts():
  tr = SignalTracker(rare_min_total=0, rare_theta_percent=40.0, rare_count="trajectories")
  tr.update([rec("t", 1.0, 0, ("a",)), rec("t", 1.0, 1, ("a",)), rec("t", 1.0, 2, ("z",))])
  sig = tr.update([rec("t", 0.0, 0, ("z",)), rec("t", 1.0, 1, ("a",))])
  assert Signal(FORGETTING, "t", 0) in sig
  assert Signal(BOUNDARY, "t", 0) in sig and Signal(BOUNDARY, "t", 1) in sig
  assert Signal(RARE, "t", 0) in sig  # z: 1/3 = 33% < 40% before this step
  assert [s.kind for s in sig] == [FORGETTING, BOUNDARY, BOUNDARY, RARE]
  assert tr.counts == {FORGETTING: 1, BOUNDARY: 2, RARE: 1}
  assert tr.steps == 2


def test_invalid_inputs_leave_state_unchanged():
  tr = SignalTracker()
  before = json.dumps(tr.state_dict())
  for bad in ([rec("t", 1.5, 0)], [rec("t", float("nan"), 0)], [rec("t", 1.0, 0), rec("u", 0, 0)]):
    with pytest.raises(ValueError):
      tr.update(bad)
    assert json.dumps(tr.state_dict()) == before
  for kwargs in (
    {"window": 0},
    {"pattern": "ngram:0"},
    {"pattern": "bag"},
    {"rare_theta_percent": -1},
    {"forgetting": "mean"},
    {"rare_min_count": 0},
    {"rare_count": "patterns"},
  ):
    with pytest.raises(ValueError):
      SignalTracker(**kwargs)


def test_empty_step():
  tr = SignalTracker()
  assert tr.update([]) == []
  assert tr.steps == 1


def test_state_dict_roundtrip_through_json():
  tr = SignalTracker(window=3, rare_min_total=0, rare_theta_percent=30.0, pattern="ngram:2")
  tr.update([rec("t", 1.0, 0, ("a", "b", "c")), rec("u", 0.0, 1, ("a", "b"))])
  tr.update([rec("t", 0.0, 0, ("a", "b")), rec("u", 1.0, 1, ("c", "d"))])
  state = json.loads(json.dumps(tr.state_dict()))
  tr2 = SignalTracker(window=3, rare_min_total=0, rare_theta_percent=30.0, pattern="ngram:2")
  tr2.load_state_dict(state)
  assert tr2.state_dict() == tr.state_dict()
  step = [rec("t", 0.0, 0, ("x", "y")), rec("u", 0.0, 1, ("a", "b")), rec("u", 1.0, 2, ("c", "d"))]
  assert tr2.update(step) == tr.update(step)
  assert tr2.state_dict() == tr.state_dict()
  with pytest.raises(ValueError):
    SignalTracker(pattern="tool_sequence").load_state_dict(state)
  with pytest.raises(ValueError):
    SignalTracker(pattern="ngram:2").load_state_dict({**state, "version": 99})


def test_load_state_trims_to_smaller_window():
  tr = SignalTracker(window=5, rare_min_total=10**9)
  for s in (1.0, 0.0, 0.0, 0.0):
    tr.update([rec("t", s, 0)])
  small = SignalTracker(window=2, rare_min_total=10**9)
  small.load_state_dict(tr.state_dict())
  assert kinds(small.update([rec("t", 0.0, 0)]), FORGETTING) == []  # steps 2-3 only
  assert small.history["t"] == [(2, 0.0), (3, 0.0), (4, 0.0)]


def test_load_state_of_version_1_reads_visits_as_the_last_steps():
  """A checkpoint from before the per-iteration window: visit means, no steps."""
  old = {"version": 1, "config": {"pattern": "tool_sequence"}, "history": {"t": [1.0, 0.0]}}
  old.update(pattern_counts={}, total=0, counts={}, steps=7)
  for window, want in ((2, [0]), (1, [])):  # step 7 looks back to steps 5-6, or to step 6
    tr = SignalTracker(window=window, rare_min_total=10**9)
    tr.load_state_dict(old)
    assert tr.history["t"] == [(5, 1.0), (6, 0.0)]
    assert kinds(tr.update([rec("t", 0.0, 0)]), FORGETTING) == want


def test_success_threshold_is_configurable():
  tr = SignalTracker(rare_min_total=10**9, success_threshold=0.8)
  tr.update([rec("t", 0.8, 0)])  # 0.8 >= 0.8: solved
  sig = tr.update([rec("t", 0.7, 0), rec("t", 0.9, 1)])  # 0.7 < 0.8 after a solve
  assert kinds(sig, FORGETTING) == [0] and kinds(sig, BOUNDARY) == [0, 1]
  with pytest.raises(ValueError):
    SignalTracker(success_threshold=1.5)


def test_observe_turns_trajectories_into_events_of_their_tasks():
  """`observe` maps each fired signal back to its trajectory's task (group_id indexes `tasks`),
  calls and reward, in `update`'s order (kind, then trajectory)."""
  from coevolve_jax.types import Task, Trajectory  # noqa: PLC0415

  tasks = [Task("t0", "bfcl", ["q0"], [["a()"]]), Task("t1", "bfcl", ["q1"], [["b()"]])]
  trajs = [
    Trajectory("t0", 0, reward=1.0, tool_names=["a"], calls=[["a()"]]),
    Trajectory("t0", 0, reward=0.0, tool_names=[], calls=[[]]),
    Trajectory("t1", 1, reward=0.0, tool_names=["b"], calls=[["b()"]]),
    Trajectory("t1", 1, reward=0.0, tool_names=["b"], calls=[["b()"]]),
  ]
  events = SignalTracker(rare_min_total=1000).observe(trajs, tasks)
  assert [(e.task.task_id, e.signal, e.calls, e.reward) for e in events] == [
    ("t0", BOUNDARY, [["a()"]], 1.0),
    ("t0", BOUNDARY, [[]], 0.0),
  ]
  again = SignalEvent.from_dict(json.loads(json.dumps(events[0].to_dict())))
  assert again == events[0]


def test_from_config_reads_every_field_by_name():
  import ml_collections  # noqa: PLC0415

  cfg = ml_collections.ConfigDict(
    {
      "window": 3,
      "rare_theta_percent": 7.5,
      "rare_min_total": 11,
      "pattern": "ngram:2",
      "success_threshold": 0.25,
      "forgetting": "visit_mean",
      "rare_min_count": 3,
      "rare_count": "trajectories",
    }
  )
  t = SignalTracker.from_config(cfg)
  got = (t.window, t.rare_theta_percent, t.rare_min_total, t.pattern, t.success_threshold)
  assert got == (3, 7.5, 11, "ngram:2", 0.25)
  assert (t.forgetting, t.rare_min_count, t.rare_count) == ("visit_mean", 3, "trajectories")


def test_simulation_script_reproduces_the_order_and_refuses_bad_sizes(capsys):
  """scripts/simulate_signals.py (docs/design.md §1.1): rare is the smallest share under the
  defaults (exit 0); impossible pools are argument errors, not numpy tracebacks."""
  import importlib.util  # noqa: PLC0415
  import os  # noqa: PLC0415

  path = os.path.join(os.path.dirname(__file__), "..", "scripts", "simulate_signals.py")
  spec = importlib.util.spec_from_file_location("simulate_signals", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert module.main(["--steps", "4"]) == 0
  assert "smallest share under the defaults: rare" in capsys.readouterr().out
  for bad in (["--tasks", "10"], ["--group_size", "1"], ["--steps", "0"], ["--learning", "nan"]):
    with pytest.raises(SystemExit) as e:
      module.main(bad)
    assert e.value.code == 2, bad
