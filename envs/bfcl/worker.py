"""A worker process that runs BFCL backend calls under resource limits (started by
`envs.bfcl.backends`; not imported by the parent).

    python -m envs.bfcl.worker FD_IN FD_OUT MEMORY_MIB

At start the process limits its own address space to MEMORY_MIB MiB (RLIMIT_AS) and turns off core
files, imports bfcl-eval and the eight multi-turn backends, and answers ("ready", pid) on FD_OUT.
It then serves one request at a time from FD_IN, each `(op, args, deadline_s)` pickled by
`multiprocessing.connection.Connection`, and answers one of

    ("ok", value)       the request's result
    ("error", text)     an unexpected failure of the request (the process goes on)
    ("memory", "")      the request ran out of memory; the process exits right after

Before each request the soft CPU-time limit (RLIMIT_CPU) is set to the CPU seconds used so far plus
the request's deadline plus one, so even code that never returns to the interpreter (a C-level
big-number loop) is ended by the kernel (SIGXCPU) should the parent not kill the process first:
the parent enforces the wall-clock deadline itself and kills and replaces a worker that misses it.

Requests (the backend instances of a session live in this process from "open" to "close"):

    open(name, task, calls)   forget `name`'s instances, remember `task`, run `calls` (a replay),
                              return their results
    exec(name, call)          run one call on `name`'s instances, return its result
    state(name, kind)         "public" (what the checker compares) or "full" instance state
    close(name)               delete `name`'s instances, return how many
    keys(prefix)              cached instance names (all when prefix is "")
    score(task, calls, name)  the official checker (`execution.check_calls`)

A MemoryError inside a backend call is normally turned into an "Error during execution" result by
BFCL's executor; here `eval` in BFCL's executor module is wrapped so that it escapes as
`MemoryBoundExceeded` instead, and the whole request is answered "memory" (the parent reports the
call as stopped at the memory bound and replaces the process, whose state may be inconsistent).
"""

from __future__ import annotations

import builtins
import importlib
import math
import os
import resource
import sys
from multiprocessing.connection import Connection
from typing import Any

# The eight multi-turn backends; imported at start so that the first call of each class costs the
# same as any other (the web-search and memory backends need packages the offline install lacks).
BACKENDS = (
  "GorillaFileSystem",
  "MathAPI",
  "MessageAPI",
  "TicketAPI",
  "TradingBot",
  "TravelAPI",
  "TwitterAPI",
  "VehicleControlAPI",
)


class MemoryBoundExceeded(BaseException):
  """A backend call ran out of memory (a BaseException, so BFCL's `except Exception` lets it
  through)."""


def limit_memory(mib: int) -> None:
  """Caps this process's address space at `mib` MiB and disables core files."""
  limit = int(mib) * 2**20
  resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def arm_cpu_limit(deadline_s: float) -> None:
  """Sets the soft CPU-time limit to the CPU seconds used so far + `deadline_s` + 1."""
  usage = resource.getrusage(resource.RUSAGE_SELF)
  soft = math.ceil(usage.ru_utime + usage.ru_stime + deadline_s) + 1
  hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
  if hard != resource.RLIM_INFINITY:
    soft = min(soft, hard)
  resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


class Worker:
  """The requests this process serves (methods `op_<name>`); see the module docstring."""

  def __init__(self) -> None:
    from envs.bfcl import execution  # noqa: PLC0415 (after the memory limit is set)

    self.execution = execution
    utils = execution.import_bfcl(execution._UTILS)
    namespace = vars(utils)

    def guarded_eval(source: str, globals_: Any = None, locals_: Any = None) -> Any:
      # BFCL calls `eval(call)` in a function of `utils` whose names it reads are module globals
      # (the instances) and literals; with the module's globals the result is the same.
      try:
        return builtins.eval(source, namespace if globals_ is None else globals_, locals_)
      except MemoryError:
        raise MemoryBoundExceeded() from None

    utils.eval = guarded_eval  # found before the builtin by BFCL's `eval(func_call)`
    config = execution.import_bfcl("bfcl_eval.constants.executable_backend_config")
    for name in BACKENDS:
      importlib.import_module(config.CLASS_FILE_PATH_MAPPING[name])
    self.tasks: dict[str, Any] = {}  # session name -> its Task

  def op_open(self, name: str, task: Any, calls: list[str]) -> list[str]:
    self.execution.cleanup(name)
    self.tasks[name] = task
    return self.execution.execute_calls(calls, task, name)[0]

  def _task(self, name: str) -> Any:
    try:
      return self.tasks[name]
    except KeyError:
      raise LookupError(f"no open session {name!r} in worker {os.getpid()}") from None

  def op_exec(self, name: str, call: str) -> str:
    return self.execution.execute_calls([call], self._task(name), name)[0][0]

  def op_state(self, name: str, kind: str) -> dict[str, dict[str, Any]]:
    instances = self.execution.execute_calls([], self._task(name), name)[1]
    if kind == "public":
      return self.execution.instance_state(instances)
    if kind == "full":
      return self.execution.full_state(instances)
    raise ValueError(f"state kind must be 'public' or 'full', got {kind!r}")

  def op_close(self, name: str) -> int:
    self.tasks.pop(name, None)
    return self.execution.cleanup(name)

  def op_keys(self, prefix: str) -> list[str]:
    if prefix:
      return self.execution.cached_keys(prefix)
    return self.execution.all_cached_keys()

  def op_score(self, task: Any, calls: list[list[list[str]]], name: str) -> tuple[float, dict]:
    return self.execution.check_calls(task, calls, name)


def serve(rx: Connection, tx: Connection, memory_mib: int) -> int:
  """Start-up, then the request loop; returns the exit status (0: the parent said quit or went
  away; 1: start-up failed; 3: a request ran out of memory)."""
  try:
    worker = Worker()
  except BaseException as e:  # noqa: BLE001 (reported to the parent, which raises it)
    tx.send(("error", f"start-up failed under {memory_mib} MiB: {type(e).__name__}: {e}"))
    return 1
  tx.send(("ready", os.getpid()))
  while True:
    try:
      op, args, deadline_s = rx.recv()
    except EOFError:
      return 0
    if op == "quit":
      return 0
    arm_cpu_limit(deadline_s)
    try:
      reply: tuple[str, Any] = ("ok", getattr(worker, "op_" + op)(*args))
    except (MemoryError, MemoryBoundExceeded):
      reply = ("memory", "")
    except Exception as e:  # noqa: BLE001 (the parent raises it as BackendError)
      reply = ("error", f"{op}: {type(e).__name__}: {e}")
    try:
      tx.send(reply)
    except MemoryError:  # the answer itself does not fit
      reply = ("memory", "")
      tx.send(reply)
    if reply[0] == "memory":
      return 3


def main(argv: list[str]) -> int:
  fd_in, fd_out, memory_mib = (int(a) for a in argv[1:4])
  limit_memory(memory_mib)
  rx = Connection(fd_in, writable=False)
  tx = Connection(fd_out, readable=False)
  return serve(rx, tx, memory_mib)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
