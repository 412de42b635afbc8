"""Sharded Qwen forward passes on 8 host CPU devices equal the single-device result.

The device count of a JAX process is fixed at start-up, so the checks run in a subprocess
(tests/sharding_worker.py) with --xla_force_host_platform_device_count=8: a dense model under
fsdp=8 and fsdp x tensor = 2 x 4 meshes, and a MoE model under expert-parallel meshes; each
parameter's sharding is checked against the logical rules.
"""

import json
import os
import subprocess
import sys
from pathlib import Path


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
