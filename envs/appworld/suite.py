"""AppWorld for the CoEvolve loop: task sets, servers, D0, warm-start demonstrations, feedback
synthesis and evaluation metrics, behind one object the loop calls when `cfg.env == "appworld"`.

Task source (`cfg.appworld.source`):
  "generated": worlds built offline (envs/appworld/world.py) under <workdir>/appworld_root: the
    train split feeds D0, test_normal is the held-out evaluation set.
  "official": `appworld download data` under `cfg.appworld.data_root`: `cfg.appworld.split` and
    `cfg.appworld.eval_split` (train/dev/test_normal/test_challenge), served from an overlay of
    the data under the workdir (`overlay_root`), so the data folder is never written to.
Servers: a ServerPool of `cfg.engine.num_slots` + 1 AppWorld servers (one per concurrent
episode, one for the feedback round).

Stages 2-3 (paper Sec. 3.2-3.3) run the core's skeleton (`coevolve_jax.feedback.synthesis`)
over this suite's hooks (`envs/appworld/synthesis.py`). With an LLM explorer (official or
generated worlds): D0 by unguided exploration of the training worlds, rounds by signal-guided
exploration of the marked tasks' worlds, abstraction into tasks derived from those worlds
(world.py `derive_task`: graded by the answer and database changes of their reference code),
validation by execution and an LLM agent's attempt plus the judge. Without an LLM (generated
worlds only) the programmatic explorer discovers the apps' APIs through `apis.api_docs`, and
each marked trajectory yields a new world of its task's family (fresh seed), validated by
execution (the family's solution scores 1.0, completing at once scores 0.0). Accepted tasks go
back to the loop, which commits them to the pool.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from coevolve_jax import config, distributed, wia
from coevolve_jax.chat import ChatFormat
from coevolve_jax.feedback.llm import TextLLM
from coevolve_jax.feedback.synthesis import Synthesizer
from coevolve_jax.types import Action, Task, Trajectory
from envs.appworld import synthesis
from envs.appworld.client import AppWorldUnavailable
from envs.appworld.data import OFFICIAL_SPLITS, load_split, split_goal_completion
from envs.appworld.env import REWARD_MODES, AppWorldEnv, code_reply, rows_to_tasks
from envs.appworld.server import ServerError, ServerPool, build_worlds, venv_python
from envs.appworld.splits import data_errors, split_names
from envs.appworld.world import SPLITS as WORLD_SPLITS
from envs.appworld.world import TEMPLATES

__all__ = ["AppWorldSuite", "check_setup", "overlay_root", "split_names", "validate_config"]
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
    errors += data_errors(str(aw.data_root or ""), [str(aw.split), *split_names(aw.eval_split)])
  elif aw.source != "generated":
    errors.append(f"appworld.source must be 'generated' or 'official', got {aw.source!r}")
  if errors:
    problems = "\n".join(f"  - {e}" for e in errors)
    raise AppWorldUnavailable(f"AppWorld is not available:\n{problems}\n{SETUP_STEPS}")


def validate_config(cfg: Any) -> None:
  """The `appworld` group (source, splits, servers, limits, world building); ValueError names
  the first bad field."""
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
  if config.get(cfg, "eval.generated_tasks") and (
    d0 == "official" or d0_explorer == "programmatic"
  ):
    config.fail(
      "eval.generated_tasks",
      "must be 0 for AppWorld without an LLM explorer for D0, or with appworld.d0='official': "
      "the generated held-out set is D0's exploration of the held-out worlds, and there D0 takes "
      "worlds as they are, so the set would be the held-out split itself",
      config.get(cfg, "eval.generated_tasks"),
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
  config.int_at_least(cfg, "appworld.server_memory_mib", 0)
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
  # One world root and one set of servers per job, on the primary process: with several
  # processes the episodes run there and their results are broadcast (AgentRunner).
  multi_process = True
  env_on_primary = True
  train_tasks: Sequence[Task]  # as the Suite protocol declares them (lists here)
  eval_tasks: Sequence[Task]
  pool: ServerPool | None  # None on a process other than the primary

  def __init__(self, cfg: Any, workdir: str):
    aw = self.aw = cfg.appworld
    self.eval_max_steps = int(cfg.eval.max_steps_per_turn)
    b = aw.build
    self.build_args = {"num_people": int(b.num_people), "num_notes": int(b.num_notes)}
    self.root = os.path.join(workdir, "appworld_root")
    self.data_root = str(aw.data_root or "")
    self.python = ""
    self.pool = None
    # The worlds, servers and data live on the primary only (the other processes need no
    # AppWorld environment or data); every process gets the task lists from it.
    tasks = distributed.on_primary(lambda: self._serve(cfg, workdir))
    self.train_tasks = [Task.from_dict(t) for t in tasks["train"]]
    self.eval_tasks = [Task.from_dict(t) for t in tasks["eval"]]
    # The data the run is scored on (summary.json "data_release"): generated worlds or the
    # official download, and which test splits.
    self.data_release = {
      "source": cfg.appworld.source,
      "data_root": cfg.appworld.data_root,
      "eval_split": cfg.appworld.eval_split,
    }
    self.api_inventory: dict[str, list[str]] | None = None
    ex = cfg.explore
    self.explore_args = {
      "rounds": int(ex.rounds),
      "steps_per_round": int(ex.steps_per_round),
      "min_calls": int(ex.min_calls),
      "max_calls": int(ex.max_calls),
    }
    self.judge = bool(ex.judge)
    self.seed = int(cfg.seed)

  def _serve(self, cfg: Any, workdir: str) -> dict[str, list[dict[str, Any]]]:
    """On the primary process: checks the set-up, builds the generated worlds (or overlays the
    official data), starts the server pool; returns the train and evaluation tasks as dicts.

    Raises:
      AppWorldUnavailable: the AppWorld environment or the official data is missing.
    """
    check_setup(cfg)
    aw, b = self.aw, self.aw.build
    self.python = venv_python(aw.venv)
    if aw.source == "generated":
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
      train, held_out = rows_to_tasks(rows, "train"), rows_to_tasks(rows, "test_normal")
    else:
      train = load_split(self.data_root, str(aw.split))
      # Several splits (the paper evaluates test_normal and test_challenge): one list, in order.
      held_out = [
        t for name in split_names(aw.eval_split) for t in load_split(self.data_root, name)
      ]
      # Servers run on an overlay of the official data under the workdir, so that derived tasks
      # can be written beside the official ones without touching the data folder.
      self.root = overlay_root(self.data_root, self.root)
    log_dir = os.path.join(workdir, "appworld_logs")
    os.makedirs(log_dir, exist_ok=True)
    # One server per decode slot, plus one for the feedback round running beside the rollouts.
    self.pool = ServerPool(
      self.root,
      size=int(cfg.engine.num_slots) + 1,
      python=self.python,
      timeout_s=float(aw.timeout_s),
      startup_timeout_s=float(aw.startup_timeout_s),
      log_dir=log_dir,
      memory_mib=int(aw.server_memory_mib),
    )
    return {
      "train": [dataclasses.asdict(t) for t in train],
      "eval": [dataclasses.asdict(t) for t in held_out],
    }

  # ------------------------------------------------------------------ episodes

  def make_env(self, task: Task, episode_id: str, *, eval: bool = False) -> AppWorldEnv:
    """A fresh episode of `task` with the training (`appworld.max_steps`) or evaluation
    (`eval.max_steps_per_turn`) reply limit; the episode id is unused (the server port keeps
    episodes apart)."""
    del episode_id
    return self.episode(task, self.eval_max_steps if eval else int(self.aw.max_steps))

  def _servers(self) -> ServerPool:
    """The server pool; RuntimeError on a process other than the primary, which has none."""
    if self.pool is None:
      raise RuntimeError(
        "AppWorld's environments run on the primary process only; another process asked for "
        "one (a caller that does not honour Suite.env_on_primary)"
      )
    return self.pool

  def episode(self, task: Task, max_steps: int) -> AppWorldEnv:
    """A fresh episode of `task` on the suite's servers with a limit of `max_steps` replies.

    Raises:
      RuntimeError: on a process other than the primary (`_servers`).
    """
    return AppWorldEnv(
      task,
      self._servers(),
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
    env = self.episode(task, max_steps=1)
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

  def demonstration(
    self,
    task: Task,
    chat: ChatFormat,
    episode_id: str,
    predict: Callable[[str], str | None] | None = None,
  ) -> Trajectory:
    """Teacher-forced trajectory: one reply holding the task's solution code, really executed.
    With `predict` (Role-Agent's WIA) the system prompt carries the WIA instruction as a
    rollout's does; the one reply ends the episode, so it has no observation to predict."""
    del episode_id
    env = self.episode(task, max_steps=1)
    traj = Trajectory(task_id=task.task_id, group_id=-1)
    try:
      first = env.reset()
      system = env.system_prompt if predict is None else wia.system_prompt(env.system_prompt)
      ids = chat.prompt_ids([{"role": "system", "content": system}] + first.messages, env.tools)
      traj.prompt_len = len(ids)
      traj.extend(ids, sampled=False)
      reply = code_reply(task.initial_config["solution"])
      traj.extend(chat.assistant_ids(reply) + [chat.im_end_id], sampled=True)  # code: plain text
      result = env.step(Action(text=reply))
      traj.reward, traj.finish = float(result.reward), "done" if result.done else "incomplete"
      return traj
    finally:
      env.close()

  # ------------------------------------------------------------------ stages 2-3

  def synthesizer(self, llm: TextLLM | None) -> Synthesizer:
    """The stage 2-3 hooks: with an LLM, exploration of live worlds, abstraction, derivation and
    validation (`synthesis.LLMWorldSynthesizer`, official or generated worlds); without one, new
    generated worlds of the marked tasks' families (`synthesis.GeneratedWorldSynthesizer`). With
    `appworld.d0 = "official"`, D0 is the split's own tasks (`synthesis.OfficialD0`)."""
    if llm is not None:
      inner: Any = synthesis.LLMWorldSynthesizer(self, llm)
    else:
      inner = synthesis.GeneratedWorldSynthesizer(self)
    if str(self.aw.get("d0", "explore")) == "official":
      return synthesis.OfficialD0(inner)
    return inner

  def discover_apis(self) -> dict[str, list[str]]:
    """App -> API names, read in a live world through apis.api_docs (cached for the run)."""
    if self.api_inventory is None:
      task = (self.train_tasks or self.eval_tasks)[0]
      env = AppWorldEnv(
        task,
        self._servers(),
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

  # ------------------------------------------------------------------ evaluation

  def metrics(self, trajs: Sequence[Trajectory]) -> dict[str, float]:
    """TGC and SGC (percent) of evaluation trajectories (success = every test passed), per
    split (`data.split_goal_completion`: "test_normal/tgc", ...; over several splits the
    figures of all tasks together are "blend/tgc", ..., else "tgc", ...). A trajectory's split
    is its held-out task's (`eval_tasks`: an episode that failed before grading has no info),
    else the one its episode's info names."""
    splits = {t.task_id: t.initial_config.get("split", "") for t in self.eval_tasks}
    split_of = {t.task_id: splits.get(t.task_id) or t.info.get("split", "") for t in trajs}
    return split_goal_completion({t.task_id: bool(t.info.get("success")) for t in trajs}, split_of)

  def close(self) -> None:
    if self.pool is not None:
      self.pool.close()


Suite = AppWorldSuite


if TYPE_CHECKING:  # mypy checks AppWorldSuite against the Suite protocol
  from coevolve_jax.suite import Suite as SuiteProtocol

  def _conforms(suite: AppWorldSuite) -> SuiteProtocol:
    return suite
