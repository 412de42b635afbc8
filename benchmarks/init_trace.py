"""Tracing a model's construction: `nnx.eval_shape(Qwen(preset))` (what the memory planner does,
and the trace `models.builder.init` compiles to build a model on a mesh) with the parameter keys
drawn by `qwen.next_params_key` against Flax's own `rngs.params()` (the reference), in one run.

    .venv/bin/python benchmarks/init_trace.py [--presets=qwen3_0_6b,qwen3_4b,qwen3_30b_a3b]

`rngs.params()` advances its stream's count with an indexed update whose sharding check fails
on a tracer, and JAX builds that error's message by walking the trace recorded so far; our draw
sets the count whole (same keys: tests/test_model_presets.py). Best of `--repeats` traces each,
alternating the two; nothing is allocated. Prints a markdown table and the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--presets", default="qwen3_0_6b,qwen3_4b,qwen2_5_7b,qwen3_30b_a3b")
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args()
  sys.path.insert(0, ROOT)
  from flax import nnx  # noqa: PLC0415

  from common import machine, markdown_table  # noqa: PLC0415
  from coevolve_jax.models import qwen  # noqa: PLC0415

  ours = qwen.next_params_key
  draws = {"flax": lambda rngs: rngs.params(), "ours": ours}

  def trace(preset: str) -> float:
    start = time.perf_counter()
    nnx.eval_shape(lambda: qwen.Qwen(qwen.QwenConfig.preset(preset), rngs=nnx.Rngs(0)))
    return time.perf_counter() - start

  rows = [["preset", "parameters", "rngs.params() s", "next_params_key s", "ratio"]]
  for preset in args.presets.split(","):
    best = {name: float("inf") for name in draws}
    for _ in range(args.repeats):
      for name, draw in draws.items():
        qwen.next_params_key = draw
        try:
          best[name] = min(best[name], trace(preset))
        finally:
          qwen.next_params_key = ours
    count = qwen.count_params(qwen.QwenConfig.preset(preset))["total"]
    rows.append(
      [
        preset,
        f"{count / 1e9:.2f}e9",
        f"{best['flax']:.2f}",
        f"{best['ours']:.2f}",
        f"{best['flax'] / best['ours']:.1f}x",
      ]
    )
  print(f"machine: {machine()}")
  print(markdown_table(rows))


if __name__ == "__main__":
  main()
