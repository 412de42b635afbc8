"""PhaseTimer: phases accumulate, per-step figures pop, seconds move between phases. Log writes
on a full disk: DiskFullError, and no torn or lost file."""

import os

import pytest
from disk_full import assert_disk_full, short_write_then_disk_full

from coevolve_jax.errors import DiskFullError
from coevolve_jax.metrics import (
  MetricsWriter,
  PhaseTimer,
  append_lines,
  truncate_jsonl,
  write_atomic,
)


def test_move_reassigns_seconds_in_totals_and_the_current_step():
  timer = PhaseTimer({"rollout": 10.0})
  with timer("rollout"):
    pass
  timer.totals["rollout"] = 12.0  # fixed figures instead of measured ones
  timer.last["rollout"] = 2.0
  timer.move(0.5, src="rollout", dst="reward")
  assert timer.totals == {"rollout": 11.5, "reward": 0.5}
  assert timer.last == {"rollout": 1.5, "reward": 0.5}
  timer.move(0.25, src="rollout", dst="reward")  # onto a phase already there
  assert timer.totals["reward"] == 0.75 and timer.last["reward"] == 0.75
  assert sum(timer.totals.values()) == pytest.approx(12.0)
  assert timer.pop_last() == {"timing/rollout": 1.25, "timing/reward": 0.75}
  timer.move(1.0, src="train", dst="eval")  # phases not seen yet start from 0
  assert timer.totals["train"] == -1.0 and timer.totals["eval"] == 1.0
  assert timer.pop_last() == {"timing/train": -1.0, "timing/eval": 1.0}
  assert timer.pop_last() == {}


def test_an_append_on_a_full_disk_raises_disk_full_error_and_leaves_no_torn_line(
  tmp_path, monkeypatch
):
  """metrics.jsonl (and every appended log) ends with its last whole row, not half of the row the
  full disk cut; a resumed writer reads it as it was."""
  writer = MetricsWriter(str(tmp_path))
  writer.write(1, {"reward/mean": 0.5})
  path = str(tmp_path / "metrics.jsonl")
  with open(path, "rb") as f:
    before = f.read()
  with monkeypatch.context() as m:
    short_write_then_disk_full(m)
    with pytest.raises(DiskFullError) as e:
      writer.write(2, {"reward/mean": 0.75})
  assert_disk_full(e.value, path)
  with open(path, "rb") as f:
    assert f.read() == before
  writer.close()
  with monkeypatch.context() as m:
    short_write_then_disk_full(m)
    with pytest.raises(DiskFullError):
      append_lines(path, ['{"step": 3}'])
  MetricsWriter(str(tmp_path), resume_step=1).close()
  with open(path, "rb") as f:
    assert f.read() == before


def test_a_replacement_on_a_full_disk_raises_disk_full_error_and_keeps_the_old_file(tmp_path):
  """summary.json, config.json, eval_*.jsonl and truncated logs are written beside and renamed:
  a full disk (here a real ENOSPC: the temporary file is /dev/full) leaves the old file whole."""
  path = tmp_path / "summary.json"
  path.write_text('{"steps": 1}')
  os.symlink("/dev/full", f"{path}.tmp")
  with pytest.raises(DiskFullError) as e:
    write_atomic(str(path), '{"steps": 2}\n' * 10000)
  assert_disk_full(e.value, str(path))
  assert path.read_text() == '{"steps": 1}' and not os.path.lexists(f"{path}.tmp")
  rows = tmp_path / "feedback.jsonl"
  rows.write_text('{"step": 1}\n{"step": 2}\n')
  os.symlink("/dev/full", f"{rows}.tmp")
  with pytest.raises(DiskFullError):
    truncate_jsonl(str(rows), 1)
  assert rows.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_compile_counter_counts_each_new_program_once():
  """A new jit shape is one XLA compilation (JAX's backend-compile event, whose name this checks
  on the installed JAX), counted under the jitted function's name; calling it again, or with a
  shape already compiled, is none; `pop` resets the step's figures; after `close` nothing is
  counted."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from coevolve_jax.metrics import CompileCounter

  def sin_scaled(x):
    return jnp.sin(x) * 3.0 + 1.0

  def cos_scaled(x):
    return jnp.cos(x) * 3.0

  counter = CompileCounter()
  try:
    f, g = jax.jit(sin_scaled), jax.jit(cos_scaled)
    f(np.ones(17)).block_until_ready()
    f(np.ones(17)).block_until_ready()
    first = counter.pop()
    assert first["compile/count"] == 1 and first["compile/seconds"] > 0
    assert first["compile/program/sin_scaled"] == 1
    f(np.ones(17)).block_until_ready()
    f(np.ones(19)).block_until_ready()  # a new shape
    g(np.ones(23)).block_until_ready()
    second = counter.pop()
    assert second["compile/count"] == 2
    assert second["compile/program/sin_scaled"] == 1
    assert second["compile/program/cos_scaled"] == 1
    assert counter.pop() == {"compile/count": 0, "compile/seconds": 0.0, "compile/cache_hits": 0}
    assert counter.total == 3
  finally:
    counter.close()
  f(np.ones(29)).block_until_ready()
  assert counter.total == 3
  counter.close()  # twice: no error


def test_call_recall_counts_ground_truth_calls_made_exactly_and_by_name():
  from coevolve_jax.metrics import call_recall  # noqa: PLC0415

  truth = [["ls()", "cd(folder='a')"], ["ls()", "cat(file_name='x')"]]
  # Turn boundaries do not matter; "ls()" made once of the two asked for; cd with another argument
  # matches by name only; an extra call costs nothing.
  calls = [["cd(folder='b')"], ["ls()", "cat(file_name='x')", "pwd()"]]
  assert call_recall(truth, calls) == (0.5, 0.75)
  assert call_recall(truth, []) == (0.0, 0.0)
  assert call_recall(truth, truth) == (1.0, 1.0)
  assert call_recall([[]], [["ls()"]]) == (1.0, 1.0)


def test_compile_census_reads_the_per_program_counts_of_a_run():
  """benchmarks/compile_census.py: per row, the named programs and the rest ("other", also the
  whole count for rows logged before per-program counts), the row's phase seconds as the
  reference, and the compilations after GRPO step 2 summed."""
  import importlib.util
  import pathlib

  path = pathlib.Path(__file__).parent.parent / "benchmarks" / "compile_census.py"
  spec = importlib.util.spec_from_file_location("compile_census", path)
  census_lib = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(census_lib)
  rows = [
    {"step": 0, "warmstart/loss": 2.0},  # no compile counts: not a census row
    {
      "step": 0,
      "compile/count": 3,
      "compile/seconds": 6.0,
      "timing/warmstart": 20.0,
      "compile/program/_sft_step_fn": 1,
      "compile/program/stage": 2,
    },
    {
      "step": 3,
      "compile/count": 2,
      "compile/seconds": 4.0,
      "timing/rollout": 5.0,
      "timing/train": 3.0,
      "timing/weight_sync_s": 9.0,
      "compile/program/_prefill_rows": 2,
      "train/padded_len": 1024,
      "train/padded_targets": 128,
    },
    {"step": 4, "compile/count": 1, "compile/seconds": 1.5, "timing/train": 3.0},  # older log
  ]
  got = census_lib.census(rows)
  assert [e["step"] for e in got] == [0, 3, 4]
  assert got[0]["programs"]["_sft_step_fn"] == 1 and got[0]["programs"]["other"] == 2
  assert got[1]["programs"]["_prefill_rows"] == 2 and got[1]["programs"]["other"] == 0
  assert got[1]["step_seconds"] == 8.0  # the phases; weight sync is inside them, not added
  assert got[1]["padded"] == (1024, 128)
  assert got[2]["programs"]["other"] == 1
  text = census_lib.table(got)
  assert "| 3 | 2 | 4.0 | 8.0 | 0.50 | 2 |" in text
  assert "compilations after GRPO step 2: 3 (5.5 s" in text


def test_a_full_disk_under_tensorboards_writer_thread_is_the_one_line_error(
  tmp_path, monkeypatch, capfd
):
  """tensorboardX writes the events in a thread of its own: a full disk there used to kill the
  thread with a traceback while the run went on. It is now the same DiskFullError, naming the
  tensorboard folder, from the run's next metrics write; no traceback is printed."""
  import errno  # noqa: PLC0415
  import time  # noqa: PLC0415

  from tensorboardX import event_file_writer  # noqa: PLC0415

  from coevolve_jax import metrics  # noqa: PLC0415

  writer = MetricsWriter(str(tmp_path))
  writer.write(1, {"loss": 1.0})

  def full(self, event):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(event_file_writer.EventsWriter, "write_event", full)
  writer._tb.add_scalar("loss", 2.0, 2)  # queued: the writer thread meets the full disk
  deadline = time.monotonic() + 10
  while not metrics._TB_DISK_FULL and time.monotonic() < deadline:
    time.sleep(0.05)
  with pytest.raises(DiskFullError) as e:
    writer.write(3, {"loss": 3.0})
  assert_disk_full(e.value, str(tmp_path / "tensorboard"))
  assert "Traceback" not in capfd.readouterr().err
  monkeypatch.undo()
  writer.close()
