"""Flag and config-file mistakes of the command lines (`coevolve_jax.main` and the tools of
`coevolve_jax.cli` and `envs`) as one `error:` line with exit status 2, not absl's usage text,
a traceback or exit 1. Imports absl and the standard library only (`--help` stays fast)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from absl import app, flags
from absl import logging as absl_logging


def one_line(error: BaseException) -> str:
  """A flag or config-file error as one line: the last line of a message that carries a
  traceback or the loader's attempts (ml_collections wraps a config file's exception so)."""
  text = error.args[0] if error.args and isinstance(error.args[0], str) else str(error)
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  if len(lines) > 1 and ("Traceback (most recent call last):" in text or "Attempted" in text):
    return f"{lines[0]} {lines[-1]}"
  return " ".join(lines)


def config_error(error: BaseException, argv: list[str]) -> str:
  """The message of a config file that does not load or of an override it refuses: an unknown
  field names the override it came from, with ConfigDict's suggestion; a syntax error its file
  and line; a file that is not there its path; any other exception of the file's own code its
  type and message."""
  while error.args and isinstance(error.args[0], BaseException):  # AttributeError(KeyError(..))
    error = error.args[0]
  if isinstance(error, SyntaxError):
    return f"--config: syntax error in {error.filename}, line {error.lineno}: {error.msg}"
  if isinstance(error, KeyError):
    key, _, hint = str(error.args[0]).partition("\n")  # "'stepz'", 'Did you mean "steps" ...?'
    field = key.strip("'")
    flag = next(
      (a.split("=")[0] for a in argv if re.search(rf"\.{re.escape(field)}(=|$)", a)), None
    )
    if flag is not None:
      return f"{flag}: unknown field {key}" + (f". {hint.strip()}" if hint.strip() else "")
  if isinstance(error, OSError) and "Attempted" in str(error):  # the loader's attempts: the last
    return f"--config: {[x for x in str(error).splitlines() if x.strip()][-1].strip()}"
  if isinstance(error, (ValueError, TypeError, AttributeError, OSError)):  # an override, a variant
    return f"--config: {one_line(error)}"
  text = repr(error.args[0]) if isinstance(error, KeyError) and error.args else one_line(error)
  return f"--config: the config file raised {type(error).__name__}: {text}"


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (`app.run(..., flags_parser=parse_flags)`), with every mistake
  (unknown or typo'd field, wrong type, a value out of bounds, missing config file, unknown
  variant, a config file that raises, a missing required flag) one `error:` line and exit
  status 2 instead of a traceback or absl's exit 1. A `--config` flag of ml_collections'
  `config_flags` is loaded here (its file runs and the overrides apply at first use)."""
  try:
    rest = flags.FLAGS(argv)
    if "config" in flags.FLAGS:
      value: Any = flags.FLAGS["config"].value
      if hasattr(value, "get"):  # a ConfigDict (not a plain string flag): load it now
        value.get("env")
  except flags.Error as e:
    print(f"error: {one_line(e)}", file=sys.stderr)
    sys.exit(2)
  except Exception as e:  # noqa: BLE001  (the config file runs code of its own)
    print(f"error: {config_error(e, argv)}", file=sys.stderr)
    sys.exit(2)
  return rest


def run(main: Callable[[Sequence[str]], int | None]) -> NoReturn:
  """absl's `app.run(main)` with `parse_flags`, and an `app.UsageError` that `main` raises also
  one `error:` line with exit status 2; `main`'s return value is the exit status (None: 0).
  Logs below WARNING are off unless `-v`/`--verbosity` is given."""

  def body(argv: Sequence[str]) -> NoReturn:
    if not flags.FLAGS["verbosity"].present:  # JAX's INFO lines (no TPU, ...): with -v 0 only
      absl_logging.set_verbosity(absl_logging.WARNING)
    try:
      code = main(argv)
    except app.UsageError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    sys.exit(code or 0)

  app.run(body, flags_parser=parse_flags)
  raise AssertionError("app.run returned")  # it exits
