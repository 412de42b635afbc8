"""Attention kernels (`model.attention`, models/kernels.py) against the plain XLA softmax, on the
machine it runs on.

    python benchmarks/attention_kernels.py                        # the backend's kernels
    python benchmarks/attention_kernels.py --seqs=256 --interpret # splash in interpret mode (CPU)

Rows, per kernel and sequence length: one decoder layer's attention of a training (GRPO) pass,
forward and backward (loss and gradient of queries, keys and values), through
`qwen._attend_by_pass` exactly as the model calls it, at the shape of `--heads` query heads,
`--kv_heads` KV heads and `--head_dim` (default Qwen3-1.7B's 16 / 8 / 128), `--batch` rows of
T tokens in `--dtype`; the median of `--repeats` timed calls after one untimed call. The ratio
column is the time of the reference ("xla", one [T, T] score matrix per head) over the
kernel's: above 1, the kernel is faster. A cell that fails (out of memory, a kernel the backend
lacks) says why instead of a time.

Then the decode step's attention at `--decode_batch` slots over `--decode_len` cache entries
(the engine's path: every kernel decodes with XLA today) against its memory bound: the keys
and values read once, at the rate a jitted sum reads memory here (rollout_bench.read_bandwidth).

Kernels: "xla" and "blocked" everywhere; "splash" on TPU (with `--interpret`, in Pallas
interpret mode elsewhere: numerics, not speed); "cudnn" on GPU.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from common import machine, markdown_table
from rollout_bench import _median_seconds, read_bandwidth

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))


def kernels_here(interpret: bool) -> list[str]:
  import jax  # noqa: PLC0415

  backend = jax.default_backend()
  out = ["xla", "blocked"]
  if backend == "tpu" or interpret:
    out.append("splash")
  if backend == "gpu":
    out.append("cudnn")
  return out


def train_seconds(kernel: str, args, t: int) -> float:
  """Median seconds of one layer's attention forward and backward at T = `t` tokens."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from coevolve_jax.models import qwen  # noqa: PLC0415

  b, n, k, h = args.batch, args.heads, args.kv_heads, args.head_dim
  dtype = jnp.dtype(args.dtype)
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (b, t, n, h), dtype)
  kk = jax.random.normal(keys[1], (b, k, h, t), dtype)
  vv = jax.random.normal(keys[2], (b, k, t, h), dtype)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  attend = functools.partial(qwen._attend_by_pass, cached=False, gathered=False, kernel=kernel)

  def loss(q, kk, vv):
    out = attend(q, kk, vv, pos, pos, None)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  return _median_seconds(lambda: jax.block_until_ready(step(q, kk, vv)), args.repeats)


def decode_seconds(args) -> tuple[float, int]:
  """(median seconds, bytes of keys and values read) of one decode step's attention."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from coevolve_jax.models import qwen  # noqa: PLC0415

  b, n, k, h, s = args.decode_batch, args.heads, args.kv_heads, args.head_dim, args.decode_len
  dtype = jnp.dtype(args.dtype)
  keys = jax.random.split(jax.random.PRNGKey(1), 3)
  q = jax.random.normal(keys[0], (b, 1, n, h), dtype)
  kk = jax.random.normal(keys[1], (b, k, h, s), dtype)
  vv = jax.random.normal(keys[2], (b, k, s, h), dtype)
  k_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
  q_pos = jnp.full((b, 1), s - 1)
  valid = jnp.ones((b, s), jnp.bool_)
  step = jax.jit(
    functools.partial(qwen._attend_by_pass, cached=True, gathered=False, kernel="auto")
  )
  seconds = _median_seconds(
    lambda: step(q, kk, vv, q_pos, k_pos, valid).block_until_ready(), args.repeats
  )
  return seconds, 2 * kk.size * dtype.itemsize


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--seqs", default="4096,16384", help="training sequence lengths")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv_heads", type=int, default=8)
  p.add_argument("--head_dim", type=int, default=128)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--decode_batch", type=int, default=64)
  p.add_argument("--decode_len", type=int, default=4096)
  p.add_argument("--kernels", default="", help="comma-separated (default: the backend's)")
  p.add_argument("--interpret", action="store_true", help="splash in interpret mode off TPU")
  args = p.parse_args(argv)
  kernels = args.kernels.split(",") if args.kernels else kernels_here(args.interpret)
  print(f"Machine: {machine()}")
  print(
    f"One layer's attention, forward and backward: batch {args.batch}, {args.heads} query / "
    f"{args.kv_heads} KV heads of {args.head_dim}, {args.dtype}; median of {args.repeats}."
  )
  rows = [["kernel", "tokens", "ms", "xla / kernel"]]
  for t in (int(s) for s in args.seqs.split(",")):
    reference = None
    for kernel in ["xla", *(k for k in kernels if k != "xla")]:
      try:
        seconds = train_seconds(kernel, args, t)
      except Exception as e:  # noqa: BLE001  (an out-of-memory cell is a result)
        rows.append([kernel, str(t), f"failed: {type(e).__name__}: {str(e)[:80]}", ""])
        continue
      if kernel == "xla":
        reference = seconds
      ratio = f"{reference / seconds:.2f}" if reference else "n/a"
      rows.append([kernel, str(t), f"{seconds * 1e3:.2f}", ratio])
      print(f"  {kernel} at {t} tokens: {seconds * 1e3:.2f} ms", flush=True)
  print(markdown_table(rows))
  seconds, nbytes = decode_seconds(args)
  bandwidth = read_bandwidth()
  bound = nbytes / bandwidth
  print(
    f"\nDecode step's attention, {args.decode_batch} slots x {args.decode_len} entries "
    f"({nbytes / 2**20:.0f} MiB of keys and values): {seconds * 1e3:.3f} ms; memory bound "
    f"{bound * 1e3:.3f} ms at {bandwidth / 1e9:.0f} GB/s read here: {bound / seconds:.1%} of "
    "the bound (every kernel decodes with XLA)"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
