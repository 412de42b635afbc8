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

Then the decode step's attention at `--decode_batch` slots over `--decode_len` cache entries,
with every slot full and with ragged slots (lengths uniform in [S/8, S]), by each of
`--decode_kernels` (default: "xla" and the backend's kernel): "xla" (the engine's XLA path, what
every CPU run decodes with), "ragged" (`kernels.ragged_decode_attention`, JAX's Pallas GPU decode
kernel, which reads each slot only to its length: what the engine decodes with on a GPU,
`model.attention` "auto" or "cudnn"; Pallas interpret mode off GPU: numerics, not speed) and
"paged" (`kernels.paged_decode_attention`, JAX's Pallas TPU paged-attention kernel over the same
cache seen as pages, likewise to each slot's length: the engine's on a TPU over a bfloat16 cache;
TPU interpret mode off TPU), `--decode_inner` chained steps per call, against
the memory bound: the filled keys and values read once, at the rate a jitted sum reads memory
here (rollout_bench.read_bandwidth), with each output's largest difference from XLA's.

Then a prefill chunk's attention from the cache: `--prefill_rows` rows of `--prefill_chunk`
queries each, the chunk written last into a bucket of `--decode_len` entries (the rows' earlier
entries uniform in [0, S - chunk]), by each of `--prefill_kernels` (default "xla" and, on a TPU,
"paged": `kernels.paged_prefill_attention`, JAX's Pallas TPU ragged paged-attention kernel, what
the engine prefills with on a TPU over a bfloat16 cache; it runs on TPUs only), one call per
timing, with the reference's ratio and the largest difference from the XLA path's output.

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


def decode_inputs(args, ragged: bool, seed: int = 1):
  """A decode step's inputs at `--decode_batch` slots of `--decode_len` entries: queries
  [B, 1, N, H], keys [B, K, H, S] (the engine's layout), values [B, K, S, H], filled lengths [B]
  (all S, or with `ragged` uniform in [S/8, S] with one slot full, as slots of a batch are
  during decode)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  b, n, k, h, s = args.decode_batch, args.heads, args.kv_heads, args.head_dim, args.decode_len
  dtype = jnp.dtype(args.dtype)
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(keys[0], (b, 1, n, h), dtype)
  kk = jax.random.normal(keys[1], (b, k, h, s), dtype)
  vv = jax.random.normal(keys[2], (b, k, s, h), dtype)
  lengths = np.full((b,), s)
  if ragged:
    lengths = np.random.default_rng(seed).integers(s // 8, s + 1, size=b)
    lengths[0] = s
  return q, kk, vv, jnp.asarray(lengths, jnp.int32)


def _chained(step, inner: int):
  """`inner` dependent calls of `step` in one program (each call's output is the next call's
  query), so one dispatch's overhead is spread over `inner` reads of the cache."""
  import jax  # noqa: PLC0415

  def run(q, *rest):
    return jax.lax.fori_loop(0, inner, lambda _, q: step(q, *rest).astype(q.dtype), q)

  return jax.jit(run)


def decode_seconds(args, kernel: str, ragged: bool) -> tuple[float, int, float]:
  """(median seconds per step, bytes of filled keys and values, max |difference| from the XLA
  path's output) of one decode step's attention by `kernel`: "xla" (the engine's XLA path:
  masked softmax over every entry of the slot), "ragged" (`kernels.ragged_decode_attention`) or
  "paged" (`kernels.paged_decode_attention`), both over a cache of key layout "sh" and reading
  filled entries only (off their device in interpret mode)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from coevolve_jax.models import qwen  # noqa: PLC0415
  from coevolve_jax.models.kernels import (  # noqa: PLC0415
    paged_decode_attention,
    ragged_decode_attention,
  )

  q, kk, vv, lengths = decode_inputs(args, ragged)
  s = args.decode_len
  k_pos = jnp.broadcast_to(jnp.arange(s), (q.shape[0], s))
  valid = k_pos < lengths[:, None]
  q_pos = (lengths - 1)[:, None]
  xla = functools.partial(qwen._attend_by_pass, cached=True, gathered=False, kernel="auto")

  def xla_step(q, kk, vv):
    return xla(q, kk, vv, q_pos, k_pos, valid)

  want = jax.jit(xla_step)(q, kk, vv).astype(jnp.float32)
  if kernel == "xla":
    step, operands, got = xla_step, (kk, vv), want
  elif kernel in ("ragged", "paged"):
    k_bksh = jnp.swapaxes(kk, 2, 3)  # the cache's key layout "sh", made outside the timed step
    attend = ragged_decode_attention if kernel == "ragged" else paged_decode_attention

    def step(q, k_bksh, vv):
      return attend(q[:, 0], k_bksh, vv, lengths)[:, None]

    operands = (k_bksh, vv)
    got = jax.jit(step)(q, *operands).astype(jnp.float32)
  else:
    raise ValueError(f"unknown decode kernel {kernel!r}: xla, ragged or paged")
  error = float(jnp.max(jnp.abs(got - want)))
  inner = args.decode_inner
  chained = _chained(step, inner)
  seconds = _median_seconds(lambda: chained(q, *operands).block_until_ready(), args.repeats)
  filled = int(jnp.sum(lengths)) * kk.shape[1] * kk.shape[2] * 2 * kk.dtype.itemsize
  return seconds / inner, filled, error


def prefill_seconds(args, kernel: str) -> tuple[float, float]:
  """(median seconds, max |difference| from the XLA path's output) of one prefill chunk's
  attention from the cache by `kernel`: "xla" (the engine's XLA path: [T, S] scores of every
  row over the bucket) or "paged" (`kernels.paged_prefill_attention`, reading each row's pages
  up to its chunk's last entry)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from coevolve_jax.models import qwen  # noqa: PLC0415
  from coevolve_jax.models.kernels import paged_prefill_attention  # noqa: PLC0415

  b, t, s = args.prefill_rows, args.prefill_chunk, args.decode_len
  n, k, h = args.heads, args.kv_heads, args.head_dim
  dtype = jnp.dtype(args.dtype)
  keys = jax.random.split(jax.random.PRNGKey(2), 3)
  q = jax.random.normal(keys[0], (b, t, n, h), dtype)
  kk = jax.random.normal(keys[1], (b, k, h, s), dtype)
  vv = jax.random.normal(keys[2], (b, k, s, h), dtype)
  starts = np.random.default_rng(2).integers(0, s - t + 1, size=b)
  lengths = jnp.asarray(starts + t, jnp.int32)
  q_pos = lengths[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None]
  k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  xla = jax.jit(
    lambda q, kk, vv: qwen._attend_by_pass(
      q, kk, vv, q_pos, k_pos, None, cached=True, gathered=False, kernel="xla"
    )
  )
  want = xla(q, kk, vv).astype(jnp.float32)
  if kernel == "xla":
    step, operands, got = xla, (kk, vv), want
  elif kernel == "paged":
    k_bksh = jnp.swapaxes(kk, 2, 3)  # the cache's key layout "sh", made outside the timed call
    step = jax.jit(lambda q, k, v: paged_prefill_attention(q, k, v, lengths))
    operands = (k_bksh, vv)
    got = step(q, *operands).astype(jnp.float32)
  else:
    raise ValueError(f"unknown prefill kernel {kernel!r}: xla or paged")
  error = float(jnp.max(jnp.abs(got - want)))
  seconds = _median_seconds(lambda: step(q, *operands).block_until_ready(), args.repeats)
  return seconds, error


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
  p.add_argument("--decode_inner", type=int, default=8, help="chained decode steps per call")
  p.add_argument(
    "--decode_kernels",
    default="",
    help="decode kernels: xla (the engine's XLA path), ragged (the engine's on a GPU), paged "
    "(the engine's on a TPU in bfloat16); default xla and the backend's (xla alone on CPU)",
  )
  p.add_argument("--prefill_rows", type=int, default=16)
  p.add_argument("--prefill_chunk", type=int, default=512)
  p.add_argument(
    "--prefill_kernels",
    default="",
    help="prefill kernels: xla, paged (the engine's on a TPU in bfloat16); default xla and the "
    "backend's",
  )
  p.add_argument("--kernels", default="", help="comma-separated (default: the backend's)")
  p.add_argument("--interpret", action="store_true", help="splash in interpret mode off TPU")
  args = p.parse_args(argv)
  kernels = args.kernels.split(",") if args.kernels else kernels_here(args.interpret)
  if not args.decode_kernels:
    import jax  # noqa: PLC0415

    here = {"gpu": ["ragged"], "tpu": ["paged"]}.get(jax.default_backend(), [])
    args.decode_kernels = ",".join(["xla", *here])
  if not args.prefill_kernels:
    import jax  # noqa: PLC0415

    args.prefill_kernels = "xla,paged" if jax.default_backend() == "tpu" else "xla"
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
  bandwidth = read_bandwidth()
  print(
    f"\nDecode step's attention, {args.decode_batch} slots x {args.decode_len} entries, "
    f"{args.decode_inner} chained steps per dispatch; memory bound: the filled keys and values "
    f"read once at {bandwidth / 1e9:.0f} GB/s (a jitted sum's rate here). 'ragged': slot "
    "lengths uniform in [S/8, S]. 'max |diff|': largest difference from the xla path's output."
  )
  rows = [
    ["kernel", "slots", "filled MiB", "ms", "bound ms", "of bound", "xla / kernel", "max |diff|"]
  ]
  for ragged in (False, True):
    reference = None
    for kernel in args.decode_kernels.split(","):
      label = "ragged" if ragged else "full"
      try:
        seconds, nbytes, error = decode_seconds(args, kernel, ragged)
      except Exception as e:  # noqa: BLE001  (a kernel the backend lacks is a result)
        rows.append(
          [kernel, label, "", f"failed: {type(e).__name__}: {str(e)[:80]}", "", "", "", ""]
        )
        continue
      reference = seconds if kernel == "xla" else reference
      bound = nbytes / bandwidth
      rows.append(
        [
          kernel,
          label,
          f"{nbytes / 2**20:.0f}",
          f"{seconds * 1e3:.3f}",
          f"{bound * 1e3:.3f}",
          f"{bound / seconds:.1%}",
          f"{reference / seconds:.2f}" if reference else "n/a",
          f"{error:.2e}",
        ]
      )
      print(f"  decode {kernel} ({label}): {seconds * 1e3:.3f} ms", flush=True)
  print(markdown_table(rows))
  print(
    f"\nPrefill chunk's attention from the cache: {args.prefill_rows} rows x "
    f"{args.prefill_chunk} queries over {args.decode_len} entries, each row's chunk after "
    "[0, S - chunk] earlier entries; median of one call each."
  )
  rows = [["kernel", "ms", "xla / kernel", "max |diff|"]]
  reference = None
  for kernel in args.prefill_kernels.split(","):
    try:
      seconds, error = prefill_seconds(args, kernel)
    except Exception as e:  # noqa: BLE001  (a kernel the backend lacks is a result)
      rows.append([kernel, f"failed: {type(e).__name__}: {str(e)[:80]}", "", ""])
      continue
    reference = seconds if kernel == "xla" else reference
    ratio = f"{reference / seconds:.2f}" if reference else "n/a"
    rows.append([kernel, f"{seconds * 1e3:.3f}", ratio, f"{error:.2e}"])
    print(f"  prefill {kernel}: {seconds * 1e3:.3f} ms", flush=True)
  print(markdown_table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
