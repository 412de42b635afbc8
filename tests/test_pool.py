"""TaskPool: durable append/reload, torn lines, leak and duplicate filtering, sampling mix."""

import collections
import dataclasses
import os

import numpy as np
import pytest
from disk_full import assert_disk_full, short_write_then_disk_full

from coevolve_jax.errors import DiskFullError
from coevolve_jax.feedback.pool import TaskPool
from coevolve_jax.types import Task
from envs.bfcl.data import load_bfcl_tasks


@pytest.fixture(scope="module")
def eval_tasks():
  return load_bfcl_tasks("multi_turn_base")[:20]


def _task(i, source="explore", text=None):
  words = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
  ]
  text = text or " ".join(f"{words[(i * 7 + k) % 10]}{i}_{k}" for k in range(40))
  return Task(
    task_id=f"{source}-{i}",
    env="bfcl",
    turns=[text],
    ground_truth=[[f"touch(file_name='f{i}.txt')"]],
    initial_config={"GorillaFileSystem": {}},
    involved_classes=["GorillaFileSystem"],
    source=source,
    provenance={"signal": "rare", "round": 1},
  )


def test_append_reload_round_trip(tmp_path):
  path = tmp_path / "pool.jsonl"
  pool = TaskPool(path)
  assert pool.add([_task(i) for i in range(5)]).added == 5
  again = TaskPool(path)
  assert len(again) == 5 and again.tasks == pool.tasks
  assert again.tasks[0].provenance == {"signal": "rare", "round": 1}


def test_torn_last_line_skipped(tmp_path, caplog):
  path = tmp_path / "pool.jsonl"
  TaskPool(path).add([_task(0), _task(1)])
  with open(path, "a") as f:
    f.write(_task(2).to_json()[:40])
  pool = TaskPool(path)
  assert len(pool) == 2 and "torn" in caplog.text
  pool.add([_task(3)])
  assert [t.task_id for t in TaskPool(path).tasks] == ["explore-0", "explore-1", "explore-3"]


def test_eval_duplicates_dropped(tmp_path, eval_tasks, caplog):
  caplog.set_level("INFO")
  pool = TaskPool(tmp_path / "pool.jsonl", threshold=0.8)
  exact = dataclasses.replace(eval_tasks[3], task_id="copy", source="synth")
  near_turns = list(eval_tasks[5].turns)
  near_turns[0] = near_turns[0] + " Please."
  near = dataclasses.replace(eval_tasks[5], task_id="near", turns=near_turns, source="synth")
  report = pool.add([exact, near, _task(1)], eval_tasks=eval_tasks)
  assert report.added == 1
  assert ("copy", "exact_eval", eval_tasks[3].task_id) in report.dropped
  assert ("near", "near_eval", eval_tasks[5].task_id) in report.dropped
  assert "dropped copy" in caplog.text and "dropped near" in caplog.text


def test_pool_duplicates_dropped(tmp_path):
  pool = TaskPool(tmp_path / "pool.jsonl")
  pool.add([_task(1)])
  same_text = dataclasses.replace(_task(1), task_id="other")
  report = pool.add([_task(1), same_text, _task(2), dataclasses.replace(_task(2), task_id="x2")])
  assert report.added == 1
  assert [d[1] for d in report.dropped] == ["duplicate_id", "exact_pool", "exact_pool"]
  words = _task(4).turns[0].split()
  near = dataclasses.replace(_task(4), task_id="near4", turns=[" ".join(words + ["extra"])])
  report = TaskPool(tmp_path / "pool.jsonl").add([_task(4), near])
  assert report.added == 1 and report.dropped == [("near4", "near_pool", "explore-4")]


def test_sampling_mix(tmp_path):
  pool = TaskPool(tmp_path / "pool.jsonl")
  pool.add([_task(i) for i in range(10)] + [_task(i, "synth") for i in range(10, 14)])
  rng = np.random.default_rng(0)
  batch = pool.sample(8, rng, synth_fraction=0.25)
  assert len(batch) == 8 and sum(t.source == "synth" for t in batch) == 2
  assert sum(t.source == "synth" for t in pool.sample(10, rng, synth_fraction=1.0)) == 10
  assert len(pool.sample(30, rng)) == 30
  with pytest.raises(ValueError):
    TaskPool(tmp_path / "empty.jsonl").sample(1, rng)


def test_sampler_weights_shape_the_draw_and_the_uniform_sampler_changes_nothing(tmp_path):
  """The pool's draw with a `TaskSampler`'s weights: "uniform" gives no weights, so the draw is
  the one without the argument (same random calls); weights make each group's draw proportional
  to them (a chi-square test of 2,000 draws), and a zero weight is never drawn."""
  from coevolve_jax.feedback.sampler import make_sampler  # noqa: PLC0415

  pool = TaskPool(tmp_path / "pool.jsonl")
  pool.add([_task(i) for i in range(6)] + [_task(i, "synth") for i in range(6, 9)])
  weights = make_sampler("uniform").weights(pool.tasks)
  assert weights is None
  for fraction in (None, 0.5):
    plain = pool.sample(5, np.random.default_rng(7), fraction)
    assert pool.sample(5, np.random.default_rng(7), fraction, weights) == plain
  w = np.array([4.0, 2.0, 1.0, 1.0, 0.0, 0.0, 1.0, 3.0, 0.0])
  rng = np.random.default_rng(0)
  counts = collections.Counter()
  for _ in range(2000):
    counts.update(t.task_id for t in pool.sample(1, rng, None, w))
  observed = [counts[t.task_id] for t in pool.tasks if w[pool.tasks.index(t)] > 0]
  expected = [2000 * x / w.sum() for x in w if x > 0]
  chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
  assert chi2 < 20.52  # the 0.999 quantile of chi-square with 5 degrees of freedom
  assert not {pool.tasks[i].task_id for i in (4, 5, 8)} & set(counts)
  mixed = collections.Counter()
  for _ in range(500):
    mixed.update(t.source for t in pool.sample(4, rng, 0.5, w))
  assert mixed == {"explore": 1000, "synth": 1000}  # the fraction holds; weights act within
  with pytest.raises(ValueError, match="weights must be"):
    pool.sample(2, rng, None, np.ones(3))
  with pytest.raises(ValueError, match="sum to 0"):
    pool.sample(2, rng, 1.0, np.array([1.0] * 6 + [0.0] * 3))
  with pytest.raises(ValueError, match="unknown task sampler"):
    make_sampler("curriculum")


def test_rollback_keeps_the_checkpointed_prefix_and_moves_the_rest_aside(tmp_path):
  path = tmp_path / "pool.jsonl"
  pool = TaskPool(path)
  tasks = [_task(i) for i in range(4)]
  assert pool.add(tasks).added == 4
  moved = pool.rollback(2, str(tmp_path / "rolled"))
  assert moved == 2
  assert [t.task_id for t in pool.tasks] == [t.task_id for t in tasks[:2]]
  assert [t.task_id for t in TaskPool(path).tasks] == [t.task_id for t in tasks[:2]]
  with open(tmp_path / "rolled") as f:
    assert [Task.from_json(line).task_id for line in f] == [t.task_id for t in tasks[2:]]
  # The moved tasks can be added again (a resumed run synthesizes them again).
  assert pool.add(tasks[2:]).added == 2


def test_same_solution_as_an_eval_task_is_dropped(tmp_path, eval_tasks):
  pool = TaskPool(tmp_path / "pool.jsonl")
  src = eval_tasks[3]
  reworded = dataclasses.replace(
    src, task_id="syn-1", turns=["Completely different words."] * len(src.turns), source="synth"
  )
  report = pool.add([reworded, _task(1)], eval_tasks=eval_tasks)
  assert report.dropped == [("syn-1", "solution_eval", src.task_id)]
  assert report.added == 1 and set(report.eval_similarity) == {"explore-1"}
  assert 0.0 <= report.eval_similarity["explore-1"] < 0.2  # unrelated words


def test_eval_similarity_is_reported_for_added_tasks(tmp_path, eval_tasks):
  pool = TaskPool(tmp_path / "pool.jsonl", threshold=0.95)
  src = eval_tasks[0]
  words = src.turns[0].split()
  close = dataclasses.replace(
    src,
    task_id="syn-2",
    turns=[" ".join(words[:-2])] + src.turns[1:],
    ground_truth=[["ls()"]] * len(src.turns),
    source="synth",
  )
  report = pool.add([close], eval_tasks=eval_tasks)
  assert report.added == 1
  assert 0.5 < report.eval_similarity["syn-2"] < 0.95  # similar, below the drop threshold


def test_each_append_is_durable_and_whole(tmp_path):
  path = tmp_path / "pool.jsonl"
  pool = TaskPool(path)
  pool.add([_task(1), _task(2)])
  lines = path.read_bytes().split(b"\n")
  assert lines[-1] == b"" and len(lines) == 3  # two whole lines, newline-terminated
  with open(path, "ab") as f:  # a crash in the middle of the third append
    f.write(_task(3).to_json().encode()[:30])
  reloaded = TaskPool(path)
  assert [t.task_id for t in reloaded.tasks] == ["explore-1", "explore-2"]
  reloaded.add([_task(3)])
  assert [t.task_id for t in TaskPool(path).tasks] == ["explore-1", "explore-2", "explore-3"]


def test_eval_index_follows_the_split_it_is_given(tmp_path, eval_tasks):
  pool = TaskPool(tmp_path / "pool.jsonl")
  copy = dataclasses.replace(eval_tasks[7], task_id="copy7", source="synth")
  assert pool.add([_task(1)], eval_tasks=eval_tasks[:5]).added == 1  # index of split A cached
  report = pool.add([copy], eval_tasks=eval_tasks[5:10])  # split B contains the original
  assert report.dropped == [("copy7", "exact_eval", eval_tasks[7].task_id)]
  assert pool.add([copy], eval_tasks=eval_tasks[:5]).added == 1  # back to A: not a leak there


def test_a_full_disk_loses_no_task_and_leaves_no_torn_line(tmp_path, monkeypatch):
  """An append cut short by a full disk raises DiskFullError with the pool file at its last whole
  task (was: OSError and half a line); a rollback that cannot write leaves both files as they
  were, so the resumed run rolls back again."""
  path = tmp_path / "pool.jsonl"
  pool = TaskPool(path)
  pool.add([_task(1), _task(2)])
  before = path.read_bytes()
  with monkeypatch.context() as m:
    short_write_then_disk_full(m)
    with pytest.raises(DiskFullError) as e:
      pool.add([_task(3)])
  assert_disk_full(e.value, str(path))
  assert path.read_bytes() == before
  assert [t.task_id for t in TaskPool(path).tasks] == ["explore-1", "explore-2"]

  rolled = tmp_path / "pool.jsonl.rolled-back"
  rolled.write_text(_task(9).to_json() + "\n")  # moved aside by an earlier resume
  rolled_before = rolled.read_bytes()
  os.symlink("/dev/full", f"{path}.tmp")  # the new pool file cannot be written
  with pytest.raises(DiskFullError) as e:
    TaskPool(path).rollback(1, str(rolled))
  assert_disk_full(e.value, str(path))
  assert path.read_bytes() == before and rolled.read_bytes() == rolled_before
  assert not os.path.lexists(f"{path}.tmp")
  assert TaskPool(path).rollback(1, str(rolled)) == 1  # space again
  assert [t.task_id for t in TaskPool(path).tasks] == ["explore-1"]


def test_damaged_pool_files_are_one_clear_run_error_and_keep_their_bytes(tmp_path):
  """A torn last line is moved to pool.jsonl.torn (not deleted); a corrupt line, or a pool with
  fewer tasks than the checkpoint counted, is a CorruptFileError (main: one `error:` line, exit 2)
  that says what to do."""
  from coevolve_jax.errors import CorruptFileError, RunError  # noqa: PLC0415

  path = tmp_path / "pool.jsonl"
  TaskPool(path).add([_task(i) for i in range(4)])
  whole = path.read_bytes()
  path.write_bytes(whole[:-40])  # the last line cut: what a crash mid-write leaves
  pool = TaskPool(path)
  assert len(pool) == 3
  assert (tmp_path / "pool.jsonl.torn").read_bytes() == whole[
    whole.rfind(b"\n", 0, -1) + 1 : -40
  ] + b"\n"
  with pytest.raises(CorruptFileError, match="counted 4") as e:
    pool.rollback(4, str(tmp_path / "pool.jsonl.rolled-back"))
  assert isinstance(e.value, RunError) and "new --workdir" in str(e.value)
  lines = whole.decode().splitlines()
  path.write_text("\n".join([lines[0], '{"env": "bfcl", "ground_tr', *lines[2:]]) + "\n")
  with pytest.raises(CorruptFileError, match="corrupt line 2"):
    TaskPool(path)


def test_a_task_starting_from_an_eval_state_is_dropped_when_states_are_disjoint(
  tmp_path, eval_tasks
):
  """explore.eval_states = "disjoint" (issue 40 item 5): another task (other words, other calls)
  in an evaluation entry's initial state is a leak of its environment; "shared_with_eval" (the
  choice before) keeps it."""
  src = eval_tasks[3]
  other = dataclasses.replace(
    src,
    task_id="syn-1",
    turns=["Completely different words."] * len(src.turns),
    ground_truth=[["ls()"]] * len(src.turns),
    source="synth",
  )
  strict = TaskPool(tmp_path / "strict.jsonl", drop_eval_states=True)
  report = strict.add([other, _task(1)], eval_tasks=eval_tasks)
  assert report.dropped == [("syn-1", "state_eval", src.task_id)] and report.added == 1
  shared = TaskPool(tmp_path / "shared.jsonl")
  assert shared.add([other], eval_tasks=eval_tasks).added == 1
