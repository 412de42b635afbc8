"""Which XLA programs a run compiles, step by step, and what share of each step they cost.

    .venv/bin/python benchmarks/compile_census.py --workdir=runs/bfcl-cpu        # a finished run
    .venv/bin/python benchmarks/compile_census.py --run --steps=6 --workdir=/tmp/census \\
        [--config=configs/bfcl.py:cpu] [--set=feedback.every=3 ...]              # run, then read

Reads the run's `metrics.jsonl` (issue 17 item 2: "measure first"). Per row with compile counts
(step 0: everything before GRPO step 1 in a fresh run, i.e. set-up, D0, warm-start and the
evaluation before training; then one row per GRPO step; the evaluations after training follow
the last row and are in none): the XLA compilations (`compile/count`, `compile/seconds`, from
JAX's backend-compile event); the programs they were for (`compile/program/<name>`: the engine's
`_prefill_rows`, `_generate_steps` and `_generate` buckets, the trainer's `_grpo_step_fn`,
`_logp_fn` and `_sft_step_fn`, everything else as "other"); the padded train batch
(`train/padded_len` x `train/padded_targets`); and, as the reference, the row's own wall seconds
(the sum of its `timing/*` phases): compile seconds / step seconds is the share of the step spent
compiling. The bucket lists the shapes come from are in docs/benchmarks/compiles.md.

Compile seconds are noisy on a shared machine (another job on the cores doubles them); the
counts are not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PROGRAMS = ("_prefill_rows", "_generate_steps", "_generate", "_grpo_step_fn", "_logp_fn")
PREFIX = "compile/program/"


def census(rows: list[dict]) -> list[dict]:
  """One entry per metrics row that carries compile counts: step, count, seconds, the step's
  phase seconds, per-program counts (PROGRAMS, then "_sft_step_fn" and "other") and the padded
  train shape where the step trained."""
  out = []
  for r in rows:
    if "compile/count" not in r:
      continue
    programs = {k[len(PREFIX) :]: int(v) for k, v in r.items() if k.startswith(PREFIX)}
    named = {p: programs.pop(p, 0) for p in (*PROGRAMS, "_sft_step_fn")}
    # The rest, also where the run logged no per-program counts (before they existed).
    named["other"] = int(r["compile/count"]) - sum(named.values())
    phases = sum(v for k, v in r.items() if k.startswith("timing/") and k != "timing/weight_sync_s")
    out.append(
      {
        "step": r["step"],
        "count": int(r["compile/count"]),
        "seconds": float(r["compile/seconds"]),
        "step_seconds": float(phases),
        "programs": named,
        "padded": (r.get("train/padded_len"), r.get("train/padded_targets")),
      }
    )
  return out


def table(entries: list[dict]) -> str:
  cols = (*PROGRAMS, "_sft_step_fn", "other")
  head = ["step", "compiles", "compile s", "step s", "compile share", *cols, "train batch (t x p)"]
  lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
  for e in entries:
    share = e["seconds"] / e["step_seconds"] if e["step_seconds"] else float("nan")
    t, p = e["padded"]
    lines.append(
      "| "
      + " | ".join(
        [
          str(e["step"]),
          str(e["count"]),
          f"{e['seconds']:.1f}",
          f"{e['step_seconds']:.1f}",
          f"{share:.2f}",
          *(str(e["programs"][c]) for c in cols),
          f"{t} x {p}" if t else "-",
        ]
      )
      + " |"
    )
  late = [e for e in entries if e["step"] > 2]
  lines.append("")
  lines.append(
    f"compilations after GRPO step 2: {sum(e['count'] for e in late)} "
    f"({sum(e['seconds'] for e in late):.1f} s; issue 17's target is 0), in total "
    f"{sum(e['count'] for e in entries)} ({sum(e['seconds'] for e in entries):.1f} s)"
  )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--workdir", required=True, help="the run's workdir (read, or run into)")
  ap.add_argument("--run", action="store_true", help="run the job into --workdir first")
  ap.add_argument("--config", default="configs/bfcl.py:cpu")
  ap.add_argument("--steps", type=int, default=6, help="GRPO steps of the run (with --run)")
  ap.add_argument("--set", action="append", default=[], help="config override key=value")
  args = ap.parse_args(argv)
  if args.run:  # the job as a user runs it, in its own process (a fresh JAX: every compile counts)
    cmd = [
      sys.executable,
      "-m",
      "coevolve_jax.main",
      f"--config={args.config}",
      f"--workdir={args.workdir}",
      f"--config.train.steps={args.steps}",
      *(f"--config.{kv}" for kv in args.set),
    ]
    subprocess.run(cmd, check=True)
  from common import machine  # noqa: PLC0415

  path = os.path.join(args.workdir, "metrics.jsonl")
  if not os.path.exists(path):
    print(f"error: {path} does not exist: not a run's workdir (or pass --run)", file=sys.stderr)
    return 2
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  print(f"compile census of {args.workdir}; machine: {machine()}")
  print(table(census(rows)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
