"""The machine a benchmark ran on: Python, library versions (missing ones named), JAX backend,
devices and each device's memory limit. Used by benchmarks/accelerator_check.sh.

    python benchmarks/env_report.py
"""

from __future__ import annotations

import importlib
import platform
import sys

LIBRARIES = (
  "jax",
  "jaxlib",
  "flax",
  "optax",
  "orbax.checkpoint",
  "transformers",
  "torch",
  "ml_collections",
  "tensorboardX",
  "datasketch",
  "bfcl_eval",
  "tree_sitter",
  "tenacity",
  "pytest",
)


def main() -> None:
  print("python", sys.version.split()[0], platform.machine(), platform.platform())
  for name in LIBRARIES:
    try:
      module = importlib.import_module(name)
      print(f"{name:18s} {getattr(module, '__version__', '?')}")
    except Exception as e:  # a missing or broken library is reported, not fatal
      print(f"{name:18s} MISSING ({type(e).__name__}: {e})")
  import jax  # noqa: PLC0415

  print("backend", jax.default_backend(), "process", jax.process_index(), "of", jax.process_count())
  for device in jax.local_devices():
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    gib = "unknown" if limit is None else f"{limit / 2**30:.2f} GiB"
    print(device, getattr(device, "device_kind", ""), "memory limit", gib)


if __name__ == "__main__":
  main()
