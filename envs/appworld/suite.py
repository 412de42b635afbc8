"""AppWorld for the CoEvolve loop: task sets, servers, D0, warm-start demonstrations, feedback
synthesis and evaluation metrics, behind one object the loop calls when `cfg.env == "appworld"`.

Task source (`cfg.appworld.source`):
  "generated": worlds built offline (envs/appworld/world.py) under <workdir>/appworld_root: the
    train split feeds D0, test_normal is the held-out evaluation set.
  "official": `appworld download data` under `cfg.appworld.data_root`: `cfg.appworld.split` and
    `cfg.appworld.eval_split` (train/dev/test_normal/test_challenge), served from an overlay of
    the data under the workdir (`overlay_root`), so the data folder is never written to.
Servers: a ServerPool of `cfg.rollout.num_slots` + 1 AppWorld servers (one per concurrent
episode, one for the feedback round).

Feedback (paper Sec. 3.1-3.3), with an LLM explorer (`llm` given; official or generated worlds):
D0 by unguided exploration of the training worlds, rounds by signal-guided exploration of the
marked tasks' worlds, abstraction into tasks derived from those worlds (world.py `derive_task`:
graded by the answer and database changes of their reference code), validation by execution and
an LLM agent's attempt plus the judge (envs/appworld/llm_explorer.py). Without an LLM (generated
worlds only) the programmatic explorer discovers the apps' APIs through `apis.api_docs`, and
each marked trajectory yields a new world of its task's family (fresh seed), validated by
execution (the family's solution scores 1.0, completing at once scores 0.0). Accepted tasks go
back to the loop, which commits them to the pool.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from coevolve_jax import config
from envs.appworld import synthesis
from envs.appworld.world import SPLITS as WORLD_SPLITS
from envs.appworld.world import TEMPLATES
from envs.appworld.client import AppWorldUnavailable
from envs.appworld.data import OFFICIAL_SPLITS, goal_completion, load_split
from envs.appworld.env import REWARD_MODES, AppWorldEnv, rows_to_tasks, task_from_row
from envs.appworld.synthesis import code_reply
from envs.appworld.server import (
  ServerError,
  ServerPool,
  add_worlds,
  build_worlds,
  derive_worlds,
  venv_python,
)
from envs.appworld import llm_explorer
from envs.bfcl.explorer import ExplorationContext
from envs.bfcl.llm_explorer import summarize_with_llm
from coevolve_jax.feedback.llm import RoundStopped, TextLLM
from coevolve_jax.feedback.rounds import UNGUIDED
from coevolve_jax.chat import ChatFormat
from coevolve_jax.feedback.rounds import RoundResult
from coevolve_jax.feedback.signals import SignalEvent
from coevolve_jax.types import Action, Task, Trajectory

__all__ = ["AppWorldSuite", "check_setup", "overlay_root", "validate_config"]
log = logging.getLogger(__name__)
SOURCES = ("official", "generated")  # `cfg.appworld.source`
# Where D0 comes from (`cfg.appworld.d0`): "explore" (the paper: exploration of the training
# worlds; an LLM explorer, or on generated worlds the programmatic one) or "official" (the
# split's human-written tasks as they are: a baseline the paper does not use).
D0_SOURCES = ("explore", "official")

SETUP_STEPS = """\
How to set AppWorld up (its pins, pydantic<2, conflict with this project's: it gets its own venv):
  1. make appworld-setup
       = python3.11 -m venv .venv-appworld; .venv-appworld/bin/pip install appworld==0.1.3.post1;
         appworld install   (unpacks the encrypted app code, offline, seconds)
     (or --config.appworld.venv=PATH for an environment made that way elsewhere)
  2. Generated worlds (offline): --config=configs/appworld.py:cpu
     (or --config.appworld.source=generated)
     Official data (needs the internet): .venv-appworld/bin/appworld download data --root DIR
       then --config.appworld.data_root=DIR (or APPWORLD_ROOT=DIR)
The run starts and stops its own servers (the equivalent of `appworld serve environment`:
uvicorn appworld.serve.environment:app on 127.0.0.1), one per concurrent episode."""


def split_names(value: str) -> list[str]:
  """The split names of `appworld.eval_split`: one name, or several separated by commas
  ("test_normal,test_challenge")."""
  return [name.strip() for name in str(value).split(",") if name.strip()]


def check_setup(cfg: Any) -> None:
  """Raises AppWorldUnavailable (with the set-up steps) unless this run's AppWorld needs are met.

  Checks the AppWorld environment (`cfg.appworld.venv`), and for `source="official"` the data
  under `cfg.appworld.data_root` (split files and their first task).
  """
  aw = cfg.appworld
  errors = []
  try:
    venv_python(aw.venv)
  except FileNotFoundError as e:
    errors.append(str(e))
  if aw.source == "official":
    from envs.appworld.client import _data_errors  # noqa: PLC0415

    errors += _data_errors(str(aw.data_root or ""), [str(aw.split), *split_names(aw.eval_split)])
  elif aw.source != "generated":
    errors.append(f"appworld.source must be 'generated' or 'official', got {aw.source!r}")
  if errors:
    problems = "\n".join(f"  - {e}" for e in errors)
    raise AppWorldUnavailable(f"AppWorld is not available:\n{problems}\n{SETUP_STEPS}")


def validate_config(cfg: Any) -> None:
  """The `appworld` group (source, splits, servers, limits, world building); ValueError names
  the first bad field."""
  if config.get(cfg, "eval.generated_tasks"):
    config.fail(
      "eval.generated_tasks",
      "must be 0 for AppWorld (a generated held-out set is built for BFCL only so far)",
      config.get(cfg, "eval.generated_tasks"),
    )
  reward = config.get(cfg, "appworld.reward")
  if reward not in REWARD_MODES:
    config.fail("appworld.reward", f"must be one of {REWARD_MODES}", reward)
  source = config.get(cfg, "appworld.source")
  if source not in SOURCES:
    config.fail("appworld.source", f"must be one of {SOURCES}", source)
  d0 = config.get(cfg, "appworld.d0")
  if d0 not in D0_SOURCES:
    config.fail("appworld.d0", f"must be one of {D0_SOURCES}", d0)
  d0_explorer = config.get(cfg, "explore.d0_explorer") or config.get(cfg, "explore.explorer")
  if source == "official" and d0 == "explore" and d0_explorer == "programmatic":
    config.fail(
      "appworld.d0",
      "'explore' on official data needs an LLM explorer (explore.explorer or "
      "explore.d0_explorer: gemini, openai or local); the programmatic explorer builds only "
      "generated worlds. appworld.d0='official' trains on the split's human-written tasks "
      "instead (a baseline)",
      d0,
    )
  splits = OFFICIAL_SPLITS if source == "official" else WORLD_SPLITS
  for field in ("appworld.split", "appworld.eval_split"):
    value = config.get(cfg, field)
    names = split_names(value) if field == "appworld.eval_split" else [value]
    if not names or any(name not in splits for name in names) or len(set(names)) < len(names):
      config.fail(field, f"must be one of {splits} with appworld.source={source!r}", value)
  urls = config.get(cfg, "appworld.server_urls")
  if (
    not isinstance(urls, (tuple, list))
    or not urls
    or not all(isinstance(u, str) and u for u in urls)
  ):
    config.fail("appworld.server_urls", "must be a non-empty tuple of URLs", urls)
  for field in ("appworld.timeout_s", "appworld.startup_timeout_s", "appworld.exec_timeout_s"):
    config.number(cfg, field, lo=0.0, lo_open=True)
  for field in ("appworld.max_steps", "appworld.max_obs_chars"):
    config.int_at_least(cfg, field, 1)
  config.int_at_least(cfg, "appworld.max_obs_tokens", 0)
  if source == "generated":
    scenarios = config.int_at_least(cfg, "appworld.build.num_scenarios", 1)
    config.int_at_least(cfg, "appworld.build.tasks_per_scenario", 1)
    held = config.get(cfg, "appworld.build.eval_scenarios")
    if not config.is_int(held) or not 0 <= held < scenarios:  # world.py's CLI rule
      config.fail(
        "appworld.build.eval_scenarios", f"must be in [0, num_scenarios = {scenarios})", held
      )
    templates, known = config.get(cfg, "appworld.build.templates"), sorted(TEMPLATES)
    if not isinstance(templates, (tuple, list)) or set(templates) - set(known):
      config.fail(
        "appworld.build.templates", f"must be a tuple of templates of {known} (() = all)", templates
      )


def overlay_root(data_root: str, dest: str) -> str:
  """An AppWorld root at `dest` that shows the official data under `data_root` through symbolic
  links (every entry of data/, and each task folder of data/tasks/ on its own), so that derived
  tasks are written into `dest`/data/tasks and the official data folder is never written to.

  Idempotent: links already there are kept. Returns `dest`.
  """
  src = os.path.join(os.path.abspath(data_root), "data")
  data = os.path.join(dest, "data")
  os.makedirs(os.path.join(data, "tasks"), exist_ok=True)

  def link(target: str, name: str) -> None:
    if not os.path.lexists(name):
      os.symlink(target, name)

  for entry in os.listdir(src):
    if entry != "tasks":
      link(os.path.join(src, entry), os.path.join(data, entry))
  for task_id in os.listdir(os.path.join(src, "tasks")):
    link(os.path.join(src, "tasks", task_id), os.path.join(data, "tasks", task_id))
  open(os.path.join(dest, "coevolve_tasks.jsonl"), "a", encoding="utf-8").close()
  return dest


class AppWorldSuite:
  """Everything AppWorld-specific that one CoEvolve run needs (see the module docstring).

  Args:
    cfg: the full run config (configs/appworld.py).
    workdir: the run's folder; generated worlds go to <workdir>/appworld_root, server logs to
      <workdir>/appworld_logs.
  """

  name = "appworld"

  def __init__(self, cfg: Any, workdir: str):
    check_setup(cfg)
    aw = self.aw = cfg.appworld
    self.eval_max_steps = int(cfg.eval.max_steps_per_turn)
    self.python = venv_python(aw.venv)
    b = aw.build
    self.build_args = {"num_people": int(b.num_people), "num_notes": int(b.num_notes)}
    if aw.source == "generated":
      self.root = os.path.join(workdir, "appworld_root")
      rows = build_worlds(
        self.root,
        self.python,
        num_scenarios=b.num_scenarios,
        tasks_per_scenario=b.tasks_per_scenario,
        eval_scenarios=b.eval_scenarios,
        seed=cfg.seed,
        templates=tuple(b.templates),
        **self.build_args,
      )
      self.train_tasks = rows_to_tasks(rows, "train")
      self.eval_tasks = rows_to_tasks(rows, "test_normal")
    else:
      self.data_root = str(aw.data_root)
      self.train_tasks = load_split(self.data_root, str(aw.split))
      # Several splits (the paper evaluates test_normal and test_challenge): one list, in order.
      self.eval_tasks = [
        t for name in split_names(aw.eval_split) for t in load_split(self.data_root, name)
      ]
      # Servers run on an overlay of the official data under the workdir, so that derived tasks
      # can be written beside the official ones without touching the data folder.
      self.root = overlay_root(self.data_root, os.path.join(workdir, "appworld_root"))
    log_dir = os.path.join(workdir, "appworld_logs")
    os.makedirs(log_dir, exist_ok=True)
    # One server per decode slot, plus one for the feedback round running beside the rollouts.
    self.pool = ServerPool(
      self.root,
      size=int(cfg.rollout.num_slots) + 1,
      python=self.python,
      timeout_s=float(aw.timeout_s),
      startup_timeout_s=float(aw.startup_timeout_s),
      log_dir=log_dir,
    )
    self.api_inventory: dict[str, list[str]] | None = None
    ex = cfg.explore
    self.explore_args = {
      "rounds": int(ex.rounds),
      "steps_per_round": int(ex.steps_per_round),
      "min_calls": int(ex.min_calls),
      "max_calls": int(ex.max_calls),
    }
    self.judge, self.validate_tasks = bool(ex.judge), bool(cfg.feedback.validate)
    self.seed = int(cfg.seed)

  # ------------------------------------------------------------------ episodes

  def make_env(self, task: Task, episode_id: str, *, eval: bool = False) -> AppWorldEnv:
    """A fresh episode of `task` with the training (`appworld.max_steps`) or evaluation
    (`eval.max_steps_per_turn`) reply limit; the episode id is unused (the server port keeps
    episodes apart)."""
    del episode_id
    return self._env(task, self.eval_max_steps if eval else int(self.aw.max_steps))

  def _env(self, task: Task, max_steps: int) -> AppWorldEnv:
    return AppWorldEnv(
      task,
      self.pool,
      experiment="coevolve",
      max_steps=int(max_steps),
      max_obs_chars=int(self.aw.max_obs_chars),
      max_obs_tokens=int(self.aw.get("max_obs_tokens", 0)),
      fail_over_limit=bool(self.aw.get("fail_over_limit", False)),
      reward=str(self.aw.reward),
      exec_timeout_s=int(self.aw.exec_timeout_s),
    )

  def run_code(self, task: Task, code: str) -> tuple[float, dict[str, Any]]:
    """Runs `code` as the one reply of an episode of `task`; returns (reward, info)."""
    env = self._env(task, max_steps=1)
    try:
      env.reset()
      result = env.step(Action(text=code_reply(code)))
      return float(result.reward), dict(result.info)
    finally:
      env.close()

  def validate(self, task: Task) -> str | None:
    """None when the task is valid by execution; else why not (solution fails, or no-op passes)."""
    solution = task.initial_config.get("solution", "")
    if not solution:
      return "no solution code"
    try:
      reward, info = self.run_code(task, solution)
      if reward < 1.0:
        return f"solution scored {reward} ({info.get('passed')}/{info.get('num_tests')} tests)"
      reward, _ = self.run_code(task, "apis.supervisor.complete_task()")
      if reward > 0.0:
        return "completing without acting already passes"
    except ServerError as e:
      return f"server error: {e}"
    return None

  def demonstration(self, task: Task, chat: ChatFormat, episode_id: str) -> Trajectory:
    """Teacher-forced trajectory: one reply holding the task's solution code, really executed."""
    del episode_id
    env = self._env(task, max_steps=1)
    traj = Trajectory(task_id=task.task_id, group_id=-1)
    try:
      first = env.reset()
      ids = chat.prompt_ids(
        [{"role": "system", "content": env.system_prompt}] + first.messages, env.tools
      )
      traj.prompt_len = len(ids)
      traj.extend(ids, sampled=False)
      reply = code_reply(task.initial_config["solution"])
      traj.extend(chat.encode(reply) + [chat.im_end_id], sampled=True)
      result = env.step(Action(text=reply))
      traj.reward, traj.finish = float(result.reward), "done" if result.done else "incomplete"
      return traj
    finally:
      env.close()

  # ------------------------------------------------------------------ D0 and feedback

  def initial_tasks(
    self, n: int, rng: np.random.Generator, llm: TextLLM | None
  ) -> tuple[list[Task], dict[str, int]]:
    """D0: up to `n` training tasks.

    `appworld.d0 = "explore"` (the paper, Sec. 3.1): with an LLM, unguided exploration of the
    training worlds, abstraction and validation (`explore_initial_tasks`); without one (generated
    worlds only), the programmatic explorer's tasks: training worlds whose reference solution
    scores 1.0 and whose immediate completion scores 0.0. `appworld.d0 = "official"`: the split's
    human-written tasks as they are (a baseline; official tasks carry no solution here, so there
    is nothing to warm-start on).
    """
    if str(self.aw.get("d0", "explore")) == "official":
      picked = [self.train_tasks[int(i)] for i in rng.permutation(len(self.train_tasks))[:n]]
      return picked, {"candidates": len(self.train_tasks), "official": len(picked)}
    if llm is not None:
      return self.explore_initial_tasks(n, rng, llm)
    if self.aw.source == "official":  # validate_config refuses this combination
      raise ValueError("D0 by exploration of official data needs an LLM explorer")
    candidates = [t for t in self.train_tasks if t.initial_config.get("solution")]
    order = rng.permutation(len(candidates))
    accepted, rejected = [], 0
    for i in order[:n]:
      task = candidates[int(i)]
      if self.validate(task) is None:
        accepted.append(Task.from_dict({**json.loads(task.to_json()), "source": "explore"}))
      else:
        rejected += 1
    return accepted, {
      "candidates": len(candidates),
      "validated": len(accepted),
      "rejected": rejected,
    }

  # ------------------------------------------------------------------ LLM exploration

  def _context(
    self, base: Task, signal: str | None = None, summary=None, focus=()
  ) -> ExplorationContext:
    """What to explore: the world of `base` (its AppWorld task id), with an optional signal."""
    return ExplorationContext(
      task_id=str(base.initial_config.get("appworld_task_id", base.task_id)),
      initial_config={
        "appworld_task_id": base.initial_config.get("appworld_task_id", base.task_id)
      },
      involved_classes=[],
      signal=signal,
      focus_calls=list(focus),
      summary=dict(summary or {}),
      rounds=self.explore_args["rounds"],
      steps_per_round=self.explore_args["steps_per_round"],
    )

  def _tasks_from_context(
    self,
    context: ExplorationContext,
    llm: TextLLM,
    rng: np.random.Generator,
    source: str,
    round_idx: int | None,
    trace: list[dict[str, Any]],
  ) -> list[tuple[str, Task | None, str]]:
    """Explore -> abstract -> derive -> validate one context (paper Sec. 3.2-3.3).

    Returns (task id, the accepted task or None, why) per abstracted task ([] when abstraction
    found none). Derived tasks of one context share a scenario id, as AppWorld's tasks of one
    scenario do.

    Raises:
      RoundStopped: the LLM's budget is spent or its endpoint unreachable.
    """
    explorer = llm_explorer.AppWorldLLMExplorer(llm, self._env)
    triplets = explorer.explore(context, rng)
    scenario = hashlib.sha1(
      f"{self.seed}:{source}:{round_idx}:{context.task_id}:{int(rng.integers(1 << 62))}".encode()
    ).hexdigest()[:7]
    trace.extend({"scenario": scenario, "parent": context.task_id, **r} for r in explorer.trace)
    choices = llm_explorer.abstract_tasks(
      llm,
      triplets,
      context,
      min_calls=self.explore_args["min_calls"],
      max_calls=self.explore_args["max_calls"],
    )
    if not choices:
      log.info("abstraction found no task in the exploration of %s", context.task_id)
      return []
    usable, out = [], []
    for j, choice in enumerate(choices):
      try:
        usable.append(
          (choice, llm_explorer.derive_spec(choice, f"{scenario}_{j + 1}", context.task_id))
        )
      except ValueError as e:
        out.append((f"{scenario}_{j + 1}", None, f"abstraction: {e}"))
    rows = derive_worlds(self.root, [spec for _, spec in usable], self.python)
    for (choice, _), row in zip(usable, rows, strict=True):
      if row.get("error"):
        out.append((row["task_id"], None, f"derivation: {row['error']}"))
        continue
      task = task_from_row(row, source=source)
      task.provenance.update(
        signal=context.signal,
        round=round_idx,
        parent=context.task_id,
        explorer=explorer.name,
        abstraction="llm",
        run_id=choice.run_id,
        description=choice.description,
        completion=choice.completion,
      )
      accepted, why = self._validate_derived(task, llm)
      out.append((task.task_id, task if accepted else None, why))
    return out

  def _validate_derived(self, task: Task, llm: TextLLM) -> tuple[bool, str]:
    """Validation of a derived task: by execution (its reference solution scores 1.0 through a
    server, completing at once scores 0.0), then with `explore.judge` an LLM agent's attempt,
    accepted on a positive reward or the judge's success (paper Sec. 3.3)."""
    if not self.validate_tasks:
      task.provenance["validation"] = "skipped"
      return True, "ok (validation skipped)"
    why = self.validate(task)
    if why is not None:
      return False, why
    if not self.judge:
      task.provenance["validation"] = "execution"
      return True, "ok"
    accepted, info = llm_explorer.attempt_and_judge(
      llm, task, self._env, max_steps=int(self.aw.max_steps)
    )
    task.provenance["validation"] = {"reward": info["reward"], "judge": info["judge"]}
    if not accepted:
      return False, f"judge rejected the attempt: {(info['judge'] or {}).get('reason', '')}"
    return True, "ok"

  def explore_initial_tasks(
    self, n: int, rng: np.random.Generator, llm: TextLLM
  ) -> tuple[list[Task], dict[str, int]]:
    """D0 by unguided LLM exploration of the training worlds (paper Sec. 3.1: no human-written
    task is used; the base tasks lend only their worlds). Tries up to 3 * n worlds; a spent
    budget or an unreachable endpoint ends D0 with what was accepted."""
    llm.budget.reset()  # D0 gets one round's token budget
    counts = {"attempted": 0, "abstracted": 0, "accepted": 0, "rejected": 0}
    out: list[Task] = []
    trace: list[dict[str, Any]] = []
    order = rng.permutation(len(self.train_tasks))
    for attempt in range(3 * n):
      if len(out) >= n or not len(order):
        break
      base = self.train_tasks[int(order[attempt % len(order)])]
      try:
        results = self._tasks_from_context(self._context(base), llm, rng, "explore", None, trace)
      except RoundStopped as e:
        log.warning("D0: stopped early: %s", e)
        break
      counts["attempted"] += 1
      counts["abstracted"] += len(results)
      for task_id, task, why in results:
        if task is None:
          counts["rejected"] += 1
          log.info("D0: rejected %s (world of %s): %s", task_id, base.task_id, why)
        elif len(out) < n:
          out.append(task)
    counts["accepted"] = len(out)
    log.info("D0: %s", counts)
    return out, counts

  def llm_round(
    self,
    events: Sequence[SignalEvent],
    rng: np.random.Generator,
    round_idx: int,
    llm: TextLLM,
  ) -> RoundResult:
    """A feedback round with an LLM (paper Sec. 3.2-3.3): per event, the context summary (LLM,
    with the trajectory's observations), signal-guided exploration in the marked task's world,
    abstraction, derivation and validation. A spent budget ends the round with what was
    accepted; an unreachable endpoint likewise."""
    start = time.perf_counter()
    llm.budget.reset()
    per_signal: dict[str, dict[str, int]] = {}
    tasks, rejected, trace, synthesized = [], [], [], 0
    for k, event in enumerate(events):
      focus = list(dict.fromkeys(c for turn in event.calls for c in turn))
      fallback = {
        "summary": f"{event.signal} signal on task {event.task.task_id} "
        f"(reward {event.reward:.2f}); APIs used: {', '.join(focus) or 'none'}",
        "failure_cause": "unknown (template summary)" if event.reward < 0.5 else "",
        "instability_pattern": event.signal or "",
        "focus_pattern": focus,
        "exploration_objectives": [f"exercise {api} in new ways" for api in focus],
        "do_not_repeat": [],
      }
      try:
        summary = fallback
        if event.signal is not None:
          summary = summarize_with_llm(
            llm,
            event.task,
            event.signal,
            event.calls,
            event.reward,
            fallback,
            event.observations,
          )
        context = self._context(event.task, event.signal, summary, focus)
        results = self._tasks_from_context(context, llm, rng, "synth", round_idx, trace)
      except RoundStopped as e:
        log.warning(
          "feedback round %d stopped after %d of %d contexts: %s", round_idx, k, len(events), e
        )
        break
      counts = per_signal.setdefault(
        event.signal or UNGUIDED, {"events": 0, "synthesized": 0, "validated": 0}
      )
      counts["events"] += 1
      for task_id, task, why in results:
        synthesized += 1
        counts["synthesized"] += 1
        if task is None:
          rejected.append((task_id, why))
        else:
          counts["validated"] += 1
          tasks.append(task)
    return RoundResult(
      round_idx=round_idx,
      tasks=tasks,
      synthesized=synthesized,
      per_signal=per_signal,
      rejected=rejected,
      trace=trace,
      llm_usage=llm.budget.reset(),
      wall_s=time.perf_counter() - start,
    )

  def discover_apis(self) -> dict[str, list[str]]:
    """App -> API names, read in a live world through apis.api_docs (cached for the run)."""
    if self.api_inventory is None:
      task = (self.train_tasks or self.eval_tasks)[0]
      env = AppWorldEnv(
        task,
        self.pool,
        experiment="discover",
        max_steps=2,
        max_obs_chars=1 << 20,
        exec_timeout_s=int(self.aw.exec_timeout_s),
      )
      try:
        env.reset()
        out = env.step(Action(text=code_reply(synthesis.DISCOVER_APIS))).messages
        self.api_inventory = synthesis.parse_inventory(out[0]["content"] if out else "{}")
      finally:
        env.close()
    return self.api_inventory

  def families(self) -> list[str]:
    """Task families whose every API the explorer discovered."""
    return synthesis.families(self.discover_apis())

  def synthesize(
    self, events: Sequence[SignalEvent], rng: np.random.Generator, round_idx: int, max_contexts: int
  ) -> tuple[list[Task], list[tuple[str, str]], dict[str, int]]:
    """New validated tasks for up to `max_contexts` signal events (`synthesis.plan_worlds`).

    Returns (accepted tasks, [(task_id, reason)] rejected, per-signal counts of accepted tasks).
    New worlds are built into the generated root only: with official data nothing is synthesized
    (the official data folder is never written to).
    """
    if self.aw.source != "generated":
      return [], [], {}
    specs, origin = synthesis.plan_worlds(events, self.families(), rng, round_idx, max_contexts)
    rows = add_worlds(self.root, specs, self.python, **self.build_args)
    accepted, rejected, per_signal = [], [], {}
    for row in rows:
      signal, parent = origin[row["task_id"]]
      task = task_from_row(row, source="synth")
      task.provenance.update(
        signal=signal, round=round_idx, parent=parent, explorer="appworld-programmatic"
      )
      why = self.validate(task)
      if why is None:
        accepted.append(task)
        per_signal[signal] = per_signal.get(signal, 0) + 1
      else:
        rejected.append((task.task_id, why))
    return accepted, rejected, per_signal

  def synthesize_round(
    self,
    events: Sequence[SignalEvent],
    rng: np.random.Generator,
    round_idx: int,
    llm: TextLLM | None,
  ) -> RoundResult:
    """A feedback round: with an LLM, `llm_round` (exploration, abstraction, derivation,
    validation; official or generated worlds); without one, the programmatic explorer's new
    worlds of the marked tasks' families, validated by execution (generated worlds only)."""
    if llm is not None:
      return self.llm_round(events, rng, round_idx, llm)
    start = time.perf_counter()
    tasks, rejected, accepted = self.synthesize(events, rng, round_idx, len(events))
    per_signal = {signal: {"validated": n} for signal, n in accepted.items()}
    trace = [
      {
        "task_id": t.task_id,
        "family": t.provenance.get("template"),
        "signal": t.provenance.get("signal"),
        "parent": t.provenance.get("parent"),
        "instruction": t.turns[0],
      }
      for t in tasks
    ]
    trace += [{"task_id": tid, "rejected": why} for tid, why in rejected]
    return RoundResult(
      round_idx=round_idx,
      tasks=tasks,
      synthesized=len(tasks) + len(rejected),
      per_signal=per_signal,
      rejected=rejected,
      trace=trace,
      wall_s=time.perf_counter() - start,
    )

  # ------------------------------------------------------------------ evaluation

  @staticmethod
  def metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """TGC and SGC (percent) of evaluation trajectories: success = every test passed."""
    return goal_completion({t.task_id: bool(t.info.get("success")) for t in trajs})

  def close(self) -> None:
    self.pool.close()


Suite = AppWorldSuite
