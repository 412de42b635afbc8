"""Run checkpoints: round trip, keep-last-N, damaged checkpoints fall back to the previous one, a
resumed run's next step is bit-identical, and restoring onto another device count or mesh."""

import asyncio
import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath
from flax import nnx

from coevolve_jax import errors, grpo
from coevolve_jax.checkpoint import CheckpointMismatchError, RunCheckpointer
from coevolve_jax.errors import DiskFullError
from coevolve_jax.metrics import truncate_jsonl
from coevolve_jax.models import Qwen
from coevolve_jax.trainer import PolicyTrainer, TrainState, make_batch, make_optimizer
from coevolve_jax.types import Trajectory
from coevolve_jax.workdir import model_changes
from disk_full import assert_disk_full, orbax_write_fails
from host_devices import run_child

import kit


def _state(scale):
  params = {"w": jnp.full((3, 2), scale, jnp.float32)}
  return TrainState(params, {"m": jnp.zeros((3, 2))}, {"w": jnp.ones((3, 2))})


def test_round_trip_and_fallback_from_a_damaged_checkpoint(tmp_path, capsys):
  ckpt = RunCheckpointer(str(tmp_path / "ck"), keep=3)
  for step in (1, 2):
    ckpt.save(step, _state(float(step)), {"step": step, "pool_size": step})
  ckpt.wait()
  step, state, meta = ckpt.restore_latest(_state(0.0))
  assert step == 2 and meta["step"] == 2 and isinstance(state, TrainState)
  np.testing.assert_array_equal(state.params["w"], np.full((3, 2), 2.0))
  np.testing.assert_array_equal(state.opt_state["m"], np.zeros((3, 2)))
  np.testing.assert_array_equal(state.ref_params["w"], np.ones((3, 2)))
  state, meta = ckpt.restore(1, _state(0.0))
  assert meta["step"] == 1 and float(state.params["w"][0, 0]) == 1.0
  ckpt.close()

  shutil.rmtree(tmp_path / "ck" / "2" / "params")  # a partial / corrupt newest checkpoint
  ckpt = RunCheckpointer(str(tmp_path / "ck"), keep=3)
  step, state, meta = ckpt.restore_latest(_state(0.0))
  assert step == 1 and meta["pool_size"] == 1
  np.testing.assert_array_equal(state.params["w"], np.full((3, 2), 1.0))
  assert "checkpoint step 2 is unreadable" in capsys.readouterr().out
  ckpt.close()


def test_train_state_is_one_pytree_of_its_three_fields():
  state = _state(2.0)
  leaves = jax.tree.leaves(state)  # field order: params, opt_state, ref_params
  assert [float(x[0, 0]) for x in leaves] == [2.0, 0.0, 1.0]
  doubled = jax.tree.map(lambda x: 2 * x, state)
  assert isinstance(doubled, TrainState) and float(doubled.params["w"][0, 0]) == 4.0
  assert jax.tree.leaves(state.replace(ref_params=None)) == leaves[:2]
  with pytest.raises(dataclasses.FrozenInstanceError):
    state.params = {}


def test_no_checkpoint_means_fresh_start(tmp_path):
  ckpt = RunCheckpointer(str(tmp_path / "ck"), keep=2)
  assert ckpt.restore_latest(_state(0.0)) is None
  ckpt.close()


def test_truncate_jsonl_drops_rows_after_the_resume_step_and_torn_lines(tmp_path):
  path = os.path.join(tmp_path, "m.jsonl")
  with open(path, "w") as f:
    f.write('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 3, "x"')
  assert truncate_jsonl(path, 2) == 2
  with open(path) as f:
    assert f.read() == '{"step": 0}\n{"step": 1}\n{"step": 2}\n'
  assert truncate_jsonl(path, -1) == 3
  with open(path) as f:
    assert f.read() == ""


def test_keep_last_n_and_unfinished_saves_are_ignored(tmp_path):
  with pytest.raises(ValueError, match="keep must be >= 1"):
    RunCheckpointer(str(tmp_path / "bad"), keep=0)
  ckpt = RunCheckpointer(str(tmp_path / "ck"), keep=2)
  for step in (1, 2, 3, 4):
    ckpt.save(step, _state(float(step)), {"step": step})
  ckpt.wait()
  assert ckpt.all_steps() == [3, 4]
  assert sorted(os.listdir(tmp_path / "ck")) == ["3", "4"]
  ckpt.close()
  # A save killed before its commit leaves a temporary folder: never taken for a checkpoint.
  shutil.copytree(tmp_path / "ck" / "4", tmp_path / "ck" / "5.orbax-checkpoint-tmp-1234")
  ckpt = RunCheckpointer(str(tmp_path / "ck"), keep=2)
  assert ckpt.all_steps() == [3, 4]
  step, state, _ = ckpt.restore_latest(_state(0.0))
  assert step == 4 and float(state.params["w"][0, 0]) == 4.0
  ckpt.close()


def test_corrupt_metadata_falls_back_with_a_warning(tmp_path, capsys):
  ckpt = RunCheckpointer(str(tmp_path / "ck"), keep=3)
  for step in (1, 2):
    ckpt.save(step, _state(float(step)), {"step": step})
  ckpt.wait()
  ckpt.close()
  with open(tmp_path / "ck" / "2" / "meta" / "metadata", "w") as f:
    f.write('{"step": 2, "trunc')  # a torn JSON write
  ckpt = RunCheckpointer(str(tmp_path / "ck"), keep=3)
  step, state, meta = ckpt.restore_latest(_state(0.0))
  assert step == 1 and meta == {"step": 1} and float(state.params["w"][0, 0]) == 1.0
  assert "checkpoint step 2 is unreadable" in capsys.readouterr().out
  ckpt.close()


def _wide_state(scale, n=40):
  """A TrainState with many small arrays: a damaged step then fails on one read while others are
  still in flight."""
  params = {f"w{i}": jnp.full((3, 2), scale, jnp.float32) for i in range(n)}
  return TrainState(params, {"m": jnp.zeros((3, 2))}, {"w": jnp.ones((3, 2))})


def _truncate_array_files(step_dir):
  """What a bad disk or a writer killed past the commit leaves: the array data files cut short."""
  for root, _, files in os.walk(step_dir / "params"):
    if os.path.basename(root) == "d":
      for name in files:
        path = os.path.join(root, name)
        os.truncate(path, os.path.getsize(path) // 2)


def _corrupt_meta(step_dir):
  with open(step_dir / "meta" / "metadata", "w") as f:
    f.write('{"step": 2, "trunc')  # a torn JSON write


def _remove_item(step_dir):
  shutil.rmtree(step_dir / "params")


@pytest.mark.parametrize("damage", [_truncate_array_files, _corrupt_meta, _remove_item])
def test_a_damaged_newest_step_is_moved_aside_and_written_again(tmp_path, capsys, damage):
  """Rerun 1 falls back to step 1, moves step 2 to 2.damaged-1 with one warning line, and saves
  step 2 again (was StepAlreadyExistsError on every rerun); rerun 2 restores the new step 2."""
  ck = tmp_path / "ck"
  ckpt = RunCheckpointer(str(ck), keep=3)
  for step in (1, 2):
    ckpt.save(step, _wide_state(float(step)), {"step": step})
  ckpt.close()
  damage(ck / "2")
  damaged = sorted(p.relative_to(ck / "2") for p in (ck / "2").rglob("*"))
  capsys.readouterr()

  ckpt = RunCheckpointer(str(ck), keep=3)
  step, state, meta = ckpt.restore_latest(_wide_state(0.0))
  assert step == 1 and meta == {"step": 1} and float(state.params["w0"][0, 0]) == 1.0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 1, lines
  assert lines[0].startswith("warning: checkpoint step 2 is unreadable (")
  assert lines[0].endswith(f"moved it to {ck}/2.damaged-1 and resuming from step 1")
  assert sorted(os.listdir(ck)) == ["1", "2.damaged-1"]
  assert sorted(p.relative_to(ck / "2.damaged-1") for p in (ck / "2.damaged-1").rglob("*")) == (
    damaged
  )  # kept as it was
  assert ckpt.all_steps() == [1]
  ckpt.save(2, _wide_state(5.0), {"step": 2})  # the resumed run redoes step 2
  ckpt.close()

  ckpt = RunCheckpointer(str(ck), keep=3)
  step, state, meta = ckpt.restore_latest(_wide_state(0.0))
  assert step == 2 and meta == {"step": 2} and float(state.params["w0"][0, 0]) == 5.0
  assert capsys.readouterr().out == ""
  ckpt.close()

  damage(ck / "2")  # damaged again: the earlier copy stays, this one is the second
  ckpt = RunCheckpointer(str(ck), keep=3)
  assert ckpt.restore_latest(_wide_state(0.0))[0] == 1
  assert sorted(os.listdir(ck)) == ["1", "2.damaged-1", "2.damaged-2"]
  assert "moved it to" in capsys.readouterr().out
  ckpt.close()


def test_no_readable_step_moves_nothing(tmp_path, capsys):
  ck = tmp_path / "ck"
  ckpt = RunCheckpointer(str(ck), keep=3)
  for step in (1, 2):
    ckpt.save(step, _state(float(step)), {"step": step})
  ckpt.close()
  for step in ("1", "2"):
    _corrupt_meta(ck / step)
  ckpt = RunCheckpointer(str(ck), keep=3)
  with pytest.raises(RuntimeError, match=r"no readable checkpoint among steps \[2, 1\]"):
    ckpt.restore_latest(_state(0.0))
  ckpt.close()
  assert sorted(os.listdir(ck)) == ["1", "2"]
  out = capsys.readouterr().out
  assert "checkpoint step 2 is unreadable" in out and "checkpoint step 1 is unreadable" in out


def test_falling_back_leaves_no_read_in_flight_on_a_closed_event_loop(tmp_path, capfd, monkeypatch):
  """A damaged step fails on one array while the others are still being read; orbax then closed
  its event loop under them and each late read printed "RuntimeError: Event loop is closed" (~48
  tracebacks per fallback). Now every loop closes with no task pending and nothing is printed."""
  ck = tmp_path / "ck"
  ckpt = RunCheckpointer(str(ck), keep=3)
  for step in (1, 2):
    ckpt.save(step, _wide_state(float(step)), {"step": step})
  ckpt.close()
  _truncate_array_files(ck / "2")
  pending_at_close = []
  close = asyncio.BaseEventLoop.close

  def counting_close(loop):
    pending_at_close.append(sum(not t.done() for t in asyncio.all_tasks(loop)))
    close(loop)

  monkeypatch.setattr(asyncio.BaseEventLoop, "close", counting_close)
  ckpt = RunCheckpointer(str(ck), keep=3)
  for _ in range(3):  # the failing read is not always first: try a few times
    with pytest.raises(ValueError):
      ckpt.restore(2, _wide_state(0.0))
  assert ckpt.restore_latest(_wide_state(0.0))[0] == 1
  ckpt.close()
  time.sleep(0.5)  # late reads would print now
  assert pending_at_close and max(pending_at_close) == 0, pending_at_close
  assert "Event loop is closed" not in capfd.readouterr().err


def _late_result_after_a_failure(loop):
  """What orbax's gather over TensorStore operations does when one fails: the coroutine ends at
  once while another operation completes 0.2 s later from TensorStore's thread. Returns whether
  that late completion found the loop open."""
  late = loop.create_future()
  delivered = []

  def complete_later():
    time.sleep(0.2)
    try:
      loop.call_soon_threadsafe(late.set_result, "read")
      delivered.append(True)
    except RuntimeError:  # "Event loop is closed": TensorStore prints this traceback
      delivered.append(False)

  async def fails():
    raise ValueError("the damaged array")

  async def waits():
    return await late

  async def restore():
    await asyncio.gather(fails(), waits())

  threading.Thread(target=complete_later).start()
  with pytest.raises(ValueError):
    loop.run_until_complete(restore())
  loop.close()
  time.sleep(0.4)
  return delivered == [True]


def test_event_loops_close_after_their_tasks_while_a_checkpointer_is_open(tmp_path):
  """The mechanism behind both the restore fallback and a background write failing: while a
  RunCheckpointer is open, a loop that orbax closes with operations in flight waits for them; the
  asyncio policy in force before comes back once the last one is closed."""
  before = asyncio.get_event_loop_policy()
  assert not _late_result_after_a_failure(asyncio.SelectorEventLoop())  # what happened
  a = RunCheckpointer(str(tmp_path / "a"), keep=1)
  b = RunCheckpointer(str(tmp_path / "b"), keep=1)
  assert _late_result_after_a_failure(asyncio.new_event_loop())
  a.close()
  assert _late_result_after_a_failure(asyncio.new_event_loop())  # b still open
  b.close()
  b.close()  # closing twice releases once
  assert asyncio.get_event_loop_policy() is before


def test_a_full_disk_when_a_save_starts_is_a_disk_full_error_and_loses_nothing(
  tmp_path, monkeypatch
):
  """The step's folder cannot be made: `save` itself raises DiskFullError naming it (orbax made
  the folders in the background: its writer threads then waited 5 minutes at exit)."""
  ck = tmp_path / "ck"
  ckpt = RunCheckpointer(str(ck), keep=3)
  ckpt.save(1, _state(1.0), {"step": 1})
  ckpt.wait()
  with monkeypatch.context() as m:
    orbax_write_fails(m, "mkdir", "2.orbax-checkpoint-tmp")
    start = time.monotonic()
    with pytest.raises(DiskFullError) as e:
      ckpt.save(2, _state(2.0), {"step": 2})
    assert_disk_full(e.value, f"{ck}/2")
    ckpt.close()
    assert time.monotonic() - start < 60
  ckpt = RunCheckpointer(str(ck), keep=3)
  step, state, meta = ckpt.restore_latest(_state(0.0))
  assert step == 1 and meta == {"step": 1} and float(state.params["w"][0, 0]) == 1.0
  ckpt.save(2, _state(2.0), {"step": 2})  # space again: the same step saves
  ckpt.close()
  ckpt = RunCheckpointer(str(ck), keep=3)
  assert ckpt.all_steps() == [1, 2]
  ckpt.close()


def _slow_writes(monkeypatch, name_end: str, seconds: float) -> None:
  """orbax's `write_text` of paths ending in `name_end` waits `seconds` first."""
  cls = type(epath.Path("/"))
  original = cls.write_text

  def slow(self, *args, **kwargs):
    if str(self).endswith(name_end):
      time.sleep(seconds)
    return original(self, *args, **kwargs)

  monkeypatch.setattr(cls, "write_text", slow)


def test_a_full_disk_during_a_background_save_is_a_disk_full_error_and_loses_nothing(
  tmp_path, monkeypatch
):
  """A write of the background save fails: the next `save` (or `wait`) raises DiskFullError naming
  the failed step, not the one being started, once the save's other writers have ended (orbax
  reports the failure while they still write into the step's temporary folder, and saving that
  step again removes the folder under them: "Directory not empty", 1 run in ~20 of this file
  under load before the wait)."""
  ck = tmp_path / "ck"
  ckpt = RunCheckpointer(str(ck), keep=3)
  ckpt.save(1, _state(1.0), {"step": 1})
  ckpt.wait()
  with monkeypatch.context() as m:
    orbax_write_fails(m, "write_text", "meta.orbax-checkpoint-tmp/metadata")
    _slow_writes(m, "opt_state.orbax-checkpoint-tmp/_METADATA", 0.5)  # a late writer
    ckpt.save(2, _state(2.0), {"step": 2})  # returns: the files are written in the background
    with pytest.raises(DiskFullError) as e:
      ckpt.save(3, _state(3.0), {"step": 3})
    assert_disk_full(e.value, f"{ck}/2")
    written = sorted(str(f) for f in ck.rglob("*"))
    time.sleep(1.0)  # longer than the late writer's wait
    assert sorted(str(f) for f in ck.rglob("*")) == written  # nothing lands after the error
    with contextlib.suppress(DiskFullError):  # orbax may report it once more
      ckpt.close()
  ckpt = RunCheckpointer(str(ck), keep=3)
  assert ckpt.all_steps() == [1]
  step, state, _ = ckpt.restore_latest(_state(0.0))
  assert step == 1 and float(state.params["w"][0, 0]) == 1.0
  with monkeypatch.context() as m:
    orbax_write_fails(m, "write_text", "meta.orbax-checkpoint-tmp/metadata")
    ckpt.save(2, _state(2.0), {"step": 2})
    with pytest.raises(DiskFullError) as e:
      ckpt.wait()
    assert_disk_full(e.value, f"{ck}/2")
    with contextlib.suppress(DiskFullError):
      ckpt.close()
  ckpt = RunCheckpointer(str(ck), keep=3)
  assert ckpt.all_steps() == [1]
  ckpt.close()


def test_disk_full_is_recognised_in_orbax_and_tensorstore_errors(tmp_path):
  """TensorStore reports ENOSPC in its message (as captured from a save to a full tmpfs); errors
  chained from one count too; other errors do not."""
  tensorstore = ValueError(
    'RESOURCE_EXHAUSTED: Error writing "1.0.count/0" in OCDBT database at local file '
    '"/r/checkpoints/1.orbax-checkpoint-tmp/opt_state.orbax-checkpoint-tmp/ocdbt.process_0/": '
    'Failed writing: "/r/checkpoints/1.orbax-checkpoint-tmp/d/123f": Failed to write 2375680 '
    "bytes to file 20: No space left on device [os_error_code='28']"
  )
  assert errors.disk_full_errno(tensorstore) == errno.ENOSPC
  assert errors.disk_full_errno(OSError(errno.EDQUOT, "quota")) == errno.EDQUOT
  try:
    try:
      raise tensorstore
    except ValueError as inner:
      raise RuntimeError("commit failed") from inner
  except RuntimeError as outer:
    assert errors.disk_full_errno(outer) == errno.ENOSPC
  assert errors.disk_full_errno(OSError(errno.EACCES, "denied")) is None
  assert errors.disk_full_errno(ValueError("[os_error_code='2'] not found")) is None
  with pytest.raises(DiskFullError, match="^disk quota exceeded writing .*/x/y.json"):
    with errors.writing(str(tmp_path / "x" / "y.json")):  # the folder need not exist
      raise OSError(errno.EDQUOT, "Disk quota exceeded")
  with pytest.raises(PermissionError), errors.writing(str(tmp_path)):
    raise PermissionError(errno.EACCES, "denied")


def test_a_disk_out_of_inodes_says_so(tmp_path, monkeypatch):
  """ENOSPC with bytes to spare: the filesystem ran out of inodes (as a tmpfs with nr_inodes does
  at orbax's first mkdir); "883.5 MiB free" alone would mislead."""
  # bsize, frsize, blocks, bfree, bavail, files, ffree, favail, flag, namemax
  full = os.statvfs_result((4096, 4096, 262144, 226176, 226176, 74, 0, 0, 0, 255))
  monkeypatch.setattr(os, "statvfs", lambda path: full)
  error = DiskFullError(str(tmp_path / "ck" / "0"))
  assert str(error).startswith(f"no space left on device writing {tmp_path}/ck/0 (883.5 MiB but ")
  assert "no inodes free on /" in str(error)
  assert error.free == 226176 * 4096 and error.free_inodes == 0


# ---------------------------------------------------------------------------------------------
# Resume of a real trainer.
# ---------------------------------------------------------------------------------------------

TINY = kit.tiny_config(
  vocab_size=256,
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=1,
  num_attention_heads=2,
  num_key_value_heads=1,
)


def _trainer(seed, mesh=None):
  return PolicyTrainer(
    Qwen(TINY, rngs=nnx.Rngs(seed)),
    make_optimizer(1e-2, 0.01, 1.0),
    grpo.GRPOConfig(),
    sampling=0.9,
    mesh=mesh,
  )


def _batch(key, np_rng):
  """8 rows drawn from the run's two RNGs (device key: tokens; host generator: lengths)."""
  tokens = np.asarray(jax.random.randint(key, (8, 24), 1, TINY.vocab_size))
  trajs = []
  for r in range(8):
    n_prompt, n_reply = int(np_rng.integers(3, 8)), int(np_rng.integers(1, 12))
    tr = Trajectory(task_id=str(r // 4), group_id=r // 4)
    tr.extend(tokens[r, :n_prompt].tolist(), sampled=False)
    tr.extend(
      tokens[r, n_prompt : n_prompt + n_reply].tolist(), sampled=True, logprobs=[-1.0] * n_reply
    )
    trajs.append(tr)
  return make_batch(trajs, np_rng.normal(0.0, 1.0, 8), min_len=32, min_targets=16)


def _step(trainer, rngs):
  key, np_rng = rngs
  key, sub = jax.random.split(key)
  batch = _batch(sub, np_rng)
  metrics = trainer.grpo_update(
    batch, trainer.logprobs(batch), trainer.logprobs(batch, trainer.ref_params)
  )
  return metrics, (key, np_rng)


def _meta(step, rngs):
  key, np_rng = rngs
  return {
    "step": step,
    "key": jax.random.key_data(key).tolist(),
    "np_rng": np_rng.bit_generator.state,
  }


def _rngs_from(meta):
  np_rng = np.random.default_rng()
  np_rng.bit_generator.state = meta["np_rng"]
  return jax.random.wrap_key_data(jnp.asarray(meta["key"], jnp.uint32)), np_rng


def test_resumed_run_takes_the_next_step_bit_identically(tmp_path):
  """Uninterrupted steps 1-3 versus steps 1-2, save, a fresh process state restored from the
  checkpoint (other initial weights, other RNG seeds), step 3: identical bits. The save is not
  waited for: step 3 of the first run donates the buffers while the save is in flight."""
  ckpt = RunCheckpointer(str(tmp_path / "ck"), keep=2)
  a = _trainer(0)
  a.freeze_reference()
  rngs = (jax.random.key(42), np.random.default_rng(7))
  for _ in range(2):
    _, rngs = _step(a, rngs)
  at_save = jax.tree.map(np.array, (a.params, a.opt_state))
  ckpt.save(2, a.state, _meta(2, rngs))
  want_metrics, _ = _step(a, rngs)  # no wait: the step runs while the save writes
  ckpt.wait()
  ckpt.close()

  b = _trainer(1)  # different weights and RNGs until restored
  b.freeze_reference()
  ckpt = RunCheckpointer(str(tmp_path / "ck"), keep=2)
  step, b.state, meta = ckpt.restore_latest(b.state)
  ckpt.close()
  assert step == 2 and meta["step"] == 2
  for x, y in zip(jax.tree.leaves(at_save), jax.tree.leaves((b.params, b.opt_state))):
    np.testing.assert_array_equal(np.asarray(y), x)  # the saved state, not the donated one
  got_metrics, _ = _step(b, _rngs_from(meta))
  assert got_metrics == want_metrics
  for x, y in zip(
    jax.tree.leaves((a.params, a.opt_state)), jax.tree.leaves((b.params, b.opt_state))
  ):
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_restore_onto_another_device_count_and_mesh(tmp_path):
  """Saved on 1 device here; restored in a fresh interpreter with 8 devices onto two meshes, saved
  from one mesh and restored onto another and onto a single device (`_mesh_child`)."""
  a = _trainer(0)
  a.freeze_reference()
  rngs = (jax.random.key(3), np.random.default_rng(3))
  _, rngs = _step(a, rngs)
  ckpt = RunCheckpointer(str(tmp_path / "ck"), keep=2)
  ckpt.save(1, a.state, _meta(1, rngs))
  ckpt.wait()
  ckpt.close()
  np.savez(
    tmp_path / "want.npz", *[np.asarray(x) for x in jax.tree.leaves((a.params, a.opt_state))]
  )
  run_child(__file__, "mesh", str(tmp_path))


def _mesh_child(folder):
  from coevolve_jax.models.sharding import make_mesh

  assert jax.device_count() == 8
  P = jax.sharding.PartitionSpec  # noqa: N806
  with np.load(os.path.join(folder, "want.npz")) as f:
    want = [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]

  def restored(directory, mesh):
    t = _trainer(5, mesh)
    t.freeze_reference()
    ckpt = RunCheckpointer(directory, keep=2)
    step, t.state, meta = ckpt.restore_latest(t.state)
    ckpt.close()
    return step, t, meta

  mesh_a = make_mesh({"fsdp": 2, "tensor": 4})
  step, a, meta = restored(os.path.join(folder, "ck"), mesh_a)  # 1 device -> 8
  assert step == 1
  emb = a.params["embed_tokens"].get_value()
  assert emb.sharding.spec == P("tensor", "fsdp") and len(emb.sharding.device_set) == 8
  assert a.opt_state[1][0].mu["embed_tokens"].get_value().sharding.spec == P("tensor", "fsdp")
  for x, y in zip(want, jax.tree.leaves((a.params, a.opt_state))):
    np.testing.assert_array_equal(np.asarray(y), x)
  _, rngs = _step(a, _rngs_from(meta))  # the restored state trains on the mesh
  ckpt = RunCheckpointer(os.path.join(folder, "ck8"), keep=2)
  ckpt.save(2, a.state, _meta(2, rngs))
  ckpt.wait()
  ckpt.close()
  want2 = [np.asarray(x) for x in jax.tree.leaves(a.state)]

  mesh_b = make_mesh({"data": 2, "fsdp": 4})  # other mesh shape, same devices
  _, b, _ = restored(os.path.join(folder, "ck8"), mesh_b)
  assert b.params["embed_tokens"].get_value().sharding.spec == P(None, "fsdp")
  one = make_mesh({}, devices=jax.devices()[:1])  # 8 devices -> 1
  _, c, _ = restored(os.path.join(folder, "ck8"), one)
  assert len(c.params["embed_tokens"].get_value().sharding.device_set) == 1
  for t in (b, c):
    for x, y in zip(want2, jax.tree.leaves(t.state)):
      np.testing.assert_array_equal(np.asarray(y), x)
  print("mesh OK")


if __name__ == "__main__":
  if sys.argv[1] == "mesh":
    _mesh_child(sys.argv[2])


def test_a_checkpoint_of_another_model_size_is_named_and_left_alone(tmp_path):
  """Resuming with a changed model size used to call the good checkpoints "unreadable" and
  advise deleting them; now the error names the arrays whose shapes differ and the config the
  checkpoint was saved with, and every step stays where it was (nothing moved or deleted)."""
  ck = tmp_path / "ck"
  ckpt = RunCheckpointer(str(ck), keep=3)
  small = _trainer(0)
  small.freeze_reference()
  for step in (1, 2):
    ckpt.save(step, small.state, {"step": step, "config": {"model": {"preset": "small"}}})
  ckpt.close()
  before = sorted(os.listdir(ck))

  wide = PolicyTrainer(
    Qwen(dataclasses.replace(TINY, hidden_size=48), rngs=nnx.Rngs(0)),
    make_optimizer(1e-2, 0.01, 1.0),
    grpo.GRPOConfig(),
    sampling=0.9,
  )
  wide.freeze_reference()
  ckpt = RunCheckpointer(str(ck), keep=3)
  with pytest.raises(CheckpointMismatchError) as e:
    ckpt.restore_latest(wide.state)
  ckpt.close()
  message = str(e.value)
  assert e.value.step == 2 and e.value.saved_config == {"model": {"preset": "small"}}
  assert "saved for another model" in message and "not moved" in message
  assert "unreadable" not in message and "delete" not in message
  assert re.search(r"params/\S+: \(\d+, 32\) saved, \(\d+, 48\) configured", message), message
  assert sorted(os.listdir(ck)) == before  # no step moved aside, none deleted

  # The advice the run adds: which model fields changed since the checkpoint was saved.
  now = json.dumps({"model": {"preset": "wide"}})
  assert model_changes(e.value.saved_config, now) == "model.preset: 'small' when saved, 'wide' now"
  assert "model.checkpoint" in model_changes(e.value.saved_config, json.dumps(e.value.saved_config))


def test_every_log_a_run_resumes_from_sets_its_torn_lines_aside(tmp_path, capsys):
  """metrics.jsonl, feedback.jsonl, exploration.jsonl and groups.jsonl, each brought back by its
  own resume path: a last line cut inside a UTF-8 character (it crashed every resume with
  UnicodeDecodeError) and a line that is not a JSON object are moved to `<log>.torn`, counted in
  one warning line, and the whole rows up to the checkpoint are kept byte for byte."""
  from coevolve_jax import workdir as workdir_files
  from coevolve_jax.feedback.pool import TaskPool
  from coevolve_jax.feedback.rounds import RoundJournal
  from coevolve_jax.hooks import GroupLog
  from coevolve_jax.metrics import MetricsWriter

  good = '{"step": 1, "text": "caf\u00e9 \u2028 ok"}\n'.encode("utf-8")
  rows = good + b'{"step": 2}\n[1, 2]\n' + '{"step": 2, "x": "\u00e9'.encode("utf-8")[:-1]
  names = ("metrics.jsonl", "feedback.jsonl", "exploration.jsonl", "groups.jsonl")
  for name in names:
    (tmp_path / name).write_bytes(rows)
  writer = MetricsWriter(str(tmp_path), resume_step=1)
  writer.close()
  pool = TaskPool(str(tmp_path / "pool.jsonl"))
  workdir_files.roll_back(str(tmp_path), 1, pool, 0, RoundJournal(str(tmp_path / "rounds")))
  GroupLog(str(tmp_path)).on_resume(1)
  out = capsys.readouterr().out
  for name in names:
    assert (tmp_path / name).read_bytes() == good, name
    torn = (tmp_path / f"{name}.torn").read_bytes()
    assert torn == b"[1, 2]\n" + rows[rows.rindex(b"\n") + 1 :] + b"\n", name
    assert f"{tmp_path / name}: 2 torn line(s)" in out, out
