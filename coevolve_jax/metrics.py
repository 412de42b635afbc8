"""Metrics: JSON lines plus TensorBoard event files (tensorboardX), and phase timers."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time
from typing import Any

from tensorboardX import SummaryWriter


def truncate_jsonl(path: str, max_step: int) -> int:
  """Drops the rows of a JSON-lines log whose "step" is above `max_step` (rows that a resumed run
  writes again) and any torn line; replaces the file atomically. Returns the rows dropped."""
  if not os.path.exists(path):
    return 0
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  kept = []
  for line in lines:
    try:
      if json.loads(line).get("step", 0) <= max_step:
        kept.append(line)
    except ValueError:  # a torn last line from a killed run
      continue
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(line + "\n" for line in kept)
  os.replace(tmp, path)
  return len(lines) - len(kept)


class MetricsWriter:
  """Appends `{"step": s, **metrics}` to `<workdir>/metrics.jsonl` and writes TensorBoard
  scalars.

  `resume_step` is the step the run restarts from (-1 for a fresh start): rows and TensorBoard
  events that an interrupted run wrote after it are dropped, so there is one row per step.
  """

  def __init__(self, workdir: str, resume_step: int = -1):
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    truncate_jsonl(path, resume_step)
    self._jsonl = open(path, "a", encoding="utf-8")
    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1)

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    self._jsonl.write(json.dumps({"step": step, **metrics}, sort_keys=True) + "\n")
    self._jsonl.flush()
    for k, v in metrics.items():
      if isinstance(v, (int, float)) and not isinstance(v, bool):
        self._tb.add_scalar(k, v, step)
    self._tb.flush()

  def close(self) -> None:
    self._jsonl.close()
    self._tb.close()


class PhaseTimer:
  """Accumulates wall seconds per named phase (`timing/<phase>` in metrics)."""

  def __init__(self, initial: dict[str, float] | None = None):
    self.totals: dict[str, float] = collections.defaultdict(float, initial or {})
    self.last: dict[str, float] = {}

  @contextlib.contextmanager
  def __call__(self, phase: str):
    start = time.perf_counter()
    try:
      yield
    finally:
      dt = time.perf_counter() - start
      self.totals[phase] += dt
      self.last[phase] = self.last.get(phase, 0.0) + dt

  def move(self, seconds: float, *, src: str, dst: str) -> None:
    """Reassigns `seconds` already counted under phase `src` to phase `dst`, in the totals and in
    the figures of the current step (`pop_last`), e.g. a checker's time measured inside the
    rollout: `move(s, src="rollout", dst="reward")`. The sum over phases is unchanged.

    Args:
      seconds: wall seconds (float; may exceed what `src` holds, which then goes negative).
      src, dst: phase names (a phase not yet seen starts from 0).
    """
    self.totals[src] -= seconds
    self.last[src] = self.last.get(src, 0.0) - seconds
    self.totals[dst] += seconds
    self.last[dst] = self.last.get(dst, 0.0) + seconds

  def pop_last(self) -> dict[str, float]:
    out = {f"timing/{k}": v for k, v in self.last.items()}
    self.last = {}
    return out
