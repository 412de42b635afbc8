"""Programmatic exploration, template abstraction, execution-based validation and the controller."""

import dataclasses

import numpy as np
import pytest

from envs.bfcl.abstraction import abstract_task
from coevolve_jax.feedback.signals import SignalEvent
from coevolve_jax.feedback.exploration import ExplorationContext
from coevolve_jax.feedback.rounds import commit_round, select_events
from coevolve_jax.feedback.synthesis import initial_tasks, synthesize_round
from envs.bfcl.explorer import ProgrammaticExplorer
from envs.bfcl.synthesis import BfclSynthesizer, SynthesisSettings
from coevolve_jax.feedback.pool import TaskPool
from envs.bfcl.sandbox import Sandbox
from envs.bfcl.validation import validate_task
from envs.bfcl.data import load_bfcl_tasks, split_tasks


@pytest.fixture(scope="module")
def tasks():
  return load_bfcl_tasks("multi_turn_base")


def _context(task, **kw):
  kw.setdefault("rounds", 2)
  kw.setdefault("steps_per_round", 8)
  return ExplorationContext(task.task_id, task.initial_config, task.involved_classes, **kw)


def test_explorer_deterministic_for_seed(tasks):
  ctx = _context(tasks[3])
  a = ProgrammaticExplorer().explore(ctx, np.random.default_rng(7))
  b = ProgrammaticExplorer().explore(ctx, np.random.default_rng(7))
  c = ProgrammaticExplorer().explore(ctx, np.random.default_rng(8))
  assert a and a == b and a != c
  assert {t.run_id for t in a} == {0, 1}


def test_explorer_calls_change_real_state(tasks):
  task = tasks[0]
  triplets = ProgrammaticExplorer().explore(
    _context(task, rounds=1, steps_per_round=10), np.random.default_rng(0)
  )
  with Sandbox(task.initial_config, task.involved_classes) as box:
    before = box.full_state()
    for t in triplets:
      assert box.run_ok(t.action)[1] == t.observation  # Real, reproducible results.
    assert box.full_state() != before


def test_forgetting_replays_focus_first(tasks):
  task = tasks[0]
  ctx = _context(task, signal="forgetting", focus_calls=task.ground_truth[0], rounds=1)
  actions = [t.action for t in ProgrammaticExplorer().explore(ctx, np.random.default_rng(1))]
  assert actions[:3] == [
    "cd(folder='document')",
    "mkdir(dir_name='temp')",
    "mv(source='final_report.pdf', destination='temp')",
  ]


def test_abstraction_and_validation(tasks):
  for i, task in enumerate(tasks[:12:4]):
    ctx = _context(task)
    triplets = ProgrammaticExplorer().explore(ctx, np.random.default_rng(i))
    new = abstract_task(triplets, ctx, f"t{i}", min_calls=3, max_turns=2, source="explore")
    assert new is not None and sum(len(t) for t in new.ground_truth) >= 3
    assert len(new.turns) == 2 and all(new.turns) and new.source == "explore"
    assert new.provenance["parent_task_id"] == task.task_id
    result = validate_task(new)
    assert result.accepted, result.reason


def test_validation_rejects_corrupted_tasks(tasks):
  good = tasks[0]
  assert validate_task(good).accepted
  failing = dataclasses.replace(
    good, ground_truth=[good.ground_truth[0] + ["cd(folder='no_such_dir')"]] + good.ground_truth[1:]
  )
  assert not validate_task(failing).accepted
  unsafe = dataclasses.replace(
    good, ground_truth=[["__import__('os').system('true')"]] + good.ground_truth[1:]
  )
  assert "unsafe" in validate_task(unsafe).reason
  short = dataclasses.replace(good, turns=["x"], ground_truth=[["ls()"]])
  assert not validate_task(short).accepted


def test_controller_d0_and_round(tasks, tmp_path):
  train, held = split_tasks(tasks, 20, seed=0)
  d0_synth = BfclSynthesizer(SynthesisSettings(rounds=2, steps_per_round=10), None)
  d0, counts = initial_tasks(d0_synth, train, 3, np.random.default_rng(0))
  assert len(d0) == 3 and counts["accepted"] == 3 and all(t.source == "explore" for t in d0)
  pool = TaskPool(tmp_path / "pool.jsonl")
  assert pool.add(d0, eval_tasks=held).added == 3
  events = [
    SignalEvent(d0[0], "forgetting", [[]], 0.0),
    SignalEvent(d0[1], "boundary", d0[1].ground_truth, 1.0),
    SignalEvent(d0[2], "rare", d0[2].ground_truth, 1.0),
  ]
  rng = np.random.default_rng(0)
  synth = BfclSynthesizer(SynthesisSettings(rounds=2, steps_per_round=8), None)
  result = synthesize_round(synth, select_events(events, rng, 3), rng, 1)
  report = commit_round(result, pool, held)
  assert report.synthesized == 3 and report.accepted + len(report.dropped) <= 3
  assert report.accepted >= 1 and len(pool) == 3 + report.accepted
  assert set(report.per_signal) == {"forgetting", "boundary", "rare"}
  synth = [t for t in pool.tasks if t.source == "synth"]
  assert (
    synth
    and synth[0].provenance["round"] == 1
    and synth[0].provenance["signal"] in report.per_signal
  )
