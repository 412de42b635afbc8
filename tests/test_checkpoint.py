"""Run checkpoints: round trip, and a damaged newest checkpoint falls back to the previous one."""

import os
import shutil

import jax.numpy as jnp
import numpy as np

from coevolve_jax.checkpoint import RunCheckpointer
from coevolve_jax.metrics import truncate_jsonl


def _trees(scale):
  params = {"w": jnp.full((3, 2), scale, jnp.float32)}
  return params, {"m": jnp.zeros((3, 2))}, {"w": jnp.ones((3, 2))}


def test_round_trip_and_fallback_from_a_damaged_checkpoint(tmp_path, capsys):
  ckpt = RunCheckpointer(str(tmp_path / "ck"), keep=3)
  for step in (1, 2):
    ckpt.save(step, *_trees(float(step)), {"step": step, "pool_size": step})
  ckpt.wait()
  step, params, _, _, meta = ckpt.restore_latest(*_trees(0.0))
  assert step == 2 and meta["step"] == 2
  np.testing.assert_array_equal(params["w"], np.full((3, 2), 2.0))
  ckpt.close()

  shutil.rmtree(tmp_path / "ck" / "2" / "params")  # a partial / corrupt newest checkpoint
  ckpt = RunCheckpointer(str(tmp_path / "ck"), keep=3)
  step, params, _, _, meta = ckpt.restore_latest(*_trees(0.0))
  assert step == 1 and meta["pool_size"] == 1
  np.testing.assert_array_equal(params["w"], np.full((3, 2), 1.0))
  assert "checkpoint step 2 is unreadable" in capsys.readouterr().out
  ckpt.close()


def test_no_checkpoint_means_fresh_start(tmp_path):
  ckpt = RunCheckpointer(str(tmp_path / "ck"), keep=2)
  assert ckpt.restore_latest(*_trees(0.0)) is None
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
