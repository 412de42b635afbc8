"""Metrics: JSON lines plus TensorBoard event files (tensorboardX), and phase timers; the run's
log writes (`append_lines`, `write_atomic`), which leave no torn line and raise DiskFullError for
a full disk."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

import jax

from coevolve_jax import distributed, errors


def append_lines(path: str, lines: Iterable[str], *, sync: bool = False) -> None:
  """Appends `lines` (each without its newline) to the file at `path`, created if missing, in one
  O_APPEND write for any normal size; `sync`: fsync before returning. Only the primary process
  writes (`distributed.is_primary`); the others return at once.

  A failed write cuts the file back to its size before, so the file never ends in a torn line.

  Raises:
    DiskFullError: the disk is full (the file is as it was); other OSErrors as raised.
  """
  if not distributed.is_primary():
    return
  data = "".join(line + "\n" for line in lines).encode("utf-8")
  with errors.writing(path):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
      size = os.fstat(fd).st_size
      try:
        view = memoryview(data)
        while view:  # one write() for any normal size; loop only on a short write
          view = view[os.write(fd, view) :]
        if sync:
          os.fsync(fd)
      except BaseException:
        with contextlib.suppress(OSError):  # not a regular file
          os.ftruncate(fd, size)
        raise
    finally:
      os.close(fd)


def write_atomic(path: str, text: str, *, sync: bool = False) -> None:
  """Replaces the file at `path` by `text`: written to `<path>.tmp` (`sync`: and fsynced), then
  renamed over it. Only the primary process writes (`distributed.is_primary`).

  Raises:
    DiskFullError: the disk is full (the file is as it was, the temporary one removed); other
      OSErrors as raised.
  """
  if not distributed.is_primary():
    return
  tmp = path + ".tmp"
  with errors.writing(path):
    try:
      with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if sync:
          f.flush()
          os.fsync(f.fileno())
      os.replace(tmp, path)
    except BaseException:
      with contextlib.suppress(OSError):
        os.remove(tmp)
      raise


def truncate_jsonl(path: str, max_step: int) -> int:
  """Brings a JSON-lines log back to step `max_step` for a resume: drops the rows whose "step"
  is above it (rows that the resumed run writes again), and sets aside every torn line (a write
  cut by a kill: not JSON, not a JSON object, or cut inside a UTF-8 character) to `<path>.torn`,
  appended, never deleted, with one warning line that counts them. The log is replaced
  atomically; only the primary process writes (the others only read).

  Returns:
    The rows dropped, torn lines included.
  Raises:
    DiskFullError: the disk is full (the log is as it was).
  """
  if not os.path.exists(path):
    return 0
  with open(path, "rb") as f:
    lines = f.read().splitlines()
  kept, torn = [], []
  for line in lines:
    try:
      later = json.loads(line.decode("utf-8")).get("step", 0) > max_step
    except (ValueError, AttributeError, TypeError):  # UnicodeDecodeError is a ValueError
      torn.append(line)
      continue
    if not later:
      kept.append(line)
  if torn and distributed.is_primary():
    with errors.writing(path + ".torn"), open(path + ".torn", "ab") as f:
      f.write(b"".join(line + b"\n" for line in torn))
      f.flush()
      os.fsync(f.fileno())
    print(f"warning: {path}: {len(torn)} torn line(s) (a write cut by a kill) moved to {path}.torn")
  write_atomic(path, b"".join(line + b"\n" for line in kept).decode("utf-8"))
  return len(lines) - len(kept)


# Disk-full failures of tensorboardX's writer thread, which writes the events in the background:
# recorded by `_tensorboard_excepthook` instead of a thread traceback, raised by the next
# `MetricsWriter` call in the main thread as the one-line DiskFullError of every other write.
_TB_DISK_FULL: list[BaseException] = []
_PREVIOUS_EXCEPTHOOK = [threading.excepthook]  # the hook in force when ours was installed


def _tensorboard_excepthook(args: threading.ExceptHookArgs) -> None:
  thread_module = type(args.thread).__module__ if args.thread is not None else ""
  error = args.exc_value
  if thread_module.startswith("tensorboardX") and error is not None:
    if errors.disk_full_errno(error) is not None:
      _TB_DISK_FULL.append(error)
      return
  _PREVIOUS_EXCEPTHOOK[0](args)


class MetricsWriter:
  """Appends `{"step": s, **metrics}` to `<workdir>/metrics.jsonl` and writes TensorBoard
  scalars.

  `resume_step` is the step the run restarts from (-1 for a fresh start): rows and TensorBoard
  events that an interrupted run wrote after it are dropped, so there is one row per step.
  Every method raises DiskFullError when the disk is full (metrics.jsonl then ends with the last
  whole row).
  """

  def __init__(self, workdir: str, resume_step: int = -1):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    truncate_jsonl(self.path, resume_step)
    self._tb_dir = os.path.join(workdir, "tensorboard")
    self._tb = None  # only the primary process writes TensorBoard events
    if distributed.is_primary():
      if threading.excepthook is not _tensorboard_excepthook:  # once, keeping the one before
        _PREVIOUS_EXCEPTHOOK[0] = threading.excepthook
        threading.excepthook = _tensorboard_excepthook
      # Imported here: tensorboardX's writer imports torch when it is installed (1.3 s), which
      # a command that stops at its config's first error should not wait for.
      from tensorboardX import SummaryWriter  # noqa: PLC0415

      with errors.writing(self._tb_dir):
        self._tb = SummaryWriter(self._tb_dir, purge_step=resume_step + 1)

  def _raise_background_failure(self) -> None:
    if _TB_DISK_FULL:
      with errors.writing(self._tb_dir):
        raise _TB_DISK_FULL.pop(0)

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    append_lines(self.path, [json.dumps({"step": step, **metrics}, sort_keys=True)])
    if self._tb is None:
      return
    self._raise_background_failure()
    for k, v in metrics.items():
      if isinstance(v, (int, float)) and not isinstance(v, bool):
        self._tb.add_scalar(k, v, step)
    with errors.writing(self._tb_dir):
      self._tb.flush()
    self._raise_background_failure()

  def close(self) -> None:
    if self._tb is None:
      return
    with errors.writing(self._tb_dir):
      self._tb.close()
    self._raise_background_failure()


class PhaseTimer:
  """Accumulates wall seconds per named phase (`timing/<phase>` in metrics)."""

  def __init__(self, initial: dict[str, float] | None = None):
    self.totals: dict[str, float] = collections.defaultdict(float, initial or {})
    self.last: dict[str, float] = {}

  @contextlib.contextmanager
  def __call__(self, phase: str):
    start = time.perf_counter()
    try:
      yield
    finally:
      dt = time.perf_counter() - start
      self.totals[phase] += dt
      self.last[phase] = self.last.get(phase, 0.0) + dt

  def move(self, seconds: float, *, src: str, dst: str) -> None:
    """Reassigns `seconds` already counted under phase `src` to phase `dst`, in the totals and in
    the figures of the current step (`pop_last`), e.g. a checker's time measured inside the
    rollout: `move(s, src="rollout", dst="reward")`. The sum over phases is unchanged.

    Args:
      seconds: wall seconds (float; may exceed what `src` holds, which then goes negative).
      src, dst: phase names (a phase not yet seen starts from 0).
    """
    self.totals[src] -= seconds
    self.last[src] = self.last.get(src, 0.0) - seconds
    self.totals[dst] += seconds
    self.last[dst] = self.last.get(dst, 0.0) + seconds

  def pop_last(self) -> dict[str, float]:
    out = {f"timing/{k}": v for k, v in self.last.items()}
    self.last = {}
    return out


# The event JAX records around every XLA backend compilation (jax/_src/dispatch.py,
# BACKEND_COMPILE_EVENT); tests/test_metrics.py checks that a new jit shape still fires it.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# The event JAX records when an executable is loaded from the persistent compilation cache
# (jax/_src/compiler.py, `compile_or_get_cached`; `compile.cache_dir`).
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
  """Counts this process's XLA compilations and their seconds, from JAX's own monitoring event
  (`jax.monitoring`, BACKEND_COMPILE_EVENT), whichever thread compiles (the GRPO step, the
  engine's prefill and decode buckets, the feedback thread's explorer model). A program loaded
  from the persistent compilation cache (`compile.cache_dir`) counts too (JAX times the load as
  the compilation: `compile/seconds` is then the load's), and is also counted in
  `compile/cache_hits`.

  `pop()` gives {"compile/count": int, "compile/seconds": float, "compile/cache_hits": int}
  since the previous pop (the run logs them per step in metrics.jsonl), and per compiled program one
  "compile/program/<name>": int, the name JAX passes with the event (`jit(_prefill_rows)` gives
  `_prefill_rows`; "unknown" on a JAX that passes none): which shapes still compile, the engine's
  prefill and decode buckets or the train step's. `total` counts since construction. `close()`
  unregisters the listener.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self.total = 0
    self._count, self._seconds, self._hits = 0, 0.0, 0
    self._programs: collections.Counter[str] = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(self._on_event)
    jax.monitoring.register_event_listener(self._on_hit)

  def _on_hit(self, event: str, **kwargs) -> None:
    if event == CACHE_HIT_EVENT:
      with self._lock:
        self._hits += 1

  def _on_event(self, event: str, duration_secs: float, **kwargs) -> None:
    if event == BACKEND_COMPILE_EVENT:
      name = str(kwargs.get("fun_name") or "unknown")
      if name.startswith("jit(") and name.endswith(")"):
        name = name[4:-1]
      with self._lock:
        self.total += 1
        self._count += 1
        self._seconds += float(duration_secs)
        self._programs[name] += 1

  def pop(self) -> dict[str, float]:
    with self._lock:
      out = {
        "compile/count": self._count,
        "compile/seconds": self._seconds,
        "compile/cache_hits": self._hits,
      }
      out.update({f"compile/program/{k}": n for k, n in sorted(self._programs.items())})
      self._count, self._seconds, self._hits = 0, 0.0, 0
      self._programs.clear()
    return out

  def close(self) -> None:
    with contextlib.suppress(AssertionError, ValueError):  # already unregistered
      jax.monitoring.unregister_event_duration_listener(self._on_event)
    with contextlib.suppress(AssertionError, ValueError):
      jax.monitoring.unregister_event_listener(self._on_hit)


def call_recall(ground_truth: list[list[str]], calls: list[list[str]]) -> tuple[float, float]:
  """How much of a task's ground truth an episode called, as a graded figure beside the
  checker's all-or-nothing reward (the generated held-out set's `call_recall` and
  `name_recall`).

  Args:
    ground_truth: per user turn, the task's ground-truth call strings, e.g.
      [["cd(folder='document')", "ls()"]].
    calls: per user turn, the call strings the episode executed (`Trajectory.calls`).
  Returns:
    (exact, by_name): the share of ground-truth calls the episode made with the same string
    (matched as multisets over the whole episode: a call counts once per time it was made), and
    the same share matching function names only. 1.0 for an empty ground truth.
  """
  want = [c for turn in ground_truth for c in turn]
  if not want:
    return 1.0, 1.0
  got = [c for turn in calls for c in turn]

  def share(key) -> float:
    need, have = collections.Counter(map(key, want)), collections.Counter(map(key, got))
    return sum(min(n, have[k]) for k, n in need.items()) / len(want)

  return share(lambda c: c), share(lambda c: c.split("(", 1)[0].strip())
