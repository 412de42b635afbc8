"""BFCL as a CoEvolve suite: the one object the loop talks to for this benchmark.

Tasks: the entries of `cfg.bfcl.category` that bfcl-eval ships, split by a seeded shuffle into
training entries (whose environment states seed D0 and feedback rounds) and a held-out evaluation
split of `cfg.bfcl.eval_size` entries. Episodes run on the real backends and are scored by the
official multi-turn checker. D0, the generated held-out set and feedback rounds run the core's
skeleton over `envs.bfcl.synthesis.BfclSynthesizer` with the explorer that matches the LLM the loop
hands over (programmatic when there is none). Every backend
call (episodes, sandboxes, checker) runs in the worker processes of `envs.bfcl.backends` under the
config's `backends` bounds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from coevolve_jax import config, warmstart
from coevolve_jax.chat import ChatFormat
from coevolve_jax.feedback.llm import TextLLM
from coevolve_jax.suite import SuiteUnavailable
from coevolve_jax.types import Task, Trajectory
from envs.bfcl import backends, synthesis
from envs.bfcl.calls import parse_call_string
from envs.bfcl.data import (
  convert_doc,
  data_release,
  disjoint_states,
  import_bfcl,
  load_bfcl_tasks,
  split_tasks,
)
from envs.bfcl.env import BfclEnv, make_env


log = logging.getLogger(__name__)
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
  """The `bfcl` group: the entries (category, eval_size, explore_category), prompt settings
  (tool_style, checked by the converter that uses it; max_obs_chars / max_obs_tokens), the
  training episodes' max_steps_per_turn, D0's backend classes, the wall-clock budget of one
  reply's calls (reply_wall_s, a finite number of seconds > 0), and the execution bounds
  `bfcl.backends.*` (call_wall_s a finite number > 0, worker_memory_mib an int >=
  `backends.MIN_WORKER_MEMORY_MIB`, workers an int >= 1). The categories' data is checked where
  it is loaded.

  Raises:
    ValueError: the first bad field, named.
  """
  for field in ("bfcl.category", "bfcl.explore_category"):
    if not isinstance(config.get(cfg, field), str):
      config.fail(field, "must be a BFCL category name (or '')", config.get(cfg, field))
  config.int_at_least(cfg, "bfcl.eval_size", 0)  # its upper bound (the entries) at load
  style = config.get(cfg, "bfcl.tool_style")
  config.owner("bfcl.tool_style", lambda: convert_doc({"name": "probe"}, style))
  config.int_at_least(cfg, "bfcl.max_obs_chars", 1)
  config.int_at_least(cfg, "bfcl.max_obs_tokens", 0)
  config.int_at_least(cfg, "bfcl.max_steps_per_turn", 1)
  config.int_at_least(cfg, "bfcl.max_classes", 0)
  config.number(cfg, "bfcl.reply_wall_s", lo=0.0, lo_open=True)
  only = config.get(cfg, "bfcl.only_classes")
  if not isinstance(only, (tuple, list)) or not all(isinstance(c, str) for c in only):
    config.fail("bfcl.only_classes", "must be a tuple of BFCL backend class names", only)
  config.number(cfg, "bfcl.backends.call_wall_s", lo=0.0, lo_open=True)
  config.int_at_least(cfg, "bfcl.backends.worker_memory_mib", backends.MIN_WORKER_MEMORY_MIB)
  config.int_at_least(cfg, "bfcl.backends.workers", 1)


def backend_pool(cfg: Any) -> backends.BackendPool:
  """The process-wide backend pool with the config's `backends` bounds (`backends.configure`).

  Raises:
    ValueError: a bad `backends` field.
  """
  return backends.configure(backends.Bounds.from_config(cfg.bfcl.backends))


def make_episode(cfg: Any, task: Task, episode_id: str, *, eval: bool = False) -> BfclEnv:
  """A BFCL episode with the run config's prompt settings (`bfcl.tool_style`,
  `bfcl.max_obs_chars`, or `bfcl.max_obs_tokens` when > 0) and the wall-clock budget of one
  reply's calls (`bfcl.reply_wall_s`, seconds; training and evaluation alike).

  Training (`eval=False`): a reply that cannot be parsed gets an error observation and the turn
  goes on; `bfcl.max_steps_per_turn` model steps force-terminate the episode. Evaluation
  (`eval=True`): BFCL's own loop (an undecodable or call-free reply ends the user turn; more than
  `eval.max_steps_per_turn` executed steps in a turn force-terminate the entry; 20 is BFCL's
  limit). The in-loop evaluation (`eval_before` / `eval_after`) and `envs.bfcl.evaluate`
  both use this.
  """
  return make_env(
    task,
    episode_id,
    max_obs_chars=cfg.bfcl.max_obs_chars,
    max_obs_tokens=cfg.bfcl.get("max_obs_tokens", 0),
    tool_style=cfg.bfcl.tool_style,
    max_steps_per_turn=cfg.eval.max_steps_per_turn if eval else cfg.bfcl.max_steps_per_turn,
    official_loop=eval,
    reply_wall_s=cfg.bfcl.reply_wall_s,
  )


class BfclSuite:
  """BFCL multi-turn behind `coevolve_jax.suite.Suite` (see the module docstring).

  Args:
    cfg: the full run config (configs/bfcl.py): reads `seed`, `bfcl`, `explore` and the step
      limit of `eval`.
    workdir: the run's folder (unused: BFCL writes nothing of its own).
  """

  name = "bfcl"
  # Backends are deterministic and per process: every process runs its own episodes.
  multi_process = True
  env_on_primary = False
  train_tasks: Sequence[Task]  # as the Suite protocol declares them (lists here)
  eval_tasks: Sequence[Task]

  def __init__(self, cfg: Any, workdir: str):
    del workdir
    self._pool = backend_pool(cfg)  # sandboxes of D0 and feedback rounds use it too
    entries = load_bfcl_tasks(cfg.bfcl.category)
    self.train_tasks, self.eval_tasks = split_tasks(entries, cfg.bfcl.eval_size, cfg.seed)
    if cfg.bfcl.get("explore_category"):  # states from another category (all of it)
      self.train_tasks = load_bfcl_tasks(cfg.bfcl.explore_category)
    if cfg.explore.eval_states == "disjoint":  # no evaluation entry's state is explored
      self.train_tasks, changed = disjoint_states(list(self.train_tasks), list(self.eval_tasks))
      log.info(
        "BFCL exploration states: %d entries; %d classes moved to their default state or left "
        "out because an evaluation entry starts from their state (explore.eval_states)",
        len(self.train_tasks),
        changed,
      )
      if not self.train_tasks:
        raise ValueError(
          "explore.eval_states = 'disjoint' leaves no BFCL state to explore: every class state "
          "of the exploration entries is an evaluation entry's. Choose another "
          "bfcl.explore_category, or explore.eval_states = 'shared_with_eval'"
        )
    self._cfg = cfg
    # The data the run is scored and explores on (summary.json "data_release").
    self.data_release = data_release([cfg.bfcl.category, cfg.bfcl.get("explore_category", "")])
    ex = cfg.explore
    self.settings = synthesis.SynthesisSettings(
      min_calls=ex.min_calls,
      max_calls=ex.max_calls,
      max_turns=ex.turns_per_task,
      rounds=ex.rounds,
      steps_per_round=ex.steps_per_round,
      judge=ex.judge,
      max_classes=cfg.bfcl.max_classes,
      only_classes=tuple(cfg.bfcl.only_classes),
    )

  def make_env(self, task: Task, episode_id: str, *, eval: bool = False) -> BfclEnv:
    """A fresh BfclEnv: training semantics, or BFCL's own loop for evaluation (`make_episode`)."""
    return make_episode(self._cfg, task, episode_id, eval=eval)

  def synthesizer(self, llm: TextLLM | None) -> synthesis.BfclSynthesizer:
    """The stage 2-3 hooks with the explorer for `llm` and the configured settings."""
    return synthesis.BfclSynthesizer(self.settings, llm)

  def demonstration(
    self,
    task: Task,
    chat: ChatFormat,
    episode_id: str,
    predict: Callable[[str], str | None] | None = None,
  ) -> Trajectory:
    """The ground-truth calls, one per reply, executed in a training episode (with WIA's
    predictions when `predict` is given: `warmstart.demonstration`)."""
    return warmstart.demonstration(
      task, chat, self.make_env, parse_call_string, episode_id, predict
    )

  def metrics(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """BFCL's own figure is the success rate the loop already reports: nothing to add."""
    del trajectories
    return {}

  def close(self) -> None:
    """Ends and reaps the backend worker processes (every episode has deleted its own
    instances already)."""
    self._pool.close()


Suite = BfclSuite


if TYPE_CHECKING:  # mypy checks BfclSuite against the Suite protocol
  from coevolve_jax.suite import Suite as SuiteProtocol

  def _conforms(suite: BfclSuite) -> SuiteProtocol:
    return suite
