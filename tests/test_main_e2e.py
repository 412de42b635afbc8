"""End to end: the CPU preset of the main job, shrunk to two GRPO steps and one feedback round.

Runs the real path (BFCL data and backends, exploration, warm-start, rollouts, official checker,
GRPO, feedback round, orbax checkpoints, summary), then checks resume (also after a full disk
stopped it) and completion behaviour.
"""

import importlib.util
import json
import os

import pytest
from disk_full import assert_disk_full, orbax_write_fails

from coevolve_jax.errors import DiskFullError
from coevolve_jax.loop import CoEvolveRun, RunError
from envs.bfcl.suite import BfclSuite

_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "bfcl.py")


def _load_config_module():
  spec = importlib.util.spec_from_file_location("bfcl_config", _CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


SUMMARY_KEYS = {
  "eval_before",
  "eval_after",
  "steps",
  "resumed_from_step",
  "signals",
  "tasks_synthesized",
  "tasks_accepted",
  "pool_size",
  "wall_s",
  "phase_s",
}
PHASES = {"rollout", "reward", "train", "feedback", "eval", "checkpoint"}


def small_config():
  cfg = _load_config_module().get_config("cpu")
  cfg.data.eval_size = 4
  cfg.eval.max_tasks = 2
  cfg.eval.max_new_tokens = 8
  cfg.eval.max_steps_per_turn = 1
  cfg.explore.initial_tasks = 6
  cfg.feedback.max_contexts = 2
  cfg.warmstart.steps = 2
  cfg.warmstart.batch_size = 2
  cfg.rollout.tasks_per_step = 2
  cfg.rollout.group_size = 2
  cfg.rollout.num_slots = 4
  cfg.rollout.max_new_tokens = 12
  cfg.rollout.max_model_steps = 2
  cfg.signals.rare_min_total = 1
  cfg.train.steps = 2
  cfg.train.mini_batches = 2
  cfg.feedback.every = 2
  cfg.checkpoint.every = 1
  return cfg


@pytest.mark.timeout(400)
def test_two_steps_one_feedback_round_then_resume_and_complete(tmp_path, capsys, monkeypatch):
  workdir = str(tmp_path / "run")
  cfg = small_config()
  cfg.train.steps = 1  # first invocation stops after step 1 (as if killed after its checkpoint)
  first = CoEvolveRun(cfg, workdir).fit()
  assert first["steps"] == 1 and first["resumed_from_step"] == 0

  # Same run, 2 steps, but the disk is full when step 2's checkpoint is written in the background
  # (after the feedback round joined the pool and the logs): one DiskFullError naming the step.
  with monkeypatch.context() as m:
    orbax_write_fails(m, "write_text", "meta.orbax-checkpoint-tmp/metadata")
    with pytest.raises(DiskFullError) as e:
      CoEvolveRun(small_config(), workdir).fit()
  assert_disk_full(e.value, os.path.join(workdir, "checkpoints", "2"))
  assert not os.path.exists(os.path.join(workdir, "summary.json.tmp"))
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f) == first  # not replaced by the failed session

  cfg = small_config()  # space again: resumes from the step-1 checkpoint
  summary = CoEvolveRun(cfg, workdir).fit()
  assert SUMMARY_KEYS <= set(summary)
  assert summary["steps"] == 2 and summary["resumed_from_step"] == 1
  assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0
  assert set(summary["signals"]) == {"forgetting", "boundary", "rare"}
  assert PHASES <= set(summary["phase_s"])
  assert summary["phase_s"]["rollout"] > 0 and summary["phase_s"]["train"] > 0
  assert summary["pool_size"] >= summary["d0"]["added"] > 0
  assert summary["pool_size"] == summary["d0"]["added"] + summary["tasks_accepted"]

  with open(os.path.join(workdir, "feedback.jsonl")) as f:
    rounds = [json.loads(line) for line in f]
  assert [r["round"] for r in rounds] == [1]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  grpo_steps = [r["step"] for r in rows if "reward/mean" in r]
  assert grpo_steps == [1, 2]  # one row per step, also across the resume
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f) == summary

  capsys.readouterr()
  again = CoEvolveRun(small_config(), workdir).fit()  # rerun after completion: nothing to do
  assert again == summary
  assert "complete" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_an_empty_d0_pool_stops_with_a_clear_error(tmp_path, monkeypatch):
  """Exploration that yields no task (every candidate failed) ends the run before warm-start
  with RunError (exit 2 from main) instead of a bare `max()` of an empty demo list."""
  monkeypatch.setattr(BfclSuite, "initial_tasks", lambda self, n, rng, llm: ([], {"accepted": 0}))
  with pytest.raises(RunError, match="task pool empty"):
    CoEvolveRun(small_config(), str(tmp_path / "run")).fit()
