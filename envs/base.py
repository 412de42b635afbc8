"""The two doors between the CoEvolve loop and a benchmark: `Env` (one episode) and `Suite`.

Environments are plain Python (no JAX). The agent loop drives an episode as:

    env = suite.make_env(task, episode_id)    # a fresh, isolated instance per episode
    result = env.reset()                      # StepResult with the first user message
    while not result.done:
        result = env.step(Action(...))        # tool results, or the next user message
    result.reward                             # set on the final StepResult
    env.close()                               # frees per-episode state

A `Suite` is everything one benchmark gives a run (tasks, episodes, the initial task set D0,
warm-start demonstrations, the synthesis of a feedback round, its own metrics); `loop.py` talks
to a benchmark only through it, and `envs.make_suite(cfg, workdir)` picks one by `cfg.env`. The
shared types (`Task`, `Action`, `StepResult`, `Trajectory`, ...) live in `coevolve_jax.types`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from coevolve_jax.feedback.llm import TextLLM
from coevolve_jax.chat import ChatFormat
from coevolve_jax.feedback.rounds import RoundResult
from coevolve_jax.feedback.signals import SignalEvent
from coevolve_jax.types import Action, StepResult, Task, Trajectory


def truncate_observation(text: str, max_chars: int, max_tokens: int = 0) -> str:
  """An environment output as the model is shown it: cut to `max_tokens` Qwen tokens when that
  is > 0 (the paper cuts observations at 4,096 tokens), else to `max_chars` characters, plus a
  marker saying how much was dropped."""
  if max_tokens > 0:
    from coevolve_jax.tokenizer import get_tokenizer  # noqa: PLC0415 (tokenizer files, once)

    enc = get_tokenizer().tokenizer.encode(text, add_special_tokens=False)
    if len(enc.ids) <= max_tokens:
      return text
    end = enc.offsets[max_tokens - 1][1]
    return f"{text[:end]}... [truncated {len(enc.ids) - max_tokens} tokens]"
  if len(text) <= max_chars:
    return text
  return f"{text[:max_chars]}... [truncated {len(text) - max_chars} characters]"


class Env(Protocol):
  """An episode of one task. Implementations must not share state between instances."""

  # Tool schemas, Qwen/OpenAI style {"type": "function", "function": {...}}.
  tools: list[dict[str, Any]]
  system_prompt: str | None
  # What the agent called so far, per user turn, per model step (call strings or API names);
  # the trajectory and the signals' action patterns are built from it.
  calls: list[list[list[str]]]

  def reset(self) -> StepResult: ...

  def step(self, action: Action) -> StepResult: ...

  def close(self) -> None: ...


class Suite(Protocol):
  """One benchmark behind one door (paper Sec. 3: the three stages on that benchmark).

  Attributes:
    name: the suite's name, as in `cfg.env` ("bfcl", "appworld").
    train_tasks: training entries; for D0 only their environment states are read.
    eval_tasks: the whole held-out split. The loop evaluates a prefix of it; the task pool's leak
      filter compares every new task against all of it.
  """

  name: str
  train_tasks: Sequence[Task]
  eval_tasks: Sequence[Task]

  def make_env(self, task: Task, episode_id: str, *, eval: bool = False) -> Env:
    """A fresh, isolated episode of `task`; `eval=True` gives the evaluation limits."""
    ...

  def initial_tasks(
    self, n: int, rng: np.random.Generator, llm: TextLLM | None
  ) -> tuple[list[Task], dict[str, int]]:
    """D0 (paper Sec. 3.4): up to `n` validated tasks and counts of how they were made
    (attempted, accepted, rejected, ...). `llm` is the D0 explorer's LLM, None for programmatic."""
    ...

  def generated_eval_tasks(
    self, n: int, rng: np.random.Generator, llm: TextLLM | None
  ) -> list[Task]:
    """Up to `n` validated tasks made like D0 (same explorer and settings) but from the held-out
    entries' environment states, with ids "eval-gen-00000", ...: the run's generated held-out
    set (`eval.generated_tasks`). Suites without one refuse `eval.generated_tasks > 0` in their
    `validate_config`."""
    ...

  def demonstration(self, task: Task, chat: ChatFormat, episode_id: str) -> Trajectory:
    """A teacher-forced trajectory of `task`'s ground truth, really executed (warm-start)."""
    ...

  def synthesize_round(
    self,
    events: Sequence[SignalEvent],
    rng: np.random.Generator,
    round_idx: int,
    llm: TextLLM | None,
  ) -> RoundResult:
    """Stages 2-3 (paper Sec. 3.2-3.3) for already selected events: explore, abstract, validate.

    Runs in a worker thread beside training: it must read only its arguments and the suite's own
    immutable state, and never touch the pool (the loop commits the result).
    """
    ...

  def metrics(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """The suite's own figures for an evaluation (AppWorld: TGC / SGC); {} when it has none."""
    ...

  def close(self) -> None:
    """Frees what the suite started (servers, worker processes)."""
    ...
