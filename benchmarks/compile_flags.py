"""The XLA:CPU flags the test suite compiles with (tests/conftest.py), against the default build:
compile seconds and execution of the tests' tiny model, in fresh processes, as `make test`'s two
pytest-xdist workers run them (two at once on a 2-core machine).

    .venv/bin/python benchmarks/compile_flags.py [--rounds=3] [--workers=2]

Each child process builds the tests' tiny Qwen (`tests/kit.py`'s `tiny_model()`: vocabulary 512,
hidden 64, 2 layers, 4 query / 2 KV heads of 16, float32), jits its summed log-softmax and the
gradient of that, and lowers and compiles both at T = 8, 16, ..., 48 (batch 2): twelve compiles,
timed together. Then it runs the T = 48 gradient 20 times (milliseconds per call). A round starts
`--workers` children at once for each setting in turn (the settings alternate within a round, so a
machine that speeds up or slows down through the run affects each alike); the table gives the
median over rounds and children, and each setting's ratio to the default build's figure of the same
run. The machine's speed varies from hour to hour (docs/testing.md): read the ratios.
Prints a markdown table and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from common import machine, markdown_table

# (name, XLA_FLAGS); each row adds to the one before, the last is what tests/conftest.py sets.
SETTINGS = (
  ("default", ""),
  ("-O0", "--xla_backend_optimization_level=0"),
  (
    "-O0, earlier fusion emitters",
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false",
  ),
  (
    "-O0, earlier emitters, one LLVM module (the tests')",
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
    "--xla_cpu_parallel_codegen_split_count=1",
  ),
)
LENGTHS = (8, 16, 24, 32, 40, 48)
CALLS = 20


def child() -> None:
  """Prints {"compile_s": ..., "exec_ms": ...} as one JSON line."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
  import kit  # noqa: PLC0415  (the tests' tiny model, so this measures what the tests compile)

  graphdef, state = nnx.split(kit.tiny_model())

  def logp_sum(state, ids):
    out = nnx.merge(graphdef, state)(ids)
    logits = out[0] if isinstance(out, tuple) else out
    return jnp.sum(jax.nn.log_softmax(logits.astype(jnp.float32)))

  grad = jax.jit(jax.value_and_grad(logp_sum))
  forward = jax.jit(logp_sum)
  start = time.perf_counter()
  for t in LENGTHS:
    ids = jnp.zeros((2, t), jnp.int32)
    grad.lower(state, ids).compile()
    forward.lower(state, ids).compile()
  compile_s = time.perf_counter() - start
  ids = jnp.zeros((2, LENGTHS[-1]), jnp.int32)
  step = grad.lower(state, ids).compile()
  jax.block_until_ready(step(state, ids))
  start = time.perf_counter()
  for _ in range(CALLS):
    jax.block_until_ready(step(state, ids))
  exec_ms = (time.perf_counter() - start) / CALLS * 1e3
  print(json.dumps({"compile_s": compile_s, "exec_ms": exec_ms}))


def run_setting(flags: str, workers: int) -> list[dict[str, float]]:
  """`workers` children at once with XLA_FLAGS=`flags`; their figures."""
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  here = os.path.dirname(os.path.abspath(__file__))
  env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), env.get("PYTHONPATH", "")])
  procs = [
    subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), "--child"],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for _ in range(workers)
  ]
  figures = []
  for proc in procs:
    out, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
      raise SystemExit(f"child with XLA_FLAGS={flags!r} failed:\n{err[-2000:]}")
    figures.append(json.loads(out.strip().splitlines()[-1]))
  return figures


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--workers", type=int, default=2, help="children at once (make test: 2)")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    child()
    return
  results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in SETTINGS}
  for r in range(args.rounds):
    for name, flags in SETTINGS:
      results[name] += run_setting(flags, args.workers)
      print(f"round {r + 1}/{args.rounds}: {name} done", file=sys.stderr, flush=True)
  med = {
    name: {k: statistics.median(f[k] for f in figs) for k in ("compile_s", "exec_ms")}
    for name, figs in results.items()
  }
  base = med["default"]
  rows = [["XLA_FLAGS", "compile s (12 programs)", "x default", "grad call ms", "x default"]]
  for name, _ in SETTINGS:
    m = med[name]
    rows.append(
      [
        name,
        f"{m['compile_s']:.2f}",
        f"{m['compile_s'] / base['compile_s']:.2f}",
        f"{m['exec_ms']:.2f}",
        f"{m['exec_ms'] / base['exec_ms']:.2f}",
      ]
    )
  print(markdown_table(rows))
  print(
    f"\nmedian of {args.rounds} rounds x {args.workers} children at once; {machine()}; "
    f"flags: {dict(SETTINGS)}"
  )


if __name__ == "__main__":
  main()
