"""A run's folder: the config it started with, its logs brought back to a checkpoint, and its
summary.

Every write goes through `metrics.write_atomic` / `append_lines`, which write from the primary
process only, so several processes of one job write each file once.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import time
from typing import Any

import filelock
from flax.traverse_util import flatten_dict

from coevolve_jax import distributed
from coevolve_jax.errors import CorruptFileError, RunError, move_aside
from coevolve_jax.feedback.pool import TaskPool
from coevolve_jax.feedback.rounds import RoundJournal
from coevolve_jax.metrics import PhaseTimer, truncate_jsonl, write_atomic
from coevolve_jax.run_state import RunState

# The loop's phases, as timed in metrics.jsonl (`timing/*`) and summary.json (`phase_s`).
PHASES = (
  "explore",
  "warmstart",
  "compile",
  "rollout",
  "reward",
  "train",
  "feedback",
  "eval",
  "checkpoint",
)
LOGS = ("feedback.jsonl", "exploration.jsonl")  # the loop's own step-keyed logs
# What a copy of a run for a branch leaves out: the branch writes its own config (a resumed run
# warns about every field that differs from config.json) and summary; the workdir lock and its
# owner file name the source's run.
RUN_OWN_FILES = ("config.json", "summary.json", "run.lock", "run.lock.owner")


def copy_run(
  src: str,
  dst: str,
  *,
  leave_out: tuple[str, ...] = RUN_OWN_FILES,
  marker: str = "",
  note: dict[str, Any] | None = None,
) -> None:
  """Makes `dst` a copy of the run folder `src` (checkpoints, pool, frozen evaluation sets, logs;
  symbolic links copied as links) without `leave_out`'s top-level files, so `CoEvolveRun(...)
  .fit()` there resumes from the newest checkpoint of `src`: a branch of that run. `marker`:
  a file written in the copy, `{"start": <src>, **note}` (what the branch was copied from, and
  what the caller adds). Copied under
  a temporary name and renamed, so a killed copy leaves no `dst`.

  Raises:
    FileExistsError: `dst` exists (a run of its own is there).
  """
  import shutil  # noqa: PLC0415

  if os.path.exists(dst):
    raise FileExistsError(f"{dst} exists: not replacing a run with a copy of {src}")
  partial = dst + ".copying"
  shutil.rmtree(partial, ignore_errors=True)
  shutil.copytree(
    src, partial, symlinks=True, ignore=lambda d, names: leave_out if d == src else ()
  )
  if marker:
    with open(os.path.join(partial, marker), "w", encoding="utf-8") as f:
      json.dump({"start": os.path.abspath(src), **(note or {})}, f, sort_keys=True)
  os.rename(partial, dst)


class WorkdirLock:
  """One run per workdir: `<workdir>/run.lock`, held (an OS file lock, `filelock`) for a run's
  session by the primary process only, with `run.lock.owner` naming the holder (host, pid,
  start time, command line).

  The OS drops the lock when its process ends however it ends, so the lock of a killed run
  is taken over at once and the owner file is rewritten; a lock that is held stops the second
  run with `RunError` naming the other process. On a filesystem without file locks (some
  network mounts), a warning says that two runs there are not detected, and the run goes on.
  """

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, "run.lock")
    self._lock: filelock.BaseFileLock | None = None

  def acquire(self) -> None:
    """Raises: RunError: another process holds the lock (its owner file named)."""
    lock = filelock.FileLock(self.path, timeout=0)
    try:
      lock.acquire()
    except filelock.Timeout:
      try:
        with open(self.path + ".owner", encoding="utf-8") as f:
          owner = json.load(f)
        who = f"pid {owner['pid']} on {owner['host']}, started {owner['started']}"
      except (OSError, ValueError, KeyError, TypeError):
        who = "a process that has not written run.lock.owner yet"
      raise RunError(
        f"{os.path.dirname(self.path)} is in use by another run ({who}); wait for it to end, "
        f"or use another --workdir"
      ) from None
    except OSError as e:  # no file locks on this filesystem
      print(f"warning: cannot lock {self.path} ({e}); a second run on this workdir is not detected")
      return
    self._lock = lock
    owner = {
      "pid": os.getpid(),
      "host": socket.gethostname(),
      "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
      "argv": sys.argv,
    }
    write_atomic(self.path + ".owner", json.dumps(owner))

  def release(self) -> None:
    if self._lock is not None:
      self._lock.release()
      self._lock = None


def check_config(workdir: str, config_json: str, fresh: bool) -> None:
  """Writes config.json on a fresh start; on resume, warns about every changed field. A
  config.json that is not a JSON object (damaged by hand or by a torn copy: the checkpoints
  carry their own config, so the run does not need it) is moved to config.json.damaged (or
  config.json.damaged.N, N = 1, 2, ..., so an earlier damaged copy is kept), with a warning, and
  this run's config is written in its place. The primary process alone does any of it (one
  file, one set of warnings, however many processes run; the others never read a file the
  primary may be moving).

  Args:
    config_json: the run's config as JSON (`ConfigDict.to_json_best_effort()`).
  """
  if not distributed.is_primary():
    return
  path = os.path.join(workdir, "config.json")
  now = json.loads(config_json)
  if fresh or not os.path.exists(path):
    write_atomic(path, json.dumps(now, indent=1, sort_keys=True))
    return
  try:
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
    if not isinstance(saved, dict):
      raise ValueError(f"a JSON {type(saved).__name__}, not an object")
  except (ValueError, UnicodeDecodeError) as e:
    suffixes = itertools.chain([".damaged"], (f".damaged.{n}" for n in itertools.count(1)))
    aside = move_aside(path, suffixes)
    print(
      f"warning: {path} is damaged ({e}); moved to {os.path.basename(aside)} and this run's "
      "config written in its place (changes since the run started are not listed)"
    )
    write_atomic(path, json.dumps(now, indent=1, sort_keys=True))
    return
  before = flatten_dict(saved, sep=".")
  now = flatten_dict(now, sep=".")
  for key in sorted(k for k in set(now) | set(before) if now.get(k) != before.get(k)):
    print(
      f"warning: config {key} changed since this run started: "
      f"{before.get(key)!r} -> {now.get(key)!r}"
    )


def model_changes(saved_config: dict[str, Any] | None, config_json: str) -> str:
  """Which `model.*` fields differ between the config a checkpoint was saved with and this
  run's (`config_json`, as in `check_config`), as advice for a checkpoint that does not match
  the configured model (`checkpoint.CheckpointMismatchError`)."""
  if not isinstance(saved_config, dict):
    return "the checkpoint records no config; compare the model with the workdir's config.json"
  before, now = flatten_dict(saved_config, sep="."), flatten_dict(json.loads(config_json), sep=".")
  changed = [
    f"{k}: {before.get(k)!r} when saved, {now.get(k)!r} now"
    for k in sorted(set(before) | set(now))
    if k.startswith("model.") and before.get(k) != now.get(k)
  ]
  if not changed:
    return (
      "no model.* field changed: the model folder (model.checkpoint) may hold another model now"
    )
  return "; ".join(changed)


def roll_back(
  workdir: str, restored: int | None, pool: TaskPool, pool_size: int, journal: RoundJournal
) -> None:
  """Brings the workdir back to the restored checkpoint (None: a fresh start).

  Pool tasks accepted after that checkpoint move to pool.jsonl.rolled-back (the resumed run
  synthesizes them again), so the resumed run continues exactly from the checkpoint; rows of
  feedback.jsonl and exploration.jsonl after its step are dropped; a fresh start clears the
  round journal, so no round of an earlier run is reused.
  """
  step = -1 if restored is None else restored
  moved = pool.rollback(pool_size, os.path.join(workdir, "pool.jsonl.rolled-back"))
  if moved:
    print(f"task pool: {moved} tasks from after the checkpoint moved to pool.jsonl.rolled-back")
  if restored is None:
    journal.clear()
  for name in LOGS:
    truncate_jsonl(os.path.join(workdir, name), step)


def completed_summary(path: str, steps: int) -> dict[str, Any] | None:
  """The summary at `path` of a run that already finished its `steps` steps, else None.

  Raises:
    CorruptFileError: the file is not a JSON object (cut mid-write, edited by hand).
  """
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      summary = json.load(f)
    if not isinstance(summary, dict):
      raise ValueError(f"a JSON {type(summary).__name__}, not an object")
  except ValueError as e:
    raise CorruptFileError(
      f"{path} is damaged ({e}); move it aside and rerun the same command: the "
      f"run resumes from its last checkpoint and writes the summary again"
    ) from e
  if summary.get("complete") and summary.get("steps") == steps:
    print(f"run in {os.path.dirname(path)} is complete ({summary['steps']} steps); nothing to do")
    return summary
  return None


def summary(
  state: RunState,
  timer: PhaseTimer,
  *,
  eval_after: float,
  eval_tasks: int,
  signals: dict[str, int],
  pool_size: int,
  resumed_from: int,
  wall_s: float,
) -> dict[str, Any]:
  """summary.json's figures (README "Outputs"), without the evaluations after training."""
  s = state
  phase = {k: round(float(timer.totals.get(k, 0.0)), 2) for k in PHASES}
  generated = s.eval_generated_before
  return {
    "complete": True,
    "steps": s.step,
    "resumed_from_step": resumed_from,
    "eval_before": s.eval_before,
    "eval_after": eval_after,
    "eval_tasks": eval_tasks,
    **({"eval_generated_init": s.eval_generated_init} if s.eval_generated_init else {}),
    **({"eval_generated_before": generated} if generated is not None else {}),
    "signals": dict(signals),
    "tasks_synthesized": s.tasks_synthesized,
    "tasks_accepted": s.tasks_accepted,
    "tasks_dropped_as_duplicates": s.tasks_dropped,
    "d0": s.d0,
    "validation_pass_rate": s.validation,
    "pool_size": pool_size,
    "wall_s": round(wall_s, 1),
    "phase_s": phase,
    # Share of wall time the training loop spent on feedback work (selecting, waiting for
    # the round in flight, committing to the pool); synthesis itself overlaps GRPO steps.
    "feedback_share": round(phase["feedback"] / wall_s, 4) if wall_s > 0 else 0.0,
    "feedback_synth_s": round(float(s.feedback_synth_s), 2),
    "feedback_rounds": s.round,
    **({"suite_eval": s.suite_eval} if s.suite_eval else {}),
  }
