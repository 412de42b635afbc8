"""Scanned decoder layers: train-step compile time against depth, step time, and the activation
memory XLA assigns to a Qwen3-4B training step.

    PYTHONPATH=. .venv/bin/python benchmarks/scan_bench.py [--what=compile,step,memory,decode]

compile: seconds of `jax.jit(step).lower(...).compile()` for the loss and gradient of
  `trainer.token_logprobs` (the trainer's forward) at 2 and 36 layers of a tiny Qwen3 (hidden 64,
  4 query / 2 KV heads of 16, MLP 192, vocabulary 512, float32, 2 x 128 tokens, 64 scored), once
  per remat policy; the best of `--repeats` fresh compiles (the jit cache is cleared between).
step: milliseconds per call of that compiled step at 2 and 8 layers, hidden 256, vocabulary
  4096 (2 x 256 tokens), median of `--steps` calls after one warm call.
memory: `compiled.memory_analysis()` of the same loss and gradient for Qwen3-4B shapes (bfloat16
  parameters, one 4,096-token sequence, 2,048 scored positions), compiled from abstract inputs
  (`nnx.eval_shape`, `jax.ShapeDtypeStruct`: nothing is allocated): temp bytes (every buffer
  the step allocates besides its arguments and outputs: activations kept for the backward pass,
  recomputed activations, per-layer gradient temporaries), argument bytes (parameters and
  tokens) and output bytes (the gradients and the loss), per remat policy; also the temp bytes of
  a 128-token sequence (what does not grow with the sequence: on XLA:CPU, which has no bfloat16
  matrix products, this holds float32 copies of the bfloat16 weights, 16 GiB, and of the
  [V, D] embedding and its gradient), temp minus that (the activation memory of one 4,096-token
  sequence), and the temp bytes one more sequence adds (batch 2 minus batch 1).

decode: the rollout engine's decode step and one prefill chunk, unrolled (the default) against
  scanned (`Engine(scan_layers=True)`): compile seconds of each at 2 and 36 layers of the tiny
  model (16 slots, 1,024-token cache, a 64-token chunk), and milliseconds per decode step (median
  of `--steps`) at 2 and 8 layers of the hidden-256 model with 64 slots at a 512-token key bucket.

The same script runs against a tree without scanned layers (`Qwen` without a `remat` argument:
the layers are then a Python loop and "remat" is reported as "-").
Prints markdown tables and the machine.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import machine, markdown_table
from flax import nnx

from coevolve_jax.models.qwen import Qwen, QwenConfig
from coevolve_jax.trainer import token_logprobs

GIB = 2**30
SCANNED = "remat" in inspect.signature(Qwen.__init__).parameters


def tiny(layers: int, hidden: int = 64, vocab: int = 512) -> QwenConfig:
  return QwenConfig(
    vocab_size=vocab,
    hidden_size=hidden,
    intermediate_size=3 * hidden,
    num_hidden_layers=layers,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=hidden // 4,
    tie_word_embeddings=True,
  )


def make_model(cfg: QwenConfig, remat: str, dtype=jnp.float32, abstract: bool = False):
  kw = {"remat": remat} if SCANNED else {}
  make = lambda: Qwen(cfg, rngs=nnx.Rngs(0), dtype=dtype, **kw)  # noqa: E731
  return nnx.split(nnx.eval_shape(make) if abstract else make())


def loss_and_grad(graphdef):
  """The jitted loss and gradient of the trainer's forward, parameters as an argument."""

  def loss(params, tokens, target_pos):
    return -jnp.mean(token_logprobs(nnx.merge(graphdef, params), tokens, target_pos))

  return jax.jit(jax.value_and_grad(loss))


def inputs(batch: int, seq: int, targets: int, abstract: bool = False):
  if abstract:
    return (
      jax.ShapeDtypeStruct((batch, seq), jnp.int32),
      jax.ShapeDtypeStruct((batch, targets), jnp.int32),
    )
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 500, (batch, seq)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(seq - targets, seq, dtype=jnp.int32), (batch, targets))
  return tokens, pos


def compile_seconds(layers: int, remat: str, repeats: int) -> float:
  best = float("inf")
  for _ in range(repeats):
    jax.clear_caches()
    graphdef, params = make_model(tiny(layers), remat, abstract=True)
    tokens, pos = inputs(2, 128, 64, abstract=True)
    t0 = time.perf_counter()
    loss_and_grad(graphdef).lower(params, tokens, pos).compile()
    best = min(best, time.perf_counter() - t0)
  return best


def step_ms(layers: int, remat: str, steps: int) -> float:
  graphdef, params = make_model(tiny(layers, hidden=256, vocab=4096), remat)
  tokens, pos = inputs(2, 256, 128)
  fn = loss_and_grad(graphdef)
  jax.block_until_ready(fn(params, tokens, pos))
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(params, tokens, pos))
    times.append(time.perf_counter() - t0)
  return 1000 * statistics.median(times)


def memory_4b(remat: str, batch: int = 1, seq: int = 4096) -> tuple[dict, float]:
  """(memory_analysis fields in bytes, compile seconds) of the Qwen3-4B loss and gradient."""
  graphdef, params = make_model(QwenConfig.qwen3_4b(), remat, jnp.bfloat16, abstract=True)
  tokens, pos = inputs(batch, seq, seq // 2, abstract=True)
  t0 = time.perf_counter()
  compiled = loss_and_grad(graphdef).lower(params, tokens, pos).compile()
  seconds = time.perf_counter() - t0
  m = compiled.memory_analysis()
  fields = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
  return {f: getattr(m, f) for f in fields}, seconds


def _engine_calls(cfg: QwenConfig, scan: bool, slots: int, cache_len: int):
  """(decode-step lowering, prefill-chunk lowering, run one decode step) of an engine."""
  from coevolve_jax.rollout import engine as eng  # noqa: PLC0415
  from coevolve_jax.rollout.sampling import SamplingParams  # noqa: PLC0415

  model = Qwen(cfg, rngs=nnx.Rngs(0))
  engine = eng.Engine(model, slots, cache_len, scan_layers=scan)
  params, sampling = engine.current_params(), SamplingParams(temperature=1.0)
  active = jnp.ones((slots,), bool)
  keys = jax.random.split(jax.random.key(0), slots)
  kv = min(cache_len, 512)

  def lower_decode():
    return eng._generate.lower(
      engine.graphdef, params, engine.state, active, keys, sampling, kv, None
    )

  def lower_prefill():
    rows = jnp.arange(4, dtype=jnp.int32)
    chunk = jnp.zeros((4, 64), jnp.int32)
    return eng._prefill_rows.lower(
      engine.graphdef, params, engine.state, rows, chunk, rows + 1, keys[:4], sampling, 128
    )

  def step():
    engine.state, tok, _, _ = eng._generate(
      engine.graphdef, params, engine.state, active, keys, sampling, kv, None
    )
    return tok

  return lower_decode, lower_prefill, step


def decode_compile_seconds(layers: int, scan: bool, repeats: int) -> tuple[float, float]:
  best = [float("inf")] * 2
  for _ in range(repeats):
    jax.clear_caches()
    lowerings = _engine_calls(tiny(layers), scan, 16, 1024)[:2]
    for i, lower in enumerate(lowerings):
      t0 = time.perf_counter()
      lower().compile()
      best[i] = min(best[i], time.perf_counter() - t0)
  return best[0], best[1]


def decode_step_ms(layers: int, scan: bool, steps: int) -> float:
  *_, step = _engine_calls(tiny(layers, hidden=256, vocab=4096), scan, 64, 1024)
  jax.block_until_ready(step())
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    jax.block_until_ready(step())
    times.append(time.perf_counter() - t0)
  return 1000 * statistics.median(times)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--what", default="compile,step,memory")
  ap.add_argument("--remats", default="none,full,save_dots")
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--steps", type=int, default=10)
  args = ap.parse_args()
  what = args.what.split(",")
  remats = args.remats.split(",") if SCANNED else ["-"]
  print(f"scanned layers: {SCANNED}\n")
  if "compile" in what:
    rows = []
    for remat in remats:
      two, deep = compile_seconds(2, remat, args.repeats), compile_seconds(36, remat, args.repeats)
      rows.append([remat, f"{two:.2f}", f"{deep:.2f}", f"{deep / two:.2f}"])
    print("train-step compile seconds (hidden 64, 2 x 128 tokens)")
    print(markdown_table([["remat", "2 layers", "36 layers", "ratio"], *rows]) + "\n")
  if "step" in what:
    rows = []
    for remat in remats:
      rows.append([remat] + [f"{step_ms(n, remat, args.steps):.1f}" for n in (2, 8)])
    print("train-step milliseconds (hidden 256, vocabulary 4096, 2 x 256 tokens)")
    print(markdown_table([["remat", "2 layers", "8 layers"], *rows]) + "\n")
  if "memory" in what:
    rows = []
    for remat in remats:
      m, seconds = memory_4b(remat)
      short = memory_4b(remat, seq=128)[0]["temp_size_in_bytes"]
      two = memory_4b(remat, batch=2)[0]["temp_size_in_bytes"]
      temp = m["temp_size_in_bytes"]
      rows.append(
        [remat]
        + [f"{m[f] / GIB:.2f}" for f in m]
        + [f"{short / GIB:.2f}", f"{(temp - short) / GIB:.2f}", f"{(two - temp) / GIB:.2f}"]
        + [f"{seconds:.0f}"]
      )
    print("Qwen3-4B loss + gradient, 1 x 4096 tokens, bfloat16: memory_analysis() GiB")
    head = ["remat", "temp", "arguments", "outputs", "temp at 128 tokens", "temp - temp(128)"]
    head += ["temp(2 seqs) - temp", "compile s"]
    print(markdown_table([head, *rows]) + "\n")
  if "decode" in what:
    rows, steps = [], []
    for scan in (False, True):
      name = "scanned" if scan else "unrolled"
      (d2, p2), (d36, p36) = (decode_compile_seconds(n, scan, args.repeats) for n in (2, 36))
      rows.append([name, f"{d2:.2f}", f"{d36:.2f}", f"{d36 / d2:.2f}"])
      rows.append([f"{name} prefill", f"{p2:.2f}", f"{p36:.2f}", f"{p36 / p2:.2f}"])
      steps.append([name] + [f"{decode_step_ms(n, scan, args.steps):.1f}" for n in (2, 8)])
    print(
      "engine compile seconds (hidden 64, 16 slots, decode at a 512-key bucket, prefill 4 x 64)"
    )
    print(markdown_table([["engine", "2 layers", "36 layers", "ratio"], *rows]) + "\n")
    ratio = [f"{float(b) / float(a):.2f}" for a, b in zip(steps[0][1:], steps[1][1:])]
    steps.append(["scanned / unrolled", *ratio])
    print("decode-step milliseconds (hidden 256, vocabulary 4096, 64 slots, 512-key bucket)")
    print(markdown_table([["engine", "2 layers", "8 layers"], *steps]) + "\n")
  print(machine())


if __name__ == "__main__":
  main()
