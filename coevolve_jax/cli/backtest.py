"""Backtest an intervention on a run's logged rollouts (`coevolve_jax.backtest`), without training.

    python -m coevolve_jax.cli.backtest --workdir=runs/bfcl_cpu \\
        --set='train.drop_from_loss=["context", "max_model_steps"]' \\
        --set=signals.success_threshold=0.9

The run must have logged its rollouts (`--config.diagnostics.rollout_log=True`). Each `--set`
is `field=JSON` (a dotted config field the backtest can replay, `backtest.REPLAYABLE`; lists for
tuples). Prints the baseline's and the intervention's figures side by side (episodes and
successes in the loss, dead groups, rank-order violations, signal events, feedback rounds) and
what changed pairwise (dead groups revived, successes filtered); `--json=PATH` also writes them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from absl import flags

from coevolve_jax import backtest, flag_errors
from coevolve_jax.cli import fail
from coevolve_jax.metrics import write_atomic


def _define_flags() -> None:
  """Command-line flags (defined only when run as a script, so importing defines none)."""
  flags.DEFINE_string("workdir", None, "The run's workdir (config.json and rollouts.jsonl).")
  flags.DEFINE_multi_string("set", [], "An override field=JSON; repeat for several.")
  flags.DEFINE_string("json", "", "Also write the report as JSON to this file.")
  flags.mark_flag_as_required("workdir")


def parse_sets(sets: Sequence[str]) -> dict[str, object]:
  """`field=JSON` strings -> {field: value} (a bare word that is not JSON is taken as a str).

  Raises:
    ValueError: an item without "=", or a field given twice.
  """
  out: dict[str, object] = {}
  for item in sets:
    key, eq, text = item.partition("=")
    if not eq or not key.strip():
      raise ValueError(f"--set {item!r}: want field=JSON, e.g. signals.success_threshold=0.9")
    key = key.strip()
    if key in out:
      raise ValueError(f"--set names {key} twice")
    try:
      out[key] = json.loads(text)
    except ValueError:
      out[key] = text
  return out


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    fail(f"unexpected arguments: {argv[1:]}")
  F = flags.FLAGS  # noqa: N806
  try:
    overrides = parse_sets(F.set)
    if not overrides:
      raise ValueError("give the intervention with at least one --set field=JSON")
    if not os.path.isdir(F.workdir):
      raise ValueError(f"--workdir {F.workdir}: not a folder")
    if F.json and (os.path.isdir(F.json) or not os.path.isdir(os.path.dirname(F.json) or ".")):
      raise ValueError(f"--json {F.json}: not a file in an existing folder")
    report = backtest.backtest(F.workdir, overrides)
    print(report.table())
    if F.json:
      write_atomic(F.json, json.dumps(report.to_dict(), indent=1, sort_keys=True))
  except (ValueError, OSError) as e:
    fail(str(e))


if __name__ == "__main__":
  # No accelerator is needed: JAX (which the config checks import) starts on the CPU, quietly.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  _define_flags()
  flag_errors.run(main)
