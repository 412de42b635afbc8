"""Rollouts under the trainer's weights, and the run's evaluations (before and after training).

`Rollouts` runs episodes of (task, group id) jobs on the engine, timed into the run's phases.
`Evaluator` owns what is evaluated: the held-out split (greedy, the suite's evaluation loop and
limits: `eval_before` / `eval_after`), the generated held-out set (frozen in
eval_generated.jsonl before D0; greedy training episodes) and, after training, every pool task by
origin. Per-task rows go to eval_<tag>.jsonl files (primary process only).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from coevolve_jax import distributed
from coevolve_jax.agent import AgentRunner
from coevolve_jax.errors import CorruptFileError, RunError
from coevolve_jax.feedback.pool import origin
from coevolve_jax.metrics import PhaseTimer, call_recall, write_atomic
from coevolve_jax.rollout.sampling import SamplingParams
from coevolve_jax.suite import Suite
from coevolve_jax.types import Task, Trajectory

GREEDY = SamplingParams(temperature=0.0)


class Rollouts:
  """Episodes under the trainer's current weights; the evaluator's seconds are moved from the
  "rollout" phase to "reward".

  Args:
    runner / eval_runner: the training episodes' and the held-out split's agent runners.
    sampling: the training rollouts' sampling.
    timer: the run's phase timer (called for the current one: a resume replaces it).
    next_key: splits the run's JAX key stream and returns a fresh key.
  """

  def __init__(
    self,
    runner: AgentRunner,
    eval_runner: AgentRunner,
    sampling: SamplingParams,
    timer: Callable[[], PhaseTimer],
    next_key: Callable[[], jax.Array],
  ):
    self.runner, self.eval_runner, self.sampling = runner, eval_runner, sampling
    self._timer, self._next_key = timer, next_key

  def __call__(
    self, jobs: list[tuple[Task, int]], *, eval: bool = False, greedy: bool = False
  ) -> list[Trajectory]:
    """Episodes of `jobs`, in order.

    `eval`: the held-out split's episodes (the suite's evaluation loop and limits), greedy.
    `greedy`: training episodes decoded greedily (the generated held-out set and the pool
    evaluation); they draw no key from the run's stream, so switching them on leaves the
    training rollouts' samples as they were.

    With several processes the episodes' results are compared across them
    (`distributed.check_agreement` of `Trajectory.digest`).

    Raises:
      distributed.ProcessesDiverged: an episode that another process computed differently.
    """
    runner = self.eval_runner if eval else self.runner
    sampling = GREEDY if eval or greedy else self.sampling
    sub = jax.random.key(0) if greedy and not eval else self._next_key()  # unused if greedy
    timer = self._timer()
    before = runner.timings.get("reward", 0.0)
    with timer("rollout"):
      trajs = runner.run(jobs, sampling, sub)
    timer.move(runner.timings["reward"] - before, src="rollout", dst="reward")
    if jax.process_count() > 1:  # each process stepped its own environments: they must agree
      distributed.check_agreement(
        [t.digest() for t in trajs],
        [f"episode {i} (task {t.task_id}, group {t.group_id})" for i, t in enumerate(trajs)],
        "held-out evaluation" if eval else "rollouts",
      )
    return trajs


def reply_rates(trajs: Sequence[Trajectory]) -> dict[str, float]:
  """Per model reply over `trajs`: "tool_call_rate", the share with at least one well-formed
  tool call, and "parse_error_rate", the share the parser refused (malformed calls, and replies
  cut at the token limit before their end-of-turn token); 0.0 for both without replies."""
  replies = sum(t.model_steps for t in trajs)
  return {
    "tool_call_rate": sum(t.tool_call_replies for t in trajs) / replies if replies else 0.0,
    "parse_error_rate": sum(t.parse_errors for t in trajs) / replies if replies else 0.0,
  }


def eval_row(t: Trajectory, task: Task | None = None) -> dict[str, Any]:
  """One evaluation file row: the task's reward, how its episode ended and what it called, and
  the task's split ("split") where the benchmark names one (one whose test splits the paper
  reports apart): `task.initial_config["split"]`, else the split its episode's info names. An
  episode that failed before grading has no info, so its row names its task's split; tasks and
  episodes that name none get none."""
  row = {
    "task_id": t.task_id,
    "reward": t.reward,
    "finish": t.finish,
    "model_steps": t.model_steps,
    "parse_errors": t.parse_errors,
    "calls": t.calls,
  }
  if split := (task.initial_config.get("split") if task else None) or t.info.get("split"):
    row["split"] = str(split)
  return row


class Evaluator:
  """The run's evaluations (see the module docstring).

  Args:
    workdir: where the eval_*.jsonl files go.
    suite: the benchmark (its held-out split and its own figures).
    rollouts: the run's episodes.
    max_tasks: `eval.max_tasks`, the prefix of the held-out split evaluated.
    success_threshold: a reward >= this counts as a success (`signals.success_threshold`).
  """

  def __init__(
    self,
    workdir: str,
    suite: Suite,
    rollouts: Rollouts,
    max_tasks: int,
    success_threshold: float,
  ):
    self.workdir, self.suite, self.rollouts = workdir, suite, rollouts
    self.split = list(suite.eval_tasks)
    self.tasks = self.split[:max_tasks]
    self.generated: list[Task] = []  # `load_or_make_generated`, once the run state is known
    self.threshold = success_threshold

  def held_out(self) -> list[Task]:
    """What the pool's leak filter keeps out: the held-out split and the generated set."""
    return [*self.split, *self.generated]

  def _write(self, name: str, rows: Sequence[dict[str, Any]]) -> None:
    write_atomic(os.path.join(self.workdir, name), "".join(json.dumps(r) + "\n" for r in rows))

  def evaluate(self, tag: str, suite_eval: dict[str, Any]) -> float:
    """Greedy success rate on the held-out split; per-task results in eval_<tag>.jsonl; the
    suite's own figures (e.g. TGC / SGC) go into `suite_eval[tag]`."""
    trajs = self.rollouts([(t, i) for i, t in enumerate(self.tasks)], eval=True)
    rows = [eval_row(r, t) for t, r in zip(self.tasks, trajs, strict=True)]
    self._write(f"eval_{tag}.jsonl", rows)
    if suite_metrics := self.suite.metrics(trajs):
      suite_eval[tag] = suite_metrics
    return float(np.mean([t.reward for t in trajs])) if trajs else 0.0

  def evaluate_generated(self, tag: str) -> dict[str, float] | None:
    """Greedy figures on the generated held-out set (None when there is none): "success" (share
    of tasks with reward >= the success threshold), "reward" (mean), "call_recall" and
    "name_recall" (mean shares of each task's ground-truth calls made, exactly and by function
    name: `metrics.call_recall`, graded where the checker's reward is all or nothing) and
    "tasks", and per model reply "tool_call_rate" (replies with a well-formed tool call) and
    "parse_error_rate" (replies whose tool calls could not be parsed): whether the policy writes
    the tool format at all; per-task results in eval_generated_<tag>.jsonl. Training episodes
    and limits, as the pool's tasks get (an in-distribution proxy, not a benchmark score)."""
    if not self.generated:
      return None
    trajs = self.rollouts([(t, i) for i, t in enumerate(self.generated)], greedy=True)
    rows = [eval_row(r, t) for t, r in zip(self.generated, trajs, strict=True)]
    self._write(f"eval_generated_{tag}.jsonl", rows)
    recall = [call_recall(t.ground_truth, r.calls) for t, r in zip(self.generated, trajs)]
    return {
      **self.success_figures([t.reward for t in trajs]),
      "call_recall": float(np.mean([e for e, _ in recall])),
      "name_recall": float(np.mean([n for _, n in recall])),
      **reply_rates(trajs),
    }

  def evaluate_pool(self, tasks: Sequence[Task]) -> dict[str, dict[str, float]]:
    """Greedy figures on every pool task after training, grouped by where the task came from:
    "d0" and "synth:<signal>" (the signal whose context the task was synthesized from;
    "synth:unguided" for random re-exploration); per-task results in eval_pool_after.jsonl."""
    trajs = self.rollouts([(t, i) for i, t in enumerate(tasks)], greedy=True)
    rows = [{**eval_row(r, t), "origin": origin(t)} for t, r in zip(tasks, trajs, strict=True)]
    self._write("eval_pool_after.jsonl", rows)
    out = {}
    for kind in sorted({r["origin"] for r in rows}):
      out[kind] = self.success_figures([r["reward"] for r in rows if r["origin"] == kind])
    return out

  def success_figures(self, rewards: list[float]) -> dict[str, float]:
    return {
      "success": float(np.mean([r >= self.threshold for r in rewards])) if rewards else 0.0,
      "reward": float(np.mean(rewards)) if rewards else 0.0,
      "tasks": len(rewards),
    }

  def load_or_make_generated(
    self, n: int, *, resumed: bool, make: Callable[[], list[Task]]
  ) -> list[Task]:
    """The generated held-out set (`eval.generated_tasks`; [] when 0), frozen in
    eval_generated.jsonl: made by the primary process on a fresh start (`make`, whose tasks
    every process receives) and written there; read back from there on a resume. A resume
    that finds the file gone makes it again (the same tasks for the same seed) and says so.

    Raises:
      RunError: the exploration found no valid task (nothing to evaluate on).
      CorruptFileError: the file is not JSON lines of tasks.
    """
    if n <= 0:
      return []
    path = os.path.join(self.workdir, "eval_generated.jsonl")
    if resumed and os.path.exists(path):
      self.generated = _read_tasks(path)
      return self.generated
    if resumed:
      print(f"warning: {path} is missing; making the generated held-out set again")
    made = distributed.on_primary(lambda: [json.loads(t.to_json()) for t in make()])
    tasks = [Task.from_dict(t) for t in made]
    if not tasks:
      raise RunError(
        f"eval.generated_tasks={n}: exploring the held-out entries' states gave no valid task; "
        f"set eval.generated_tasks=0 or check the explorer (its errors are logged above)"
      )
    write_atomic(path, "".join(t.to_json() + "\n" for t in tasks))
    print(f"generated held-out set: {len(tasks)} tasks frozen in {path}")
    self.generated = tasks
    return tasks


def _read_tasks(path: str) -> list[Task]:
  try:
    with open(path, encoding="utf-8") as f:
      return [Task.from_json(line) for line in f if line.strip()]
  except (ValueError, TypeError) as e:
    raise CorruptFileError(
      f"{path} is damaged ({e}): the generated held-out set of this run cannot be read; "
      f"delete it to have it made again (the same tasks for the same seed)"
    ) from e
