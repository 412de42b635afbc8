"""Per-call cost of bounded BFCL execution (envs/bfcl/backends.py) against running in-process.

    .venv/bin/python benchmarks/bfcl_call_overhead.py [--repeats 300]

For a few normal calls on multi_turn_base entries, times each call run in this process
(`execution.execute_calls`, what `BfclEnv.step` did before the worker pool) and through a
worker process (`BackendSession.execute`: pipe round trip, pickling, the per-request CPU limit),
after a warm-up, and prints the medians and the difference in microseconds, with the worker's
start-up time.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

from envs.bfcl import execution
from envs.bfcl.backends import BackendPool, Bounds
from envs.bfcl.data import load_bfcl_tasks

CALLS = (  # (entry index, call)
  (0, "ls()"),
  (15, "add(a=1, b=2)"),
  (100, "get_stock_info(symbol='AAPL')"),
  (50, "displayCarStatus(option='fuel')"),
)


def _median_us(fn, repeats: int) -> float:
  for _ in range(10):
    fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e6


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=300)
  args = parser.parse_args()
  tasks = load_bfcl_tasks("multi_turn_base")
  with BackendPool(Bounds(workers=1)) as pool:
    start = time.perf_counter()
    pool.session(tasks[0]).open()
    print(f"worker start-up (first session): {time.perf_counter() - start:.2f} s")
    print(f"{'call':<36} {'in-process us':>14} {'worker us':>10} {'overhead us':>12}")
    for index, call in CALLS:
      task = tasks[index]
      name = execution.new_model_name("bench")
      local = _median_us(
        functools.partial(execution.execute_calls, [call], task, name), args.repeats
      )
      execution.cleanup(name)
      session = pool.session(task)
      remote = _median_us(functools.partial(session.execute, [call]), args.repeats)
      session.close()
      print(f"{call:<36} {local:>14.0f} {remote:>10.0f} {remote - local:>12.0f}")


if __name__ == "__main__":
  main()
