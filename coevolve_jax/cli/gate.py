"""The promotion gate over training branches (`coevolve_jax.gate`).

    python -m coevolve_jax.cli.gate --source=runs/bfcl_cpu --steps=2 --out=runs/gate \\
        --candidate='{"name": "drop_dead", "overrides": {"train.drop_dead_groups": true},
                      "target": "dead_groups", "better": "lower"}'

`--source` (repeat it, one run folder per seed) names finished or stopped runs with a checkpoint
and a generated held-out set (`eval.generated_tasks > 0`: the selection split); `--candidate`
(repeat it) is a JSON object, or `@file.json` holding a list of them. `--config` names the
sources' config file (as `coevolve_jax.main` takes it), whose defaults fill what the runs'
config.json lacks (fields added since they started); without it, configs/base.py's do. Every
branch trains `--steps` GRPO steps from the source's newest checkpoint in `<out>/<name>-<i>`;
the same command again resumes a killed gate. Prints each candidate's decision and writes
`<out>/gate.json` and the skill records (`--skills`, default `<out>/skills.jsonl`).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Sequence

from absl import flags

from coevolve_jax import flag_errors, gate
from coevolve_jax.cli import fail


def _define_flags() -> None:
  """Command-line flags (defined only when run as a script, so importing defines none)."""
  flags.DEFINE_multi_string("source", [], "A run folder to branch from (one per seed).")
  flags.DEFINE_multi_string("candidate", [], "A candidate as JSON, or @file with a JSON list.")
  flags.DEFINE_integer("steps", 2, "GRPO steps per branch.")
  flags.DEFINE_string("out", None, "The gate's folder (branches, gate.json, skills.jsonl).")
  flags.DEFINE_float("tolerance", 0.0, "Allowed fall of the mean selection score.")
  flags.DEFINE_string("skills", "", "The skills file to write to (default <out>/skills.jsonl).")
  flags.DEFINE_string(
    "config",
    "",
    "The sources' config file, as main takes it (e.g. configs/bfcl.py:cpu_real): their "
    "config.json is laid over it, so fields newer than the runs take its defaults (default: "
    "configs/base.py's shared groups).",
  )
  flags.mark_flag_as_required("out")


def parse_candidates(items: Sequence[str]) -> list[gate.Candidate]:
  """`--candidate` values -> Candidates.

  Raises:
    ValueError: JSON that does not parse or a candidate `Candidate.from_dict` refuses.
    OSError: an @file that cannot be read.
  """
  out = []
  for item in items:
    if item.startswith("@"):
      with open(item[1:], encoding="utf-8") as f:
        text = f.read()
    else:
      text = item
    try:
      value = json.loads(text)
    except ValueError as e:
      raise ValueError(f"--candidate {item[:60]!r}: not JSON ({e})") from None
    for d in value if isinstance(value, list) else [value]:
      if not isinstance(d, dict):
        raise ValueError(f"--candidate {item[:60]!r}: want a JSON object or a list of them")
      out.append(gate.Candidate.from_dict(d))
  return out


# The shared groups' defaults (configs/base.py of this checkout): what a source's config.json is
# laid over without --config, so fields newer than the run take their defaults.
BASE_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "configs", "base.py")


def load_config_file(spec: str):
  """`path/to/config.py[:variant]` -> its `get_config(variant)` (as `--config=` of main).

  Raises:
    OSError: no such file. ImportError, ValueError: what loading it raises.
  """
  path, _, variant = spec.partition(":")
  if not os.path.isfile(path):
    raise OSError(f"--config: no config file {path!r}")
  module_spec = importlib.util.spec_from_file_location("gate_run_config", path)
  assert module_spec is not None and module_spec.loader is not None
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  try:
    return module.get_config(variant) if variant else module.get_config()
  except TypeError as e:  # a variant given to a file without variants, or the reverse
    raise ValueError(f"--config {spec}: {e}") from None


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    fail(f"unexpected arguments: {argv[1:]}")
  F = flags.FLAGS  # noqa: N806
  try:
    candidates = parse_candidates(F.candidate)
    defaults = (
      load_config_file(F.config or BASE_CONFIG) if F.config or os.path.isfile(BASE_CONFIG) else None
    )
    record = gate.run_gate(
      F.source,
      candidates,
      F.steps,
      F.out,
      tolerance=F.tolerance,
      skills=F.skills,
      defaults=defaults,
    )
  except (ValueError, OSError, RuntimeError, ImportError) as e:
    fail(str(e))
  for d in record["decisions"]:
    print(f"{d['candidate']}: {d['reason']}")


if __name__ == "__main__":
  _define_flags()
  flag_errors.run(main)
