"""Memory per device of the job's prefill and GRPO step on all local devices, against the plan.

    python benchmarks/mesh_memory.py --config=configs/bfcl.py --config.model.preset=qwen3_0_6b \
        [--cache_len=4096] [--prompt_len=2048] [--train_rows=8] [--train_seq=2048]

Builds the config's mesh, model (random weights), trainer (reference frozen) and engine over
every local device as the job does (`benchmark._build`, `cache_len` entries per slot), then runs
  1. the largest prefill the rollouts make: every slot at once, `prompt_len` tokens each
     (`Engine.prefill_many`: the forwards of `prefill_schedule`, shard-local cache writes);
  2. one GRPO epoch (`PolicyTrainer.grpo_epoch`) on `train_rows` sequences of `train_seq`
     tokens, half of them sampled;
and prints, per device, what the arrays the job holds take (parameters, AdamW, reference,
rollout weights, KV cache), the backend's peak after each phase (`memory_stats()`; "n/a" where
the backend keeps none, as on CPU), the compiled temporaries of the largest prefill forward
(`memory_analysis()`), and the memory planner's figures for the same workload
(`memory_plan.plan(activations="compiled")`), with the ratio measured / planned: the reference
this check compares against is the planner the job's start-up check uses.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from coevolve_jax import benchmark, memory_plan
from coevolve_jax.rollout import engine as engine_mod
from coevolve_jax.rollout.sampling import SamplingParams
from coevolve_jax.types import Trajectory

GIB = 2**30


def _peaks() -> list[int | None]:
  """Peak bytes in use on each local device since start-up (None: the backend keeps none)."""
  return [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]


def _largest_prefill_temp(engine, prompt_len: int) -> int | None:
  """Compiled temporaries per device of the prefill forward that `prefill_many` runs first for
  every slot and `prompt_len` tokens (None where the backend gives no memory analysis)."""
  slots = engine.num_slots
  (rows, t), *_ = engine_mod.prefill_schedule(
    [prompt_len] * slots,
    [0] * slots,
    engine.cache_len,
    engine.max_prefill_tokens,
    engine.prefill_min_chunk,
  )
  padded = engine.padded_rows(len(rows), t)
  kv = engine_mod._kv_bucket(prompt_len, engine.cache_len, engine.prefill_min_kv)
  args = engine._prefill_args(
    np.zeros((padded,), np.int32),
    np.zeros((padded, t), np.int32),
    np.ones((padded,), np.int32),
    [jax.random.key(0)] * padded,
    SamplingParams(temperature=1.0),
    kv,
  )
  with engine._ctx():
    analysis = engine_mod._prefill_rows.lower(*args).compile().memory_analysis()
  return None if analysis is None else int(analysis.temp_size_in_bytes)


def _progress(start: float, phase: str, peaks: list[int | None] | None = None) -> None:
  """One line per finished phase, printed at once: a stage cut by its time limit (the
  accelerator check's) still shows how far it got and what the device held."""
  peak = max((p for p in peaks or [] if p is not None), default=None)
  print(
    f"[{time.perf_counter() - start:6.1f} s] {phase}"
    + (f"; peak so far {peak / GIB:.3g} GiB per device (max)" if peak is not None else ""),
    flush=True,
  )


def run(cfg, cache_len: int, prompt_len: int, rows: int, seq: int) -> dict:
  """The measurements and the plan (bytes per device); see the module docstring."""
  if not 1 <= prompt_len < cache_len or min(rows, seq) < 2:
    raise ValueError("need 1 <= prompt_len < cache_len, train_rows >= 2 and train_seq >= 2")
  start = time.perf_counter()
  mesh, model, trainer, engine = benchmark._build(cfg, prompt_len, cache_len - prompt_len - 1)
  held = benchmark._allocated_bytes(trainer, engine)
  _progress(
    start,
    f"built on mesh {dict(mesh.shape)}; held per device: "
    + ", ".join(f"{k} {_gib(v)} GiB" for k, v in held.items()),
    _peaks(),
  )
  rng = np.random.default_rng(0)
  vocab = model.config.vocab_size
  prompts = rng.integers(1, vocab, (engine.num_slots, prompt_len)).tolist()
  key = jax.random.key(0)
  engine.prefill_many([(s, p, key) for s, p in enumerate(prompts)], SamplingParams(temperature=1.0))
  after_prefill = _peaks()
  _progress(start, f"prefilled {engine.num_slots} slots x {prompt_len} tokens", after_prefill)
  trajs = []
  for i in range(rows):
    tr = Trajectory(task_id=f"m{i}", group_id=i // 2)
    ids = rng.integers(1, vocab, seq)
    tr.extend(ids[: seq // 2].tolist(), sampled=False)
    tr.extend(ids[seq // 2 :].tolist(), sampled=True, logprobs=[-1.0] * (seq - seq // 2))
    trajs.append(tr)
  trainer.grpo_epoch(trajs, rng.standard_normal(rows).astype(np.float32), 1)
  after_train = _peaks()
  _progress(start, f"GRPO epoch on {rows} rows x {seq} tokens", after_train)
  plan = memory_plan.plan(
    cfg.model.preset,
    dict(mesh.shape),
    batch=rows,
    seq_len=seq,
    num_slots=engine.num_slots,
    cache_len=cache_len,
    dtype=cfg.model.dtype,
    param_dtype=cfg.model.param_dtype,
    weights_layout=cfg.engine.weights_layout,
    remat=cfg.model.remat,
    activations="compiled",
  )
  dev = jax.devices()[0]
  return {
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": f"{jax.device_count()} x {dev.device_kind} ({dev.platform}), JAX {jax.__version__}",
    "mesh": dict(mesh.shape),
    "workload": {
      "slots": engine.num_slots,
      "cache_len": cache_len,
      "prompt_len": prompt_len,
      "train_rows": rows,
      "train_seq": seq,
    },
    "held": held,
    "prefill_temp": _largest_prefill_temp(engine, prompt_len),
    "peak_after_prefill": after_prefill,
    "peak_after_train": after_train,
    "plan": {
      "params": plan.params,
      "optimizer": plan.optimizer,
      "reference": plan.reference,
      "rollout_weights": plan.rollout_weights,
      "kv_cache": plan.kv_cache,
      "activations": plan.activations,
      "total": plan.total,
      "source": plan.activation_source,
    },
  }


def _gib(x) -> str:
  return "n/a" if x is None else f"{x / GIB:.3g}"


def _ratio(a, b) -> str:
  return "n/a" if a is None or not b else f"{a / b:.2f}"


def format_report(rec: dict) -> str:
  """A markdown table of the record: measured and planned GiB per device, and their ratio."""
  held, plan = rec["held"], rec["plan"]
  rows = [
    ("params (master)", held["params"], plan["params"]),
    ("AdamW state", held["optimizer"], plan["optimizer"]),
    ("reference", held["reference"], plan["reference"]),
    ("rollout weights", held["rollout_weights"], plan["rollout_weights"]),
    ("KV cache", held["kv_cache"], plan["kv_cache"]),
    ("largest prefill: compiled temporaries", rec["prefill_temp"], None),
  ]
  for name in ("peak_after_prefill", "peak_after_train"):
    peaks = [p for p in rec[name] if p is not None]
    rows.append(
      (f"{name.replace('_', ' ')} (max over devices)", max(peaks, default=None), plan["total"])
    )
  lines = [
    f"{rec['date']}, {rec['machine']}, mesh {rec['mesh']}, workload {rec['workload']}",
    "",
    "| per device | measured GiB | planned GiB | measured / planned |",
    "| --- | --- | --- | --- |",
  ]
  lines += [f"| {n} | {_gib(m)} | {_gib(p)} | {_ratio(m, p)} |" for n, m, p in rows]
  lines.append(
    f"\nPlanned activations ({plan['source']}): {_gib(plan['activations'])} GiB; "
    "peaks per device: " + json.dumps(rec["peak_after_train"])
  )
  return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  F = flags.FLAGS  # noqa: N806
  rec = run(F.config, F.cache_len, F.prompt_len, F.train_rows, F.train_seq)
  print(format_report(rec))
  if F.out:
    with open(F.out, "w") as f:
      json.dump(rec, f, indent=1)
  return 0


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "Config file (path[:variant]).")
  flags.DEFINE_integer("cache_len", 4096, "KV-cache entries per slot.")
  flags.DEFINE_integer("prompt_len", 2048, "Tokens prefilled into every slot.")
  flags.DEFINE_integer("train_rows", 8, "Sequences in the GRPO epoch.")
  flags.DEFINE_integer("train_seq", 2048, "Tokens per training sequence.")
  flags.DEFINE_string("out", "", "Write the record to this JSON file.")
  sys.exit(app.run(main) or 0)
