"""Rollout throughput: our engine against transformers `generate` and google-tunix's sampler.

    .venv/bin/python benchmarks/rollout_bench.py [--batches=1,8,32,64] [--new_tokens=32]

One random Qwen3 (8 layers, hidden 512, full 151,936-token vocabulary, float32 or `--dtype`; saved
once as a Hugging Face folder that every contender loads) and one set of random 128-token prompts.
For each batch size it prints generated tokens/s (new tokens over the wall time of a whole generate
call, prefill included, median of --repeats calls after a warm-up call of the same shapes) greedy
and sampled (T = 0.9, full vocabulary), the ratio of ours to the faster peer, whether our greedy
tokens equal transformers', how one decode step's time grows with batch size and with cache length
and how far it is from the memory bound (every weight and the filled cache read once at the rate
a jitted sum reads memory here: `step_bytes`, `read_bandwidth`), and the matmul bound: the most
tokens/s an implementation could reach here if every product ran at the rate XLA (or the faster
of XLA and torch) reaches on it in this run (`matmul_bound`; also re-measured after each of our
greedy calls, `PairedBound`), and the product bound, the same with every product the engine runs
at its own shape's rate (`product_bound`).
Our engine runs at each `--decode_steps` K (decode steps per device call, default 1,8); the last
K is the one compared with the peers, and a last table gives each K's tokens/s against the first
K's in this run and whether their tokens are identical (they must be). `--profile=DIR` then
traces one greedy call at the largest batch and prints where its device time went, by operation
(benchmarks/op_profile.py).

google-tunix conflicts with our pins, so it runs in its own environment (`--tunix_python`,
default .venv-tunix/bin/python) as a subprocess of this script (`--worker=tunix`), on the same
folder and prompts. The machine (CPU, cores, load, library versions, date) is printed with the
results.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from common import machine, markdown_table

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VOCAB = 151936
T_SAMPLED = 0.9


def _config_kwargs(args) -> dict:
  """The benchmark model's QwenConfig fields: `--layers` of width `--hidden`, hidden / 64 query
  heads and half as many KV heads of `--head_dim` (64; Qwen3-0.6B's is 128), MLP 3 x hidden,
  the head tied to the embedding with `--tied=1` (as in Qwen3-0.6B)."""
  heads = args.hidden // 64
  return dict(
    vocab_size=VOCAB,
    hidden_size=args.hidden,
    intermediate_size=3 * args.hidden,
    num_hidden_layers=args.layers,
    num_attention_heads=heads,
    num_key_value_heads=max(1, heads // 2),
    head_dim=args.head_dim,
    tie_word_embeddings=bool(args.tied),
  )


def _prompts(batch: int, length: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(1, VOCAB, (batch, length)).astype(np.int64)


def _cache_len(args) -> int:
  """Cache entries per slot of our engines: prompt and new tokens, rounded up to 128."""
  return -(-(args.prompt_len + args.new_tokens) // 128) * 128


def _timed(call, repeats: int):
  """(median wall seconds over `repeats` calls, the last call's result)."""
  times, result = [], None
  for _ in range(repeats):
    start = time.perf_counter()
    result = call()
    times.append(time.perf_counter() - start)
  return float(np.median(times)), result


# ------------------------------------------------------------------------------------- tunix


def tunix_worker(args) -> None:
  """Runs in the tunix environment: prints one JSON line {mode: {batch: [tok/s, tokens]}}."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from tunix.generate import sampler as sampler_lib  # noqa: PLC0415
  from tunix.models.qwen3 import model as qwen3_model  # noqa: PLC0415
  from tunix.models.qwen3 import params as qwen3_params  # noqa: PLC0415

  kw = _config_kwargs(args)
  cfg = qwen3_model.ModelConfig(
    num_layers=kw["num_hidden_layers"],
    vocab_size=VOCAB,
    embed_dim=kw["hidden_size"],
    hidden_dim=kw["intermediate_size"],
    num_heads=kw["num_attention_heads"],
    head_dim=kw["head_dim"],
    num_kv_heads=kw["num_key_value_heads"],
    rope_theta=1_000_000,
    norm_eps=1e-6,
    use_tied_embedding=kw["tie_word_embeddings"],
  )
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with mesh:
    model = qwen3_params.create_model_from_safe_tensors(
      args.folder, cfg, mesh, dtype=jnp.dtype(args.dtype)
    )

  class IdTokenizer:
    """Prompts travel as space-separated token ids, so tunix sees exactly our ids."""

    def encode(self, text, **kw):
      return [int(x) for x in text.split()]

    def decode(self, ids, **kw):
      return " ".join(str(int(i)) for i in ids)

    def bos_id(self):
      return 0  # falsy: no BOS is prepended

    def eos_id(self):
      return -1  # never sampled: every row generates exactly max_generation_steps tokens

    def pad_id(self):
      return 0

  out = {}
  prompts = _prompts(max(args.batches), args.prompt_len)
  for mode in ("greedy", "sampled"):
    out[mode] = {}
    for b in args.batches:
      sampler = sampler_lib.Sampler(
        model,
        IdTokenizer(),
        sampler_lib.CacheConfig(
          cache_size=args.prompt_len + args.new_tokens + 8,
          num_layers=cfg.num_layers,
          num_kv_heads=cfg.num_kv_heads,
          head_dim=cfg.head_dim,
        ),
      )
      texts = [" ".join(map(str, p)) for p in prompts[:b]]
      kwargs = dict(
        max_generation_steps=args.new_tokens,
        max_prompt_length=args.prompt_len,
        echo=False,
        eos_tokens=[-1],
      )
      if mode == "sampled":
        kwargs.update(temperature=T_SAMPLED, top_p=1.0, top_k=None, seed=0)
      sampler(texts, **kwargs)  # warm-up: compiles these shapes
      wall, res = _timed(lambda: sampler(texts, **kwargs), args.repeats)  # noqa: B023
      tokens = [list(map(int, t))[: args.new_tokens] for t in res.tokens]
      n = sum(len(t) for t in tokens)
      out[mode][str(b)] = [n / wall, tokens[:8]]
      print(f"tunix {mode} b={b}: {n / wall:.1f} tok/s", file=sys.stderr, flush=True)
  print(json.dumps(out))


def run_tunix(args) -> dict | None:
  python = (
    os.path.join(ROOT, args.tunix_python)
    if not os.path.isabs(args.tunix_python)
    else args.tunix_python
  )
  if not os.path.exists(python):
    print(f"tunix: {python} not found; skipped", file=sys.stderr)
    return None
  cmd = [
    python,
    os.path.abspath(__file__),
    "--worker=tunix",
    f"--folder={args.folder}",
    f"--batches={','.join(map(str, args.batches))}",
    f"--new_tokens={args.new_tokens}",
    f"--prompt_len={args.prompt_len}",
    f"--layers={args.layers}",
    f"--hidden={args.hidden}",
    f"--head_dim={args.head_dim}",
    f"--tied={args.tied}",
    f"--repeats={args.repeats}",
  ]
  env = dict(os.environ)  # without our --profile dump flags: the worker's programs are not ours
  env["XLA_FLAGS"] = getattr(args, "xla_flags_before", env.get("XLA_FLAGS", ""))
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
  sys.stderr.write(proc.stderr[-3000:] if proc.returncode else "")
  if proc.returncode:
    print(f"tunix worker failed (exit {proc.returncode}); skipped", file=sys.stderr)
    return None
  return json.loads(proc.stdout.strip().splitlines()[-1])


# -------------------------------------------------------------------------------- transformers


def run_transformers(args, prompts: np.ndarray) -> dict:
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  torch.set_num_threads(os.cpu_count() or 1)
  model = transformers.AutoModelForCausalLM.from_pretrained(
    args.folder, dtype=getattr(torch, args.dtype)
  )
  model.eval()
  out = {}
  for mode in ("greedy", "sampled"):
    out[mode] = {}
    for b in args.batches:
      ids = torch.tensor(prompts[:b])
      kwargs = dict(
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        attention_mask=torch.ones_like(ids),
        pad_token_id=0,
      )
      if mode == "sampled":
        kwargs.update(do_sample=True, temperature=T_SAMPLED, top_k=0, top_p=1.0)
      else:
        kwargs.update(do_sample=False)
      with torch.inference_mode():
        torch.manual_seed(0)
        model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        wall, res = _timed(lambda: model.generate(ids, **kwargs), args.repeats)  # noqa: B023
      new = res[:, ids.shape[1] :].tolist()
      out[mode][str(b)] = [sum(map(len, new)) / wall, new[:8]]
      print(
        f"transformers {mode} b={b}: {out[mode][str(b)][0]:.1f} tok/s", file=sys.stderr, flush=True
      )
  return out


# ---------------------------------------------------------------------------------------- ours


def run_ours(args, model, prompts: np.ndarray, decode_steps: int, paired: bool = False) -> dict:
  """Per batch size, greedy and sampled calls alternate (one engine, warmed up in both modes), so
  the sampled / greedy ratio compares neighbouring runs rather than runs minutes apart. With
  `paired`, a `PairedBound` sample follows each timed greedy call, and out["paired"][b] lists
  each call's tokens/s over its neighbouring bound's."""
  import jax.numpy as jnp  # noqa: PLC0415

  from coevolve_jax.rollout import Engine, SamplingParams, generate  # noqa: PLC0415

  cache = _cache_len(args)
  modes = {
    "greedy": SamplingParams(temperature=0.0),
    "sampled": SamplingParams(temperature=T_SAMPLED),
  }
  out = {mode: {} for mode in modes}
  out["paired"], arrays = {}, {}
  for b in args.batches:
    engine = Engine(model, b, cache, dtype=jnp.dtype(args.dtype))
    bound = (
      PairedBound(model.config, b, args.prompt_len, args.new_tokens, arrays) if paired else None
    )
    batch = prompts[:b].tolist()
    times = {mode: [] for mode in modes}
    for rep in range(args.repeats + 1):  # the first round warms up (compiles)
      for mode, sampling in modes.items():
        start = time.perf_counter()
        res = generate(
          engine, batch, sampling, max_new_tokens=args.new_tokens, decode_steps=decode_steps
        )
        if rep:
          times[mode].append(time.perf_counter() - start)
          n = sum(len(c.token_ids) for c in res)
          out[mode][str(b)] = [n / float(np.median(times[mode])), [c.token_ids for c in res[:8]]]
          if bound and mode == "greedy":
            ratio = n / times[mode][-1] / bound.sample()
            out["paired"].setdefault(str(b), []).append(ratio)
    for mode in modes:
      print(
        f"ours K={decode_steps} {mode} b={b}: {out[mode][str(b)][0]:.1f} tok/s",
        file=sys.stderr,
        flush=True,
      )
  return out


def step_times(args, model) -> tuple[dict, dict]:
  """Seconds per greedy decode step by batch size and by cache entries filled kv: ({(b, kv): one
  `generate` step from kv - 1 entries (a device call and a copy to the host per step)},
  {(b, kv): a `generate_steps` call of K = the last --decode_steps steps from kv - K entries,
  over K (the batcher's and agent loop's path: one call and one copy per K tokens)}). Medians
  of --step_repeats calls after a compiling one; the cache holds max(--kv_lengths) entries."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from coevolve_jax.rollout import Engine, SamplingParams  # noqa: PLC0415

  greedy, k = SamplingParams(temperature=0.0), args.decode_steps[-1]
  single, per_k = {}, {}
  for b in args.batches:
    engine = Engine(model, b, max(args.kv_lengths), dtype=jnp.dtype(args.dtype))
    active, keys = np.ones((b,), bool), jax.random.split(jax.random.key(0), b)

    def one(i, engine=engine, active=active) -> int:
      engine.generate(active, jax.random.key(i), greedy)
      return 1

    def several(i, engine=engine, active=active, keys=keys, b=b) -> int:
      limits = np.full((b,), k)
      tokens, _ = engine.generate_steps(
        active, keys, np.full((b,), i), limits, [], greedy, max_steps=k
      )
      return len(tokens)  # fewer than K where the steps would pass a key bucket's end

    kinds = [(single, 1, one)] + ([(per_k, k, several)] if k > 1 else [])
    for kv in args.kv_lengths:
      for out, steps, call in kinds:
        if steps > kv:
          continue
        times, ran = [], set()
        for i in range(args.step_repeats + 1):  # the first compiles
          # Timing only: every slot pretends kv - steps entries are filled (contents do not
          # matter), so the call's last step fills entry kv - 1.
          engine._pos[:] = kv - steps  # pylint: disable=protected-access
          engine.state = engine.state._replace(next_pos=jnp.full((b,), kv - steps, jnp.int32))
          start = time.perf_counter()
          ran.add(call(i))
          times.append(time.perf_counter() - start)
        if ran != {steps}:
          print(
            f"step_times: at kv {kv} a {steps}-step call ran {sorted(ran)} steps (a key bucket "
            "ends inside it); not reported",
            file=sys.stderr,
          )
          continue
        out[(b, kv)] = float(np.median(times[1:])) / steps
  return single, per_k


def step_bytes(cfg, batch: int, kv_used: float, itemsize: int) -> float:
  """Bytes one decode step of `batch` rows must read at least: every weight once (the layers'
  and the output head's [D, V], which is the embedding table when tied; the B embedding rows
  looked up are left out) and the `kv_used` filled cache entries of each row (keys and values of
  every layer). All weights count, experts included (a batch of 64 reaches most of them)."""
  from coevolve_jax.models.qwen import count_params  # noqa: PLC0415

  weights = count_params(cfg)["non_embedding"] + cfg.hidden_size * cfg.vocab_size
  kv = batch * kv_used * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
  return (weights + kv) * itemsize


def read_bandwidth(nbytes: int | None = None, repeats: int = 5) -> float:
  """Bytes/s at which the default device reads its memory here: a jitted sum over an `nbytes`
  float32 array (one untimed run, median of `repeats`). The reference of the memory bound: a
  measured rate, like the matmul bound's, not a datasheet's. Default size 512 MiB on a CPU and
  4 GiB on an accelerator, where 512 MiB read in about 0.1 ms and the call's own overhead would
  show in the rate."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  if nbytes is None:
    nbytes = 1 << (29 if jax.default_backend() == "cpu" else 32)
  x = jnp.ones((nbytes // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  return nbytes / _median_seconds(lambda: total(x).block_until_ready(), repeats)


# ------------------------------------------------------------------------------ matmul bound


def _rates(m: int, k: int, n: int, repeats: int = 5) -> tuple[float, float]:
  """FLOP/s of XLA's and of torch's bare [m, k] x [k, n] float32 product here (median of
  `repeats` each)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import torch  # noqa: PLC0415

  rng = np.random.default_rng(0)
  a = rng.standard_normal((m, k), np.float32)
  b = rng.standard_normal((k, n), np.float32)
  xa, xb, ta, tb = jnp.asarray(a), jnp.asarray(b), torch.from_numpy(a), torch.from_numpy(b)
  product = jax.jit(jnp.matmul)
  flops = 2 * m * k * n
  return (
    flops / _median_seconds(lambda: product(xa, xb).block_until_ready(), repeats),
    flops / _median_seconds(lambda: ta @ tb, repeats),
  )


def _median_seconds(run, repeats: int) -> float:
  """One untimed call of `run`, then the median wall time of `repeats` calls."""
  run()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _call_flops(cfg, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
  """(prefill, decode) FLOPs of one generate call as `matmul_bound` counts them: the prompts
  through every layer plus the head at each prompt's last position, then new_tokens - 1 decode
  steps through layers and head (attention, norms and sampling left out)."""
  from coevolve_jax.models.qwen import count_params  # noqa: PLC0415

  layers = count_params(cfg)["non_embedding"]
  head = cfg.hidden_size * cfg.vocab_size
  return (
    2.0 * batch * prompt_len * layers + 2.0 * batch * head,
    2.0 * batch * (new_tokens - 1) * (layers + head),
  )


def _bound_shapes(cfg, batch: int, prompt_len: int) -> tuple[list, list]:
  """The products whose rates set `matmul_bound`: the prefill MLP's ([B * P, D] x [D, F],
  [B * P, F] x [F, D]) and a decode step's ([B, D] x [D, V] head, [B, D] x [D, F] MLP)."""
  d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  m = batch * prompt_len
  return [(m, d, f), (m, f, d)], [(batch, d, v), (batch, d, f)]


def matmul_bound(args, model) -> dict:
  """Fastest generate call the matmul rate of this machine allows, per batch size.

  FLOPs of one call: `_call_flops` (attention, norms and sampling left out, so the bound is
  generous). Prefill FLOPs run at the best rate measured for the prefill's MLP products, decode
  FLOPs at the best for a step's head and MLP product (`_bound_shapes`). Two bounds: with XLA's
  products (what a JAX engine on XLA:CPU can reach) and with the faster library per product
  (what any implementation using XLA or torch can reach).
  """
  cfg = model.config
  out = {}
  for b in args.batches:
    prefill_flops, decode_flops = _call_flops(cfg, b, args.prompt_len, args.new_tokens)
    shapes = _bound_shapes(cfg, b, args.prompt_len)
    prefill, decode = ([_rates(*s) for s in group] for group in shapes)
    row = {"gflop": (prefill_flops + decode_flops) / 1e9}
    for name, pick in (("xla", lambda r: r[0]), ("any", max)):
      pre, dec = max(map(pick, prefill)), max(map(pick, decode))
      row[name] = b * args.new_tokens / (prefill_flops / pre + decode_flops / dec)
      row[f"{name}_rates"] = f"{pre / 1e9:.0f} / {dec / 1e9:.0f}"
    out[b] = row
  return out


class PairedBound:
  """`matmul_bound`'s XLA bound for one batch size, measured again beside each of our timed
  calls: `sample()` times its four products as `_rates` does (XLA, float32) and returns the
  bound in tokens/s. This machine's speed drifts by 10% and more within minutes, between our
  calls and a bound measured after them (the same code gave 76% and 92% of it at batch 64 in
  two runs); a ratio of neighbouring measurements does not carry that drift."""

  def __init__(self, cfg, batch: int, prompt_len: int, new_tokens: int, arrays: dict):
    """`arrays`: a dict shared between the batch sizes' instances (operands by shape)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    self.flops = _call_flops(cfg, batch, prompt_len, new_tokens)
    self.tokens = batch * new_tokens
    self.groups = _bound_shapes(cfg, batch, prompt_len)
    rng = np.random.default_rng(0)
    for m, k, n in (s for group in self.groups for s in group):
      for shape in ((m, k), (k, n)):
        if shape not in arrays:
          arrays[shape] = jnp.asarray(rng.standard_normal(shape, np.float32))
    self.arrays = arrays
    self.product = jax.jit(jnp.matmul)
    self.sample()  # compiles

  def _rate(self, m: int, k: int, n: int, repeats: int = 5) -> float:
    """XLA's FLOP/s for [m, k] x [k, n], measured as `_rates` does."""
    a, b = self.arrays[(m, k)], self.arrays[(k, n)]
    return (
      2.0 * m * k * n / _median_seconds(lambda: self.product(a, b).block_until_ready(), repeats)
    )

  def sample(self) -> float:
    pre, dec = (max(self._rate(*s) for s in group) for group in self.groups)
    return self.tokens / (self.flops[0] / pre + self.flops[1] / dec)


def call_products(cfg, batch: int, prompt_len: int, new_tokens: int, engine) -> dict:
  """The matrix products of one `generate` call of `batch` prompts of `prompt_len` tokens and
  `new_tokens` new tokens, as the engine runs them, counted by shape.

  Prefill: the forwards of `prefill_schedule` at the engine's padded row count R and chunk length
  t: per layer the q, k, v, o, gate, up and down projections of [R * t, .] rows, then the head on
  R rows. Decode: new_tokens - 1 steps of the same products on [batch, .] rows. Attention's own
  products (scores and values, which grow with the cache) are left out, as in `matmul_bound`.
  Returns {(m, k, n): count}; `engine` gives `max_prefill_tokens`, `prefill_min_chunk`,
  `cache_len` and `padded_rows`.
  """
  from coevolve_jax.rollout.engine import prefill_schedule  # noqa: PLC0415

  d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
  out: dict[tuple[int, int, int], int] = {}

  def add(m: int, times: int) -> None:
    layer = [(m, d, q), (m, d, kv), (m, d, kv), (m, q, d), (m, d, f), (m, d, f), (m, f, d)]
    for shape in layer:
      out[shape] = out.get(shape, 0) + times * cfg.num_hidden_layers

  def head(m: int, times: int) -> None:
    out[(m, d, v)] = out.get((m, d, v), 0) + times

  forwards = prefill_schedule(
    [prompt_len] * batch,
    [0] * batch,
    engine.cache_len,
    engine.max_prefill_tokens,
    engine.prefill_min_chunk,
  )
  for rows, t in forwards:
    r = engine.padded_rows(len(rows), t)
    add(r * t, 1)
    head(r, 1)
  add(batch, new_tokens - 1)
  head(batch, new_tokens - 1)
  return out


def product_bound(args, model) -> dict:
  """Per batch size, the fastest generate call the products of `call_products` allow, each at
  the rate XLA (or the faster of XLA and torch) reaches here on its own shape: the reference
  that holds our engine to the products it runs rather than to the best-shaped one
  (`matmul_bound` runs every decode FLOP at the faster of the head's and the MLP's rates, and
  every prefill FLOP at the faster MLP product's).
  """
  import jax.numpy as jnp  # noqa: PLC0415

  from coevolve_jax.rollout import Engine  # noqa: PLC0415

  cache = _cache_len(args)
  rates: dict[tuple[int, int, int], tuple[float, float]] = {}
  out = {}
  for b in args.batches:
    engine = Engine(model, b, cache, dtype=jnp.dtype(args.dtype))
    products = call_products(model.config, b, args.prompt_len, args.new_tokens, engine)
    seconds = {"xla": 0.0, "any": 0.0}
    for shape, count in products.items():
      if shape not in rates:
        # Small products take well under a millisecond: repeat them enough for a stable median.
        rates[shape] = _rates(*shape, repeats=int(max(5, min(101, 5e9 // (2 * np.prod(shape))))))
      flops = 2 * float(np.prod(shape)) * count
      seconds["xla"] += flops / rates[shape][0]
      seconds["any"] += flops / max(rates[shape])
    out[b] = {
      "products": sum(products.values()),
      "xla": b * args.new_tokens / seconds["xla"],
      "any": b * args.new_tokens / seconds["any"],
    }
  return out


def profile_call(args, model, prompts: np.ndarray) -> None:
  """Traces one greedy generate call at the largest batch (after a warm-up call) into
  `args.profile`/trace and prints `op_profile`'s table of it. A profiler that cannot start (no
  CUPTI on a GPU image, say) is reported, not raised: the tables above are the run's results."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from op_profile import op_table, render  # noqa: PLC0415

  from coevolve_jax.rollout import Engine, SamplingParams, generate  # noqa: PLC0415

  b = max(args.batches)
  cache = _cache_len(args)
  engine = Engine(model, b, cache, dtype=jnp.dtype(args.dtype))
  k = args.decode_steps[-1]

  def call():
    return generate(
      engine,
      prompts[:b].tolist(),
      SamplingParams(temperature=0.0),
      max_new_tokens=args.new_tokens,
      decode_steps=k,
    )

  def dumped() -> set[str]:
    return set(glob.glob(os.path.join(args.profile, "hlo", "*after_optimizations.txt")))

  before = dumped()
  programs = [os.path.basename(path).split(".")[1] for path in before]
  if len(programs) > len(set(programs)):
    # One program compiled for several batches, K or samplings: compiled again here, so that
    # the dump holds the traced programs apart (their operation numbers differ between shapes).
    jax.clear_caches()
  else:
    before = set()
  call()
  trace = os.path.join(args.profile, "trace")
  try:
    with jax.profiler.trace(trace):
      start = time.perf_counter()
      call()
      wall = time.perf_counter() - start
    rows, span = op_table(trace, sorted(dumped() - before) or os.path.join(args.profile, "hlo"))
  except Exception as e:  # noqa: BLE001  (a diagnostic: report and keep the results above)
    print(f"\nprofile: failed ({type(e).__name__}: {e})")
    return
  print(
    f"\nwhere one greedy call's device time goes (batch {b}, K = {k}, {wall:.2f} s traced; "
    f"last column: ms per decode step, for the decode program's rows)\n"
  )
  print(render(rows, span, top=25, per=args.new_tokens - 1))


# ---------------------------------------------------------------------------------------- main


def report(args, ours, hf, tunix, steps, bound, by_product=None, bandwidth=None) -> None:
  print(f"\nmachine: {machine(torch_version=True)}")
  print(
    f"model: Qwen3, {args.layers} layers, hidden {args.hidden}, head_dim {args.head_dim}, "
    f"{'tied' if args.tied else 'untied'} head, vocab {VOCAB}, {args.dtype}; "
    f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens per row\n"
  )
  rows = [
    ["mode", "batch", "ours tok/s", "transformers tok/s", "tunix tok/s", "ours / faster peer"]
  ]
  for mode in ("greedy", "sampled"):
    for b in map(str, args.batches):
      peers = [p[mode][b][0] for p in (hf, tunix) if p]
      ratio = f"{ours[mode][b][0] / max(peers):.2f}x" if peers else "-"
      rows.append(
        [
          mode,
          b,
          f"{ours[mode][b][0]:.1f}",
          f"{hf[mode][b][0]:.1f}" if hf else "-",
          f"{tunix[mode][b][0]:.1f}" if tunix else "-",
          ratio,
        ]
      )
  print(markdown_table(rows))
  print()
  cost = [["batch", "sampled / greedy time (ours)"]]
  for b in map(str, args.batches):
    cost.append([b, f"{ours['greedy'][b][0] / ours['sampled'][b][0]:.3f}"])
  print(markdown_table(cost))
  for name, peer in (("transformers", hf), ("tunix", tunix)):
    if not peer:
      continue
    same = []
    for b in map(str, args.batches):
      pairs = list(zip(ours["greedy"][b][1], peer["greedy"][b][1]))
      same.append(f"b={b}: {sum(a == h for a, h in pairs)}/{len(pairs)} rows identical")
    print(f"\ngreedy tokens equal {name}' (first 8 rows): " + "; ".join(same))
  kvs = args.kv_lengths
  srows = [["batch"] + [f"step ms @ kv {k}" for k in kvs]]
  for b in args.batches:
    srows.append([str(b)] + [f"{steps[0][(b, k)] * 1e3:.1f}" for k in kvs])
  print(
    f"\nours: one decode step (median of {args.step_repeats}), by batch size and cache length\n"
  )
  print(markdown_table(srows))
  if bandwidth:
    report_memory_bound(args, steps, bandwidth)
  if not bound:
    return
  print(
    "\nmatmul bound: the fastest generate call this machine's measured matmul rates allow "
    "(attention, norms and sampling not counted), with XLA's products and with the faster "
    "of XLA and torch per product\n"
  )
  brows = [
    [
      "batch",
      "GFLOP per call",
      "XLA GFLOP/s prefill / decode",
      "XLA bound tok/s",
      "best GFLOP/s",
      "best bound tok/s",
      "1.5x faster greedy peer",
      "ours greedy",
      "ours / XLA bound",
      "paired: median (range)",
    ]
  ]
  for b in args.batches:
    x = bound[b]
    peers = [peer["greedy"][str(b)][0] for peer in (hf, tunix) if peer]
    target = f"{1.5 * max(peers):.1f}" if peers else "-"
    mine = ours["greedy"][str(b)][0]
    paired = ours.get("paired", {}).get(str(b))
    brows.append(
      [
        str(b),
        f"{x['gflop']:.0f}",
        x["xla_rates"],
        f"{x['xla']:.1f}",
        x["any_rates"],
        f"{x['any']:.1f}",
        target,
        f"{mine:.1f}",
        f"{mine / x['xla']:.0%}",
        f"{np.median(paired):.0%} ({min(paired):.0%}-{max(paired):.0%})" if paired else "-",
      ]
    )
  print(markdown_table(brows))
  print(
    "\n(paired: each timed greedy call over the XLA bound measured right after it, "
    "`PairedBound`: the machine's drift between our calls and the bound's own measurement "
    "cancels)"
  )
  if not by_product:
    return
  print(
    "\nproduct bound: the same, with each product the engine runs (projections and head, "
    "prefill forwards as scheduled, decode steps) at the rate measured for its own shape\n"
  )
  prows = [
    ["batch", "products per call", "XLA bound tok/s", "best bound tok/s", "ours / XLA bound"]
  ]
  for b in args.batches:
    x, mine = by_product[b], ours["greedy"][str(b)][0]
    prows.append(
      [str(b), str(x["products"]), f"{x['xla']:.1f}", f"{x['any']:.1f}", f"{mine / x['xla']:.0%}"]
    )
  print(markdown_table(prows))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--batches", default="1,8,32,64")
  p.add_argument("--new_tokens", type=int, default=32)
  p.add_argument(
    "--decode_steps",
    default="1,8",
    help="our generate()'s decode steps per device call, each measured; the last is compared "
    "with the peers, and each with the first in its own table",
  )
  p.add_argument("--prompt_len", type=int, default=128)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--head_dim", type=int, default=64)
  p.add_argument("--tied", type=int, default=0, help="1: the output head is the embedding")
  p.add_argument("--kv_lengths", default="256,1024,4096")
  p.add_argument("--step_repeats", type=int, default=5)
  p.add_argument(
    "--repeats",
    type=int,
    default=3,
    help="timed generate calls per contender and setting (the median is reported)",
  )
  p.add_argument("--peers", default="transformers,tunix")
  p.add_argument(
    "--dtype",
    default="float32",
    choices=("float32", "bfloat16"),
    help="weights and KV cache of every contender (the matmul bound stays float32: --bound=0)",
  )
  p.add_argument("--tunix_python", default=".venv-tunix/bin/python")
  p.add_argument("--bound", type=int, default=1, help="print the matmul bound (0: skip)")
  p.add_argument(
    "--profile",
    default="",
    help="a folder: trace one greedy generate call at the largest batch (jax.profiler, with the "
    "HLO of its programs) after the tables, and print where its device time goes "
    "(benchmarks/op_profile.py)",
  )
  p.add_argument("--folder", default="", help="(worker) the Hugging Face folder")
  p.add_argument("--worker", default="", help="(internal) run a peer in its own environment")
  args = p.parse_args()
  args.batches = [int(x) for x in args.batches.split(",")]
  args.kv_lengths = [int(x) for x in args.kv_lengths.split(",")]
  args.decode_steps = [int(x) for x in args.decode_steps.split(",")]
  if args.worker == "tunix":
    tunix_worker(args)
    return
  sys.path.insert(0, ROOT)
  args.xla_flags_before = os.environ.get("XLA_FLAGS", "")
  if args.profile:  # before JAX starts: the dump names each traced operation's source and shape
    hlo = os.path.join(args.profile, "hlo")
    if os.path.isdir(hlo) and os.listdir(hlo):
      p.error(f"--profile: {hlo} already holds a dump; give an empty or new folder")
    os.environ["XLA_FLAGS"] = " ".join(
      [
        args.xla_flags_before,
        f"--xla_dump_to={os.path.join(args.profile, 'hlo')}",
        "--xla_dump_hlo_as_text",
        "--xla_dump_hlo_module_re=_generate|_prefill",
      ]
    ).strip()
  from flax import nnx  # noqa: PLC0415

  from coevolve_jax.models import Qwen, QwenConfig, save_pretrained  # noqa: PLC0415

  import jax.numpy as jnp  # noqa: PLC0415

  model = Qwen(
    QwenConfig(**_config_kwargs(args)),
    rngs=nnx.Rngs(0),
    dtype=jnp.dtype(args.dtype),
  )
  prompts = _prompts(max(args.batches), args.prompt_len)
  peers = args.peers.split(",") if args.peers else []
  with tempfile.TemporaryDirectory() as folder:
    args.folder = folder
    save_pretrained(model, folder)
    last = args.decode_steps[-1]
    by_k = {
      k: run_ours(args, model, prompts, k, paired=bool(args.bound) and k == last)
      for k in args.decode_steps
    }
    ours = by_k[args.decode_steps[-1]]
    hf = run_transformers(args, prompts) if "transformers" in peers else None
    tunix = run_tunix(args) if "tunix" in peers else None
  steps = step_times(args, model)
  bandwidth = read_bandwidth()
  bound = matmul_bound(args, model) if args.bound else None
  by_product = product_bound(args, model) if args.bound else None
  report(args, ours, hf, tunix, steps, bound, by_product, bandwidth)
  report_decode_steps(args, by_k)
  if args.profile:
    profile_call(args, model, prompts)


def report_memory_bound(args, steps: tuple[dict, dict], bandwidth: float) -> None:
  """Decode steps (`step_times`: one per call, and per step of a K-step call) against the
  memory bound: `step_bytes` at `read_bandwidth`, at the entries filled on average over the
  call's steps."""
  import jax.numpy as jnp  # noqa: PLC0415

  from coevolve_jax.models import QwenConfig  # noqa: PLC0415

  cfg = QwenConfig(**_config_kwargs(args))
  itemsize = jnp.dtype(args.dtype).itemsize
  k = args.decode_steps[-1]
  print(
    f"\nmemory bound of a decode step: every weight and each row's filled cache entries read "
    f"once ({args.dtype}), at the {bandwidth / 1e9:.0f} GB/s a jitted sum over a large array "
    f"reads here (`read_bandwidth`); steps of one-step calls (from kv - 1 entries) and of "
    f"K = {k}-step calls (from kv - {k}: the batcher's path)\n"
  )
  rows = [["batch", "kv", "K", "ms per step", "MB read", "bound ms", "bound / step"]]
  for b in args.batches:
    for kv in args.kv_lengths:
      for n, times in ((1, steps[0]), (k, steps[1])):
        if (b, kv) not in times:
          continue
        need = step_bytes(cfg, b, kv - (n - 1) / 2, itemsize)  # the steps' mean entries
        rows.append(
          [
            str(b),
            str(kv),
            str(n),
            f"{times[(b, kv)] * 1e3:.2f}",
            f"{need / 1e6:.0f}",
            f"{need / bandwidth * 1e3:.2f}",
            f"{need / bandwidth / times[(b, kv)]:.1%}",
          ]
        )
  print(markdown_table(rows))


def report_decode_steps(args, by_k: dict) -> None:
  """Each K (decode steps per device call) against the first, same engine shapes and prompts:
  tokens/s ratio, and whether the first 8 rows' tokens are identical (they must be)."""
  if len(by_k) < 2:
    return
  base = args.decode_steps[0]
  rows = [["mode", "batch", "K", "tok/s", f"vs K={base}", "first 8 rows identical"]]
  for mode in ("greedy", "sampled"):
    for b in map(str, args.batches):
      ref = by_k[base][mode][b]
      for k in args.decode_steps:
        got = by_k[k][mode][b]
        rows.append(
          [mode, b, str(k), f"{got[0]:.1f}", f"{got[0] / ref[0]:.2f}x", str(got[1] == ref[1])]
        )
  print(f"\nours: decode steps per device call (K), against K={base} in this run\n")
  print(markdown_table(rows))


if __name__ == "__main__":
  main()
