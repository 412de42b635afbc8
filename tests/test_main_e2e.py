"""End to end: the CPU preset of the main job, shrunk to two GRPO steps and one feedback round.

Runs the real path (BFCL data and backends, exploration, warm-start, rollouts, official checker,
GRPO, feedback round, orbax checkpoints, summary), then checks resume (also after a full disk
stopped it) and completion behaviour.
"""

import ast
import dataclasses
import importlib.util
import json
import os
import types
import uuid

import numpy as np
import pytest
from disk_full import assert_disk_full, orbax_write_fails

from coevolve_jax import backtest, hooks
from coevolve_jax.errors import CorruptFileError, DiskFullError
from coevolve_jax.feedback import synthesis
from coevolve_jax.feedback.rounds import RoundResult
from coevolve_jax.feedback.signals import KINDS
from coevolve_jax.loop import CoEvolveRun, RunError
from coevolve_jax.types import FINISHES, Task, Trajectory
from envs.bfcl.data import disjoint_states, load_bfcl_tasks, split_tasks

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


def _another_model_is_refused_and_moves_nothing(tmp_path, workdir, config):
  """The same workdir resumed with a wider model (a Hugging Face folder): one RunError that
  names the differing arrays and the changed model field, with every checkpoint, log and pool
  line left as it was (it used to call the checkpoints unreadable and advise deleting them)."""
  from coevolve_jax.models import QwenConfig, builder, hf  # noqa: PLC0415

  folder = str(tmp_path / "wider-model")
  wider = dataclasses.replace(QwenConfig.tiny_cpu(), hidden_size=192)
  hf.save_pretrained(builder.init(wider, seed=0), folder)
  files = lambda: sorted(  # noqa: E731
    (os.path.relpath(os.path.join(d, f), workdir), os.path.getsize(os.path.join(d, f)))
    for d, _, names in os.walk(workdir)
    for f in names
    if not f.startswith("run.lock")  # each session holds the lock and names itself
  )
  before = files()
  cfg = config()
  cfg.model.checkpoint = folder
  with pytest.raises(RunError) as e:
    CoEvolveRun(cfg, workdir).fit()
  message = str(e.value)
  assert "checkpoint step 1" in message and "saved for another model" in message, message
  assert ", 128) saved, " in message and ", 192) configured" in message, message
  assert f"model.checkpoint: '' when saved, {folder!r} now" in message, message
  assert "delete" not in message and "unreadable" not in message
  assert files() == before


def small_config():
  cfg = _load_config_module().get_config("cpu")
  cfg.bfcl.eval_size = 4
  cfg.eval.max_tasks = 2
  cfg.eval.max_new_tokens = 8
  cfg.eval.max_steps_per_turn = 1
  cfg.explore.initial_tasks = 6
  cfg.feedback.max_contexts = 2
  cfg.warmstart.steps = 2
  cfg.warmstart.batch_size = 2
  cfg.rollout.tasks_per_step = 2
  cfg.rollout.group_size = 2
  cfg.engine.num_slots = 4
  cfg.episode.max_new_tokens = 12
  cfg.episode.max_model_steps = 2
  cfg.signals.rare_min_total = 1
  cfg.train.steps = 2
  cfg.train.mini_batches = 2
  cfg.feedback.every = 2
  cfg.checkpoint.every = 1
  cfg.eval.generated_tasks = 2
  # compile.ahead as in the preset, on a set this small: a 2,048-token cache (episodes here are
  # ~1.1k tokens), prefill chunks of 512 only (shorter ones at the end of a cache), one train
  # bucket (T 2,048, P 24 = 2 replies x 12 tokens).
  cfg.engine.cache_len = 2048
  cfg.engine.prefill_min_chunk = 512
  cfg.train.len_buckets = (2048,)
  cfg.train.target_buckets = (24,)
  return cfg


@pytest.fixture
def restore_compile_cache():
  """A run's `compile.cache_dir` points this process's JAX at its folder: put back the process's
  setting afterwards, so later tests in this worker do not store into this test's folder."""
  import jax  # noqa: PLC0415
  from jax.experimental.compilation_cache import compilation_cache  # noqa: PLC0415

  before = jax.config.jax_compilation_cache_dir
  yield
  jax.config.update("jax_compilation_cache_dir", before)
  compilation_cache.reset_cache()


def _from_cache(out: str) -> int:
  """Programs the session loaded from the compilation cache before GRPO, from its print."""
  (line,) = [x for x in out.splitlines() if "programs before GRPO" in x]
  return int(line.rsplit("; ", 1)[1].split()[0])


class _StepCounter:
  """A training hook with state of its own: the steps and rollouts it has seen, as a metric."""

  name = "step_counter"

  def __init__(self):
    self.steps, self.rollouts, self.resumed_at = 0, 0, []

  def on_step(self, record):
    self.steps += 1
    self.rollouts += len(record.trajectories)
    assert record.advantages.shape == (len(record.trajectories),)
    return {"hooks/steps_seen": self.steps, "hooks/rollouts_seen": self.rollouts}

  def state_dict(self):
    return {"steps": self.steps, "rollouts": self.rollouts}

  def load_state_dict(self, state):
    self.steps, self.rollouts = state["steps"], state["rollouts"]

  def on_resume(self, step):
    self.resumed_at.append(step)


@pytest.mark.timeout(400)
@pytest.mark.usefixtures("restore_compile_cache")
def test_two_steps_one_feedback_round_then_resume_and_complete(tmp_path, capsys, monkeypatch):
  workdir = str(tmp_path / "run")
  cache_dir = str(tmp_path / "compile_cache")  # kept by every session of this run
  counters = []  # one hook per session; its state comes back from the checkpoint
  monkeypatch.setitem(
    hooks.HOOKS, "step_counter", lambda cfg, wd: counters.append(_StepCounter()) or counters[-1]
  )

  def config():
    cfg = small_config()
    cfg.train.hooks = ("group_log", "step_counter")
    cfg.eval.generated_before_warmstart = True
    cfg.diagnostics.rollout_log = True
    return cfg

  # The first session runs both steps, but the disk is full when step 2's checkpoint is written
  # in the background (after the feedback round joined the pool and the logs): one DiskFullError
  # naming the step, no summary; step 1's checkpoint stands (as if killed after writing it).
  cfg = config()
  cfg.compile.cache_dir = cache_dir
  with monkeypatch.context() as m:
    orbax_write_fails(m, "write_text", "meta.orbax-checkpoint-tmp/metadata", r"/checkpoints/2[./]")
    with pytest.raises(DiskFullError) as e:
      CoEvolveRun(cfg, workdir).fit()
  assert_disk_full(e.value, os.path.join(workdir, "checkpoints", "2"))
  out = capsys.readouterr().out
  assert _from_cache(out) == 0 and os.listdir(cache_dir)  # stored, not loaded
  # compile.ahead and its memory check at start-up, before D0 and the warm-start.
  assert out.index("memory per device, from the compiled programs") < out.index("D0: {")
  printed = {  # the generated set's figures as the session printed them
    k: ast.literal_eval(out.split(f"generated held-out set {k}: ", 1)[1].split("\n", 1)[0])
    for k in ("before the warm-start", "before training")
  }
  assert not any(
    os.path.exists(os.path.join(workdir, f)) for f in ("summary.json.tmp", "summary.json")
  )
  written = sorted(d for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
  assert written == ["0", "1"]  # step 2's is left as orbax's unfinished temporary folder
  _another_model_is_refused_and_moves_nothing(tmp_path, workdir, config)

  # The generated held-out set was frozen at the start; a resume reads it back from the file
  # (cut here to its first task, so the evaluation after training shows which set it used).
  gen_path = os.path.join(workdir, "eval_generated.jsonl")
  with open(gen_path) as f:
    generated = [json.loads(line) for line in f]
  assert 1 <= len(generated) <= 2 and all(t["task_id"].startswith("eval-gen-") for t in generated)
  assert os.path.exists(gen_path.replace(".jsonl", "_init.jsonl"))  # measured before warm-start
  with open(gen_path, "w") as f:
    f.write(json.dumps(generated[0]) + "\n")

  cfg = config()  # space again: resumes from the step-1 checkpoint
  cfg.compile.cache_dir = cache_dir
  capsys.readouterr()
  summary = CoEvolveRun(cfg, workdir).fit()
  assert _from_cache(capsys.readouterr().out) > 0  # compile.ahead loaded the first session's
  assert SUMMARY_KEYS <= set(summary)
  assert summary["steps"] == 2 and summary["resumed_from_step"] == 1
  assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0
  assert set(summary["signals"]) == {"forgetting", "boundary", "rare"}
  assert PHASES <= set(summary["phase_s"])
  assert summary["phase_s"]["rollout"] > 0 and summary["phase_s"]["train"] > 0
  assert summary["pool_size"] >= summary["d0"]["added"] > 0
  assert summary["pool_size"] == summary["d0"]["added"] + summary["tasks_accepted"]
  # The figures before training come from the checkpoint (the whole set's, not the cut file's);
  # the generated set measured before the warm-start too, with the per-reply tool-call figures.
  init = summary["eval_generated_init"]
  assert init == printed["before the warm-start"] and init["tasks"] == len(generated)
  assert summary["eval_generated_before"] == printed["before training"]
  assert 0.0 <= init["tool_call_rate"] <= 1.0 and 0.0 <= init["parse_error_rate"] <= 1.0
  assert summary["eval_generated_after"]["tasks"] == 1  # the file's set, not a new one
  for figures in (summary["eval_generated_before"], summary["eval_generated_after"]):
    assert 0.0 <= figures["success"] <= 1.0 and 0.0 <= figures["reward"] <= 1.0
    assert 0.0 <= figures["name_recall"] <= 1.0 and figures["call_recall"] <= figures["name_recall"]
  with open(os.path.join(workdir, "pool.jsonl")) as f:
    pool = [json.loads(line) for line in f]
  assert not {t["task_id"] for t in pool} & {t["task_id"] for t in generated}
  # eval.pool_after: every pool task evaluated once, grouped by where it came from.
  with open(os.path.join(workdir, "eval_pool_after.jsonl")) as f:
    pool_eval = [json.loads(line) for line in f]
  assert [r["task_id"] for r in pool_eval] == [t["task_id"] for t in pool]
  assert sum(v["tasks"] for v in summary["eval_pool_after"].values()) == len(pool)
  assert summary["eval_pool_after"]["d0"]["tasks"] == summary["d0"]["added"]
  # groups.jsonl: one row per GRPO group and step, also across the resume (2 steps x 2 tasks).
  with open(os.path.join(workdir, "groups.jsonl")) as f:
    groups = [json.loads(line) for line in f]
  assert [g["step"] for g in groups] == [1, 1, 2, 2]
  assert all(len(g["rewards"]) == 2 and set(g["fired"]) <= set(KINDS) for g in groups)

  with open(os.path.join(workdir, "feedback.jsonl")) as f:
    rounds = [json.loads(line) for line in f]
  assert [(r["stage"], r["round"]) for r in rounds] == [("d0", 0), ("round", 1)]
  assert rounds[0]["accepted"] == summary["d0"]["accepted"] and rounds[0].get("stopped") is None
  assert set(summary["data_release"]["files"]) == {cfg.bfcl.category}  # what it is scored on
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  grpo_steps = [r["step"] for r in rows if "reward/mean" in r]
  assert grpo_steps == [1, 2]  # one row per step, also across the resume
  # The hook's state was checkpointed: the resumed session's hook goes on from step 1's count.
  seen = [(r["hooks/steps_seen"], r["hooks/rollouts_seen"]) for r in rows if "reward/mean" in r]
  assert seen == [(1, 4), (2, 8)] and counters[-1].resumed_at == [1]
  # Diagnostics (on by default) in every GRPO row; the rollout log holds each step's episodes
  # once across the failed session and the resume, and a backtest's replay of the run's own
  # config gives back the run's figures: its dead groups and its signal events.
  steps = [r for r in rows if "reward/mean" in r]
  for r in steps:
    assert r["diag/dead_groups"] == pytest.approx(1 - r["rollout/mixed_groups"] / 2)
    assert r["diag/sampled_logprob"] < 0 and r["diag/turns_per_episode"] >= 1
  assert [json.loads(x)["step"] for x in open(os.path.join(workdir, "rollouts.jsonl"))] == [
    1
  ] * 4 + [2] * 4
  same = backtest.backtest(workdir, {"signals.window": cfg.signals.window})
  assert same.baseline.dead_groups == sum(2 - r["rollout/mixed_groups"] for r in steps)
  assert same.baseline.events == {k: steps[-1][f"signals/{k}"] for k in KINDS}
  # What compiled before GRPO (D0, warm-start, eval before): one step-0 row, from the fresh start.
  assert [r["step"] for r in rows if "compile/count" in r and "reward/mean" not in r] == [0]
  # The round's signal shares are those of the events its steps fired (paper Fig. 4); the
  # metrics count cumulatively, and round 1 covers steps 1 and 2.
  last = [r for r in rows if "reward/mean" in r][-1]
  fired = {k: last[f"signals/{k}"] for k in KINDS}
  assert rounds[1]["signal_events"] == fired
  if sum(fired.values()):
    assert sum(rounds[1]["signal_shares"].values()) == pytest.approx(1.0)
  for r in rows:  # how each of the 2 x 2 episodes ended; none dropped by default
    if "reward/mean" in r:
      assert sum(r[f"rollout/finished_{f}"] for f in FINISHES) == 4
      assert r["rollout/dropped_from_loss"] == 0
      # XLA compilations of the step, with one count per compiled program that adds up to them.
      programs = {k: v for k, v in r.items() if k.startswith("compile/program/")}
      assert sum(programs.values()) == r["compile/count"] >= 0
      # compile.ahead compiled the engine's and the train step's programs before step 1.
      ahead = ("_prefill_rows", "_generate_steps", "_generate", "_grpo_step_fn", "_logp_fn")
      assert not any(f"compile/program/{p}" in r for p in ahead), programs
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f) == summary

  capsys.readouterr()
  again = CoEvolveRun(config(), workdir).fit()  # rerun after completion: nothing to do
  assert again == summary
  assert "complete" in capsys.readouterr().out


def _stops_before_warmstart():
  """`small_config` without compile.ahead, for runs that stop at D0: the start-up compile of
  every engine and train program (32 + 1 here) was most of their time and nothing they check."""
  cfg = small_config()
  cfg.compile.ahead = False
  return cfg


@pytest.mark.timeout(120)
def test_an_empty_d0_pool_stops_with_a_clear_error(tmp_path, monkeypatch):
  """Exploration that yields no task (every candidate failed) ends the run before warm-start
  with RunError (exit 2 from main) instead of a bare `max()` of an empty demo list."""
  real = synthesis.initial_tasks

  def nothing_for_d0(synth, entries, n, rng, **kw):  # the generated set is made as before
    return ([], {"accepted": 0}) if "prefix" not in kw else real(synth, entries, n, rng, **kw)

  monkeypatch.setattr(synthesis, "initial_tasks", nothing_for_d0)
  with pytest.raises(RunError, match="task pool empty"):
    CoEvolveRun(_stops_before_warmstart(), str(tmp_path / "run")).fit()


@pytest.mark.timeout(120)
def test_the_generated_held_out_set_is_frozen_first_and_kept_out_of_the_pool(tmp_path, monkeypatch):
  """The generated held-out set is made and written before D0, and the pool's leak filter
  compares D0 with it: a generated set equal to D0 (ids aside) drops every D0 task, so the run
  stops before warm-start with the empty-pool error."""
  workdir = str(tmp_path / "run")
  cfg = small_config()
  train, held = split_tasks(load_bfcl_tasks(cfg.bfcl.category), cfg.bfcl.eval_size, cfg.seed)
  train, _ = disjoint_states(train, held)  # what the suite explores (explore.eval_states)
  made = {}

  def generated_equal_to_d0(synth, entries, n, rng, token_limit=0):
    assert not os.path.exists(os.path.join(workdir, "pool.jsonl"))  # before D0
    tasks, _ = synthesis.initial_tasks(  # D0's draw
      synth, train, 6, np.random.default_rng(0), token_limit=token_limit
    )
    for i, t in enumerate(tasks):
      t.task_id = f"eval-gen-{i:05d}"
    made["tasks"] = tasks
    return tasks

  monkeypatch.setattr(synthesis, "generated_eval_tasks", generated_equal_to_d0)
  with pytest.raises(RunError, match="task pool empty"):
    CoEvolveRun(_stops_before_warmstart(), workdir).fit()
  with open(os.path.join(workdir, "eval_generated.jsonl")) as f:
    frozen = [Task.from_json(line) for line in f]
  assert frozen == made["tasks"] and frozen


def _unrepeatable_round(synth, events, rng, round_idx, *, validate=True):
  """A round whose tasks never repeat (like an LLM explorer sampling at temperature > 0): each
  task's query is fresh random words; its ground truth is its context task's."""
  del synth, rng, validate
  tasks = [
    Task(
      task_id=f"syn-r{round_idx}-{k:04d}",
      env="bfcl",
      turns=[" ".join(uuid.uuid4().hex for _ in range(8))],
      ground_truth=e.task.ground_truth,
      initial_config=e.task.initial_config,
      involved_classes=e.task.involved_classes,
      source="synth",
      provenance={"signal": e.signal, "round": round_idx},
    )
    for k, e in enumerate(events)
  ]
  n = len(tasks)
  counts = {"unguided": {"events": n, "synthesized": n, "validated": n}}
  return RoundResult(round_idx, tasks, n, counts, [], [])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_round_committed_before_a_kill_keeps_its_tasks_on_resume(tmp_path, monkeypatch):
  """Run 1 commits round 1 after step 3 and dies writing the step-3 checkpoint; run 2 resumes
  from step 2 with the round in flight. The round is not synthesized again: its tasks come back
  under the same ids with the same content, and no task id names two tasks. Slow (two runs of
  three steps); the default run covers its parts: resume from a checkpoint end to end (the test
  above), the pool's rollback to the checkpointed prefix (test_pool) and the round journal that
  hands a resumed round its recorded tasks (test_feedback_round)."""
  monkeypatch.setattr(synthesis, "synthesize_round", _unrepeatable_round)
  workdir = str(tmp_path / "run")

  def config():
    cfg = small_config()
    cfg.train.steps, cfg.checkpoint.every = 3, 2
    cfg.feedback.every, cfg.feedback.lag, cfg.feedback.mode = 2, 1, "random"
    return cfg

  real_save = CoEvolveRun._save

  def dies_saving_step_3(self, step):
    if step == 3:
      raise KeyboardInterrupt("killed while writing the step-3 checkpoint")
    real_save(self, step)

  monkeypatch.setattr(CoEvolveRun, "_save", dies_saving_step_3)
  with pytest.raises(KeyboardInterrupt):
    CoEvolveRun(config(), workdir).fit()
  pool_path = os.path.join(workdir, "pool.jsonl")
  with open(pool_path) as f:
    first = [json.loads(line) for line in f if '"synth"' in line]
  assert first, "round 1 committed nothing: the comparison would be empty"

  monkeypatch.setattr(CoEvolveRun, "_save", real_save)
  summary = CoEvolveRun(config(), workdir).fit()
  assert summary["resumed_from_step"] == 2 and summary["steps"] == 3
  with open(pool_path) as f:
    pool = [json.loads(line) for line in f]
  ids = [t["task_id"] for t in pool]
  assert len(ids) == len(set(ids))
  for task in first:
    assert task in pool, task["task_id"]


def test_step_metrics_count_how_episodes_ended_and_the_dropped():
  """`_rollout_metrics`: one count per finish (cut by the context, step limit, environment error,
  done) and the trajectories train.drop_from_loss left out of the loss."""
  finishes = ["done", "context", "context", "error", "max_model_steps", "done"]
  trajs = [
    Trajectory("t", i // 2, finish=f, reward=float(f == "done")) for i, f in enumerate(finishes)
  ]
  keep = np.array([f not in ("context", "error") for f in finishes])
  run = types.SimpleNamespace(tracker=types.SimpleNamespace(counts={"boundary": 1}))
  got = CoEvolveRun._rollout_metrics(
    run, trajs, np.array([t.reward for t in trajs]), np.array([t.group_id for t in trajs]), keep
  )
  assert {k: got[f"rollout/finished_{k}"] for k in FINISHES} == {
    "done": 2,
    "context": 2,
    "max_model_steps": 1,
    "error": 1,
  }
  assert got["rollout/dropped_from_loss"] == 3 and got["signals/boundary"] == 1


def test_a_damaged_summary_is_one_clear_error_before_any_work(tmp_path):
  """A summary.json cut mid-write (or edited by hand) stops the run at once with a RunError that
  names it and says how to go on, not a bare JSONDecodeError."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "summary.json").write_text('{"complete": tru')
  with pytest.raises(CorruptFileError, match="summary.json is damaged .*move it aside"):
    CoEvolveRun(small_config(), str(workdir)).fit()


TIMES = ("timing/", "compile/", "memory/")  # with engine/*_seconds: what differs between runs


def _engine_time(key: str) -> bool:
  return key.startswith("engine/") and key.endswith("_seconds")


def _run_files(workdir: str) -> dict[str, list[dict]]:
  """The run's JSON-lines outputs without their timing and compile figures (which differ between
  processes and sessions; the engine's work counts stay): what a run computed."""
  out = {}
  for name in sorted(os.listdir(workdir)):
    if name.endswith(".jsonl"):
      with open(os.path.join(workdir, name)) as f:
        rows = [json.loads(line) for line in f]
      out[name] = [
        {k: v for k, v in r.items() if not k.startswith(TIMES) and not _engine_time(k)}
        for r in rows
      ]
  return out


def _shared_start_gives_the_same_run(
  tmp_path, workdir: str, cache_dir: str, monkeypatch, make_config
) -> None:
  """scripts/ablations.py's shared start: `bootstrap()` runs step 0 (D0, one warm-start, the
  evaluations before, checkpoint 0) and stops; a copy of that workdir resumed with a variant's
  switch (GRPO only: step 1 runs no feedback round either way) computes what `workdir`'s run did
  from scratch, row for row, without a warm-start of its own."""
  spec = importlib.util.spec_from_file_location(
    "ablations", os.path.join(os.path.dirname(_CONFIG), os.pardir, "scripts", "ablations.py")
  )
  ablations = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(ablations)
  warmstarts = []
  real_warmstart = CoEvolveRun._warmstart

  def counted(self):
    warmstarts.append(os.path.basename(self.workdir))
    real_warmstart(self)

  def config(feedback: bool):
    cfg = make_config()
    cfg.compile.cache_dir = cache_dir
    cfg.train.steps, cfg.feedback.enabled = 1, feedback
    cfg.compile.ahead = False  # only the programs step 1 runs, from the run's cache
    return cfg

  start, copy = str(tmp_path / "start"), str(tmp_path / "copy")
  with monkeypatch.context() as m:
    m.setattr(CoEvolveRun, "_warmstart", counted)
    assert CoEvolveRun(config(True), start).bootstrap() == 0
    assert CoEvolveRun(config(True), start).bootstrap() == 0  # done already: nothing runs again
    assert not os.path.exists(os.path.join(start, "summary.json"))
    ablations.copy_start(start, copy)
    with pytest.raises(FileExistsError):
      ablations.copy_start(start, copy)
    copied = CoEvolveRun(config(False), copy).fit()
  assert warmstarts == ["start"]
  with open(os.path.join(workdir, "summary.json")) as f:
    alone = json.load(f)
  assert copied["resumed_from_step"] == 0 and copied["steps"] == 1
  for key in ("wall_s", "phase_s", "feedback_share"):
    alone.pop(key), copied.pop(key)
  assert copied == alone
  assert _run_files(copy) == _run_files(workdir)
  with open(os.path.join(copy, "config.json")) as f:
    assert json.load(f)["feedback"]["enabled"] is False  # the variant's own, not the start's


@pytest.mark.slow
def test_shared_start_gives_the_same_run(tmp_path, monkeypatch):
  """scripts/ablations.py's shared start against a run of one step from scratch (slow: the
  end-to-end test in `make test` runs the same session without the shared start)."""
  workdir, cache_dir = str(tmp_path / "run"), str(tmp_path / "compile_cache")

  def config():
    cfg = small_config()
    cfg.eval.generated_before_warmstart = True
    return cfg

  cfg = config()
  cfg.compile.cache_dir, cfg.train.steps = cache_dir, 1
  CoEvolveRun(cfg, workdir).fit()
  _shared_start_gives_the_same_run(tmp_path, workdir, cache_dir, monkeypatch, config)


def _enable_role_agent(cfg):
  cfg.role_agent.aiw.enabled = True
  cfg.role_agent.wia.enabled = True


def _enable_qevolve(cfg):
  cfg.qevolve.enabled = True
  cfg.qevolve.updates, cfg.qevolve.batch = 8, 32


def _enable_qevolve_iterate(cfg):
  _enable_qevolve(cfg)
  cfg.qevolve.mode, cfg.qevolve.variant, cfg.qevolve.epochs = "iterate", "bppo", 2
  cfg.train.target_buckets = (24, 64)  # the demonstrations' 49 targets fit the update


def _enable_qevolve_between_model(cfg):
  _enable_qevolve(cfg)
  cfg.qevolve.mode, cfg.qevolve.placement, cfg.qevolve.iterations = "iterate", "between", 2
  cfg.qevolve.critic, cfg.qevolve.model_layers, cfg.qevolve.model_width = "model", 1, 64
  cfg.qevolve.model_batch = 4
  cfg.train.target_buckets = (24, 64)


@pytest.mark.slow
@pytest.mark.parametrize(
  "enable, figures",
  [
    (_enable_role_agent, ("aiw/weight_entropy", "wia/prediction_share")),
    (_enable_qevolve, ("qevolve/v_loss", "qevolve/buffer")),
    (_enable_qevolve_iterate, ("qevolve/v_loss", "qevolve/experts")),
    (_enable_qevolve_between_model, ("qevolve/v_loss", "qevolve/iterations", "qevolve/bp_loss")),
  ],
  ids=["role_agent", "qevolve", "qevolve_iterate", "qevolve_between_model"],
)
def test_loop_options_resume_to_the_same_metric_rows(tmp_path, enable, figures):
  """The loop's options on (feedback rounds off): Role-Agent's AIW sampler and WIA's
  predictions and process rewards; Q-Evolve's critic, and its iterations (BPPO's decaying clip,
  demonstrations in the update, two passes; and two iterations between GRPO updates with the
  "model" critic, whose network comes back too). Three steps in one session and the same
  run killed after step 2's checkpoint and resumed give the same metric rows (rewards, loss, the
  options' figures but wall-clock ones): AIW's weights and failure library, and the critic's
  heads, optimiser state, replay buffer and RNG, come back from the checkpoint, so the resumed
  run draws the same tasks and trains on the same advantages."""

  def config(steps):
    cfg = small_config()
    enable(cfg)
    cfg.feedback.enabled = False
    cfg.train.steps, cfg.checkpoint.every = steps, 1
    return cfg

  def rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      keep = ("step", "reward/mean", "train/loss")
      return [
        {
          k: v
          for k, v in r.items()
          if k in keep or (k.startswith(("aiw/", "wia/", "qevolve/")) and "cost" not in k)
        }
        for r in map(json.loads, f)
        if "reward/mean" in r
      ]

  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  CoEvolveRun(config(3), straight).fit()
  CoEvolveRun(config(2), resumed).fit()
  CoEvolveRun(config(3), resumed).fit()
  want = rows(straight)
  assert [r["step"] for r in want] == [1, 2, 3]
  assert all(all(f in r for f in figures) for r in want)
  assert rows(resumed) == want
  assert all(r.get("qevolve/experts", 1) > 0 for r in want)  # demonstrations in the update
