"""Orbax checkpoints of the whole run: parameters, optimizer state, reference policy and metadata.

Metadata (JSON) holds the step, host and device RNG states, signal histories, pending feedback
events, counters and timings; the task pool lives in its own append-only file beside.
Saving is asynchronous: `save` copies the arrays off the devices and returns, and the files are
written in the background while training continues (the next step may donate the saved buffers).
Orbax commits a step atomically (a temporary folder renamed when complete), so a run killed
mid-save resumes from the previous complete step; a damaged step is skipped with a warning.

Restoring places every array with the sharding of the example trees it is given, so a checkpoint
saved on one device count or mesh restores onto another.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import orbax.checkpoint as ocp


class RunCheckpointer:
  """The run's checkpoints in `directory`, newest `keep` kept (orbax CheckpointManager).

  Items per step: params, opt_state, ref_params (pytrees of arrays) and meta (JSON: step, RNG
  states, signal histories, pool size, config, ...).
  """

  ITEMS = ("params", "opt_state", "ref_params", "meta")

  def __init__(self, directory: str, keep: int):
    """Raises: ValueError when keep < 1."""
    if keep < 1:
      raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=True, enable_async_checkpointing=True
    )
    self._mgr = ocp.CheckpointManager(directory, options=options, item_names=self.ITEMS)

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    """Steps of the committed checkpoints, ascending (unfinished saves are not listed)."""
    return sorted(self._mgr.all_steps())

  def save(self, step: int, params, opt_state, ref_params, meta: dict[str, Any]) -> None:
    """Starts an asynchronous save of `step` and returns once the arrays are copied to the host.

    `meta` must be JSON-serialisable. Older checkpoints beyond `keep` are deleted.
    """
    args = ocp.args.Composite(
      params=ocp.args.StandardSave(params),
      opt_state=ocp.args.StandardSave(opt_state),
      ref_params=ocp.args.StandardSave(ref_params),
      meta=ocp.args.JsonSave(meta),
    )
    self._mgr.save(step, args=args, force=True)

  def restore(self, step: int, params, opt_state, ref_params) -> tuple[Any, Any, Any, dict]:
    """Restores onto the structure (and shardings) of the given example pytrees."""
    abstract = lambda tree: jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)  # noqa: E731
    out = self._mgr.restore(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract(params)),
        opt_state=ocp.args.StandardRestore(abstract(opt_state)),
        ref_params=ocp.args.StandardRestore(abstract(ref_params)),
        meta=ocp.args.JsonRestore(),
      ),
    )
    logging.info("restored checkpoint step %d", step)
    return out.params, out.opt_state, out.ref_params, out.meta

  def restore_latest(self, params, opt_state, ref_params) -> tuple[int, Any, Any, Any, dict] | None:
    """Restores the newest readable checkpoint; an unreadable one (corrupt, partial) is skipped
    with a warning and the previous one used. Returns (step, params, opt_state, ref, meta), or
    None when there is no checkpoint.

    Raises:
      RuntimeError: checkpoints exist but none can be read.
    """
    steps = sorted(self._mgr.all_steps(), reverse=True)
    for step in steps:
      try:
        return (step, *self.restore(step, params, opt_state, ref_params))
      except Exception as e:  # orbax raises many types for a damaged checkpoint
        first_line = str(e).strip().splitlines()[0][:300] if str(e).strip() else repr(e)
        logging.warning(
          "checkpoint step %d is unreadable (%s); trying an older one", step, first_line
        )
        print(
          f"warning: checkpoint step {step} is unreadable ({type(e).__name__}: "
          f"{first_line}); trying an older one"
        )
    if steps:
      raise RuntimeError(
        f"no readable checkpoint among steps {steps} in {self._mgr.directory}; "
        "delete the checkpoints folder to start over"
      )
    return None

  def wait(self) -> None:
    self._mgr.wait_until_finished()

  def close(self) -> None:
    self._mgr.close()
