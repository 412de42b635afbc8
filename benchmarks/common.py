"""Helpers shared by the benchmark scripts (standard library only: the scripts also run in side
environments such as .venv-tunix). Import as `from common import ...`: a script's own folder is on
`sys.path` when it runs as `python benchmarks/<script>.py`."""

from __future__ import annotations

import datetime
import os
import platform


def cpu_name() -> str:
  """The CPU's model name (Linux /proc/cpuinfo), else what `platform` knows (often only the
  architecture: `platform.processor()` is empty on many Linux VMs)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor() or platform.machine()


def machine(torch_version: bool = False) -> str:
  """One line naming the machine, the time, the load and the JAX backend (and torch's version)."""
  import jax  # noqa: PLC0415  (lazy: the table helpers need no JAX)

  line = (
    f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; {cpu_name()}; "
    f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}; "
    f"jax {jax.__version__} on {jax.devices()[0].platform}"
  )
  if torch_version:
    try:
      import torch  # noqa: PLC0415

      line += f"; torch {torch.__version__}"
    except ImportError:
      line += "; torch absent"
  return line


def markdown_table(rows: list[list[str]]) -> str:
  """A markdown table; the first row is the header."""
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
  lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
  return "\n".join(lines)
