"""Entry point: `python -m coevolve_jax.main --config=configs/bfcl.py:cpu --workdir=runs/bfcl-cpu`.

Rerunning the same command resumes from the last checkpoint; after completion it reports that the
run is complete and exits 0. A run that cannot go on (RunError, e.g. a full disk: DiskFullError)
prints one line, `error: ...`, and exits 2. Ctrl-C or SIGTERM (a preemption, `docker stop`, a job
scheduler) stops the run: the checkpoint save in flight is finished, the logs are closed, and the
process exits at once (130 for SIGINT, 143 for SIGTERM) without waiting for work that a resume
redoes (a feedback round in flight, environment steps, compiles); a second signal exits without
waiting for the checkpoint.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import re
import signal
import sys
import tempfile
import threading
from typing import NoReturn

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from coevolve_jax import errors
from coevolve_jax.flag_errors import parse_flags

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


_STOP_SIGNALS = ("SIGINT", "SIGTERM")
_EXIT_HANDLERS_S = 3.0  # at most this long for the exit handlers after an interrupt


def stop_on_signals() -> None:
  """SIGINT and SIGTERM raise KeyboardInterrupt (args: the signal's name) in the main thread, so
  the run closes its checkpointer and logs on the way out (`CoEvolveRun.fit`); a second one exits
  at once (status 128 + signal), without waiting for the checkpoint in flight. For every command
  that runs `CoEvolveRun.fit` (this one, scripts/ablations.py); see `exit_interrupted`."""
  if threading.current_thread() is not threading.main_thread():
    return  # signal handlers can only be set from the main thread (main() called by a test)
  received: list[str] = []

  def handler(signum: int, frame: object) -> None:
    del frame
    name = signal.Signals(signum).name
    if received:
      print(f"\n{name} again: exiting now, without waiting for the checkpoint", file=sys.stderr)
      sys.stderr.flush()
      os._exit(128 + signum)
    received.append(name)
    raise KeyboardInterrupt(name)

  for name in _STOP_SIGNALS:
    signal.signal(signal.Signals[name], handler)


def exit_interrupted(error: KeyboardInterrupt, resume: str) -> NoReturn:
  """After `stop_on_signals`' KeyboardInterrupt reached the command's top (the run's checkpoint
  and logs closed): the `resume` advice on stderr, then `_exit_now` with status 128 + the signal
  (130 for SIGINT, 143 for SIGTERM; 130 for a KeyboardInterrupt of no signal)."""
  name = error.args[0] if error.args else None
  code = 128 + (signal.Signals[name] if name in _STOP_SIGNALS else signal.SIGINT)
  print(f"\ninterrupted; {resume}", file=sys.stderr)
  _exit_now(code)


def _exit_now(code: int) -> NoReturn:
  """Exits with `code` once the run has closed what it must (checkpoint, logs): the interpreter's
  exit handlers run (BFCL workers and AppWorld servers stopped, JAX shut down), then the process
  ends without joining threads still busy with work a resume redoes (a feedback round's LLM and
  environment calls, environment steps, XLA compiles), which Python would otherwise wait for
  (tens of seconds to minutes). Never returns."""
  for stream in (sys.stdout, sys.stderr):
    stream.flush()
  # Exit handlers that hang (a JAX multi-host shutdown waiting for the other processes, a server
  # that ignores SIGTERM) get _EXIT_HANDLERS_S; the children end anyway (BFCL workers read EOF,
  # AppWorld servers get SIGTERM from the kernel when this process is gone).
  watchdog = threading.Timer(_EXIT_HANDLERS_S, os._exit, (code,))
  watchdog.daemon = True
  watchdog.start()
  atexit._run_exitfuncs()
  logging.shutdown()
  os._exit(code)


def main(argv: list[str]) -> int:
  del argv
  stop_on_signals()
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
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    print(f"error: cannot use --workdir={workdir}: it is a file, not a folder", file=sys.stderr)
    return 2
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
  except KeyboardInterrupt as e:
    exit_interrupted(
      e, f"rerun the same command to resume from the last checkpoint in {workdir}/checkpoints"
    )
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


_CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
_HELP_ARGS = ("-h", "--help", "--helpshort", "-?")


def _help() -> str:
  """The `--help` text: what the command does, its flags, and the shipped configs with their
  variants (each config file's `VARIANTS`)."""
  lines = [__doc__.strip(), "", "Flags:"]
  lines += [
    "  --config=configs/NAME.py[:VARIANT]  the run's config (required)",
    "  --config.GROUP.FIELD=VALUE          override one field, e.g. --config.train.steps=20",
    "  --workdir=DIR                       checkpoints, logs and summary (required)",
    "  --helpfull                          every flag, absl's included",
    "",
    "Configs (configs/NAME.py is full scale; :VARIANT as listed):",
  ]
  for name in sorted(os.listdir(_CONFIGS_DIR)) if os.path.isdir(_CONFIGS_DIR) else []:
    if not name.endswith(".py"):
      continue
    path = os.path.join(_CONFIGS_DIR, name)
    spec = importlib.util.spec_from_file_location(f"coevolve_help_{name[:-3]}", path)
    if spec is None or spec.loader is None:
      continue
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "VARIANTS"):  # configs/base.py (shared groups) has none
      first = re.split(r"[.:]\s", " ".join((module.__doc__ or "").split()), maxsplit=1)[0]
      variants = ", ".join(f":{v}" for v in module.VARIANTS)
      lines.append(f"  configs/{name}  {first}  (variants {variants})")
  return "\n".join(lines)


def run() -> None:
  argv = sys.argv[1:]
  if any(a in _HELP_ARGS for a in argv):
    print(_help())
    sys.exit(0)
  if errors_ := _moved_overrides(argv):
    print("\n".join(errors_), file=sys.stderr)
    sys.exit(2)
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  run()
