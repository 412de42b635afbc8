"""Runs a test module's child mode in a fresh interpreter with 8 host (CPU) devices.

The main test process keeps its single device; XLA's device count is fixed at start-up, so the
multi-device half of a test runs as `python <test file> <mode> [args...]` with
`--xla_force_host_platform_device_count=8`, and prints "<mode> OK" when every check passed.
"""

import os
import subprocess
import sys


def xla_flags(devices: int = 8) -> str:
  """The suite's XLA flags (tests/conftest.py: LLVM at -O0) with `devices` host devices."""
  flags = os.environ.get("XLA_FLAGS", "")
  return f"{flags} --xla_force_host_platform_device_count={devices}".strip()


def child_env(devices: int = 8) -> dict[str, str]:
  """This process's environment for a CPU child with `devices` host devices (`xla_flags`)."""
  return dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu")


def run_child(test_file: str, mode: str, *args: str, timeout: int = 300) -> str:
  """Runs `test_file` as a script in `mode` on 8 host devices; returns its stdout.

  Raises:
    AssertionError: the child failed, or did not print "<mode> OK".
  """
  proc = subprocess.run(
    [sys.executable, test_file, mode, *args],
    env=child_env(8),
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert f"{mode} OK" in proc.stdout, proc.stdout[-3000:]
  return proc.stdout
