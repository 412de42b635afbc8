"""Stage 2's types (paper Sec. 3.2, docs/design.md §1.2), shared by every benchmark.

An `Explorer` acts in fresh instances of the real environment for an `ExplorationContext` (an
environment state, an optional signal with its guidance text and focus, and a budget of runs and
steps) and returns (action, observation, run id) `Triplet`s. Benchmarks implement explorers
(BFCL: programmatic and LLM-driven tool calls; AppWorld: LLM-written code), the feedback loop
reads only these types.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np

from coevolve_jax.types import Task

SIGNALS = (None, "forgetting", "boundary", "rare")  # None: unguided (D0, random re-exploration)
# The signal-specific guidance of paper Sec. 3.2, given to an LLM explorer with its context.
GUIDANCE = {
  "forgetting": (
    "The agent has forgotten an operation it used to perform correctly. Re-practise the "
    "forgotten operation exactly first, then variations of it, then connect it to related "
    "operations, going from simple to complex."
  ),
  "rare": (
    "The agent rarely uses this action pattern. Vary the rare scenario: try other parameter "
    "combinations and edge cases of the rare calls."
  ),
  "boundary": (
    "The agent sometimes succeeds and sometimes fails here. Make small variations of the "
    "parameters and find out what distinguishes the successful from the failed attempts."
  ),
  None: "Explore the environment freely: try the available tools on the objects you discover.",
}
# The keys of a context summary (paper Sec. 3.2, Fig. 11).
SUMMARY_KEYS = (
  "summary",
  "failure_cause",
  "instability_pattern",
  "focus_pattern",
  "exploration_objectives",
  "do_not_repeat",
)


@dataclasses.dataclass(frozen=True)
class Triplet:
  """One successful exploration step: the action (a call string, a code block), its
  (untruncated) result, and the run it belongs to."""

  action: str
  observation: str
  run_id: int


@dataclasses.dataclass
class ExplorationContext:
  """What to explore: an environment state, an optional signal with its focus, and the budget.

  Attributes:
    task_id: the base task or environment-state id (provenance only).
    initial_config / involved_classes: the environment state (`Task`'s fields of that name).
    signal: None (unguided), "forgetting", "boundary" or "rare".
    focus_calls: call strings (or API names) from the marked trajectory or the task's ground
      truth.
    summary: the context summary with keys SUMMARY_KEYS (by the LLM when one is configured,
      else from the benchmark's template).
    rounds: independent runs, each in a fresh environment. steps_per_round: actions per run.
    base: the task whose state is explored, when a benchmark needs more of it than its state.
  """

  task_id: str
  initial_config: dict[str, Any]
  involved_classes: list[str]
  signal: str | None = None
  focus_calls: list[str] = dataclasses.field(default_factory=list)
  summary: dict[str, Any] = dataclasses.field(default_factory=dict)
  rounds: int = 4
  steps_per_round: int = 12
  base: Task | None = None

  @property
  def guidance(self) -> str:
    return GUIDANCE[self.signal]


class Explorer(Protocol):
  """Acts in fresh real environments for `context`; deterministic for a given rng state.

  `trace` holds the last `explore` call's every attempted step ({"run", "step", "action",
  "observation", "ok"}), failed attempts included; empty when the explorer keeps only its
  triplets.
  """

  name: str
  trace: list[dict[str, Any]]

  def explore(self, context: ExplorationContext, rng: np.random.Generator) -> list[Triplet]: ...


@dataclasses.dataclass
class Exploration:
  """What exploring one context found, as a `Synthesizer` hands it to its abstraction.

  Attributes:
    triplets: the successful steps, in order.
    trace: rows for exploration.jsonl (every attempted step, in the benchmark's row format).
    meta: benchmark-specific facts the abstraction needs (AppWorld: the derived tasks' scenario).
  """

  triplets: list[Triplet]
  trace: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)
