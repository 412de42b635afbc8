"""Entry point: `python -m coevolve_jax.main --config=configs/bfcl.py:cpu --workdir=runs/bfcl-cpu`.

Rerunning the same command resumes from the last checkpoint; after completion it reports that the
run is complete and exits 0. A run that cannot go on (RunError, e.g. a full disk: DiskFullError)
prints one line, `error: ...`, and exits 2.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from coevolve_jax import errors

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Config file (path[:variant]).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and summary.")
flags.mark_flags_as_required(["config", "workdir"])


class _AfterDiskFull(logging.Filter):
  """Drops what orbax logs (on absl's logger) from its first report of a write that failed for a
  full disk on: its threads report that one failure several times over, with tracebacks, and the
  run stops with DiskFullError, which `main` prints as one line."""

  def __init__(self):
    super().__init__()
    self.disk_full = False

  def filter(self, record: logging.LogRecord) -> bool:
    if record.exc_info and errors.disk_full_errno(record.exc_info[1]) is not None:
      self.disk_full = True
    return not self.disk_full


def main(argv: list[str]) -> int:
  del argv
  if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO; -v 0 shows them
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("absl").addFilter(_AfterDiskFull())  # -v shows those reports too
  cfg = _CONFIG.value
  from coevolve_jax import config, suite  # noqa: PLC0415 (keep --help fast)

  try:  # the whole config, then the suite's set-up: at once, before minutes of set-up
    config.validate(cfg)
  except ValueError as e:
    print(f"error: invalid config: {e}", file=sys.stderr)
    return 2
  try:
    suite.check_setup(cfg)
  except suite.SuiteUnavailable as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  workdir = _WORKDIR.value
  assert workdir is not None  # a required flag: absl stops before main without it
  try:  # fail before minutes of set-up, not after
    os.makedirs(workdir, exist_ok=True)
    with tempfile.TemporaryFile(dir=workdir):
      pass
  except OSError as e:
    print(f"error: cannot use --workdir={workdir}: {e}", file=sys.stderr)
    return 2
  from coevolve_jax import distributed  # noqa: PLC0415 (imports JAX; keep --help fast)

  try:  # several hosts (TPU pod slice, Vertex AI replicas, GPU cluster): before any computation
    distributed.initialize_from_env()
    distributed.check_shared_dir(workdir)
  except (ValueError, RuntimeError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  from coevolve_jax.loop import CoEvolveRun, RunError  # noqa: PLC0415 (imports JAX; keep --help fast)

  try:
    summary = CoEvolveRun(cfg, workdir).fit()
  except (RunError, distributed.PrimaryFailed) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(
      f"\ninterrupted; rerun the same command to resume from the last checkpoint in "
      f"{workdir}/checkpoints",
      file=sys.stderr,
    )
    return 130
  print(json.dumps(summary, indent=1, sort_keys=True))
  return 0


def _moved_overrides(argv: list[str]) -> list[str]:
  """One error line per `--config.<field>` override of a field that moved (the config's
  `MOVED`), before absl's flag parser reports it as an unknown field with a traceback."""
  fields = [a[len("--config.") :].split("=", 1)[0] for a in argv if a.startswith("--config.")]
  if not fields:
    return []
  from coevolve_jax import config  # noqa: PLC0415 (imports JAX: only with overrides)

  return [f"error: --config.{f}: {err}" for f in fields if (err := config.moved_error(f))]


def run() -> None:
  if errors_ := _moved_overrides(sys.argv[1:]):
    print("\n".join(errors_), file=sys.stderr)
    sys.exit(2)
  app.run(main)


if __name__ == "__main__":
  run()
