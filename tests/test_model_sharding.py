"""Sharded Qwen forward passes on 8 host CPU devices equal the single-device result.

The device count of a JAX process is fixed at start-up, so the checks run in a subprocess
(tests/sharding_worker.py) with --xla_force_host_platform_device_count=8: a dense model under
fsdp=8 and fsdp x tensor = 2 x 4 meshes, and a MoE model under expert-parallel meshes; each
parameter's sharding is checked against the logical rules.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from coevolve_jax.models import sharding


def test_sharded_forward_equals_single_device_and_parameters_follow_the_rules():
  root = Path(__file__).resolve().parent.parent
  env = dict(
    os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3"
  )  # silence XLA's partitioner warnings
  proc = subprocess.run(
    [sys.executable, str(root / "tests" / "sharding_worker.py")],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
  meshes = {
    (r["model"], tuple(sorted((k, v) for k, v in r["mesh"].items() if v > 1))) for r in rows
  }
  assert meshes == {
    ("dense", (("fsdp", 8),)),
    ("dense", (("fsdp", 2), ("tensor", 4))),
    ("moe", (("expert", 4), ("fsdp", 2))),
    ("moe", (("data", 2), ("expert", 2), ("tensor", 2))),
  }
  assert all(r["ok"] and r["max_abs_err"] <= 1e-5 for r in rows), rows


@dataclasses.dataclass(frozen=True)
class _FakeDevice:
  """What `mesh_utils` reads of a device, for a multislice layout this machine does not have."""

  id: int
  slice_index: int
  platform: str = "cpu"
  device_kind: str = "cpu"
  process_index: int = 0


def test_several_slices_lay_the_slices_over_data_or_else_fsdp():
  """Two slices of 4 devices: with data 2 the slices are data's two rows (only data's gradient
  reduction crosses the slices); with data 1 they split fsdp into its outer halves; a mesh where
  neither axis divides by the slice count is refused with the reason."""
  devices = [_FakeDevice(i, slice_index=i // 4) for i in range(8)]
  grid = sharding.device_grid([2, 4, 1, 1], devices)
  assert [[d.slice_index for d in row.flat] for row in grid] == [[0] * 4, [1] * 4]
  grid = sharding.device_grid([1, 8, 1, 1], devices)
  assert grid.shape == (1, 8, 1, 1)
  assert [d.slice_index for d in grid.flat] == [0] * 4 + [1] * 4
  with pytest.raises(ValueError, match="span 2 slices: mesh.data or mesh.fsdp"):
    sharding.device_grid([1, 1, 8, 1], devices)


def test_one_slice_keeps_the_host_devices_in_order():
  devices = jax.devices()
  mesh = sharding.make_mesh({"fsdp": -1})
  assert list(mesh.devices.flat) == devices


def test_a_moe_model_without_an_expert_axis_is_warned_with_the_mesh_to_use():
  """Issue 39 item 3: a MoE model on several devices and no expert axis gets a warning naming
  an expert axis that divides both its experts and the devices; dense models, one device, or a
  mesh that has an expert axis get none."""
  warn = sharding.expert_axis_warning
  said = warn(128, {"data": 1, "fsdp": 8, "tensor": 1, "expert": 1})
  assert "128 experts" in said and "--config.mesh.expert=8 --config.mesh.fsdp=1" in said
  assert "--config.mesh.expert=4 --config.mesh.fsdp=1" in warn(4, {"fsdp": 4})
  assert "--config.mesh.expert=2 --config.mesh.fsdp=3" in warn(6, {"fsdp": 6})
  assert "--config.mesh" not in warn(3, {"fsdp": 8})  # nothing divides both: no mesh to name
  assert warn(0, {"fsdp": 8}) is None  # dense
  assert warn(128, {"fsdp": 1}) is None  # one device
  assert warn(128, {"fsdp": 2, "expert": 4}) is None
