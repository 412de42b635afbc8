"""Warm-start (supervised) step time: batches padded to `warmstart.target_buckets` (multiples of
32 up to the longest reply) against the previous padding (every batch to the longest reply, or
the power of two above its own longest), in one run on the same batches.

    .venv/bin/python benchmarks/warmstart_bench.py [--initial_tasks=600] [--steps=24]

The CPU preset's (`configs/bfcl.py:cpu`) D0 of `--initial_tasks` tasks (programmatic explorer,
seed 0, the leak filter against the held-out split and a generated set of 16, as the ablation
grid's start) gives the demonstrations; `--steps` batches of `warmstart.batch_size` are drawn
once, and each padding runs the same batches on a fresh `PolicyTrainer` (AdamW, the preset's
tiny_cpu model), first one warm-up pass over every shape, then `--repeats` timed passes, the two
alternating. Printed: seconds per step (median of the passes), the mean P (targets per row after
padding), the distinct shapes, the ratio of the two, and the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--initial_tasks", type=int, default=600)
  p.add_argument("--steps", type=int, default=24)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--workdir", default=os.path.join(ROOT, "runs", "warmstart_bench"))
  args = p.parse_args()
  sys.path.insert(0, ROOT)
  sys.path.insert(0, os.path.join(ROOT, "scripts"))
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  import ablations  # noqa: PLC0415
  from common import machine, markdown_table  # noqa: PLC0415
  from coevolve_jax.loop import CoEvolveRun  # noqa: PLC0415
  from coevolve_jax.trainer import PolicyTrainer, make_batch, make_optimizer  # noqa: PLC0415
  from coevolve_jax.warmstart import sft_batches, target_buckets  # noqa: PLC0415

  overrides = {"explore.initial_tasks": args.initial_tasks, "eval.generated_tasks": 16}
  cfg = ablations.load_config("coevolve", 0, overrides)
  run = CoEvolveRun(cfg, args.workdir)
  run._session_start, run._closing = 0.0, []  # noqa: SLF001 (outside `fit`'s session)
  run._start()  # noqa: SLF001 (the job's own parts: model, suite and chat format; fresh state)
  run._generated_eval_set(resumed=False)  # noqa: SLF001
  d0, _ = run._initial_tasks()  # noqa: SLF001
  run.pool.add(d0, eval_tasks=run.evaluator.held_out())
  chat = run.parts.chat
  demos = [run.suite.demonstration(t, chat, f"demo{i}") for i, t in enumerate(run.pool.tasks)]
  rng = np.random.default_rng(0)
  batches = list(sft_batches(demos, cfg.warmstart.batch_size, rng, args.steps))
  t_max = max(len(d.token_ids) for d in demos)
  p_max = max(d.num_generated for d in demos)
  paddings = {
    "longest reply / power of two (before)": [
      make_batch(b, min_len=t_max, min_targets=p_max) for b in batches
    ],
    "target_buckets (now)": [
      make_batch(b, min_len=t_max, target_buckets=target_buckets(demos)) for b in batches
    ],
  }

  def trainer():
    tx = make_optimizer(optax.constant_schedule(cfg.warmstart.lr), 0.0, cfg.train.grad_clip)
    graphdef, state = nnx.split(run.trainer.model())  # own buffers: each trainer donates its
    model = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    return PolicyTrainer(
      model, tx, run.trainer.cfg, 1.0, mesh=run.parts.mesh, compute_dtype=cfg.model.dtype
    )

  trainers = {name: trainer() for name in paddings}
  for name, padded in paddings.items():  # one pass compiles every shape
    for b in padded:
      trainers[name].sft_update(b)
  times: dict[str, list[float]] = {name: [] for name in paddings}
  for _ in range(args.repeats):
    for name, padded in paddings.items():
      start = time.perf_counter()
      for b in padded:
        trainers[name].sft_update(b)
      jax.block_until_ready(trainers[name].params)
      times[name].append((time.perf_counter() - start) / len(padded))
  rows = [["padding of P", "s / step", "mean P", "shapes (T, P)", "speed-up over before"]]
  base = statistics.median(times[next(iter(paddings))])
  for name, padded in paddings.items():
    sec = statistics.median(times[name])
    shapes = sorted({b.target_pos.shape[1:] + b.tokens.shape[1:] for b in padded})
    rows.append(
      [
        name,
        f"{sec:.3f}",
        f"{statistics.fmean(b.target_pos.shape[1] for b in padded):.1f}",
        ", ".join(f"({t}, {p_})" for p_, t in shapes),
        f"{base / sec:.2f}x",
      ]
    )
  replies = statistics.fmean(d.num_generated for d in demos)
  print(
    f"{len(demos)} demonstrations (replies of {replies:.1f} sampled tokens on average, "
    f"{p_max} at most), {args.steps} batches of {cfg.warmstart.batch_size}, "
    f"median of {args.repeats} passes"
  )
  print(markdown_table(rows))
  print(machine())


if __name__ == "__main__":
  main()
