"""The growing task pool (docs/design.md §1.3-1.4): append-only JSON lines on disk, with leak
and duplicate filtering.

Every accepted task is appended as one O_APPEND write of its whole line followed by fsync, so a
crash mid-round loses no task accepted before it; a torn last line (a crash during a write) is
skipped with a warning and cut off on load. A write that fails for a full disk leaves the file at
its last whole line and raises DiskFullError. `add` drops exact and near-duplicates (MinHash
over word 3-gram shingles of the user turns plus the ground-truth calls, estimated Jaccard >=
`threshold`) of the evaluation split and of the pool itself, tasks whose ground-truth calls
and initial state equal an evaluation task's (its solution under another wording) and, with
`drop_eval_states` (`explore.eval_states = "disjoint"`), tasks that start from an evaluation
task's initial state at all, logging every drop. It also reports each added task's highest
similarity to the evaluation split.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
from datasketch import MinHash, MinHashLSH

from coevolve_jax import distributed, errors
from coevolve_jax.errors import DiskFullError
from coevolve_jax.metrics import append_lines, write_atomic
from coevolve_jax.types import Task

log = logging.getLogger(__name__)
SYNTH_SOURCES = ("synth",)
UNGUIDED = "unguided"  # the signal key of contexts without a signal (random re-exploration)
# explore.eval_states: whether exploration and the pool keep clear of the evaluation entries'
# initial states ("disjoint") or may share them ("shared_with_eval", the choice before 2026-12).
EVAL_STATES = ("disjoint", "shared_with_eval")


def origin(task: Task) -> str:
  """Where a pool task came from: "d0" (unguided exploration before training) or
  "synth:<signal>" (a feedback round; "synth:unguided" for random re-exploration)."""
  if task.source not in SYNTH_SOURCES:
    return "d0"
  return f"synth:{task.provenance.get('signal') or UNGUIDED}"


def task_text(task: Task) -> str:
  """Normalized text a task is compared by: its user turns and ground-truth calls, lower-cased."""
  calls = " ".join(c for turn in task.ground_truth for c in turn)
  return " ".join(" ".join(task.turns + [calls]).lower().split())


def minhash(text: str, num_perm: int = 128, shingle: int = 3) -> MinHash:
  """MinHash of the word `shingle`-grams of `text` (the whole word list when shorter)."""
  words = re.findall(r"\w+", text.lower())
  grams = {" ".join(words[i : i + shingle]) for i in range(max(1, len(words) - shingle + 1))}
  m = MinHash(num_perm=num_perm)
  for g in sorted(grams):
    m.update(g.encode("utf-8"))
  return m


def _state_key(task: Task) -> str:
  """A task's initial state: its environment classes and their configs, canonical JSON."""
  return json.dumps(
    [sorted(task.involved_classes), task.initial_config], sort_keys=True, default=str
  )


def _solution_key(task: Task) -> str:
  """A task's initial state and ground-truth calls (its solution), canonical JSON."""
  return json.dumps([task.initial_config, task.ground_truth], sort_keys=True, default=str)


@dataclasses.dataclass
class AddReport:
  """What `TaskPool.add` did.

  Attributes:
    added: tasks appended.
    dropped: (task_id, reason, id of the task it duplicates) per dropped task.
    eval_similarity: added task id -> highest estimated Jaccard similarity (MinHash, word
      3-grams) to any evaluation task, in [0, 1] (0.0 when no evaluation tasks were given).
  """

  added: int
  dropped: list[tuple[str, str, str | None]]
  eval_similarity: dict[str, float] = dataclasses.field(default_factory=dict)


class TaskPool:
  """Append-only task pool backed by a JSON-lines file (reloaded on construction, so runs can
  resume).

  Args:
    path: the JSON-lines file.
    threshold: estimated Jaccard similarity (MinHash) at or above which a task is a near
      duplicate (`pool.near_dup_threshold`).
    num_perm: MinHash permutations.
    drop_eval_states: also drop a task whose initial state (classes and configs) equals an
      evaluation task's (`explore.eval_states == "disjoint"`).
  """

  def __init__(
    self,
    path: str | os.PathLike,
    threshold: float = 0.8,
    num_perm: int = 128,
    *,
    drop_eval_states: bool = False,
  ):
    self.path = os.fspath(path)
    self.drop_eval_states = drop_eval_states
    self.threshold = threshold
    self.num_perm = num_perm
    self._tasks: list[Task] = []
    self._exact: dict[str, str] = {}  # normalized text -> task id
    self._hashes: dict[str, MinHash] = {}
    self._lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    self._eval_cache: tuple[Any, Any] = (None, None)  # (split key, index) of the last eval split
    for task in self._load():
      self._index(task)

  def _load(self) -> list[Task]:
    if not os.path.exists(self.path):
      return []
    with open(self.path, "rb") as f:
      data = f.read()
    good_end = data.rfind(b"\n") + 1
    if good_end < len(data) and distributed.is_primary():  # a write cut by a crash: kept beside
      # the pool, not deleted (by the primary process; every process reads up to good_end)
      torn = self.path + ".torn"
      with errors.writing(torn), open(torn, "ab") as f:
        f.write(data[good_end:] + b"\n")
        os.fsync(f.fileno())
      log.warning(
        "task pool %s: a torn last line (%d bytes) moved to %s",
        self.path,
        len(data) - good_end,
        torn,
      )
      with open(self.path, "r+b") as f:
        f.truncate(good_end)
        os.fsync(f.fileno())
    tasks = []
    for i, line in enumerate(data[:good_end].decode("utf-8").splitlines()):
      if line.strip():
        try:
          tasks.append(Task.from_json(line))
        except (ValueError, TypeError) as e:
          raise errors.CorruptFileError(
            f"task pool {self.path}: corrupt line {i + 1}: {e}. Repair or remove that line "
            f"(the run's tasks are one JSON object per line), or start a new --workdir"
          ) from e
    return tasks

  def rollback(self, size: int, backup_path: str) -> int:
    """Keeps the first `size` tasks (the pool as a checkpoint saw it); the rest move to
    `backup_path` (appended), so a resumed run replays from the checkpoint and nothing accepted is
    deleted. Returns the number of tasks moved. The pool file is replaced atomically.

    Raises:
      CorruptFileError: `size` larger than the pool (tasks the checkpoint counted are missing).
      DiskFullError: the disk is full; both files are as they were.
    """
    if size > len(self._tasks):
      raise errors.CorruptFileError(
        f"task pool {self.path} holds {len(self._tasks)} tasks but the checkpoint being resumed "
        f"counted {size}: tasks committed before it were lost (a damaged file; a torn line is "
        f"kept in {self.path}.torn). Restore the file, or start a new --workdir"
      )
    kept, moved = self._tasks[:size], self._tasks[size:]
    if not moved:
      return 0
    backup_size = os.path.getsize(backup_path) if os.path.exists(backup_path) else 0
    append_lines(backup_path, (t.to_json() for t in moved), sync=True)
    try:
      write_atomic(self.path, "".join(t.to_json() + "\n" for t in kept), sync=True)
    except DiskFullError:
      os.truncate(backup_path, backup_size)  # the resumed run moves them again
      raise
    self._tasks, self._exact, self._hashes = [], {}, {}
    self._lsh = MinHashLSH(threshold=self.threshold, num_perm=self.num_perm)
    for task in kept:
      self._index(task)
    return len(moved)

  def _index(self, task: Task) -> None:
    self._tasks.append(task)
    self._exact[task_text(task)] = task.task_id
    m = minhash(task_text(task), self.num_perm)
    self._hashes[task.task_id] = m
    self._lsh.insert(f"pool:{task.task_id}", m)

  def _append(self, task: Task) -> None:
    append_lines(self.path, [task.to_json()], sync=True)

  def _near(self, m: MinHash, lsh: MinHashLSH, hashes: dict[str, MinHash]) -> str | None:
    """The most similar indexed key with estimated Jaccard >= threshold, or None."""
    best, best_sim = None, -1.0
    for key in sorted(lsh.query(m)):
      sim = m.jaccard(hashes[key])
      if sim >= self.threshold and sim > best_sim:
        best, best_sim = key, sim
    return best

  def _eval_index(self, eval_list: list[Task]):
    """Exact texts, solutions, MinHashes and LSH of an evaluation split; the last one is cached
    (every round passes the same split), keyed by the tasks' ids and texts."""
    key = tuple((t.task_id, task_text(t), _solution_key(t), _state_key(t)) for t in eval_list)
    if self._eval_cache[0] != key:
      hashes = {f"eval:{t.task_id}": minhash(task_text(t), self.num_perm) for t in eval_list}
      lsh = MinHashLSH(threshold=self.threshold, num_perm=self.num_perm)
      for k, m in hashes.items():
        lsh.insert(k, m)
      self._eval_cache = (
        key,
        (
          {task_text(t): t.task_id for t in eval_list},
          {_solution_key(t): t.task_id for t in eval_list},
          {_state_key(t): t.task_id for t in eval_list},
          hashes,
          lsh,
        ),
      )
    return self._eval_cache[1]

  def add(self, tasks: Iterable[Task], *, eval_tasks: Iterable[Task] = ()) -> AddReport:
    """Appends the tasks that are not duplicates of an evaluation task or of the pool (incl. this
    batch).

    Returns:
      AddReport with the number added, (task_id, reason, similar_to) per dropped task, and each
        added task's highest similarity to the evaluation split. Reasons are "duplicate_id",
        "exact_eval", "solution_eval" (same initial state and ground-truth calls as an evaluation
        task), "state_eval" (starts from an evaluation task's initial state; with
        `drop_eval_states`), "near_eval", "exact_pool", "near_pool".
    Raises:
      DiskFullError: the disk is full (the tasks before the failed one are added).
    """
    eval_exact, eval_solutions, eval_states, eval_hashes, eval_lsh = self._eval_index(
      list(eval_tasks)
    )
    pool_hashes = {f"pool:{k}": m for k, m in self._hashes.items()}
    dropped: list[tuple[str, str, str | None]]
    added, dropped, similarity = 0, [], {}
    for task in tasks:
      text, m = task_text(task), minhash(task_text(task), self.num_perm)
      if f"pool:{task.task_id}" in pool_hashes:
        drop = ("duplicate_id", task.task_id)
      elif text in eval_exact:
        drop = ("exact_eval", eval_exact[text])
      elif (near := self._near(m, eval_lsh, eval_hashes)) is not None:
        drop = ("near_eval", near.split(":", 1)[1])
      elif _solution_key(task) in eval_solutions:
        drop = ("solution_eval", eval_solutions[_solution_key(task)])
      elif self.drop_eval_states and _state_key(task) in eval_states:
        drop = ("state_eval", eval_states[_state_key(task)])
      elif text in self._exact:
        drop = ("exact_pool", self._exact[text])
      elif (near := self._near(m, self._lsh, pool_hashes)) is not None:
        drop = ("near_pool", near.split(":", 1)[1])
      else:
        self._append(task)
        self._index(task)
        pool_hashes[f"pool:{task.task_id}"] = m
        similarity[task.task_id] = max((m.jaccard(e) for e in eval_hashes.values()), default=0.0)
        added += 1
        continue
      log.info("task pool: dropped %s (%s, similar to %s)", task.task_id, *drop)
      dropped.append((task.task_id, drop[0], drop[1]))
    return AddReport(added=added, dropped=dropped, eval_similarity=similarity)

  @property
  def tasks(self) -> list[Task]:
    return list(self._tasks)

  def __len__(self) -> int:
    return len(self._tasks)

  def sample(
    self,
    n: int,
    rng: np.random.Generator,
    synth_fraction: float | None = None,
    weights: np.ndarray | None = None,
  ) -> list[Task]:
    """n tasks: drawn over the pool, or with `synth_fraction` of them from synthesized tasks.

    Draws without replacement within each group when it is large enough, else with replacement.
    When one group is empty the other fills all n. `weights` ([len(pool)] >= 0, in pool order;
    a `feedback.sampler.TaskSampler`'s) makes the draw within each group proportional to them;
    None draws uniformly (the same random calls as without the argument).

    Raises:
      ValueError: an empty pool; weights of another length, negative, not finite, or summing
        to 0 within a group that must supply tasks.
    """
    if not self._tasks:
      raise ValueError("cannot sample from an empty task pool")
    if weights is not None:
      weights = np.asarray(weights, np.float64)
      if weights.shape != (len(self._tasks),) or not np.all(np.isfinite(weights) & (weights >= 0)):
        raise ValueError(f"weights must be [{len(self._tasks)}] finite and >= 0, got {weights!r}")
    if synth_fraction is None:
      return _draw(self._tasks, n, rng, weights)
    is_synth = np.array([t.source in SYNTH_SOURCES for t in self._tasks])
    synth = [t for t, s in zip(self._tasks, is_synth) if s]
    base = [t for t, s in zip(self._tasks, is_synth) if not s]
    n_synth = int(round(n * synth_fraction)) if synth and base else (n if synth else 0)
    w_synth = None if weights is None else weights[is_synth]
    w_base = None if weights is None else weights[~is_synth]
    return _draw(synth, n_synth, rng, w_synth) + _draw(base, n - n_synth, rng, w_base)


def _draw(
  tasks: list[Task], n: int, rng: np.random.Generator, weights: np.ndarray | None = None
) -> list[Task]:
  if n <= 0:
    return []
  if weights is None:
    idx = rng.choice(len(tasks), size=n, replace=n > len(tasks))
  else:
    total = weights.sum()
    if total <= 0:
      raise ValueError(f"task weights sum to {total} over {len(tasks)} tasks: nothing to draw")
    replace = n > int(np.count_nonzero(weights))
    idx = rng.choice(len(tasks), size=n, replace=replace, p=weights / total)
  return [tasks[int(i)] for i in idx]
