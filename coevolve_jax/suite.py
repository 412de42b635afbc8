"""The contracts between the CoEvolve loop and a benchmark: `Env` (one episode) and `Suite`.

Environments are plain Python (no JAX). The agent loop drives an episode as:

    env = suite.make_env(task, episode_id)    # a fresh, isolated instance per episode
    result = env.reset()                      # StepResult with the first user message
    while not result.done:
        result = env.step(Action(...))        # tool results, or the next user message
    result.reward                             # set on the final StepResult
    env.close()                               # frees per-episode state

A `Suite` is what one benchmark must supply to a run: its tasks, its episodes, warm-start
demonstrations, the hooks of the paper's stages 2-3 (`synthesizer(llm)`, a
`feedback.synthesis.Synthesizer`: the D0 and feedback-round skeletons over them are written once,
in `coevolve_jax.feedback.synthesis`), its own evaluation figures, and whether it runs on several
processes. The loop talks to a benchmark only through it.

Suites are plug-ins: `SUITES` maps a name (`cfg.env`) to the module that implements it, imported
by name at run time, so the core never imports a benchmark. A module implementing a suite defines
`Suite` (the class, built as `Suite(cfg, workdir)`), `check_setup(cfg)` (what the suite needs on
this machine, checked in seconds and without JAX) and `validate_config(cfg)` (its own config
fields). `cfg.env` may also be a dotted module path (`mypkg.my_suite`) of a suite outside this
repository.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from coevolve_jax.chat import ChatFormat
from coevolve_jax.types import Action, StepResult, Task, Trajectory

if TYPE_CHECKING:  # the feedback package imports this module's neighbours, not this module
  from coevolve_jax.feedback.llm import TextLLM
  from coevolve_jax.feedback.synthesis import Synthesizer

# Suite name -> the module that implements it (see the module docstring).
SUITES = {"bfcl": "envs.bfcl.suite", "appworld": "envs.appworld.suite"}


class SuiteUnavailable(RuntimeError):
  """What a suite needs on this machine is missing; the message gives the set-up steps."""


class Env(Protocol):
  """An episode of one task. Implementations must not share state between instances.

  Attributes:
    tools: tool schemas, Qwen/OpenAI style {"type": "function", "function": {...}}.
    system_prompt: the episode's system message, or None.
    calls: what the agent called so far, per user turn, per model step (BFCL: the call strings
      that ran; AppWorld: the step's code block, none for a reply without one).
      `Trajectory.calls` (eval rows, signal events, the stage-2 summary) is built from it: from
      the final StepResult's info["per_turn_calls"] when the episode is graded, else from
      `calls` itself. The signals' action patterns are not: they read `Trajectory.tool_names`,
      the names of the tool calls the chat format parses from each reply, replaced for a step by
      the names in its StepResult's info["tool_names"] where the environment gives them
      (`agent.STEP_TOOL_NAMES`; AppWorld: the APIs the step's code names).
    observations: per user turn, the output of each call in `calls` as the model saw it ([]
      for environments that keep none): the stage-2 summary's evidence (docs/design.md §1.2).
  """

  tools: list[dict[str, Any]]
  system_prompt: str | None
  calls: list[list[list[str]]]
  observations: list[list[str]]

  def reset(self) -> StepResult: ...

  def step(self, action: Action) -> StepResult: ...

  def close(self) -> None: ...


class Suite(Protocol):
  """One benchmark behind one door (paper Sec. 3: the three stages on that benchmark).

  Attributes:
    name: the suite's name, as in `cfg.env` ("bfcl", "appworld").
    multi_process: whether a run may use several JAX processes with this suite (every process
      builds the suite). The loop refuses several processes when False.
    env_on_primary: with several processes, whether the suite's environments (episodes and
      warm-start demonstrations) run on process 0 only, their results broadcast to the others
      (`AgentRunner(env_on_primary=True)`): for a suite whose environments are servers and
      files that exist once per job (AppWorld). When False every process runs its own
      episodes, which must then be deterministic (BFCL's; the rollouts' agreement check stops
      the job where they are not).
    train_tasks: training entries; D0 and the rounds read only their environment states.
    eval_tasks: the whole held-out split. The loop evaluates a prefix of it; the task pool's leak
      filter compares every new task against all of it.
    data_release: which release of the benchmark's data the run explores and is scored on
      (package versions, files), written to summary.json so that figures say what they are on.
  """

  name: str
  multi_process: bool
  env_on_primary: bool
  train_tasks: Sequence[Task]
  eval_tasks: Sequence[Task]
  data_release: dict[str, Any]

  def make_env(self, task: Task, episode_id: str, *, eval: bool = False) -> Env:
    """A fresh, isolated episode of `task`; `eval=True` gives the evaluation limits."""
    ...

  def demonstration(
    self,
    task: Task,
    chat: ChatFormat,
    episode_id: str,
    predict: Callable[[str], str | None] | None = None,
  ) -> Trajectory:
    """A teacher-forced trajectory of `task`'s ground truth, really executed (warm-start).
    `predict`: Role-Agent's WIA predictions (`warmstart.demonstration`), None for none."""
    ...

  def synthesizer(self, llm: TextLLM | None) -> Synthesizer:
    """The stage 2-3 hooks (`feedback.synthesis.Synthesizer`) for the explorer LLM `llm` (None:
    the suite's programmatic explorer). Called once per D0, generated set or round; the object
    may run in a worker thread beside training and must read only the suite's immutable state.
    """
    ...

  def metrics(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """The suite's own figures for an evaluation (AppWorld: TGC / SGC); {} when it has none."""
    ...

  def close(self) -> None:
    """Frees what the suite started (servers, worker processes)."""
    ...


def suite_module(name: str) -> Any:
  """The module implementing suite `name` (a `SUITES` name or a dotted module path).

  Raises:
    ValueError: an unknown name, or a module path that does not import.
  """
  path = SUITES.get(name, name if "." in str(name) else None)
  if path is None:
    raise ValueError(f"env must be one of {sorted(SUITES)} or a suite module path, got {name!r}")
  try:
    return importlib.import_module(path)
  except ImportError as e:
    if name in SUITES:
      raise
    raise ValueError(f"env={name!r}: the suite module does not import ({e})") from e


def check_setup(cfg: Any) -> None:
  """Raises SuiteUnavailable (with the set-up steps) when `cfg.env`'s suite cannot run here."""
  suite_module(cfg.env).check_setup(cfg)


def validate_config(cfg: Any) -> None:
  """Checks the fields only `cfg.env`'s suite reads; ValueError names the first bad one."""
  suite_module(cfg.env).validate_config(cfg)


def make_suite(cfg: Any, workdir: str) -> Suite:
  """The `Suite` named by `cfg.env`, built from the run config; it may write under `workdir`.

  Raises:
    ValueError: unknown `cfg.env`.
    SuiteUnavailable: the suite's environment or data is missing.
  """
  return suite_module(cfg.env).Suite(cfg, workdir)
