"""Task samplers: the per-task weights of each GRPO step's draw from the pool.

The pool's draw (`TaskPool.sample`) takes its weights from a `TaskSampler`, so re-weighting the
pool (e.g. up-weighting tasks whose failures resemble recent ones, as Role-Agent's Agent-In-World
does) is one class registered here, with its state saved in every checkpoint so that a resumed
run draws the same tasks. The default, "uniform", gives no weights: every task is as likely.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from coevolve_jax.types import Task, Trajectory


class TaskSampler(Protocol):
  """Weights of the pool's tasks for the next draw.

  Attributes:
    name: the sampler's name (`pool.sampler`).
  """

  name: str

  def weights(self, tasks: Sequence[Task]) -> np.ndarray | None:
    """[len(tasks)] float64 weights >= 0 in pool order, or None for a uniform draw."""
    ...

  def observe(self, tasks: Sequence[Task], trajectories: Sequence[Trajectory]) -> None:
    """Sees a step's tasks and rollouts (after the update), e.g. to find failures."""
    ...

  def state_dict(self) -> dict[str, Any]:
    """JSON-serialisable state, saved with every checkpoint."""
    ...

  def load_state_dict(self, state: dict[str, Any]) -> None: ...


class UniformSampler:
  """Every pool task is as likely (the paper's draw)."""

  name = "uniform"

  def weights(self, tasks: Sequence[Task]) -> np.ndarray | None:
    del tasks
    return None

  def observe(self, tasks: Sequence[Task], trajectories: Sequence[Trajectory]) -> None:
    del tasks, trajectories

  def state_dict(self) -> dict[str, Any]:
    return {}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    del state


SAMPLERS: dict[str, Callable[[Any], TaskSampler]] = {"uniform": lambda cfg: UniformSampler()}


def make_sampler(name: str, cfg: Any = None) -> TaskSampler:
  """The sampler registered as `name`, built from the run config.

  Raises:
    ValueError: an unknown name.
  """
  if name not in SAMPLERS:
    raise ValueError(f"unknown task sampler {name!r} (known: {sorted(SAMPLERS)})")
  return SAMPLERS[name](cfg)


if TYPE_CHECKING:  # mypy checks UniformSampler against the TaskSampler protocol

  def _conforms(sampler: UniformSampler) -> TaskSampler:
    return sampler
