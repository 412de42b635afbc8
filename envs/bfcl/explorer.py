"""Stage 2 on BFCL (docs/design.md §1.2): the LLM-free explorer of the real backends.

An explorer (`coevolve_jax.feedback.exploration.Explorer`) acts in fresh backend instances for an
`ExplorationContext` and returns (action, observation, run id) triplets. `ProgrammaticExplorer`
needs no LLM: it samples valid calls from the tool schemas and values seen in the environment
state. The LLM explorer is `llm_explorer.LLMExplorer` over a `TextLLM`; it puts the signals'
guidance texts (`exploration.GUIDANCE`) in its prompts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from coevolve_jax.feedback.exploration import ExplorationContext, Triplet
from coevolve_jax.types import ToolCall
from envs.bfcl.calls import ToolCallError, parse_call_string
from envs.bfcl.sandbox import Sandbox
from envs.bfcl.values import ValuePool, sample_arguments, vary_arguments


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


if TYPE_CHECKING:  # mypy checks ProgrammaticExplorer against the Explorer protocol
  from coevolve_jax.feedback.exploration import Explorer

  def _conforms(explorer: ProgrammaticExplorer) -> Explorer:
    return explorer
