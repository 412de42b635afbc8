"""Simulates the three CoEvolve signals on a synthetic task pool and prints each signal's share.

Issue 20 item 3: in the paper's Fig. 4 boundary signals are the largest group (45-51%) and rare
patterns the smallest; this script checks which readings of the signal rules reproduce that
order on a pool like the one the issue describes, with `SignalTracker` itself (no copy of its
rules).

The pool: `--tasks` tasks, each with a reference tool sequence of 3-6 calls drawn uniformly from
`--tools` tool names. A task's success probability is sigmoid(a_task + `--learning` * step),
a_task ~ N(0, 1.5): some tasks start solved, some unsolved, and training slowly helps. Each step
samples `--tasks_per_step` tasks and `--group_size` rollouts of each. A successful rollout calls
the reference sequence; a failed one deviates from it: stops early (half the failures, at a
uniform point, possibly before the first call), calls a wrong tool in one place (three in ten)
or one call too many (two in ten). Rewards are binary.

Usage:
  python scripts/simulate_signals.py [--steps 10] [--seed 0]

Prints, per reading of the rules, the events of each kind over the run and their shares, and
per step for the defaults; exits 1 when rare is not the smallest share under the defaults.
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np

from coevolve_jax.feedback.signals import KINDS, RolloutRecord, SignalTracker

# (label, SignalTracker keyword arguments) of the readings compared.
READINGS = (
  ("defaults: per-rollout forgetting, rare counted per task", {}),
  ("rare counted per trajectory", {"rare_count": "trajectories"}),
  ("forgetting on the visit mean", {"forgetting": "visit_mean"}),
)


def simulate(args: argparse.Namespace) -> list[list[RolloutRecord]]:
  """The run's rollouts, one list of records per step (the same for every reading)."""
  rng = np.random.default_rng(args.seed)
  tools = [f"tool_{i:02d}" for i in range(args.tools)]
  refs = [list(rng.choice(tools, size=rng.integers(3, 7))) for _ in range(args.tasks)]
  skill = rng.normal(0.0, 1.5, size=args.tasks)
  steps = []
  for step in range(args.steps):
    chosen = rng.choice(args.tasks, size=args.tasks_per_step, replace=False)
    records = []
    for task in chosen:
      p = 1.0 / (1.0 + math.exp(-(skill[task] + args.learning * step)))
      for _ in range(args.group_size):
        ref = refs[task]
        if rng.random() < p:
          score, called = 1.0, list(ref)
        else:
          score, u = 0.0, rng.random()
          if u < 0.5:
            called = ref[: rng.integers(0, len(ref))]
          elif u < 0.8:
            called = list(ref)
            called[rng.integers(len(ref))] = str(rng.choice(tools))
          else:
            called = [*ref, str(rng.choice(tools))]
        records.append(RolloutRecord(f"task{task}", f"task{task}", score, called, len(records)))
    steps.append(records)
  return steps


def shares(counts: dict[str, int]) -> dict[str, float]:
  total = sum(counts.values())
  return {k: (counts[k] / total if total else 0.0) for k in KINDS}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    epilog="Exit status 1: rare is not the smallest share under the defaults.",
  )
  parser.add_argument("--tasks", type=int, default=100, help="tasks in the pool")
  parser.add_argument("--tools", type=int, default=40, help="tool names the calls are drawn from")
  parser.add_argument("--tasks_per_step", type=int, default=32, help="tasks rolled out per step")
  parser.add_argument("--group_size", type=int, default=8, help="rollouts per task (>= 2)")
  parser.add_argument("--steps", type=int, default=10, help="training steps")
  parser.add_argument("--learning", type=float, default=0.15, help="skill gain per step (logit)")
  parser.add_argument("--seed", type=int, default=0, help="random seed (>= 0)")
  args = parser.parse_args(argv)
  if min(args.tools, args.tasks_per_step, args.steps, args.seed + 1) < 1 or args.group_size < 2:
    parser.error(
      "--tools, --tasks_per_step and --steps must be >= 1, --group_size >= 2, --seed >= 0"
    )
  if args.tasks < args.tasks_per_step:
    parser.error(f"--tasks ({args.tasks}) must be >= --tasks_per_step ({args.tasks_per_step})")
  if not math.isfinite(args.learning):
    parser.error("--learning must be a finite number")
  run = simulate(args)
  n = sum(map(len, run))
  print(
    f"pool: {args.tasks} tasks of 3-6 calls over {args.tools} tools; {args.tasks_per_step} tasks"
    f" x {args.group_size} rollouts x {args.steps} steps = {n} trajectories (seed {args.seed})"
  )
  print(f"\n| reading | {' | '.join(KINDS)} | shares ({', '.join(KINDS)}) |")
  print("|---|---|---|---|---|")
  result = {}
  per_step = []
  for label, kwargs in READINGS:
    tracker = SignalTracker(**kwargs)
    for records in run:
      fired = tracker.update(records)
      if not kwargs:
        per_step.append({k: sum(s.kind == k for s in fired) for k in KINDS})
    share = shares(tracker.counts)
    result[label] = share
    cells = " | ".join(str(tracker.counts[k]) for k in KINDS)
    print(f"| {label} | {cells} | {', '.join(f'{share[k]:.1%}' for k in KINDS)} |")
  print("\nper step, defaults:")
  for step, counts in enumerate(per_step):
    print(f"  step {step}: " + ", ".join(f"{k} {counts[k]}" for k in KINDS))
  default = result[READINGS[0][0]]
  smallest = min(KINDS, key=default.get)
  print(f"\nsmallest share under the defaults: {smallest}")
  return 0 if smallest == "rare" else 1


if __name__ == "__main__":
  sys.exit(main())
