"""BFCL as a CoEvolve suite: the one object the loop talks to for this benchmark.

Tasks: the entries of `cfg.data.category` that bfcl-eval ships, split by a seeded shuffle into
training entries (whose environment states seed D0 and feedback rounds) and a held-out evaluation
split of `cfg.data.eval_size` entries. Episodes run on the real backends and are scored by the
official multi-turn checker. D0 and feedback rounds go through `envs.bfcl.synthesis` with the
explorer that matches the LLM the loop hands over (programmatic when there is none). Every backend
call (episodes, sandboxes, checker) runs in the worker processes of `envs.bfcl.backends` under the
config's `backends` bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from coevolve_jax import config, warmstart
from coevolve_jax.feedback.llm import TextLLM
from coevolve_jax.chat import ChatFormat
from coevolve_jax.feedback.rounds import RoundResult
from coevolve_jax.feedback.signals import SignalEvent
from coevolve_jax.types import Task, Trajectory
from envs import SuiteUnavailable
from envs.bfcl import backends, synthesis
from envs.bfcl.calls import parse_call_string
from envs.bfcl.data import convert_doc, import_bfcl, load_bfcl_tasks, split_tasks
from envs.bfcl.env import BfclEnv, make_env


BFCL_EVAL = "bfcl-eval==2026.3.23"  # the version setup.py and the Makefile install


def check_setup(cfg: Any) -> None:
  """Raises SuiteUnavailable unless bfcl-eval (installed with --no-deps by `make setup`) imports."""
  del cfg
  try:
    import_bfcl()
  except ImportError as e:
    raise SuiteUnavailable(
      f"BFCL is not available ({e}). Install it with `make setup`, or by hand:\n"
      f"  pip install --no-deps {BFCL_EVAL}   (its offline needs are in setup.py)"
    ) from e


def validate_config(cfg: Any) -> None:
  """BFCL's own fields: the tool style (checked by the converter that uses it) and the execution
  bounds `backends.*` (call_wall_s a finite number > 0, worker_memory_mib an int >=
  `backends.MIN_WORKER_MEMORY_MIB`, workers an int >= 1).

  Raises:
    ValueError: the first bad field, named.
  """
  style = config.get(cfg, "data.tool_style")
  config.owner("data.tool_style", lambda: convert_doc({"name": "probe"}, style))
  config.number(cfg, "backends.call_wall_s", lo=0.0, lo_open=True)
  config.int_at_least(cfg, "backends.worker_memory_mib", backends.MIN_WORKER_MEMORY_MIB)
  config.int_at_least(cfg, "backends.workers", 1)


def backend_pool(cfg: Any) -> backends.BackendPool:
  """The process-wide backend pool with the config's `backends` bounds (`backends.configure`).

  Raises:
    ValueError: a bad `backends` field.
  """
  return backends.configure(backends.Bounds.from_config(cfg.backends))


def make_episode(cfg: Any, task: Task, episode_id: str, *, eval: bool = False) -> BfclEnv:
  """A BFCL episode with the run config's prompt settings (`data.tool_style`,
  `data.max_obs_chars`, or `data.max_obs_tokens` when > 0).

  Training (`eval=False`): a reply that cannot be parsed gets an error observation and the turn
  goes on; `rollout.max_steps_per_turn` model steps force-terminate the episode. Evaluation
  (`eval=True`): BFCL's own loop (an undecodable or call-free reply ends the user turn; more than
  `eval.max_steps_per_turn` executed steps in a turn force-terminate the entry; 20 is BFCL's
  limit). The in-loop evaluation (`eval_before` / `eval_after`) and `coevolve_jax.cli.evaluate`
  both use this.
  """
  return make_env(
    task,
    episode_id,
    max_obs_chars=cfg.data.max_obs_chars,
    max_obs_tokens=cfg.data.get("max_obs_tokens", 0),
    tool_style=cfg.data.tool_style,
    max_steps_per_turn=cfg.eval.max_steps_per_turn if eval else cfg.rollout.max_steps_per_turn,
    official_loop=eval,
  )


class BfclSuite:
  """BFCL multi-turn behind `envs.base.Suite` (see the module docstring).

  Args:
    cfg: the full run config (configs/bfcl.py): reads `seed`, `data`, `backends`, `explore`,
      `feedback.validate` and the step limits of `rollout` and `eval`.
    workdir: the run's folder (unused: BFCL writes nothing of its own).
  """

  name = "bfcl"

  def __init__(self, cfg: Any, workdir: str):
    del workdir
    self._pool = backend_pool(cfg)  # sandboxes of D0 and feedback rounds use it too
    entries = load_bfcl_tasks(cfg.data.category)
    self.train_tasks, self.eval_tasks = split_tasks(entries, cfg.data.eval_size, cfg.seed)
    if cfg.data.get("explore_category"):  # states from another category (all of it)
      self.train_tasks = load_bfcl_tasks(cfg.data.explore_category)
    self._cfg = cfg
    ex = cfg.explore
    self._d0_args = {
      "min_calls": ex.min_calls,
      "max_calls": ex.max_calls,
      "max_turns": ex.turns_per_task,
      "rounds": ex.rounds,
      "steps_per_round": ex.steps_per_round,
      "max_classes": ex.max_classes or None,
      "only_classes": tuple(ex.only_classes),
    }
    self.settings = synthesis.SynthesisSettings(
      min_calls=ex.min_calls,
      max_calls=ex.max_calls,
      max_turns=ex.turns_per_task,
      rounds=ex.rounds,
      steps_per_round=ex.steps_per_round,
      validate=cfg.feedback.validate,
      judge=ex.judge,
    )

  def make_env(self, task: Task, episode_id: str, *, eval: bool = False) -> BfclEnv:
    """A fresh BfclEnv: training semantics, or BFCL's own loop for evaluation (`make_episode`)."""
    return make_episode(self._cfg, task, episode_id, eval=eval)

  def initial_tasks(
    self, n: int, rng: np.random.Generator, llm: TextLLM | None
  ) -> tuple[list[Task], dict[str, int]]:
    """D0 by unguided exploration of the training entries' states (see `synthesis`)."""
    counts: dict[str, int] = {}
    explorer = synthesis.make_explorer(llm)
    tasks = synthesis.build_initial_tasks(
      self.train_tasks, n, explorer, rng, counts=counts, llm=llm, **self._d0_args
    )
    return tasks, counts

  def generated_eval_tasks(
    self, n: int, rng: np.random.Generator, llm: TextLLM | None
  ) -> list[Task]:
    """D0's exploration (`initial_tasks`' explorer and settings, `only_classes` included) over
    the held-out entries' states: up to `n` validated tasks, ids "eval-gen-00000", ..., source
    "explore_eval". Only the entries' initial states are read, never their questions or answers.
    """
    tasks = synthesis.build_initial_tasks(
      list(self.eval_tasks), n, synthesis.make_explorer(llm), rng, llm=llm, **self._d0_args
    )
    for i, task in enumerate(tasks):
      task.task_id, task.source = f"eval-gen-{i:05d}", "explore_eval"
    return tasks

  def demonstration(self, task: Task, chat: ChatFormat, episode_id: str) -> Trajectory:
    """The ground-truth calls, one per reply, executed in a training episode."""
    return warmstart.demonstration(task, chat, self.make_env, parse_call_string, episode_id)

  def synthesize_round(
    self,
    events: Sequence[SignalEvent],
    rng: np.random.Generator,
    round_idx: int,
    llm: TextLLM | None,
  ) -> RoundResult:
    """`synthesis.synthesize_round` with the explorer for `llm` and the configured settings."""
    explorer = synthesis.make_explorer(llm)
    return synthesis.synthesize_round(list(events), explorer, rng, round_idx, self.settings, llm)

  def metrics(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """BFCL's own figure is the success rate the loop already reports: nothing to add."""
    del trajectories
    return {}

  def close(self) -> None:
    """Ends and reaps the backend worker processes (every episode has deleted its own
    instances already)."""
    self._pool.close()


Suite = BfclSuite
