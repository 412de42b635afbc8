"""Stage 2 (docs/design.md §1.2): signal-guided re-exploration of the real environment.

An Explorer acts in fresh backend instances for an ExplorationContext and returns (action,
observation, run id) triplets. `ProgrammaticExplorer` needs no LLM: it samples valid calls from the
tool schemas and values seen in the environment state. The LLM explorers (Gemini via google-genai,
a local model served by our engine) are `llm_explorer.LLMExplorer` over a `llm.TextLLM`; they
implement the same `Explorer` protocol and put the GUIDANCE texts below in their prompts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np

from envs.bfcl.sandbox import Sandbox
from envs.bfcl.values import ValuePool, sample_arguments, vary_arguments
from coevolve_jax.types import ToolCall
from envs.bfcl.calls import ToolCallError, parse_call_string

SIGNALS = (None, "forgetting", "boundary", "rare")
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
  """One successful exploration step: the call string, its (untruncated) result, and the run it
  belongs to."""

  action: str
  observation: str
  run_id: int


@dataclasses.dataclass
class ExplorationContext:
  """What to explore: an environment state, an optional signal with its focus calls, and the budget.

  Attributes:
    task_id: the base task or environment-state id (provenance only).
    initial_config / involved_classes: the BFCL environment state.
    signal: None (unguided), "forgetting", "boundary" or "rare".
    focus_calls: call strings from the marked trajectory or the task's ground truth.
    summary: docs/design.md §1.2 context with keys SUMMARY_KEYS (by the LLM when one is
      configured, else from a template).
    rounds: independent runs, each in a fresh backend. steps_per_round: call attempts per run.
  """

  task_id: str
  initial_config: dict[str, Any]
  involved_classes: list[str]
  signal: str | None = None
  focus_calls: list[str] = dataclasses.field(default_factory=list)
  summary: dict[str, Any] = dataclasses.field(default_factory=dict)
  rounds: int = 4
  steps_per_round: int = 12

  @property
  def guidance(self) -> str:
    return GUIDANCE[self.signal]


class Explorer(Protocol):
  """Acts in fresh real environments for `context`; deterministic for a given rng state.

  `trace` holds the last `explore` call's every attempted step (run, action, observation, ok),
  failed attempts included; empty when the explorer keeps only its triplets.
  """

  name: str
  trace: list[dict[str, Any]]

  def explore(self, context: ExplorationContext, rng: np.random.Generator) -> list[Triplet]: ...


class ProgrammaticExplorer:
  """LLM-free explorer: samples schema-valid calls, keeps those that executed without error.

  Behaviour per signal: forgetting replays the focus calls exactly, then varies them; boundary makes
  small parameter variations of the focus calls; rare tries other parameter combinations of the rare
  calls; None samples tools uniformly. A share `p_free` of later steps samples any tool in every
  mode.
  """

  name = "programmatic"

  def __init__(self, p_free: float = 0.3, max_attempts: int = 4):
    self.p_free = p_free
    self.max_attempts = max_attempts
    self.trace: list[dict[str, Any]] = []  # only triplets are kept (see Explorer)

  def _focus(self, context: ExplorationContext) -> list[ToolCall]:
    calls = []
    for text in context.focus_calls:
      try:
        calls.append(parse_call_string(text, context.involved_classes))
      except ToolCallError:
        continue
    return calls

  def _propose(
    self,
    sandbox: Sandbox,
    context: ExplorationContext,
    focus: list[ToolCall],
    step: int,
    values: ValuePool,
    rng: np.random.Generator,
  ) -> ToolCall:
    """One candidate call for this step (not yet validated)."""
    if context.signal == "forgetting" and step < len(focus):
      return focus[step]
    usable = [c for c in focus if c.name in sandbox.schemas]
    if context.signal is not None and usable and rng.random() >= self.p_free:
      base = usable[int(rng.integers(len(usable)))]
      schema = sandbox.schemas[base.name]
      scale = 1 if context.signal == "boundary" else 2
      return ToolCall(
        base.name, vary_arguments(base.arguments, schema, values, rng, n_changes=scale)
      )
    names = sorted(sandbox.schemas)
    name = names[int(rng.integers(len(names)))]
    return ToolCall(name, sample_arguments(sandbox.schemas[name], values, rng))

  def _run(
    self, context: ExplorationContext, run_id: int, rng: np.random.Generator
  ) -> list[Triplet]:
    focus = self._focus(context)
    values = ValuePool.from_config(context.initial_config)
    for call in focus:
      values.add_values(call.arguments)
    triplets = []
    with Sandbox(context.initial_config, context.involved_classes, context.task_id) as sandbox:
      for step in range(context.steps_per_round):
        for _ in range(self.max_attempts):
          text, result = sandbox.run_ok(self._propose(sandbox, context, focus, step, values, rng))
          if result is not None:
            triplets.append(Triplet(text, result, run_id))
            values.add_observation(result)
            break
          if context.signal == "forgetting" and step < len(focus):
            break  # An exact replay is attempted once.
    return triplets

  def explore(self, context: ExplorationContext, rng: np.random.Generator) -> list[Triplet]:
    """Runs `context.rounds` independent runs in fresh backends; returns their successful
    triplets."""
    out: list[Triplet] = []
    for run_id in range(context.rounds):
      out.extend(self._run(context, run_id, rng))
    return out
