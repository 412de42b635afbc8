"""A decode step's time by attention kernel and KV-cache layout, at given slot lengths.

    nice .venv/bin/python benchmarks/decode_step.py [--lengths=200,700,1100,2100,ragged]
    python benchmarks/decode_step.py --preset=qwen3_0_6b --dtype=bfloat16 --slots=64   # a device

The forward of one engine decode step (`Qwen.decode` of one token per slot against the KV cache,
then the logits; the cache donated, as the engine does) of the model in `--folder` (default:
SmolLM2-135M-Instruct from the model cache, `make real-model`), `--slots` slots of a
`--cache_len`-entry cache filled with random keys and values (or, with `--preset`, a random model
of that preset in `--dtype`: no folder needed), each slot at the given length
("ragged": lengths spread evenly from 300 to 2,100), at the engine's key bucket (the smallest
power of two >= the longest slot, at least 256). Two layouts: "stacked" (a stacked cache and
model under a scan over layers, the job's `engine.scan_layers`) and "unrolled" (one cache per
layer). Two kernels: "xla" (`model.attention = "xla"`, one plain masked softmax over the bucket,
which it slices out of the cache) and "auto" (on CPU the "blocked" path: a decode step from a
stacked cache or a bucket shorter than the cache reads 512-entry blocks in place, up to the
longest slot's, `qwen._attend_cached_blocks`; on a GPU JAX's Pallas ragged decode kernel,
each slot read to its own length, `kernels.ragged_decode_attention`). Median of `--repeats`
calls after one untimed call; the ratio column is xla's time over auto's (above 1: auto is
faster), and the largest difference of their logits from the same cache. The machine is
printed with the table.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from common import machine, markdown_table
from rollout_bench import _median_seconds

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))


def slot_lengths(spec: str, slots: int) -> list[int]:
  """`spec` ("ragged" or one length) as one length per slot."""
  if spec == "ragged":
    return [int(x) for x in np.linspace(300, 2100, slots)]
  return [int(spec)] * slots


def key_bucket(longest: int, cache_len: int) -> int:
  """The engine's decode key bucket for a longest slot of `longest` entries."""
  from coevolve_jax.rollout.engine import _kv_bucket  # noqa: PLC0415

  return _kv_bucket(longest, cache_len)


def step_seconds(folder: str, kernel: str, stacked: bool, lengths, args):
  """(median seconds, [B, V] float32 logits) of one decode step at these slot lengths, of the
  model in `folder` or, with `args.preset`, a random model of that preset."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from coevolve_jax.models.hf import from_pretrained  # noqa: PLC0415
  from coevolve_jax.models.kernels import key_layout  # noqa: PLC0415
  from coevolve_jax.models.qwen import KVCache, unstack  # noqa: PLC0415

  if args.preset:
    from coevolve_jax.models.qwen import Qwen, QwenConfig  # noqa: PLC0415

    dtype = jnp.dtype(args.dtype)
    cfg = QwenConfig.preset(args.preset)
    model = Qwen(cfg, rngs=nnx.Rngs(0), dtype=dtype, attention=kernel)
  else:
    dtype = jnp.float32
    model = from_pretrained(folder, attention=kernel)
  if not stacked:
    model = unstack(model)
  b, s = len(lengths), args.cache_len
  empty = KVCache.zeros(
    model.config, b, s, dtype, stacked=stacked, keys=key_layout(kernel, dtype=dtype)
  )
  rng = np.random.default_rng(0)  # the same cache contents for every kernel and layout
  cache = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype), empty)
  graphdef, state = nnx.split(model)

  @jax.jit(static_argnames=("kv_len",), donate_argnums=(1,))
  def step(state, cache, ids, pos, kv_len):
    m = nnx.merge(graphdef, state)
    hidden, cache = m.decode(ids, pos, cache, pos[:, 0], kv_len)
    return m.logits(hidden)[:, -1], cache

  ids = jnp.ones((b, 1), jnp.int32)
  pos = jnp.asarray(lengths, jnp.int32)[:, None] - 1
  kv_len = key_bucket(max(lengths), s)
  # Each call writes the same token at the same entries, so every call sees the same cache.
  logits, cache = step(state, cache, ids, pos, kv_len)
  held = [cache]  # the newest cache: each call donates the one before

  def call():
    out, held[0] = step(state, held[0], ids, pos, kv_len)
    out.block_until_ready()

  return _median_seconds(call, args.repeats), np.asarray(logits)


def main(argv=None) -> int:
  from coevolve_jax.cli.import_model import smollm2_folder  # noqa: PLC0415

  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--folder", default=str(smollm2_folder()), help="Hugging Face model folder")
  p.add_argument("--slots", type=int, default=8)
  p.add_argument("--cache_len", type=int, default=4096)
  p.add_argument("--lengths", default="200,700,1100,2100,ragged", help="per-slot lengths")
  p.add_argument("--layouts", default="stacked,unrolled")
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--preset", default="", help="a random model of this preset instead of --folder")
  p.add_argument("--dtype", default="float32", help="with --preset: its parameters and compute")
  args = p.parse_args(argv)
  if not args.preset and not os.path.isdir(args.folder):
    print(f"no model folder at {args.folder}: run `make real-model` or pass --folder")
    return 2
  print(f"Machine: {machine()}")
  print(
    f"One decode step of {args.preset or os.path.basename(args.folder)}: {args.slots} slots, a "
    f"{args.cache_len}-entry cache; median of {args.repeats}."
  )
  rows = [["layout", "slot lengths", "key bucket", "xla ms", "auto ms", "xla / auto", "max |diff|"]]
  for layout in args.layouts.split(","):
    for spec in args.lengths.split(","):
      lengths = slot_lengths(spec, args.slots)
      (xla_s, xla_logits), (auto_s, auto_logits) = (
        step_seconds(args.folder, kernel, layout == "stacked", lengths, args)
        for kernel in ("xla", "auto")
      )
      label = f"{min(lengths)}-{max(lengths)}" if spec == "ragged" else spec
      rows.append(
        [
          layout,
          label,
          str(key_bucket(max(lengths), args.cache_len)),
          f"{xla_s * 1e3:.1f}",
          f"{auto_s * 1e3:.1f}",
          f"{xla_s / auto_s:.2f}",
          f"{np.abs(xla_logits - auto_logits).max():.1e}",
        ]
      )
      print(f"  {layout} {label}: xla {xla_s * 1e3:.1f} ms, auto {auto_s * 1e3:.1f} ms", flush=True)
  print(markdown_table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
