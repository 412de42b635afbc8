"""Orbax checkpoints of the whole run: its `TrainState` (parameters, optimizer state, reference
policy) and metadata.

Metadata (JSON) holds the step, host and device RNG states, signal histories, pending feedback
events, counters and timings; the task pool lives in its own append-only file beside.
Saving is asynchronous: `save` copies the arrays off the devices and returns, and the files are
written in the background while training continues (the next step may donate the saved buffers).
Orbax commits a step atomically (a temporary folder renamed when complete), so a run killed
mid-save resumes from the previous complete step. A committed step that cannot be read (a bad
disk, a truncated file, edited metadata) is moved aside to `<step>.damaged-<n>` beside the others
(kept, never deleted) with a one-line warning, and the previous step is restored; the run then
writes that step again. A step whose stored arrays have other shapes or paths than the run's
(a checkpoint of another model size) is not damaged: restoring stops with
CheckpointMismatchError, naming the differing arrays, and moves nothing.

A save that fails for a full disk (now, or in the background) raises DiskFullError naming the
step's folder and the space left, from `save` or `wait`; the previous checkpoints are untouched
and the unfinished step's temporary folder is removed by the next save.

While a RunCheckpointer is open, event loops that asyncio creates (orbax makes one per restore
and per background write) close only once their tasks are done (bounded): see
`_DrainingEventLoop`.

Restoring places every array with the sharding of the example TrainState it is given, so a
checkpoint saved on one device count or mesh restores onto another.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from coevolve_jax import errors
from coevolve_jax.trainer import TrainState

_STATE_ITEMS = ("params", "opt_state", "ref_params")


class CheckpointMismatchError(RuntimeError):
  """A readable checkpoint that was written for another model or optimizer: its arrays'
  paths or shapes differ from the run's (a changed `model.*` field, not damage). Nothing is
  moved or deleted.

  Attributes:
    step: the checkpoint's step. differences: one line per differing array ("params/x/value:
      (64, 32) saved, (64, 16) configured"), at most the first few. saved_config: the config
      the checkpoint was saved with (its meta's "config"), or None when it has none.
  """

  def __init__(self, step: int, directory: str, differences: list[str], total: int, saved_config):
    self.step, self.differences, self.saved_config = step, differences, saved_config
    shown = "; ".join(differences)
    super().__init__(
      f"checkpoint step {step} in {directory} was saved for another model: {total} arrays "
      f"differ from the configured model's ({shown}). The checkpoints are intact and were "
      f"not moved"
    )


def shape_differences(step_folder: str, like: dict[str, Any]) -> list[str] | None:
  """One line per array whose path or shape differs between the items stored in `step_folder`
  and `like` ({item name: pytree of arrays or shape structs}), e.g. "params/x/value: (64, 32)
  saved, (64, 16) configured"; [] when they agree; None when an item's array metadata is
  unreadable (a damaged step, not another model's)."""
  try:  # each item's own array metadata (a reopened manager knows no item handler to read it)
    reader = ocp.StandardCheckpointHandler()
    folder = epath.Path(step_folder)
    saved = {item: array_shapes(reader.metadata(folder / item).tree) for item in like}
  except Exception:  # damaged metadata
    return None
  lines = []
  for item, tree in like.items():
    want = array_shapes(tree)
    for path in sorted(set(saved[item]) | set(want)):
      got, need = saved[item].get(path), want.get(path)
      if got != need:
        lines.append(
          f"{item}/{path}: {'absent' if got is None else got} saved, "
          f"{'absent' if need is None else need} configured"
        )
  return lines


def array_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
  """{"a/b/c": shape} of a pytree of arrays, or of orbax's metadata of one (nested dicts and
  lists of array metadata, which are leaves; None entries are empty states with no arrays)."""

  def key_name(k: Any) -> str:  # DictKey.key, GetAttrKey.name, SequenceKey.idx
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        return str(getattr(k, attr))
    return str(k)

  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {"/".join(key_name(k) for k in path): tuple(leaf.shape) for path, leaf in leaves}


class RunCheckpointer:
  """The run's checkpoints in `directory`, newest `keep` kept (orbax CheckpointManager).

  Items per step: params, opt_state, ref_params (the three fields of a `TrainState`, each a
  pytree of arrays, stored as separate items so a reader can load the parameters alone) and meta
  (JSON: step, RNG states, signal histories, pool size, config, ...).
  """

  ITEMS = ("params", "opt_state", "ref_params", "meta")

  def __init__(self, directory: str, keep: int):
    """Raises: ValueError when keep < 1."""
    if keep < 1:
      raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep,
      create=True,
      enable_async_checkpointing=True,
      # The step's folders are made in `save` itself: made in the background, a failure (a full
      # disk) left orbax's other writer threads waiting 5 minutes for them, at interpreter exit.
      async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
    )
    self._mgr = ocp.CheckpointManager(directory, options=options, item_names=self.ITEMS)
    self.directory = os.fspath(self._mgr.directory)
    self._saving: int | None = None  # the step of the save in flight
    self._threads_before: set[threading.Thread] = set()  # alive when that save began
    _DrainingPolicy.hold()
    self._holds_policy = True

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    """Steps of the committed checkpoints, ascending (unfinished saves are not listed)."""
    return sorted(self._mgr.all_steps())

  def save(self, step: int, train_state: TrainState, meta: dict[str, Any]) -> None:
    """Starts an asynchronous save of `step` and returns once the arrays are copied to the host
    (after the previous save has finished).

    Args:
      step: the checkpoint's step. train_state: params, opt_state and ref_params to save.
      meta: JSON-serialisable metadata.
    Older checkpoints beyond `keep` are deleted.
    Raises:
      DiskFullError: this save, or the previous one still in flight, failed for a full disk.
    """
    self.wait()
    args = ocp.args.Composite(
      params=ocp.args.StandardSave(train_state.params),
      opt_state=ocp.args.StandardSave(train_state.opt_state),
      ref_params=ocp.args.StandardSave(train_state.ref_params),
      meta=ocp.args.JsonSave(meta),
    )
    self._saving = step
    self._threads_before = set(threading.enumerate())
    with self._writing_in_flight():
      self._mgr.save(step, args=args, force=True)

  def restore(self, step: int, like: TrainState) -> tuple[TrainState, dict[str, Any]]:
    """Restores `step` onto the structure, shapes, dtypes and shardings of `like`'s arrays (which
    are only read), so a checkpoint from another device count or mesh lands on `like`'s.

    Returns:
      (the restored TrainState, meta).
    Raises:
      Whatever orbax raises for a missing, damaged or mismatched checkpoint.
    """
    abstract = lambda tree: jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)  # noqa: E731
    out = self._mgr.restore(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract(like.params)),
        opt_state=ocp.args.StandardRestore(abstract(like.opt_state)),
        ref_params=ocp.args.StandardRestore(abstract(like.ref_params)),
        meta=ocp.args.JsonRestore(),
      ),
    )
    logging.info("restored checkpoint step %d", step)
    return TrainState(out.params, out.opt_state, out.ref_params), out.meta

  def restore_latest(self, like: TrainState) -> tuple[int, TrainState, dict[str, Any]] | None:
    """Restores the newest readable checkpoint onto `like` (see `restore`).

    Newer steps that cannot be read (corrupt, truncated, missing files) are moved aside to
    `<directory>/<step>.damaged-<n>` (kept for inspection; n counts earlier ones of that step), with
    one warning line each, so that the run can write those steps again.

    Returns:
      (step, TrainState, meta), or None when there is no checkpoint.
    Raises:
      CheckpointMismatchError: a step that does not restore was saved for another model (its
        arrays' shapes or paths differ from `like`'s); nothing is moved.
      RuntimeError: checkpoints exist but none can be read (nothing is moved then).
    """
    steps = sorted(self._mgr.all_steps(), reverse=True)
    unreadable: list[tuple[int, Exception]] = []
    for step in steps:
      try:
        state, meta = self.restore(step, like)
      except Exception as e:  # orbax raises many types for a damaged checkpoint
        self._check_matches(step, like)  # another model's checkpoint is not damaged
        unreadable.append((step, e))
        continue
      for bad, error in unreadable:
        self._set_aside(bad, error, step)
      if unreadable:
        self._mgr.reload()  # forget the steps moved aside, so that they can be saved again
      return step, state, meta
    if steps:
      for step, error in unreadable:
        print(f"warning: checkpoint step {step} is unreadable ({errors.describe(error)})")
      raise RuntimeError(
        f"no readable checkpoint among steps {steps} in {self.directory}; "
        "delete the checkpoints folder to start over"
      )
    return None

  def _check_matches(self, step: int, like: TrainState) -> None:
    """Raises CheckpointMismatchError when `step`'s stored array metadata is readable and its
    paths or shapes differ from `like`'s; returns when they agree or the metadata is unreadable
    (then the step is damaged, not another model's)."""
    lines = shape_differences(self._step_folder(step), {i: getattr(like, i) for i in _STATE_ITEMS})
    if not lines:  # the same arrays, or metadata unreadable (the caller treats it as damage)
      return
    try:
      meta = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
      saved_config = meta.get("config") if isinstance(meta, dict) else None
    except Exception:  # the meta is only advice here
      saved_config = None
    raise CheckpointMismatchError(step, self.directory, lines[:3], len(lines), saved_config)

  def _set_aside(self, step: int, error: Exception, restored: int) -> None:
    """Renames the unreadable `step` to `<step>.damaged-<n>` (primary host; the others wait)."""
    if ocp.multihost.is_primary_host(0):
      suffixes = (f".damaged-{n}" for n in itertools.count(1))
      aside = errors.move_aside(self._step_folder(step), suffixes)
      print(
        f"warning: checkpoint step {step} is unreadable ({errors.describe(error)}); moved it to "
        f"{aside} and resuming from step {restored}"
      )
    if jax.process_count() > 1:
      ocp.multihost.sync_global_processes(f"coevolve_set_aside_{step}")

  def _step_folder(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  @contextlib.contextmanager
  def _writing_in_flight(self):
    """`errors.writing` naming the folder of the save in flight (the directory when none); on an
    error, that save's writers are waited for first (`_drain_writers`)."""
    folder = self.directory if self._saving is None else self._step_folder(self._saving)
    try:
      with errors.writing(folder):
        yield
    except Exception:
      self._drain_writers()
      raise

  def _drain_writers(self) -> None:
    """Waits, at most `_DRAIN_TIMEOUT_S` in all, for the threads orbax started since the last
    save began. When one item of a save fails (a full disk), orbax reports it at once while the
    other items' threads go on writing into the step's temporary folder; a later save of the
    same step, which removes that folder first, then fails with "Directory not empty"."""
    deadline = time.monotonic() + _DRAIN_TIMEOUT_S
    for thread in threading.enumerate():
      if (
        thread not in self._threads_before
        and type(thread).__module__.startswith("orbax.")
        and thread is not threading.current_thread()
      ):
        thread.join(max(0.0, deadline - time.monotonic()))

  def wait(self) -> None:
    """Waits for the save in flight.

    Raises:
      DiskFullError: it failed for a full disk.
    """
    with self._writing_in_flight():
      self._mgr.wait_until_finished()
    self._saving = None

  def close(self) -> None:
    """Waits for the save in flight and releases orbax's threads.

    Raises:
      DiskFullError: the save in flight failed for a full disk.
    """
    try:
      with self._writing_in_flight():
        self._mgr.close()
    finally:
      if self._holds_policy:
        self._holds_policy = False
        _DrainingPolicy.release()


_DRAIN_TIMEOUT_S = 120.0  # for reads or writes still in flight when their operation failed


class _DrainingEventLoop(asyncio.SelectorEventLoop):
  """An event loop that, closed with tasks still pending, first lets them finish.

  Orbax runs a restore, or a background write, in a fresh event loop: it reads or writes the
  arrays concurrently (`asyncio.gather`) and closes the loop when done. When one of them fails
  (a damaged checkpoint, a full disk), gather raises at once while the others are still in flight
  in TensorStore; each of those, completing after the close, schedules its result on the closed
  loop and TensorStore prints "RuntimeError: Event loop is closed" (one traceback per array).
  Closing only after they finish leaves nothing to arrive late.
  """

  def close(self) -> None:
    if not self.is_closed() and not self.is_running():
      pending = [t for t in asyncio.all_tasks(self) if not t.done()]
      if pending:
        _, left = self.run_until_complete(asyncio.wait(pending, timeout=_DRAIN_TIMEOUT_S))
        for task in left:  # one that hangs: give up on it rather than hang the run
          task.cancel()
        if left:
          self.run_until_complete(asyncio.wait(left))
        for task in pending:  # their errors repeat the one already raised
          if not task.cancelled():
            task.exception()
    super().close()


class _DrainingPolicy(asyncio.AbstractEventLoopPolicy):
  """The event loop policy in force before, except that new loops are `_DrainingEventLoop`s;
  installed while any RunCheckpointer is open (`hold`, `release`)."""

  _lock = threading.Lock()
  _holders = 0
  _installed: _DrainingPolicy | None = None

  def __init__(self, base: asyncio.AbstractEventLoopPolicy):
    self._base = base

  @classmethod
  def hold(cls) -> None:
    with cls._lock:
      if cls._holders == 0:
        cls._installed = cls(asyncio.get_event_loop_policy())
        asyncio.set_event_loop_policy(cls._installed)
      cls._holders += 1

  @classmethod
  def release(cls) -> None:
    with cls._lock:
      cls._holders -= 1
      if cls._holders == 0:
        if asyncio.get_event_loop_policy() is cls._installed:  # not replaced by someone else
          asyncio.set_event_loop_policy(cls._installed._base)
        cls._installed = None

  def get_event_loop(self):
    return self._base.get_event_loop()

  def set_event_loop(self, loop) -> None:
    self._base.set_event_loop(loop)

  def new_event_loop(self):
    return _DrainingEventLoop()

  def get_child_watcher(self):
    return self._base.get_child_watcher()

  def set_child_watcher(self, watcher) -> None:
    self._base.set_child_watcher(watcher)
