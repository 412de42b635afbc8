"""Compares what two runs of the main job computed, wall times aside.

    python scripts/compare_runs.py RUN_A RUN_B [--rtol 0] [--atol 0]

Reads from both workdirs: summary.json, metrics.jsonl, pool.jsonl, feedback.jsonl,
exploration.jsonl, groups.jsonl, eval_before.jsonl and eval_after.jsonl, and where the run has
them, the generated held-out set (eval_generated.jsonl, eval_generated_before/after.jsonl) and
eval_pool_after.jsonl. Every value must be equal, except
timings (keys `wall_s`, `phase_s`, `feedback_share`, `feedback_synth_s`, `synth_s`, `wait_s`, the
metrics ending in `/synth_s` or `/wait_s`, the engine's `engine/prefill_seconds` and
`engine/decode_seconds`, and `timing/*` metrics) and XLA compilations
(`compile/*` metrics: their seconds differ between any two runs, their counts with what an earlier
run in the same process or the compilation cache already compiled), which differ between any two
runs. `--ignore PREFIX` (repeatable) also leaves out the keys that start with PREFIX, e.g.
`--ignore diag/ --ignore alert` to compare a run that adds read-only diagnostics with one from
before them. Numbers compare with
`|a - b| <= atol + rtol * |b|` (default: exactly), so the same command on two meshes or two
commits can be checked at float tolerance. Prints one line per file and every difference found;
exits 1 when anything differs or a file is missing on one side only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

FILES = (
  "summary.json",
  "metrics.jsonl",
  "pool.jsonl",
  "feedback.jsonl",
  "exploration.jsonl",
  "groups.jsonl",
  "eval_before.jsonl",
  "eval_after.jsonl",
  "eval_generated.jsonl",
  "eval_generated_before.jsonl",
  "eval_generated_after.jsonl",
  "eval_pool_after.jsonl",
)
TIMING_KEYS = {"wall_s", "phase_s", "feedback_share", "feedback_synth_s", "synth_s", "wait_s"}
TIMING_KEYS |= {"prefill_seconds", "decode_seconds"}  # engine/*: the rollout engine's wall time


def _load(path: str) -> list[Any] | None:
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    if path.endswith(".json"):
      return [json.load(f)]
    return [json.loads(line) for line in f if line.strip()]


def _strip(value: Any, ignore: tuple[str, ...] = ()) -> Any:
  """`value` without timing entries and keys starting with an `ignore` prefix, at any depth."""
  if isinstance(value, dict):
    return {
      k: _strip(v, ignore)
      for k, v in value.items()
      if str(k).rsplit("/", 1)[-1] not in TIMING_KEYS
      and not str(k).startswith(("timing/", "compile/", *ignore))
    }
  if isinstance(value, list):
    return [_strip(v, ignore) for v in value]
  return value


def diff(a: Any, b: Any, rtol: float, atol: float, where: str = "") -> list[str]:
  """Human-readable differences between two JSON values (numbers within tolerance are equal)."""
  if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]
  if isinstance(a, (int, float)) and isinstance(b, (int, float)):
    if math.isnan(a) and math.isnan(b):
      return []
    return [] if abs(a - b) <= atol + rtol * abs(b) else [f"{where}: {a!r} != {b!r}"]
  if isinstance(a, dict) and isinstance(b, dict):
    out = []
    for k in sorted(set(a) | set(b), key=str):
      if k not in a or k not in b:
        out.append(f"{where}.{k}: only in {'B' if k not in a else 'A'}")
      else:
        out += diff(a[k], b[k], rtol, atol, f"{where}.{k}")
    return out
  if isinstance(a, list) and isinstance(b, list):
    if len(a) != len(b):
      return [f"{where}: {len(a)} items != {len(b)} items"]
    return [
      d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, rtol, atol, f"{where}[{i}]")
    ]
  return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("run_a")
  p.add_argument("run_b")
  p.add_argument("--rtol", type=float, default=0.0)
  p.add_argument("--atol", type=float, default=0.0)
  p.add_argument("--max-lines", type=int, default=20, help="differences printed per file")
  p.add_argument("--ignore", action="append", default=[], help="leave out keys with this prefix")
  args = p.parse_args(argv)
  failed = False
  for name in FILES:
    a = _load(os.path.join(args.run_a, name))
    b = _load(os.path.join(args.run_b, name))
    if a is None and b is None:
      print(f"{name:28s} absent in both")
      continue
    if a is None or b is None:
      print(f"{name:28s} MISSING in {'A' if a is None else 'B'}")
      failed = True
      continue
    ignore = tuple(args.ignore)
    found = diff(_strip(a, ignore), _strip(b, ignore), args.rtol, args.atol, name)
    print(f"{name:28s} {len(a):5d} rows  {'same' if not found else f'{len(found)} differences'}")
    for line in found[: args.max_lines]:
      print(f"    {line}")
    failed |= bool(found)
  print("RESULT:", "different" if failed else "same (timings aside)")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
