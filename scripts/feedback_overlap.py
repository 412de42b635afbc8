"""How long the training loop is blocked by one feedback round: synchronous vs overlapped.

    .venv/bin/python scripts/feedback_overlap.py --rounds 3

Builds the CPU preset's D0 (12 one-backend tasks on MessageAPI / TicketAPI, programmatic
explorer), marks every task with each signal, then per round runs the CPU preset's synthesis
(6 contexts, 2 runs x 8 steps) and commits it to a task pool with the evaluation split:

* reference, `synchronous`: the loop is blocked for select + synthesize + commit (what a loop
  without a worker thread pays, and what `feedback.concurrent=False` does);
* `overlapped`: the loop is blocked for select + commit only; synthesis runs in the worker while
  GRPO steps go on (`feedback.concurrent=True`, the default). The ratio is overlapped/synchronous.

Prints a table and the machine line. GRPO step time is not simulated here: overlap hides the
synthesis completely only while it is shorter than `feedback.lag` steps.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, ROOT)

from coevolve_jax.feedback import rounds  # noqa: E402
from envs.bfcl import synthesis  # noqa: E402
from envs.bfcl.explorer import ProgrammaticExplorer  # noqa: E402
from coevolve_jax.feedback.pool import TaskPool  # noqa: E402
from envs.bfcl.data import load_bfcl_tasks, split_tasks  # noqa: E402


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rounds", type=int, default=3)
  args = p.parse_args()
  train, held = split_tasks(load_bfcl_tasks("multi_turn_base"), 20, seed=0)
  d0 = synthesis.build_initial_tasks(
    train,
    12,
    ProgrammaticExplorer(),
    np.random.default_rng(0),
    min_calls=1,
    max_calls=2,
    max_turns=1,
    rounds=2,
    steps_per_round=8,
    max_classes=1,
    only_classes=("MessageAPI", "TicketAPI"),
  )
  events = [
    rounds.SignalEvent(t, kind, t.ground_truth, reward)
    for t in d0
    for kind, reward in (("boundary", 1.0), ("rare", 0.0), ("forgetting", 0.0))
  ]
  settings = synthesis.SynthesisSettings(1, 2, 1, 2, 8)
  rows = {"synchronous": [], "overlapped": []}
  with tempfile.TemporaryDirectory() as tmp:
    pool = TaskPool(os.path.join(tmp, "pool.jsonl"))
    pool.add(d0, eval_tasks=held)
    for r in range(1, args.rounds + 1):
      t0 = time.perf_counter()
      chosen = rounds.select_events(
        events, np.random.default_rng([0, r, 0]), 6, pool_tasks=pool.tasks
      )
      t1 = time.perf_counter()
      result = synthesis.synthesize_round(
        chosen, ProgrammaticExplorer(), np.random.default_rng([0, r, 1]), r, settings
      )
      t2 = time.perf_counter()
      rounds.commit_round(result, pool, held)
      t3 = time.perf_counter()
      rows["synchronous"].append(t3 - t0)
      rows["overlapped"].append((t1 - t0) + (t3 - t2))
  sync, over = (statistics.fmean(rows[k]) for k in ("synchronous", "overlapped"))
  print("| loop blocked per round | mean s | per round s | vs synchronous |")
  print("| --- | --- | --- | --- |")
  for name, mean in (("synchronous (reference)", sync), ("overlapped", over)):
    per = ", ".join(f"{x:.3f}" for x in rows[name.split()[0]])
    print(f"| {name} | {mean:.3f} | {per} | {mean / sync:.2f}x |")
  load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
  print(
    f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
    f"Python {platform.python_version()}, load average {load:.1f}"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
