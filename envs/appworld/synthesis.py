"""AppWorld's hooks for stages 2-3 (paper Sec. 3.2-3.3): `coevolve_jax.feedback.synthesis`
`Synthesizer`s over AppWorld worlds.

* `LLMWorldSynthesizer` (an explorer LLM; official or generated worlds): explores a live world of
  the base task one code block per step (`llm_explorer.AppWorldLLMExplorer`), abstracts code
  steps into tasks, derives each into a task of its own on disk (world.py `derive_task`: graded
  by the answer and database changes of its reference code) and validates it by execution, an
  LLM agent's attempt and the judge.
* `GeneratedWorldSynthesizer` (no LLM; generated worlds only): D0 takes the training worlds whose
  family solution scores 1.0 by execution; a round builds, per marked trajectory, a new world of
  the marked task's family (or a random family the explorer discovered through `apis.api_docs`:
  `DISCOVER_APIS`, `families`) with a fresh seed, validated by execution (the solution scores
  1.0, completing at once scores 0.0).
* `OfficialD0` (`appworld.d0 = "official"`, a baseline): D0 is the split's human-written tasks as
  they are; rounds are the wrapped synthesizer's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from coevolve_jax.feedback.exploration import Exploration, ExplorationContext
from coevolve_jax.feedback.llm import TextLLM
from coevolve_jax.feedback.signals import SignalEvent
from coevolve_jax.feedback.synthesis import Candidate
from coevolve_jax.types import Task
from envs.appworld import llm_explorer
from envs.appworld.env import AppWorldEnv, api_names, task_from_row
from envs.appworld.server import add_worlds, derive_worlds

log = logging.getLogger(__name__)


class WorldHost(Protocol):
  """What the synthesizers need of the run's AppWorld suite (`suite.AppWorldSuite`).

  Attributes:
    aw: the `appworld` config group. root / python: the world root and AppWorld's interpreter.
    seed: the run's seed. explore_args: rounds, steps_per_round, min_calls, max_calls.
    build_args: the world builder's keyword arguments. judge: `explore.judge`.
  """

  aw: Any
  root: str
  python: str
  seed: int
  explore_args: dict[str, int]
  build_args: dict[str, int]
  judge: bool

  def episode(self, task: Task, max_steps: int) -> AppWorldEnv:
    """A fresh episode of `task` with a limit of `max_steps` replies."""
    ...

  def validate(self, task: Task) -> str | None:
    """None when the task is valid by execution, else why not."""
    ...

  def families(self) -> list[str]:
    """The generated task families whose every API the explorer discovered."""
    ...


# APIs each generated task family's solution calls (envs/appworld/world.py _PREAMBLE + template).
FAMILY_APIS = {
  "count_notes": (
    "supervisor.show_account_passwords",
    "supervisor.show_profile",
    "simple_note.login",
    "simple_note.search_notes",
    "supervisor.complete_task",
  ),
  "count_tagged": ("simple_note.login", "simple_note.search_notes", "supervisor.complete_task"),
  "latest_title": ("simple_note.login", "simple_note.search_notes", "supervisor.complete_task"),
  "create_note": ("simple_note.login", "simple_note.create_note", "supervisor.complete_task"),
  "delete_note": (
    "simple_note.login",
    "simple_note.search_notes",
    "simple_note.delete_note",
    "supervisor.complete_task",
  ),
  "count_open_todos": (
    "todoist.login",
    "todoist.show_projects",
    "todoist.show_tasks",
    "supervisor.complete_task",
  ),
  "complete_todo": (
    "todoist.login",
    "todoist.show_projects",
    "todoist.show_tasks",
    "todoist.update_task",
    "supervisor.complete_task",
  ),
}
DISCOVER_APIS = """\
import json
found = {}
for app in apis.api_docs.show_app_descriptions():
    names = [a["name"] for a in apis.api_docs.show_api_descriptions(app_name=app["name"])]
    found[app["name"]] = names
print(json.dumps(found))
"""


def parse_inventory(text: str) -> dict[str, list[str]]:
  """App -> API names from the output of `DISCOVER_APIS`.

  Raises:
    RuntimeError: the output is not that JSON (the discovery code failed in the world).
  """
  try:
    return json.loads(text)
  except ValueError as e:
    raise RuntimeError(f"API discovery through apis.api_docs failed: {text[:500]}") from e


def families(inventory: dict[str, list[str]]) -> list[str]:
  """Task families whose every API is in `inventory` (app -> API names)."""
  found = {f"{app}.{name}" for app, names in inventory.items() for name in names}
  return [f for f, needed in FAMILY_APIS.items() if set(needed) <= found]


def _world_context(
  suite: WorldHost, base: Task, signal: str | None = None, summary=None, focus=()
) -> ExplorationContext:
  """What to explore: the world of `base` (its AppWorld task id), with an optional signal."""
  world = base.initial_config.get("appworld_task_id", base.task_id)
  return ExplorationContext(
    task_id=str(world),
    initial_config={"appworld_task_id": world},
    involved_classes=[],
    signal=signal,
    focus_calls=list(focus),
    summary=dict(summary or {}),
    rounds=suite.explore_args["rounds"],
    steps_per_round=suite.explore_args["steps_per_round"],
    base=base,
  )


_BARE_API = re.compile(r"\w+\.\w+")  # an API name, as events recorded calls before code


def event_apis(event: SignalEvent) -> list[str]:
  """The APIs a marked trajectory's code steps (`event.calls`) name, in order of first use; a
  call that is a bare `<app>.<api>` name (events of checkpoints written before episodes recorded
  their code) counts as itself."""
  names = (
    name
    for turn in event.calls
    for call in turn
    for name in ([call] if _BARE_API.fullmatch(call) else api_names(call))
  )
  return list(dict.fromkeys(names))


def summary_template(event: SignalEvent) -> tuple[dict[str, Any], list[str]]:
  """The template context summary of a marked AppWorld trajectory and its focus (the APIs its
  code called, in order of first use: `event_apis`)."""
  focus = event_apis(event)
  summary = {
    "summary": f"{event.signal} signal on task {event.task.task_id} "
    f"(reward {event.reward:.2f}); APIs used: {', '.join(focus) or 'none'}",
    "failure_cause": "unknown (template summary)" if event.reward < 0.5 else "",
    "instability_pattern": event.signal or "",
    "focus_pattern": focus,
    "exploration_objectives": [f"exercise {api} in new ways" for api in focus],
    "do_not_repeat": [],
  }
  return summary, focus


class LLMWorldSynthesizer:
  """Stages 2-3 on AppWorld with an explorer LLM (see the module docstring).

  Args:
    suite: the run's AppWorld suite (episodes on its servers, its world root and settings).
    llm: the explorer, abstractor, attempting agent and judge.
  """

  revisits = True
  keeps_ids = True  # derived tasks are folders under the world root, named by their scenario

  def __init__(self, suite: WorldHost, llm: TextLLM):
    self.suite, self.llm = suite, llm
    self.name = llm.name

  def d0_bases(self, entries: Sequence[Task]) -> list[Task]:
    return list(entries)

  def d0_context(self, base: Task, rng: np.random.Generator) -> ExplorationContext:
    del rng
    return _world_context(self.suite, base)

  def plan_round(
    self, events: Sequence[SignalEvent], rng: np.random.Generator, round_idx: int
  ) -> list[SignalEvent]:
    del rng, round_idx
    return list(events)

  def summary_template(self, event: SignalEvent) -> tuple[dict[str, Any], list[str]]:
    return summary_template(event)

  def event_context(
    self,
    event: SignalEvent,
    summary: dict[str, Any],
    focus: list[str],
    rng: np.random.Generator,
  ) -> ExplorationContext:
    del rng
    return _world_context(self.suite, event.task, event.signal, summary, focus)

  def explore(
    self,
    context: ExplorationContext,
    rng: np.random.Generator,
    *,
    label: str,
    source: str,
    round_idx: int | None,
  ) -> Exploration:
    """The LLM's runs in fresh episodes of the base world; the derived tasks' scenario id (a
    seeded hash, so one context's tasks share it as AppWorld's tasks of one scenario do)."""
    del label
    explorer = llm_explorer.AppWorldLLMExplorer(self.llm, self.suite.episode)
    triplets = explorer.explore(context, rng)
    draw = int(rng.integers(1 << 62))
    key = f"{self.suite.seed}:{source}:{round_idx}:{context.task_id}:{draw}"
    scenario = hashlib.sha1(key.encode()).hexdigest()[:7]
    rows = [{"scenario": scenario, "parent": context.task_id, **r} for r in explorer.trace]
    return Exploration(triplets, rows, {"scenario": scenario, "explorer": explorer.name})

  def abstract(
    self,
    exploration: Exploration,
    context: ExplorationContext,
    *,
    label: str,
    source: str,
    round_idx: int | None,
  ) -> list[Candidate]:
    """Abstraction (`llm_explorer.abstract_tasks`), then derivation of each task into its own
    folder under the world root (ids "<scenario>_1", ...)."""
    del label
    args = self.suite.explore_args
    choices = llm_explorer.abstract_tasks(
      self.llm,
      exploration.triplets,
      context,
      min_calls=args["min_calls"],
      max_calls=args["max_calls"],
    )
    if not choices:
      log.info("abstraction found no task in the exploration of %s", context.task_id)
      return []
    scenario = exploration.meta["scenario"]
    out: list[tuple[str, Task | None, str]]
    usable, out = [], []
    for j, choice in enumerate(choices):
      try:
        usable.append(
          (choice, llm_explorer.derive_spec(choice, f"{scenario}_{j + 1}", context.task_id))
        )
      except ValueError as e:
        out.append((f"{scenario}_{j + 1}", None, f"abstraction: {e}"))
    rows = derive_worlds(self.suite.root, [spec for _, spec in usable], self.suite.python)
    for (choice, _), row in zip(usable, rows, strict=True):
      if row.get("error"):
        out.append((row["task_id"], None, f"derivation: {row['error']}"))
        continue
      task = task_from_row(row, source=source)
      task.provenance.update(
        signal=context.signal,
        round=round_idx,
        parent=context.task_id,
        explorer=exploration.meta["explorer"],
        abstraction="llm",
        run_id=choice.run_id,
        description=choice.description,
        completion=choice.completion,
      )
      out.append((task.task_id, task, ""))
    return out

  def validate(self, task: Task) -> tuple[bool, str]:
    """By execution (the reference solution scores 1.0 through a server, completing at once
    scores 0.0), then with `explore.judge` an LLM agent's attempt, accepted on a positive reward
    or the judge's success (paper Sec. 3.3). The attempt gets `appworld.max_steps` replies, and
    at least `explore.max_calls` + 1 (a task's every step, then complete_task, one per reply)."""
    why = self.suite.validate(task)
    if why is not None:
      return False, why
    if not self.suite.judge:
      task.provenance["validation"] = "execution"
      return True, "ok"
    replies = max(int(self.suite.aw.max_steps), int(self.suite.explore_args["max_calls"]) + 1)
    accepted, info = llm_explorer.attempt_and_judge(self.llm, task, self.suite.episode, replies)
    task.provenance["validation"] = {"reward": info["reward"], "judge": info["judge"]}
    if not accepted:
      return False, f"judge rejected the attempt: {(info['judge'] or {}).get('reason', '')}"
    return True, "ok"


class GeneratedWorldSynthesizer:
  """Stages 2-3 on generated worlds without an LLM (see the module docstring). On official
  data it makes nothing (the official data folder is never written to).

  Args:
    suite: the run's AppWorld suite.
  """

  name = "appworld-programmatic"
  llm = None
  revisits = False  # a training world is one task: trying it twice would add it twice
  keeps_ids = True

  def __init__(self, suite: WorldHost):
    self.suite = suite
    self._round, self._worlds = 0, 0  # the round being planned and its worlds so far

  def d0_bases(self, entries: Sequence[Task]) -> list[Task]:
    return [t for t in entries if t.initial_config.get("solution")]

  def plan_round(
    self, events: Sequence[SignalEvent], rng: np.random.Generator, round_idx: int
  ) -> list[SignalEvent]:
    """The events in a random order: each gets the next new world (`event_context`)."""
    self._round, self._worlds = round_idx, 0
    return [events[int(i)] for i in rng.permutation(len(events))]

  def d0_context(self, base: Task, rng: np.random.Generator) -> ExplorationContext:
    del rng
    return _world_context(self.suite, base)

  def summary_template(self, event: SignalEvent) -> tuple[dict[str, Any], list[str]]:
    return {}, []

  def event_context(
    self,
    event: SignalEvent,
    summary: dict[str, Any],
    focus: list[str],
    rng: np.random.Generator,
  ) -> ExplorationContext:
    """A new world to build: the marked task's family (or a random discovered one) and a seed."""
    context = _world_context(self.suite, event.task, event.signal, summary, focus)
    if self.suite.aw.source != "generated":  # official data: nothing is built (no draws)
      return context
    family = event.task.provenance.get("template")
    if family not in (known := self.suite.families()):
      family = str(rng.choice(sorted(known)))
    seed = int(rng.integers(1 << 30))
    key = f"syn:{self._round}:{self._worlds}:{seed}"  # the world's scenario id, seeded
    self._worlds += 1
    scenario = hashlib.sha1(key.encode()).hexdigest()[:7]
    context.initial_config = {"template": family, "seed": seed, "task_id": f"{scenario}_1"}
    return context

  def explore(
    self,
    context: ExplorationContext,
    rng: np.random.Generator,
    *,
    label: str,
    source: str,
    round_idx: int | None,
  ) -> Exploration:
    """D0: nothing to explore (the training world's family solution is known). A round: the new
    world, built with the offline world builder under the generated root."""
    del rng, label, source, round_idx
    spec = context.initial_config
    if "template" not in spec:  # D0 (the world is the task), or official data
      return Exploration([])
    world = {k: spec[k] for k in ("task_id", "template", "seed")}
    (row,) = add_worlds(self.suite.root, [world], self.suite.python, **self.suite.build_args)
    trace = {
      "task_id": row["task_id"],
      "family": spec["template"],
      "signal": context.signal,
      "parent": context.task_id,
      "instruction": row.get("instruction", ""),
    }
    return Exploration([], [trace], {"row": row})

  def abstract(
    self,
    exploration: Exploration,
    context: ExplorationContext,
    *,
    label: str,
    source: str,
    round_idx: int | None,
  ) -> list[Candidate]:
    del label
    if "row" in exploration.meta:  # a round's new world
      task = task_from_row(exploration.meta["row"], source=source)
      task.provenance.update(
        signal=context.signal, round=round_idx, parent=context.task_id, explorer=self.name
      )
      return [(task.task_id, task, "")]
    base = context.base
    if round_idx is not None or base is None:  # official data: nothing is built
      return []
    return [(base.task_id, Task.from_dict({**json.loads(base.to_json()), "source": source}), "")]

  def validate(self, task: Task) -> tuple[bool, str]:
    why = self.suite.validate(task)
    return why is None, why or "ok"


class OfficialD0:
  """`appworld.d0 = "official"`: D0 is the split's human-written tasks as they are (a baseline
  the paper does not use; official tasks carry no solution here, so there is nothing to
  warm-start on); everything else is `inner`'s.
  """

  revisits = False
  keeps_ids = True

  def __init__(self, inner: LLMWorldSynthesizer | GeneratedWorldSynthesizer):
    self.inner, self.name, self.llm = inner, inner.name, inner.llm
    self._passed: set[str] = set()  # the official tasks D0 took (no validation)

  def d0_bases(self, entries: Sequence[Task]) -> list[Task]:
    return list(entries)

  def d0_context(self, base: Task, rng: np.random.Generator) -> ExplorationContext:
    del rng
    return ExplorationContext(base.task_id, {}, [], base=base)

  def plan_round(
    self, events: Sequence[SignalEvent], rng: np.random.Generator, round_idx: int
  ) -> list[SignalEvent]:
    return self.inner.plan_round(events, rng, round_idx)

  def summary_template(self, event: SignalEvent) -> tuple[dict[str, Any], list[str]]:
    return self.inner.summary_template(event)

  def event_context(
    self,
    event: SignalEvent,
    summary: dict[str, Any],
    focus: list[str],
    rng: np.random.Generator,
  ) -> ExplorationContext:
    return self.inner.event_context(event, summary, focus, rng)

  def explore(
    self,
    context: ExplorationContext,
    rng: np.random.Generator,
    *,
    label: str,
    source: str,
    round_idx: int | None,
  ) -> Exploration:
    if round_idx is None:
      return Exploration([])
    return self.inner.explore(context, rng, label=label, source=source, round_idx=round_idx)

  def abstract(
    self,
    exploration: Exploration,
    context: ExplorationContext,
    *,
    label: str,
    source: str,
    round_idx: int | None,
  ) -> list[Candidate]:
    if round_idx is not None:
      return self.inner.abstract(
        exploration, context, label=label, source=source, round_idx=round_idx
      )
    assert context.base is not None
    self._passed.add(context.base.task_id)
    return [(context.base.task_id, context.base, "")]

  def validate(self, task: Task) -> tuple[bool, str]:
    if task.task_id in self._passed:
      return True, "official task (not validated)"
    return self.inner.validate(task)


if TYPE_CHECKING:  # mypy checks each synthesizer against the Synthesizer protocol
  from coevolve_jax.feedback.synthesis import Synthesizer

  def _conforms_llm_worlds(synthesizer: LLMWorldSynthesizer) -> Synthesizer:
    return synthesizer

  def _conforms_generated(synthesizer: GeneratedWorldSynthesizer) -> Synthesizer:
    return synthesizer

  def _conforms_official(synthesizer: OfficialD0) -> Synthesizer:
    return synthesizer
