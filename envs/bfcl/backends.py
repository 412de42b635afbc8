"""BFCL backend calls in a small pool of worker processes, each call under a wall-time and memory
bound (docs/design.md §3, "Bounded execution").

The backends are plain Python, and some of their calls never finish or eat all memory for literal
arguments a model may well write (`MathAPI.power(base=10, exponent=10**12)`, `square_root(number=2,
precision=10**9)`, `logarithm(value=2, base=10, precision=10**9)`). Such a call cannot be
interrupted inside the process that runs it (it never returns to the interpreter), so every call,
from episodes (`envs.bfcl.env`), explorer and validation sandboxes (`envs.bfcl.sandbox`) and the
official checker (`score_calls`), runs here:

- `BackendPool` keeps `Bounds.workers` long-lived worker processes (`envs/bfcl/worker.py`, started
  with `subprocess`: a fresh interpreter that imports neither JAX nor the run's main module, so
  nothing is forked from the parent). Each worker limits its own address space to
  `Bounds.worker_memory_mib` (RLIMIT_AS) and, per request, its CPU time (RLIMIT_CPU, a backstop
  that the kernel enforces should the parent be gone).
- The parent waits at most `Bounds.call_wall_s` for each call's answer. A call over the bound
  (time or memory), or whose worker dies, is *stopped*: its worker is killed, reaped and replaced,
  and the call returns an error observation (`CallOutcome.ran` False). A stopped call has no
  effect: it is not part of the episode's executed calls, so the checker does not replay it.
- A session (`BackendSession`: one episode or sandbox) keeps its backend instances in one worker
  for its whole life, so sessions are spread over the workers (the one with the fewest open
  sessions) and each worker serves its sessions one request at a time. A session remembers the
  calls it executed and a digest of each result. When its worker has been replaced (by a call of
  this or of any other session on it), its next request first rebuilds its instances in the new
  worker by replaying those calls from the initial state, which is what the official checker
  itself does; if the replay is stopped or any result differs, the session raises `BackendLost`
  and the episode ends with an error result (`BfclEnv`: reward 0, error type "env:backend_lost").
- The calls of one model reply (`BackendSession.execute(calls, budget_s)`; `BfclEnv` passes the
  config's `bfcl.reply_wall_s`) also share one wall-clock budget: once they have spent it, the
  reply's remaining calls are not started and each gets `budget_observation` (`ran` False), so a
  reply of many slow calls cannot hold its batch for many times `call_wall_s`.

`default_pool()` is the process-wide pool that everything uses unless given another;
`configure(bounds)` sets its bounds (the suite and `make_episode` call it with the run config's
`backends` group). Pools close their workers on `close()` and at interpreter exit.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

from coevolve_jax.types import Task
from envs.bfcl.execution import new_model_name

STARTUP_TIMEOUT_S = 120.0  # a worker's start-up (imports) on a busy machine
QUIT_TIMEOUT_S = 5.0  # a worker's orderly exit at close() before it is killed
MIN_WORKER_MEMORY_MIB = 512  # a worker needs ~150 MiB of address space before any call


@dataclasses.dataclass(frozen=True)
class Bounds:
  """Limits of backend execution (the run config's `backends` group).

  Attributes:
    call_wall_s: wall-clock seconds one call may take in its worker, transfer included; a replay
      or checker run of n calls gets n + 1 times this.
    worker_memory_mib: address-space limit (RLIMIT_AS) of each worker process, in MiB; it covers
      the backend instances of every session the worker holds.
    workers: worker processes in the pool.

  Raises:
    ValueError: call_wall_s not a finite number > 0, worker_memory_mib not an int >=
      MIN_WORKER_MEMORY_MIB, or workers not an int >= 1.
  """

  call_wall_s: float = 10.0
  worker_memory_mib: int = 4096
  workers: int = 4

  def __post_init__(self):
    wall = self.call_wall_s
    if isinstance(wall, bool) or not isinstance(wall, (int, float)) or not math.isfinite(wall):
      raise ValueError(f"call_wall_s must be a finite number of seconds > 0, got {wall!r}")
    if wall <= 0:
      raise ValueError(f"call_wall_s must be a finite number of seconds > 0, got {wall!r}")
    for field, lo in (("worker_memory_mib", MIN_WORKER_MEMORY_MIB), ("workers", 1)):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{field} must be an int >= {lo}, got {value!r}")

  @classmethod
  def from_config(cls, backends: Mapping[str, Any]) -> "Bounds":
    """The bounds of a config's `backends` group (configs/bfcl.py). Raises ValueError as above."""
    return cls(
      call_wall_s=backends["call_wall_s"],
      worker_memory_mib=backends["worker_memory_mib"],
      workers=backends["workers"],
    )


class BackendError(RuntimeError):
  """A worker reported an unexpected failure of a request (a bug, not a bound)."""


class BackendUnavailable(BackendError):
  """No worker process could be started (the message says why), or the pool is closed."""


class BackendLost(BackendError):
  """A session's instances could not be rebuilt after its worker was replaced."""


class CallStopped(Exception):
  """A request went over a bound or lost its worker; the worker has been replaced.

  Attributes:
    reason: "time", "memory" or "crash".
    observation: the error text an episode shows for a call stopped this way.
  """

  def __init__(self, reason: str, observation: str):
    super().__init__(observation)
    self.reason, self.observation = reason, observation


class _WorkerGone(Exception):
  """The worker had already exited before a request was sent (it has been replaced)."""


@dataclasses.dataclass(frozen=True)
class CallOutcome:
  """One call's result text, and whether it ran (False: stopped at a bound, no effect)."""

  text: str
  ran: bool


def _observation(reason: str, bounds: Bounds, detail: str = "") -> str:
  if reason == "time":
    what = f"did not finish within {bounds.call_wall_s:g} s and was stopped"
  elif reason == "memory":
    what = f"needed more than {bounds.worker_memory_mib} MiB of memory and was stopped"
  else:
    what = f"was stopped because its backend process ended unexpectedly ({detail})"
  return f"Error during execution: the call {what}; it had no effect."


def _positive_seconds(value: Any) -> bool:
  """True for a finite number > 0 (not a bool)."""
  number = isinstance(value, (int, float)) and not isinstance(value, bool)
  return number and math.isfinite(value) and value > 0


def budget_observation(budget_s: float) -> str:
  """The error text for a call of a reply that was not run because the reply's calls had
  already spent their shared wall-clock budget of `budget_s` seconds."""
  return (
    f"Error during execution: the call was not run: this reply's calls had already spent their "
    f"shared time budget of {budget_s:g} s; it had no effect. Make fewer or quicker calls per "
    "reply."
  )


def _exit_text(code: int | None) -> str:
  if code is None:
    return "still running"
  if code < 0:
    try:
      return f"signal {signal.Signals(-code).name}"
    except ValueError:
      return f"signal {-code}"
  return f"exit status {code}"


def _digest(text: str) -> bytes:
  return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class _Worker:
  """One worker process slot of a pool: the process, its pipes, a lock, a generation count.

  `generation` grows by one every time a process is started in this slot; a session whose
  instances were created under an older generation must rebuild them. Callers hold `lock` around
  `request` (one request at a time per worker).
  """

  def __init__(self, pool: "BackendPool", index: int):
    self.pool, self.index = pool, index
    self.lock = threading.Lock()
    self.generation = 0
    self.sessions = 0  # open sessions assigned here (guarded by the pool's lock)
    self.proc: subprocess.Popen | None = None
    self._tx: Connection | None = None
    self._rx: Connection | None = None
    self._ready = False

  def _spawn(self) -> None:
    if self.pool.closed:
      raise BackendUnavailable("the backend pool is closed")
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    try:
      self.proc = subprocess.Popen(
        [sys.executable, "-m", "envs.bfcl.worker", str(req_r), str(rep_w)]
        + [str(self.pool.bounds.worker_memory_mib)],
        pass_fds=(req_r, rep_w),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,  # backends may print; the protocol has its own pipes
        env=self.pool.child_env,
      )
    except BaseException:
      for fd in (req_r, req_w, rep_r, rep_w):
        os.close(fd)
      raise
    os.close(req_r)
    os.close(rep_w)
    self._tx, self._rx = Connection(req_w, readable=False), Connection(rep_r, writable=False)
    self._ready = False
    self.generation += 1
    self.pool.started_pids.append(self.proc.pid)

  def alive(self) -> bool:
    return self.proc is not None and self.proc.poll() is None

  def stop(self, graceful: bool = False) -> str:
    """Ends the process (a "quit" request first when `graceful`), reaps it and closes the pipes;
    returns how it ended."""
    proc, self.proc = self.proc, None
    if proc is None:
      return "not running"
    if graceful and proc.poll() is None and self._ready:
      assert self._tx is not None  # set by _spawn, with the process
      try:
        self._tx.send(("quit", (), 0.0))
        proc.wait(QUIT_TIMEOUT_S)
      except (OSError, subprocess.TimeoutExpired):
        pass
    if proc.poll() is None:
      proc.kill()
    code = proc.wait()
    for conn in (self._tx, self._rx):
      if conn is not None:
        conn.close()
    self._tx = self._rx = None
    self._ready = False
    return _exit_text(code)

  def _replace(self) -> str:
    """Kills and reaps the process and starts the next one (unless the pool is closed)."""
    how = self.stop()
    if not self.pool.closed:
      self._spawn()
    return how

  def _await_ready(self) -> None:
    if self._ready:
      return
    assert self._rx is not None and self.proc is not None
    problem = None
    try:
      if not self._rx.poll(STARTUP_TIMEOUT_S):
        problem = f"no answer within {STARTUP_TIMEOUT_S:g} s"
      else:
        kind, value = self._rx.recv()
        if kind != "ready":
          problem = value
    except (EOFError, OSError):
      problem = "the process exited"
    if problem is not None:
      how = self.stop()
      raise BackendUnavailable(f"BFCL worker process did not start ({problem}; {how})")
    self._ready = True

  def request(self, op: str, args: tuple, deadline_s: float) -> Any:
    """Sends one request and waits at most `deadline_s` for its answer (caller holds `lock`).

    Raises:
      CallStopped: over the deadline, out of memory, or the process died; it has been replaced.
      _WorkerGone: the process had exited before the request; it has been replaced, the request
        was not sent.
      BackendError: the worker reported an unexpected failure.
      BackendUnavailable: no process could be started, or the pool is closed.
    """
    if self.proc is None:
      self._spawn()
    self._await_ready()
    if not self.alive():
      self._replace()
      raise _WorkerGone()
    assert self.proc is not None and self._tx is not None and self._rx is not None  # alive
    try:
      self._tx.send((op, args, deadline_s))
    except OSError:
      self._replace()
      raise _WorkerGone() from None
    bounds = self.pool.bounds
    try:
      if not self._rx.poll(deadline_s):
        self._replace()
        raise CallStopped("time", _observation("time", bounds))
      kind, value = self._rx.recv()
    except (EOFError, OSError):
      how = self._replace()
      raise CallStopped("crash", _observation("crash", bounds, how)) from None
    except (KeyboardInterrupt, SystemExit):
      self.stop()  # its answer would be read as the next request's: the worker must go
      raise
    if kind == "memory":
      self._replace()
      raise CallStopped("memory", _observation("memory", bounds))
    if kind == "error":
      raise BackendError(f"BFCL worker process {self.proc.pid}: {value}")
    return value


_POOLS: set["BackendPool"] = set()  # open pools, closed at interpreter exit
_POOLS_LOCK = threading.Lock()


class BackendPool:
  """A small pool of BFCL worker processes under `bounds` (see the module docstring).

  Processes start when first needed and are replaced after a stopped call; `close()` (also run at
  interpreter exit) ends and reaps them all. Thread-safe: episodes on host threads share it.

  Attributes:
    bounds: the pool's `Bounds`.
    started_pids: every worker process id this pool has started, in order (diagnostics, tests).
  """

  def __init__(self, bounds: Bounds | None = None):
    self.bounds = bounds or Bounds()
    self.started_pids: list[int] = []
    self.closed = False
    self._lock = threading.Lock()
    self._workers = [_Worker(self, i) for i in range(self.bounds.workers)]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    self.child_env = env  # the workers import this checkout's `envs` package
    with _POOLS_LOCK:
      _POOLS.add(self)

  def session(self, task: Task, model_name: str | None = None) -> "BackendSession":
    """A session for one episode or sandbox of `task` (instances are created at its first call or
    `open()`); close it when done.

    Raises:
      BackendUnavailable: the pool is closed.
    """
    return BackendSession(self, task, model_name or new_model_name("sess"))

  def _assign(self) -> _Worker:
    with self._lock:
      if self.closed:
        raise BackendUnavailable("the backend pool is closed")
      worker = min(self._workers, key=lambda w: (w.sessions, w.index))
      worker.sessions += 1
      return worker

  def _release(self, worker: _Worker) -> None:
    with self._lock:
      worker.sessions -= 1

  def _least_busy(self) -> _Worker:
    with self._lock:
      if self.closed:
        raise BackendUnavailable("the backend pool is closed")
      return min(self._workers, key=lambda w: (w.sessions, w.index))

  def score(
    self, task: Task, calls_per_turn_per_step: list[list[list[str]]], model_name: str
  ) -> tuple[float, dict[str, Any]]:
    """The official checker on `task` and the decoded calls, in a worker
    (`score_calls` documents arguments and result). Its deadline is
    `call_wall_s` times (1 + the calls it executes: the given ones and the ground truth); over it,
    or over the memory bound, the score is 0.0 with error_type "checker:stopped".

    Raises:
      BackendUnavailable: no worker could be started, or the pool is closed.
      BackendError: the worker failed unexpectedly.
    """
    n_calls = sum(len(step) for turn in calls_per_turn_per_step for step in turn)
    n_calls += sum(len(turn) for turn in task.ground_truth)
    deadline = self.bounds.call_wall_s * (1 + n_calls)
    worker = self._least_busy()
    with worker.lock:
      for attempt in range(2):
        try:
          return worker.request("score", (task, calls_per_turn_per_step, model_name), deadline)
        except _WorkerGone:
          if attempt:
            raise BackendError("BFCL worker process exited twice before a request") from None
        except CallStopped as e:
          info = {
            "calls": calls_per_turn_per_step,
            "checker": {"valid": False, "error_type": "checker:stopped", "error_message": str(e)},
          }
          return 0.0, info
    raise AssertionError("unreachable")

  def instance_names(self, model_name: str = "") -> list[str]:
    """Cached backend instance names in all running workers (those of `model_name`, checker
    variants included, or all when ""), for tests and leak checks; [] once the pool is closed.

    Raises:
      BackendError: a worker failed unexpectedly.
    """
    names: list[str] = []
    for worker in self._workers:
      with worker.lock:
        if worker.alive() and not self.closed:
          try:
            names.extend(worker.request("keys", (model_name,), self.bounds.call_wall_s))
          except (_WorkerGone, CallStopped):
            continue  # a replaced worker holds no instances
    return names

  def close(self) -> None:
    """Ends and reaps every worker process (sessions still open fail from now on). Idempotent."""
    with self._lock:
      self.closed = True
    with _POOLS_LOCK:
      _POOLS.discard(self)
    for worker in self._workers:
      got = worker.lock.acquire(timeout=self.bounds.call_wall_s + QUIT_TIMEOUT_S)
      try:
        worker.stop(graceful=got)
      finally:
        if got:
          worker.lock.release()

  def __enter__(self) -> "BackendPool":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


class BackendSession:
  """The backend instances of one episode or sandbox, held by one worker of a pool.

  Attributes:
    model_name: the unique name keying the instances in BFCL's cache.
    replays: how many times the instances were rebuilt in a replaced worker.
  """

  def __init__(self, pool: BackendPool, task: Task, model_name: str):
    self.pool, self.task, self.model_name = pool, task, model_name
    self.replays = 0
    self._worker = pool._assign()
    self._generation = -1  # the worker generation holding the instances; -1 = none yet
    self._log: list[str] = []  # calls that ran, in order
    self._digests: list[bytes] = []  # digest of each one's result
    self._closed = False

  def _ensure(self) -> None:
    """Creates or rebuilds the instances in the current worker process (caller holds its lock).

    Raises:
      BackendLost: the replay was stopped or gave other results than the first run.
    """
    worker = self._worker
    if self._closed:
      raise BackendError(f"session {self.model_name} is closed")
    if self._generation == worker.generation and worker.alive():
      return
    deadline = self.pool.bounds.call_wall_s * (1 + len(self._log))
    for attempt in range(2):
      try:
        results = worker.request("open", (self.model_name, self.task, list(self._log)), deadline)
        break
      except _WorkerGone:
        if attempt:
          raise BackendLost(f"{self.model_name}: its worker exited twice in a row") from None
      except CallStopped as e:
        raise BackendLost(
          f"the backend state of {self.model_name} could not be rebuilt after its worker was "
          f"replaced: replaying its {len(self._log)} calls was stopped ({e.reason})"
        ) from e
    if [_digest(r) for r in results] != self._digests:
      raise BackendLost(
        f"the backend state of {self.model_name} could not be rebuilt after its worker was "
        f"replaced: replaying its {len(self._log)} calls gave different results"
      )
    self.replays += bool(self._log)
    self._generation = worker.generation

  def _request(self, op: str, args: tuple, deadline_s: float) -> Any:
    """A request on this session's instances (caller holds the worker's lock)."""
    for attempt in range(2):
      self._ensure()
      try:
        return self._worker.request(op, args, deadline_s)
      except _WorkerGone:
        if attempt:
          raise BackendLost(f"{self.model_name}: its worker exited twice in a row") from None
    raise AssertionError("unreachable")

  def open(self) -> None:
    """Creates the instances now (otherwise the first call does).

    Raises:
      BackendUnavailable, BackendLost, BackendError: as `execute`.
    """
    with self._worker.lock:
      self._ensure()

  def execute(self, calls: list[str], budget_s: float | None = None) -> list[CallOutcome]:
    """Runs trusted call strings (built by `call_to_string`, or trusted ground truth) in order,
    each within `call_wall_s` seconds and the worker's memory bound, and all of them within
    `budget_s` seconds of wall clock when it is given.

    The budget counts the real time (`time.monotonic`) this session spends on the calls, including
    rebuilding its instances in a replaced worker, but not waiting for a worker that another
    session's call holds. Once it is spent no further call is started, so the calls take at most
    `budget_s` plus the last started call's own time (at most `call_wall_s`, plus a worker start
    and replay should its worker have been replaced).

    Args:
      calls: the call strings, in order.
      budget_s: wall-clock seconds (> 0) the calls share; None = no shared budget.

    Returns:
      One `CallOutcome` per call: BFCL's result text; for a call stopped at a bound (or whose
      worker died) an "Error during execution: ..." text and `ran` False; for a call not started
      because the budget was spent, `budget_observation(budget_s)` and `ran` False. A call that
      did not run has no effect; the later calls run on the state before it.

    Raises:
      ValueError: budget_s is not None and not a finite number > 0.
      BackendLost: the instances could not be rebuilt after a worker replacement (end the episode).
      BackendUnavailable: no worker could be started (the message says why), or the pool is
        closed.
      BackendError: the worker failed unexpectedly.
    """
    if budget_s is not None and not _positive_seconds(budget_s):
      raise ValueError(f"budget_s must be a finite number of seconds > 0, got {budget_s!r}")
    out = []
    wall = self.pool.bounds.call_wall_s
    spent = 0.0
    for call in calls:
      if budget_s is not None and spent >= budget_s:
        out.append(CallOutcome(budget_observation(budget_s), ran=False))
        continue
      with self._worker.lock:
        start = time.monotonic()
        try:
          text = self._request("exec", (self.model_name, call), wall)
        except CallStopped as e:
          out.append(CallOutcome(e.observation, ran=False))
          continue
        finally:
          spent += time.monotonic() - start
        self._log.append(call)
        self._digests.append(_digest(text))
        out.append(CallOutcome(text, ran=True))
    return out

  def state(self, kind: str = "public") -> dict[str, dict[str, Any]]:
    """A copy of the instances' state: "public" (what the official checker compares) or "full"
    (every attribute but RNGs and docs).

    Raises:
      BackendLost: the state could not be read (its request was stopped at a bound) or rebuilt.
      BackendUnavailable, BackendError: as `execute`.
    """
    with self._worker.lock:
      try:
        return self._request("state", (self.model_name, kind), self.pool.bounds.call_wall_s)
      except CallStopped as e:
        raise BackendLost(f"reading the state of {self.model_name} was stopped ({e})") from e

  def close(self) -> None:
    """Deletes the instances in the worker (if it still holds them) and frees the session's place
    in the pool. Never raises; idempotent."""
    if self._closed:
      return
    self._closed = True
    worker = self._worker
    try:
      with worker.lock:
        if self._generation == worker.generation and worker.alive() and not self.pool.closed:
          worker.request("close", (self.model_name,), self.pool.bounds.call_wall_s)
    except (BackendError, CallStopped, _WorkerGone):
      pass  # the instances went with their worker process
    finally:
      self.pool._release(worker)


_DEFAULT_LOCK = threading.Lock()
_default: BackendPool | None = None
_default_bounds = Bounds()


def default_pool() -> BackendPool:
  """The process-wide pool (bounds from the last `configure`, else `Bounds()`); a closed one is
  replaced by a fresh pool with the same bounds."""
  global _default
  with _DEFAULT_LOCK:
    if _default is None or _default.closed:
      _default = BackendPool(_default_bounds)
    return _default


def configure(bounds: Bounds) -> BackendPool:
  """Sets the default pool's bounds and returns the default pool. With other bounds than the
  current pool's, that pool is closed and a new one made: call it before episodes start."""
  global _default, _default_bounds
  with _DEFAULT_LOCK:
    old = _default
    _default_bounds = bounds
    if old is not None and not old.closed and old.bounds == bounds:
      return old
    _default = BackendPool(bounds)
  if old is not None:
    old.close()
  return _default


@atexit.register
def _close_all() -> None:
  with _POOLS_LOCK:
    pools = list(_POOLS)
  for pool in pools:
    pool.close()


def score_calls(
  task: Task,
  calls_per_turn_per_step: list[list[list[str]]],
  model_name: str | None = None,
  *,
  pool: BackendPool | None = None,
) -> tuple[float, dict[str, Any]]:
  """Scores decoded calls with the official BFCL multi-turn checker, in a worker process under the
  pool's bounds (`BackendPool.score`); cleans up the checker's instances.

  Args:
    task: the task (ground_truth per turn, initial_config, involved_classes).
    calls_per_turn_per_step: [turn][step][call string]; every string must be trusted
      (call_to_string). Steps without calls should be left out (the official runner drops them).
    model_name: a unique name; a fresh one if None. Its "_eval"/"_ground_truth_eval" instances are
      deleted.
    pool: the `BackendPool` to run in (None = `default_pool()`).

  Returns:
    (1.0 if the checker says valid else 0.0, info with "checker" ({valid, error_type, error_message}
    of the checker's result) and "calls"). A checker run that exceeds its bound (the per-call wall
    time times the number of calls it executes, or the worker's memory) scores 0.0 with error_type
    "checker:stopped".

  Raises:
    BackendUnavailable: no worker process could be started, or the pool is
      closed.
  """
  pool = pool or default_pool()
  return pool.score(task, calls_per_turn_per_step, model_name or new_model_name("score"))
