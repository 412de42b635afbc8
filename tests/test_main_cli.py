"""The entry points as a user runs them: `python -m coevolve_jax.main --config=... --workdir=...`
and the tools `python -m coevolve_jax.cli.NAME`."""

import os
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_appworld_without_server_or_data_stops_at_once_with_setup_steps(tmp_path):
  env = dict(
    os.environ,
    APPWORLD_SERVER_URLS=f"http://127.0.0.1:{_free_port()}",
    APPWORLD_ROOT=str(tmp_path / "no-data"),
  )
  start = time.monotonic()
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "coevolve_jax.main",
      "--config=configs/appworld.py",
      f"--workdir={tmp_path / 'run'}",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert proc.returncode == 2, proc.stderr
  assert time.monotonic() - start < 20
  for step in (
    "pip install appworld",
    "appworld install",
    "appworld download data",
    "appworld serve environment",
  ):
    assert step in proc.stderr
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_unknown_config_variant_is_a_clear_error(tmp_path):
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "coevolve_jax.main",
      "--config=configs/bfcl.py:tpu-typo",
      f"--workdir={tmp_path}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert proc.returncode != 0
  assert "unknown variant 'tpu-typo'" in proc.stderr


def test_unusable_workdir_fails_fast_with_a_clear_error(tmp_path):
  afile = tmp_path / "afile"
  afile.write_text("keep me")
  start = time.monotonic()
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "coevolve_jax.main",
      "--config=configs/bfcl.py:cpu",
      f"--workdir={afile}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert proc.returncode == 2
  assert "cannot use --workdir" in proc.stderr
  assert time.monotonic() - start < 20
  assert afile.read_text() == "keep me"


@pytest.mark.parametrize("tool", ["bench", "plan_device_memory", "evaluate"])
def test_command_line_tools_run_as_modules(tool):
  """Each tool of coevolve_jax/cli/ starts with `python -m coevolve_jax.cli.NAME` and its help
  shows the command it documents (absl exits with status 1 after printing help)."""
  proc = subprocess.run(
    [sys.executable, "-m", f"coevolve_jax.cli.{tool}", "--helpshort"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert f"python -m coevolve_jax.cli.{tool} " in proc.stdout
