"""Benchmark tools: rollout_bench.py's product bound counts the products the engine runs, and
op_profile.py names where a traced call's time went."""

import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import jax.numpy as jnp
import pytest
from flax import nnx

from coevolve_jax.models import Qwen, QwenConfig
from coevolve_jax.rollout import Engine

import kit

BENCH = pathlib.Path(__file__).parent.parent / "benchmarks"


def _load(name: str):
  sys.path.insert(0, str(BENCH))  # the scripts import their sibling `common`
  try:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  finally:
    sys.path.remove(str(BENCH))
  return module


def _tiny(**overrides) -> QwenConfig:
  """A 2-layer Qwen3 of width 64 and vocabulary 1,000: q width 32, k and v 16, MLP 96, so every
  product's shape differs from the others'."""
  shape = dict(vocab_size=1000, intermediate_size=96, head_dim=8)  # the rest: kit.tiny_config's
  return kit.tiny_config(**{**shape, **overrides})


@pytest.fixture(scope="module")
def bench():
  return _load("rollout_bench")


@pytest.mark.parametrize(
  "rows_mode, prefill",
  [
    # 3 prompts of 128 tokens, at most 256 tokens per forward: rows {0, 1}, then row 2 alone.
    ("fit", {256: 1, 128: 1}),  # padded to the next power of two: 2 rows, 1 row
    ("full", {256: 2}),  # padded to the most a forward takes: 2 rows both times
  ],
)
def test_call_products_are_the_engines(bench, rows_mode, prefill, monkeypatch):
  cfg = _tiny()
  model = Qwen(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
  engine = Engine(model, 3, 256, max_prefill_tokens=256, prefill_rows=rows_mode)
  got = bench.call_products(cfg, 3, 128, 5, engine)

  def layer(m, times):  # q, k, v, o, gate, up, down of one layer, in every layer
    return {
      (m, 64, 32): 2 * times,
      (m, 64, 16): 2 * 2 * times,
      (m, 32, 64): 2 * times,
      (m, 64, 96): 2 * 2 * times,
      (m, 96, 64): 2 * times,
    }

  want: dict = {}
  for part in [layer(m, n) for m, n in prefill.items()] + [layer(3, 4)]:
    for shape, count in part.items():
      want[shape] = want.get(shape, 0) + count
  for m, n in prefill.items():  # the head on each forward's padded rows
    want[(m // 128, 64, 1000)] = want.get((m // 128, 64, 1000), 0) + n
  want[(3, 64, 1000)] = 4  # the head at each of the 4 decode steps
  assert got == want

  # The prefill forwards assumed above are the ones the engine runs in a generate call.
  import coevolve_jax.rollout.engine as engine_lib
  from coevolve_jax.rollout import SamplingParams, generate

  ran, real = [], engine_lib._prefill_rows

  def logged(*args):
    ran.append(args[4].shape[0] * args[4].shape[1])  # chunk_rt [R, t]: R * t rows
    return real(*args)

  monkeypatch.setattr(engine_lib, "_prefill_rows", logged)
  prompts = [[1 + (i * 7 + j) % 900 for j in range(128)] for i in range(3)]
  out = generate(engine, prompts, SamplingParams(temperature=0.0), max_new_tokens=5)
  assert [len(c.token_ids) for c in out] == [5, 5, 5]
  assert {m: ran.count(m) for m in ran} == prefill


def test_paired_bound_is_the_matmul_bound_measured_again(bench, monkeypatch):
  """`PairedBound.sample()` is `matmul_bound`'s XLA bound for the rates of its own timing: with
  both given the same rate per product shape, both equal the bound computed here by hand."""
  cfg = _tiny()
  b, p, n = 2, 16, 5
  real = bench.PairedBound(cfg, b, p, n, {}).sample()  # timed for real: a finite rate
  assert 0 < real < float("inf")

  rate = {(b * p, 64, 96): 3e9, (b * p, 96, 64): 5e9, (b, 64, 1000): 2e9, (b, 64, 96): 1e9}
  monkeypatch.setattr(bench, "_rates", lambda m, k, n_, repeats=5: (rate[(m, k, n_)],) * 2)
  monkeypatch.setattr(bench.PairedBound, "_rate", lambda self, *shape, repeats=5: rate[shape])
  from coevolve_jax.models.qwen import count_params

  layers = count_params(cfg)["non_embedding"]
  prefill = 2 * b * p * layers + 2 * b * 64 * 1000  # prompts through the layers, head at the end
  decode = 2 * b * (n - 1) * (layers + 64 * 1000)  # n - 1 steps through layers and head
  want = b * n / (prefill / 5e9 + decode / 2e9)  # the faster product of each phase
  args = SimpleNamespace(batches=[b], prompt_len=p, new_tokens=n)
  model = Qwen(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
  assert bench.matmul_bound(args, model)[b]["xla"] == pytest.approx(want, rel=1e-12)
  assert bench.PairedBound(cfg, b, p, n, {}).sample() == pytest.approx(want, rel=1e-12)


def test_step_bytes_counts_every_weight_and_the_filled_cache(bench):
  """A decode step's bytes: the layers' weights and the head once, and batch x entries x layers x
  (keys and values) x KV heads x head width of cache; a tied head is the embedding, counted
  once."""
  from coevolve_jax.models.qwen import count_params

  for tied in (False, True):
    cfg = _tiny(tie_word_embeddings=tied)
    counts = count_params(cfg)
    # Untied: the embedding count holds the input table and the head, each 64 x 1000.
    assert counts["embedding"] == (1 if tied else 2) * 64 * 1000
    weights = counts["non_embedding"] + 64 * 1000
    cache = 3 * 40 * 2 * 2 * 2 * 8  # 3 rows, 40 entries, 2 layers, k and v, 2 KV heads, width 8
    assert bench.step_bytes(cfg, 3, 40, 2) == 2 * (weights + cache)
    assert bench.step_bytes(cfg, 3, 41, 4) - bench.step_bytes(cfg, 3, 40, 4) == 4 * cache // 40


def test_step_times_reports_only_calls_that_ran_k_steps(bench, capsys):
  """A K-step call is timed per step only where it runs all K steps: from 252 entries (kv 260)
  the 256-key bucket ends after 4 steps, so kv 260 has a one-step time and no K-step time; from
  504 (kv 512, the cache's end) all 8 steps run."""
  model = Qwen(_tiny(), rngs=nnx.Rngs(0), dtype=jnp.float32)
  args = SimpleNamespace(
    batches=[2], kv_lengths=[260, 512], decode_steps=[1, 8], dtype="float32", step_repeats=1
  )
  single, per_k = bench.step_times(args, model)
  assert set(single) == {(2, 260), (2, 512)} and set(per_k) == {(2, 512)}
  assert all(t > 0 for t in [*single.values(), *per_k.values()])
  assert "at kv 260 a 8-step call ran [4] steps" in capsys.readouterr().err


def test_op_profile_names_the_product_of_a_traced_program(tmp_path):
  """A program of one [256, 512] x [512, 384] product and a tanh, traced three times with its HLO
  dumped (a fresh process: the dump flag must be set before JAX starts): the product's row names
  its source and shape and counts three runs, and its time is within the traced span."""
  script = textwrap.dedent(
    f"""
    import jax, jax.numpy as jnp
    f = jax.jit(lambda x, w: jnp.tanh(x @ w) * 2.0)
    x, w = jnp.ones((256, 512)), jnp.ones((512, 384))
    f(x, w).block_until_ready()
    with jax.profiler.trace({str(tmp_path / "trace")!r}):
      for _ in range(3):
        f(x, w).block_until_ready()
    """
  )
  env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path / 'hlo'} --xla_dump_hlo_as_text")
  subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)
  profile = _load("op_profile")
  rows, span = profile.op_table(str(tmp_path / "trace"), str(tmp_path / "hlo"))
  products = [r for r in rows if "dot_general" in r["op"]]
  assert len(products) == 1, rows
  (row,) = products
  assert row["shape"] == "f32[256,384]" and row["count"] == 3
  assert not row["op"].startswith("jit("), row  # the program's prefix is stripped
  assert row["program"].startswith("jit_") and 0 < row["ms"] <= span
  table = profile.render(rows, span, per=3)
  assert "dot_general" in table and "ms per 1/3" in table
  with pytest.raises(FileNotFoundError, match="no \\*.trace.json.gz"):
    profile.op_table(str(tmp_path / "hlo"))
