"""Metrics: JSON lines plus TensorBoard event files (tensorboardX), and phase timers."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time
from typing import Any

from tensorboardX import SummaryWriter


class MetricsWriter:
  """Appends `{"step": s, **metrics}` to `<workdir>/metrics.jsonl` and writes TensorBoard
  scalars."""

  def __init__(self, workdir: str):
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

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

  def pop_last(self) -> dict[str, float]:
    out = {f"timing/{k}": v for k, v in self.last.items()}
    self.last = {}
    return out
