"""Throughput benchmark of the rollout engine and the GRPO step, and a cross-machine comparison.

    python -m coevolve_jax.cli.bench --config=configs/bfcl.py:cpu \
        --out=docs/benchmarks/bench/cpu.json
    python -m coevolve_jax.cli.bench compare A.json B.json ... \
        --report=docs/benchmarks/bench/report.md

`bench` runs on whatever backend JAX finds (CPU, GPU, TPU; all local devices) with the config's
model preset, dtype and mesh, random weights and random token ids, and prints a table of
rollout and GRPO-step tokens/s, MFU and per-device memory (`--out`: the JSON record).
`compare` writes a markdown table (and a PNG plot beside it) of tokens/s per chip and tokens per
dollar, with the on-demand prices of coevolve_jax/accelerators.py and their date.

What is measured and how (model FLOPs, MFU, memory): `coevolve_jax.benchmark`, which this
command line only drives.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from absl import app, flags
from ml_collections import config_flags

from coevolve_jax import accelerators, benchmark, compiling, flag_errors


def _compare_main(paths: Sequence[str], report: str = "") -> int:
  records, labels = [], []
  for path in paths:
    try:
      with open(path) as f:
        records.append(json.load(f))
    except (OSError, json.JSONDecodeError) as e:
      print(f"error: cannot read {path}: {e}", file=sys.stderr)
      return 2
    labels.append(os.path.splitext(os.path.basename(path))[0])
  try:
    text, rows = benchmark.compare(records, labels, accelerators)
  except (ValueError, KeyError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(text)
  if report:
    png = os.path.splitext(report)[0] + ".png"
    benchmark.plot(rows, png)
    with open(report, "w") as f:
      f.write(
        f"# Throughput comparison\n\n{text}\n![tokens per chip and per dollar]"
        f"({os.path.basename(png)})\n"
      )
    print(f"wrote {report} and {png}")
  return 0


def _define_flags() -> None:
  """Command-line flags (defined only when run as a script, so importing defines none)."""
  config_flags.DEFINE_config_file("config", None, "Config file (path[:variant]).")
  flags.DEFINE_string("out", "", "Write the measurements to this JSON file.")
  flags.DEFINE_integer("repeats", 3, "Timed repetitions (medians are reported).")
  flags.DEFINE_integer("prompt_len", 512, "Prompt tokens prefilled per slot.")
  flags.DEFINE_integer("gen_len", 64, "Decode steps (tokens per slot).")
  flags.DEFINE_integer("train_rows", 8, "Sequences per GRPO update.")
  flags.DEFINE_integer("train_seq", 1024, "Tokens per training sequence.")
  flags.DEFINE_integer("matmul_n", 2048, "Size of the reference matmul.")
  flags.DEFINE_string(
    "chip", "", "Chip name of coevolve_jax/accelerators.py (default: from the device kind)."
  )
  flags.DEFINE_string("report", "", "compare: markdown file to write (and .png beside).")


def main(argv: Sequence[str]) -> int:
  if len(argv) > 1 and argv[1] == "compare":
    return _compare_main(argv[2:], flags.FLAGS.report)
  F = flags.FLAGS  # noqa: N806
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; did you mean `compare`?")
  if F.config is None:
    raise app.UsageError("--config is required (e.g. --config=configs/bfcl.py:cpu)")
  if F.out:  # before minutes of measuring, not after
    folder = os.path.dirname(os.path.abspath(F.out))
    try:
      os.makedirs(folder, exist_ok=True)
    except OSError as e:
      raise app.UsageError(f"--out={F.out}: cannot make its folder {folder}: {e}") from None
    if os.path.isdir(F.out) or not os.access(folder, os.W_OK):
      raise app.UsageError(f"--out={F.out}: not a file this process can write")
  compiling.enable_cache(F.config.compile.cache_dir)  # warm-up passes load, timed ones run
  try:
    rec = benchmark.run_bench(
      F.config,
      prompt_len=F.prompt_len,
      gen_len=F.gen_len,
      rows=F.train_rows,
      seq=F.train_seq,
      repeats=F.repeats,
      matmul_n=F.matmul_n,
      chip=F.chip,
    )
  except (ValueError, KeyError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(benchmark.format_record(rec))
  if F.out:
    with open(F.out, "w") as f:
      json.dump(rec, f, indent=1, sort_keys=True)
    print(f"wrote {F.out}")
  return 0


if __name__ == "__main__":
  _define_flags()
  flag_errors.run(main)
