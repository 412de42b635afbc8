"""Task samplers: the per-task weights of each GRPO step's draw from the pool.

The pool's draw (`TaskPool.sample`) takes its weights from a `TaskSampler`, so re-weighting the
pool is one class registered here, with its state saved in every checkpoint so that a resumed run
draws the same tasks. The default, "uniform", gives no weights: every task is as likely; "aiw"
up-weights failed tasks and earlier failures like them (Role-Agent's Agent-In-World,
`feedback.aiw`), chosen by `role_agent.aiw.enabled`.
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

  def metrics(self) -> dict[str, float]:
    """Figures of the last `weights` and `observe` calls for metrics.jsonl ({} for none)."""
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

  def metrics(self) -> dict[str, float]:
    return {}

  def state_dict(self) -> dict[str, Any]:
    return {}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    del state


def _aiw(cfg: Any, llm: Any) -> TaskSampler:
  from coevolve_jax.feedback.aiw import AIWSampler  # pylint: disable=g-import-not-at-top

  return AIWSampler.from_config(cfg, llm)


# name -> factory(run config, the explorer LLM or None)
SAMPLERS: dict[str, Callable[[Any, Any], TaskSampler]] = {
  "uniform": lambda cfg, llm: UniformSampler(),
  "aiw": _aiw,
}


def sampler_name(cfg: Any) -> str:
  """The run's sampler: "aiw" with `role_agent.aiw.enabled`, else `pool.sampler`.

  Raises:
    ValueError: `role_agent.aiw.enabled` beside a `pool.sampler` other than "uniform" or "aiw".
  """
  name = cfg["pool"]["sampler"]
  role_agent = cfg.get("role_agent")
  if role_agent is not None and role_agent["aiw"]["enabled"]:
    if name not in ("uniform", "aiw"):
      raise ValueError(f"role_agent.aiw.enabled draws with 'aiw', not pool.sampler={name!r}")
    return "aiw"
  return name


def make_sampler(name: str, cfg: Any = None, llm: Any = None) -> TaskSampler:
  """The sampler registered as `name`, built from the run config and the explorer LLM
  (`TextLLM`, None with the programmatic explorer; AIW's `llm` analyser calls it).

  Raises:
    ValueError: an unknown name, or settings the sampler refuses.
  """
  if name not in SAMPLERS:
    raise ValueError(f"unknown task sampler {name!r} (known: {sorted(SAMPLERS)})")
  return SAMPLERS[name](cfg, llm)


if TYPE_CHECKING:  # mypy checks UniformSampler against the TaskSampler protocol

  def _conforms(sampler: UniformSampler) -> TaskSampler:
    return sampler
