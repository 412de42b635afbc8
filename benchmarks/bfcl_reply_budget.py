"""Wall time of one BFCL reply of many slow calls, with and without the shared reply budget.

    .venv/bin/python benchmarks/bfcl_reply_budget.py [--calls 6] [--call-wall-s 10] [--budget-s 20]

Each call of the reply (`power(base=10, exponent=10**12)` on a multi_turn_base MathAPI entry)
runs into the per-call bound `call_wall_s`, so without a shared budget the reply costs `calls` x
(call_wall_s + worker restart + replay); `BackendSession.execute(calls, budget_s)` stops starting
calls once the reply has spent `budget_s`, so it costs at most budget_s plus one call's bound
whatever the number of calls. The reference is the same reply without a budget (what
`BfclEnv.step` did before `bfcl.reply_wall_s`), in the same run. Prints a markdown table and the
machine; the defaults are the run config's (`bfcl.backends.call_wall_s`, `bfcl.reply_wall_s`).
"""

from __future__ import annotations

import argparse
import time

from common import machine, markdown_table
from envs.bfcl.backends import BackendPool, Bounds
from envs.bfcl.data import load_bfcl_tasks

SLOW_CALL = "power(base=10, exponent=1000000000000)"
MATH_ENTRY = 15  # multi_turn_base entry with GorillaFileSystem and MathAPI


def _reply_seconds(
  pool: BackendPool, calls: list[str], budget_s: float | None
) -> tuple[float, int]:
  """(wall seconds of one reply of `calls`, number of calls that were started)."""
  session = pool.session(load_bfcl_tasks("multi_turn_base")[MATH_ENTRY])
  session.open()
  session.execute(["add(a=1, b=2)"])  # the worker is up and the instances exist
  start = time.monotonic()
  outcomes = session.execute(calls, budget_s=budget_s)
  elapsed = time.monotonic() - start
  refused = sum("shared time budget" in o.text for o in outcomes)
  session.close()
  return elapsed, len(calls) - refused


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--calls", type=int, default=6, help="slow calls in the reply")
  parser.add_argument("--call-wall-s", type=float, default=Bounds().call_wall_s)
  parser.add_argument("--budget-s", type=float, default=20.0)
  args = parser.parse_args()
  calls = [SLOW_CALL] * args.calls
  with BackendPool(Bounds(call_wall_s=args.call_wall_s, workers=1)) as pool:
    reference, ref_started = _reply_seconds(pool, calls, None)
    budgeted, started = _reply_seconds(pool, calls, args.budget_s)
  per_call = reference / args.calls
  rows = [
    ["no budget (reference)", str(args.calls), str(ref_started), f"{reference:.1f}", "1.00"],
    [
      f"reply budget {args.budget_s:g} s",
      str(args.calls),
      str(started),
      f"{budgeted:.1f}",
      f"{budgeted / reference:.2f}",
    ],
  ]
  print(machine())
  print(f"call_wall_s {args.call_wall_s:g} s; one stopped call costs {per_call:.1f} s here")
  print(
    markdown_table([["reply", "calls", "calls started", "wall s", "ratio to reference"], *rows])
  )
  print(
    f"without the budget a reply of n such calls costs about n x {per_call:.1f} s "
    f"(100 calls: {100 * per_call / 60:.0f} min); with it at most "
    f"{args.budget_s:g} s + one call"
  )


if __name__ == "__main__":
  main()
