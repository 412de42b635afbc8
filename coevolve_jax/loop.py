"""The CoEvolve main loop (paper Sec. 3, Algorithm 1): GRPO on a task pool that grows by feedback.

    D0 <- unguided exploration                     pool <- D0
    [a generated held-out set, frozen before D0 (eval.generated_tasks)]
    warm-start on D0's solutions; freeze the reference policy; evaluate (before)
    for step = 1 .. T:
      tasks <- sample(pool); G rollouts each (engine + agent loop); rewards (suite's evaluator)
      advantages (Eq. 1, or the configured estimator); one GRPO epoch (trainer)
      events += signals(rollouts)                  forgetting, boundary, rare (Sec. 3.1)
      every F steps: a feedback round (scheduler: select contexts; explore -> abstract ->
        validate in a worker thread, Sec. 3.2-3.3; commit to the pool after `lag` steps)
      training hooks see the step; checkpoint every `checkpoint.every` steps
    evaluate (after) [and every pool task: eval.pool_after]; summary.json

The loop only orchestrates and times phases. Its parts are built by `components.build`; the
benchmark is behind `suite.Suite`, stages 2-3 behind `feedback.synthesis` over the suite's hooks,
the rounds' timing in `scheduler.RoundScheduler`, evaluations in `evaluation.Evaluator`, the
workdir's files in `workdir`. Host-side work is plain Python; the model, the engine and the update
are jitted.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
import tqdm

from coevolve_jax import (
  advantages,
  components,
  config,
  distributed,
  errors,
  grpo,
  memory_plan,
  qevolve,
  warmstart,
  wia,
)
from coevolve_jax import workdir as workdir_files
from coevolve_jax.checkpoint import CheckpointMismatchError
from coevolve_jax.errors import CorruptFileError, RunError
from coevolve_jax.evaluation import Evaluator, Rollouts
from coevolve_jax.feedback import synthesis
from coevolve_jax.hooks import StepRecord, run_hooks
from coevolve_jax.metrics import (
  CompileCounter,
  MetricsWriter,
  PhaseTimer,
  append_lines,
  write_atomic,
)
from coevolve_jax.rollout.sampling import SamplingParams
from coevolve_jax.run_state import RunState
from coevolve_jax.scheduler import RoundScheduler
from coevolve_jax.trainer import make_batch, target_positions
from coevolve_jax.types import FINISHES, Task, Trajectory

__all__ = ["CoEvolveRun", "CorruptFileError", "RunError"]
# Entropy that, with the run's seed, seeds the generated held-out set's exploration: another
# stream than D0's (`RunState.np_rng`, seeded by the seed alone) and the rounds' ([seed, r, i]).
GENERATED_EVAL_STREAM = 0x6576616C


class CoEvolveRun:
  """One training run in `workdir`; `fit()` starts it or resumes it from the last checkpoint.

  Raises (from `fit`):
    ValueError: a bad config field (`config.validate`, before any work).
    RunError: the workdir holds a run that cannot continue as configured, or D0 is empty.
    DiskFullError (a RunError): a checkpoint or log write failed for a full disk; the files keep
      what was written before it, so the same run resumes once there is space.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, workdir: str):
    config.validate(cfg)
    self.cfg, self.workdir = cfg, os.path.abspath(workdir)
    os.makedirs(self.workdir, exist_ok=True)
    self.summary_path = os.path.join(self.workdir, "summary.json")

  # ------------------------------------------------------------------ the algorithm

  def fit(self) -> dict[str, Any]:
    """Runs (or resumes) the whole job and returns the summary written to summary.json.

    On an error, the checkpoint save in flight is finished (or fails) and the logs are closed
    before the error propagates, so that nothing writes on after it is reported.
    """
    done = workdir_files.completed_summary(self.summary_path, self.cfg.train.steps)
    if done is not None:
      return done
    return self._session(self._run)

  def bootstrap(self) -> int:
    """Runs step 0 only (D0, warm-start, the evaluations before training, checkpoint 0) and stops
    there; `fit()` in the same workdir, or in a copy of it, goes on from that checkpoint.

    scripts/ablations.py runs it once per seed and copies the workdir to the variants of the seed
    whose switch step 0 does not read (`feedback.enabled`, `.mode`, `.kinds`), so they share one
    D0 and warm-start. A workdir that already holds a checkpoint gets no new step 0 (only its
    logs are reopened and closed).

    Returns:
      The step of the newest checkpoint after it (0 after a fresh start).

    Raises:
      The errors of `fit`.
    """
    return self._session(self._step0)

  def _session(self, body: Callable[[], Any]) -> Any:
    """`body()` with this session's clock and compile counter; on an error or an interrupt
    (KeyboardInterrupt), the checkpointer (its save in flight finished) and logs are closed
    before it propagates; on an interrupt the feedback round in flight is abandoned."""
    self._session_start = time.perf_counter()
    self._closing: list[tuple[str, Any]] = []  # closed after an error, in order
    lock = workdir_files.WorkdirLock(self.workdir)
    distributed.on_primary(lock.acquire)  # one run per workdir; the primary holds it
    # XLA compilations of this process, logged per step (`compile/count`, `compile/seconds`).
    self.compiles = CompileCounter()
    try:
      return body()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (coevolve_jax.main): stop, keep the checkpoint
      if (scheduler := getattr(self, "rounds", None)) is not None:
        scheduler.abandon()  # a round in flight is redone on resume; not waited for
      self._close_after_error()
      raise
    except Exception:
      self._close_after_error()
      raise
    finally:
      self.compiles.close()
      lock.release()

  def _step0(self) -> int:
    restored = self._start()
    if restored is None:
      self._bootstrap()
      self.metrics.write(0, {**self.compiles.pop(), **self.timer.pop_last(), **self._work()})
    self._close()
    return self.state.step

  def _run(self) -> dict[str, Any]:
    restored = self._start()
    if self.cfg.compile.ahead:  # at start-up: a run that cannot fit stops before D0 and warm-start
      self._compile_ahead()
    if restored is not None:
      self._generated_eval_set(resumed=True)  # as frozen at the start
    if restored is None:
      self._bootstrap()  # D0 -> warm-start -> eval before -> checkpoint 0
    elif self.state.pending is not None:
      self.rounds.submit(self.state, self.state.pending)  # in flight at the checkpoint: redone
    before = self.compiles.pop()  # set-up, D0, warm-start, eval before: not step 1's
    work = self._work()
    if restored is None:  # step 0's row: what compiled, and the phases, before GRPO step 1
      self.metrics.write(0, {**before, **self.timer.pop_last(), **work})
    count, seconds, hits = (before[f"compile/{k}"] for k in ("count", "seconds", "cache_hits"))
    print(f"compiled {count} programs before GRPO ({seconds:.1f} s; {hits} from the cache)")
    steps = self.cfg.train.steps
    with tqdm.tqdm(total=steps, initial=self.state.step, desc="grpo", unit="step") as bar:
      while self.state.step < steps:
        info = self._step(self.state.step + 1)
        bar.set_postfix(reward=f"{info['reward/mean']:.2f}", pool=len(self.pool))
        bar.update(1)
    return self._finish(restored or 0)

  def _bootstrap(self) -> None:
    """Step 0: D0 by unguided exploration, supervised warm-start, eval before, checkpoint."""
    with self.timer("explore"):  # the pool is empty here: a fresh start rolls it back to 0
      self._generated_eval_set(resumed=False)  # frozen before D0
      d0, counts = self._initial_tasks()
      report = self.pool.add(d0, eval_tasks=self.evaluator.held_out())
      self.state.d0 = {**counts, "added": report.added, "dropped": len(report.dropped)}
      print(f"D0: {self.state.d0}")
      if stopped := counts.get("stopped"):
        print(
          f"D0 stopped early ({stopped['reason']}): {counts['accepted']} of "
          f"{self.cfg.explore.initial_tasks} tasks, at most {stopped['contexts_skipped']} "
          f"contexts not explored: {stopped['message']}"
        )
      # D0's row of feedback.jsonl ("round" 0), beside the rounds' rows.
      row = {"stage": "d0", "round": 0, "step": 0, **self.state.d0, "pool_size": len(self.pool)}
      append_lines(os.path.join(self.workdir, "feedback.jsonl"), [json.dumps(row)])
      if not len(self.pool):
        raise RunError(
          f"D0 exploration left the task pool empty ({self.state.d0}): there is nothing to "
          f"train on. Raise explore.initial_tasks or explore.rounds, or check the explorer "
          f"(its errors are logged above)."
        )
    if self.cfg.eval.generated_before_warmstart and self.cfg.warmstart.steps > 0:
      with self.timer("eval"):  # what the warm-start teaches: the same figures before it
        self.state.eval_generated_init = self.evaluator.evaluate_generated("init")
      if self.state.eval_generated_init is not None:
        print(f"generated held-out set before the warm-start: {self.state.eval_generated_init}")
    with self.timer("warmstart"):
      self._warmstart()
    self.trainer.freeze_reference()
    with self.timer("eval"):
      self.state.eval_before = self.evaluator.evaluate("before", self.state.suite_eval)
      self.state.eval_generated_before = self.evaluator.evaluate_generated("before")
    print(f"eval before training: {self.state.eval_before:.3f}")
    if self.state.eval_generated_before is not None:
      print(f"generated held-out set before training: {self.state.eval_generated_before}")
    self._save(0)

  def _initial_tasks(self) -> tuple[list[Task], dict[str, Any]]:
    """D0 (`feedback.synthesis.initial_tasks` over the suite's hooks), made once by the primary
    process and given to every process (`distributed.on_primary`: explorer and judge LLM calls
    and environment writes happen once) with the run's RNG state after it, so every process
    goes on from the same state."""
    rng = self.state.np_rng

    def make() -> dict[str, Any]:
      synth = self.suite.synthesizer(self.parts.d0_llm)
      d0, counts = synthesis.initial_tasks(
        synth,
        self.suite.train_tasks,
        self.cfg.explore.initial_tasks,
        rng,
        token_limit=self.cfg.explore.d0_tokens,
      )
      tasks = [json.loads(t.to_json()) for t in d0]
      return {"tasks": tasks, "counts": counts, "rng": rng.bit_generator.state}

    out = distributed.on_primary(make)
    rng.bit_generator.state = out["rng"]
    return [Task.from_dict(t) for t in out["tasks"]], out["counts"]

  def _generated_eval_set(self, *, resumed: bool) -> list[Task]:
    """The generated held-out set (`Evaluator.load_or_make_generated`): D0's exploration of the
    held-out entries' states, seeded by (seed, `GENERATED_EVAL_STREAM`) so that D0's random
    stream is untouched."""

    def make() -> list[Task]:
      rng = np.random.default_rng([self.cfg.seed, GENERATED_EVAL_STREAM])
      synth = self.suite.synthesizer(self.parts.d0_llm)
      return synthesis.generated_eval_tasks(
        synth, self.suite.eval_tasks, n, rng, token_limit=self.cfg.explore.d0_tokens
      )

    n = self.cfg.eval.generated_tasks
    return self.evaluator.load_or_make_generated(n, resumed=resumed, make=make)

  def _warmstart(self) -> None:
    ws = self.cfg.warmstart
    if ws.steps <= 0:
      return
    demos = self._demonstrations()
    if self.critic is not None:  # the hybrid dataset's expert part (Q-Evolve)
      found = (qevolve.episode(t, self.critic.cfg, "expert") for t in demos)
      self.critic.buffer.extend([e for e in found if e is not None])
    warmstart.warm_start(
      self.trainer,
      demos,
      steps=ws.steps,
      batch_size=ws.batch_size,
      lr=ws.lr,
      grad_clip=self.cfg.train.grad_clip,
      rng=self.state.np_rng,
      mesh=self.parts.mesh,
      compute_dtype=self.cfg.model.dtype,
      log=lambda i, loss: self.metrics.write(0, {"warmstart/loss": loss, "warmstart/step": i}),
      micro_batches=memory_plan.warmstart_micro_batches(
        self.cfg, dict(self.parts.mesh.shape), self.trainer.micro_batches
      ),
    )

  def _demonstrations(self) -> list[Trajectory]:
    """The pool's warm-start demonstrations (`Suite.demonstration`), executed on the primary
    process only and given to every process when the suite's environments live there
    (`Suite.env_on_primary`)."""

    wia_cfg = self.cfg.role_agent.wia

    def make() -> list[Trajectory]:
      seen: list[str] = []
      predict = None
      if wia_cfg.enabled and wia_cfg.demos == "shuffled":  # the control needs the texts first
        for i, t in enumerate(self.pool.tasks):
          self.suite.demonstration(t, self.parts.chat, f"demo{i}", seen.append)
      if wia_cfg.enabled:
        predict = wia.demo_predictor(wia_cfg.demos, wia_cfg.char_cap, seen, self.cfg.seed)
      return [
        self.suite.demonstration(t, self.parts.chat, f"demo{i}", predict)
        for i, t in enumerate(self.pool.tasks)
      ]

    if not self.suite.env_on_primary:
      return make()
    made = distributed.on_primary(lambda: [t.to_dict() for t in make()])
    return [Trajectory.from_dict(t) for t in made]

  def _step(self, step: int) -> dict[str, Any]:
    """One GRPO step, then the hooks, the feedback round's bookkeeping, metrics and (maybe) a
    checkpoint."""
    cfg = self.cfg
    synth_fraction = None if cfg.pool.synth_fraction < 0 else cfg.pool.synth_fraction
    weights = self.parts.sampler.weights(self.pool.tasks)
    tasks = self.pool.sample(cfg.rollout.tasks_per_step, self.state.np_rng, synth_fraction, weights)
    g = cfg.rollout.group_size
    trajs = self.rollouts([(t, i) for i, t in enumerate(tasks) for _ in range(g)])
    rewards = np.array([t.reward for t in trajs], np.float32)
    groups = np.array([t.group_id for t in trajs])
    keep = grpo.loss_rows(
      [t.finish for t in trajs],
      rewards,
      groups,
      cfg.train.drop_from_loss,
      cfg.train.drop_dead_groups,
    )
    estimator, wia_cfg = cfg.train.advantage_estimator, None
    if cfg.role_agent.wia.enabled:  # Role-Agent's process rewards (coevolve_jax/wia.py)
      estimator, wia_cfg = "role_agent", wia.WIAConfig.from_config(cfg.role_agent.wia)
    between = self.critic is not None and self.critic.cfg.placement == "between"
    if self.critic is not None and not between:  # Q-Evolve (coevolve_jax/qevolve.py)
      info, adv = self._qevolve_update(step, trajs, rewards, groups, keep)
    else:
      inputs = advantages.AdvantageInputs(trajs, rewards, groups, keep, self.trainer.cfg, wia_cfg)
      with self._timed("wia", wia_cfg is not None):  # host time of WIA's scoring
        adv = advantages.estimate(estimator, inputs)
      with self.timer("train"):
        info = self.trainer.grpo_epoch(trajs, adv, cfg.train.mini_batches, keep=keep)
      if between:  # Q-Evolve's iterations after CoEvolve's GRPO update
        info.update(self._qevolve_between(step, trajs, rewards, groups, keep))
    events = self.tracker.observe(trajs, tasks)
    self.state.events.extend(events)
    with self._timed("aiw", self.parts.sampler.name == "aiw"):  # AIW's analysis and retrieval
      self.parts.sampler.observe(tasks, trajs)
    info.update(self.parts.sampler.metrics())
    if wia_cfg is not None:
      with self.timer("wia"):
        info.update(wia.metrics(trajs, wia_cfg, cfg.signals.success_threshold, keep.tolist()))
    info.update(self._rollout_metrics(trajs, rewards, groups, keep))
    held_out = self.evaluator.held_out()
    record = StepRecord(step, tasks, trajs, rewards, keep, adv, events, info, held_out)
    info.update(run_hooks(self.parts.hooks, record))
    self.state.step = step
    if cfg.feedback.enabled:
      with self.timer("feedback"):
        info.update(self.rounds.tick(self.state, step, held_out))
    elif self.parts.llm is not None and step % cfg.feedback.every == 0:
      self.parts.llm.budget.reset()  # a round's budget period without rounds (AIW's analyser)
    info["pool/size"] = len(self.pool)
    info.update(self.timer.pop_last())
    # The engine's copy of the weights (cast, gathered over fsdp) made for this step's rollouts.
    info["timing/weight_sync_s"] = self.trainer.last_sync_s
    info.update(self.compiles.pop())
    info.update(self._work())
    self.metrics.write(step, info)  # before the save: a resume rewrites rows after its step
    if step % cfg.checkpoint.every == 0 or step == cfg.train.steps:
      self._save(step)
    return info

  def _qevolve_update(
    self,
    step: int,
    trajs: list[Trajectory],
    rewards,
    groups,
    keep,
    iteration: int | None = None,
    fit_on: int | None = None,
  ) -> tuple[dict[str, Any], np.ndarray]:
    """The step's policy update with Q-Evolve's critic: its per-reply advantages ("qevolve"
    estimator); mode "critic" trains on them with the GRPO objective, mode "iterate" with the
    behaviour-proximal one (`qevolve.objective`, iteration step - 1) on the rollouts and
    `qevolve.experts` demonstrations from the buffer, `qevolve.epochs` passes.

    Args:
      iteration: the behaviour-proximal objective's iteration number (default step - 1).
      fit_on: how many of `trajs` the critic takes into its buffer (default all).
    Returns:
      (the step's metrics: the update's, qevolve/*; the rollouts' advantages [N, P]).
    """
    critic, cfg = self.critic, self.cfg
    assert critic is not None  # called only with qevolve.enabled
    qcfg = critic.cfg
    iterate = qcfg.mode == "iterate"
    experts = []
    if iterate:  # demonstrations the update's batch shapes hold (`train.*_buckets`)
      fits = lambda e: e.origin == "expert" and self.trainer.fits(e.trajectory(0))  # noqa: E731
      experts = critic.buffer.sample(qcfg.experts, critic.rng, fits)
    demos = [e.trajectory(-1 - i) for i, e in enumerate(experts)]  # a group of its own each
    self._rescore(demos)  # their behaviour log-probs: the policy's now (BPPO's pi_k)
    rows = trajs + demos
    with self.timer("critic"):
      critic_in, metrics = self._critic_step(rows, len(trajs) if fit_on is None else fit_on)
    every = np.concatenate([keep, np.ones(len(demos), bool)])
    all_rewards = np.array([t.reward for t in rows], np.float32)
    all_groups = np.concatenate([groups, [t.group_id for t in demos]]).astype(groups.dtype)
    if iterate:
      self.trainer.set_objective(
        qevolve.objective(qcfg, step - 1 if iteration is None else iteration)
      )
      critic_in = (qcfg, [qevolve.weighted_advantages(a, qcfg) for a in critic_in[1]])
    inputs = advantages.AdvantageInputs(
      rows, all_rewards, all_groups, every, self.trainer.cfg, qevolve=critic_in
    )
    adv = advantages.estimate("qevolve", inputs)
    with self.timer("train"):
      for _ in range(qcfg.epochs if iterate else 1):
        info = self.trainer.grpo_epoch(rows, adv, cfg.train.mini_batches, keep=every)
    info.update(metrics)
    if iterate:
      info["qevolve/experts"] = len(demos)
    info["qevolve/cost_vs_train"] = self.timer.last["critic"] / max(self.timer.last["train"], 1e-9)
    return info, adv[: len(trajs)]

  def _rescore(self, rows: list[Trajectory]) -> None:
    """Sets the sampled tokens' log-probs of `rows` (in place) to the current policy's: the
    behaviour policy of a Q-Evolve iteration (BPPO's pi_k)."""
    if not rows:
      return
    trainer = self.trainer
    batch = make_batch(rows, len_buckets=trainer.len_buckets, target_buckets=trainer.target_buckets)
    scored = distributed.fetch(trainer.logprobs(batch))  # row-sharded: gathered whole
    for r, t in enumerate(rows):
      for j, i in enumerate(target_positions(t)):
        t.logprobs[i] = float(scored[r, j])

  def _qevolve_between(self, step: int, trajs, rewards, groups, keep) -> dict[str, Any]:
    """`qevolve.iterations` Q-Evolve iterations after the step's GRPO update (placement
    "between"): each rescores copies of the step's rollouts under the policy as it stands,
    takes `qevolve.experts` demonstrations from the buffer, and trains on the critic's
    advantages by the behaviour-proximal objective (iteration number (step - 1) x iterations
    + k), `epochs` passes; the critic takes the rollouts into its buffer once (the first
    iteration) and fits on its replay in each. The GRPO objective is restored after them.

    Returns:
      metrics: the last iteration's update and critic figures under qevolve/ (the update's as
      qevolve/bp_<name>), qevolve/iterations.
    """
    critic, base = self.critic, self.trainer.cfg
    assert critic is not None
    qcfg = critic.cfg
    out: dict[str, Any] = {}
    for k in range(qcfg.iterations):
      rows = [Trajectory.from_dict(t.to_dict()) for t in trajs]  # the step's own stay as sampled
      self._rescore(rows)
      info, _ = self._qevolve_update(
        step, rows, rewards, groups, keep, iteration=(step - 1) * qcfg.iterations + k,
        fit_on=len(rows) if k == 0 else 0,
      )  # fmt: skip
      out = {
        name if name.startswith("qevolve/") else f"qevolve/bp_{name.removeprefix('train/')}": v
        for name, v in info.items()
      }
    self.trainer.set_objective(base)
    out["qevolve/iterations"] = qcfg.iterations
    return out

  def _critic_step(self, trajs: list[Trajectory], fit_on: int) -> tuple[Any, dict[str, float]]:
    """Q-Evolve's critic on a step's rows (`Critic.step`, in `qevolve.order`): each reply's GAE
    advantage, and `qevolve.updates` critic steps on the first `fit_on` rows' episodes (the
    step's rollouts, which join the buffer; the rows after them are the buffer's own
    demonstrations) and a replay of the buffer's. By default the advantages come first, under
    the critic as it stands (trained on earlier steps and the warm-start's demonstrations, as
    PPO estimates advantages before fitting its value).

    Returns:
      ((the critic's settings, per trajectory [T_i] reply advantages): `AdvantageInputs.
      qevolve`; the qevolve/* metrics).
    Raises:
      RunError: a trajectory whose replies the critic cannot read one to one.
    """
    critic = self.critic
    assert critic is not None  # called only with qevolve.enabled
    eps = [qevolve.episode(t, critic.cfg) for t in trajs]
    at = [i for i, e in enumerate(eps) if e is not None]  # rows with an episode, in order
    real = [e for e in eps if e is not None]
    reply_adv, metrics = critic.step(real, [j for j, i in enumerate(at) if i < fit_on])
    found = iter(reply_adv)
    out = []
    for t, e in zip(trajs, eps):
      adv = np.zeros(len(t.replies), np.float32) if e is None else next(found)
      if len(adv) != len(t.replies):
        raise RunError(
          f"trajectory {t.task_id}: {len(adv)} critic steps for {len(t.replies)} replies"
        )
      out.append(adv)
    return (critic.cfg, out), metrics

  def _work(self) -> dict[str, float]:
    """The engine's prefill and decode work since the last row (`Engine.pop_work`): engine/*."""
    return self.parts.engine.pop_work()

  def _timed(self, phase: str, on: bool) -> contextlib.AbstractContextManager:
    """`self.timer(phase)` when `on` (an option's phase), else nothing: a run without the
    option reports no `timing/<phase>`."""
    return self.timer(phase) if on else contextlib.nullcontext()

  def _rollout_metrics(
    self, trajs, rewards: np.ndarray, groups: np.ndarray, keep: np.ndarray
  ) -> dict[str, Any]:
    finishes = [t.finish for t in trajs]
    return {
      "reward/mean": float(rewards.mean()),
      "reward/max": float(rewards.max()),
      "rollout/tokens_generated": int(sum(t.num_generated for t in trajs)),
      "rollout/parse_errors": int(sum(t.parse_errors for t in trajs)),
      "rollout/tool_call_replies": int(sum(t.tool_call_replies for t in trajs)),
      "rollout/model_steps": int(sum(t.model_steps for t in trajs)),
      "rollout/groups": len(np.unique(groups)),
      # rollout/finished_done, _context, _max_model_steps, _error: how the episodes ended
      **{f"rollout/finished_{f}": finishes.count(f) for f in FINISHES},
      "rollout/dropped_from_loss": int(np.sum(~keep)),  # train.drop_from_loss
      "rollout/mixed_groups": int(
        sum(len(set(rewards[groups == g])) > 1 for g in np.unique(groups))
      ),
      **{f"signals/{k}": v for k, v in self.tracker.counts.items()},
    }

  def _finish(self, resumed_from: int) -> dict[str, Any]:
    """Joins a round still in flight, evaluates (after), writes summary.json, frees resources."""
    if self.state.pending is not None:  # resumed with fewer steps than a round in flight needed
      with self.timer("feedback"):
        self.rounds.commit(self.state, self.evaluator.held_out())
    self.rounds.shutdown()
    with self.timer("eval"):
      eval_after = self.evaluator.evaluate("after", self.state.suite_eval)
      extra: dict[str, Any] = {"data_release": self.suite.data_release}
      if (generated := self.evaluator.evaluate_generated("after")) is not None:
        extra["eval_generated_after"] = generated
      if self.cfg.eval.pool_after:
        extra["eval_pool_after"] = self.evaluator.evaluate_pool(self.pool.tasks)
    self.ckpt.wait()
    summary = workdir_files.summary(
      self.state,
      self.timer,
      eval_after=eval_after,
      eval_tasks=len(self.evaluator.tasks),
      signals=self.tracker.counts,
      pool_size=len(self.pool),
      resumed_from=resumed_from,
      wall_s=self._wall_s(),
    )
    write_atomic(self.summary_path, json.dumps({**summary, **extra}, indent=1, sort_keys=True))
    self.metrics.close()
    self.ckpt.close()
    if self.critic_ckpt is not None:
      self.critic_ckpt.close()
    self.suite.close()  # stops what the suite started (servers, workers), also at exit on failure
    return {**summary, **extra}

  def _compile_ahead(self) -> None:
    """compile.ahead: every program a GRPO step can run, compiled at start-up, right after
    set-up (the reference is frozen there, so its log-prob forward is compiled in its own dtype),
    before D0, the warm-start and the evaluations, which then find the engine's programs compiled:
    the engine's prefill and decode shapes for the rollouts' sampling and the evaluations' greedy
    one, and the train step and log-prob forward at every (T, P) bucket; then the memory check
    of those programs (`_check_program_memory`), so that a run that cannot fit its devices stops
    before its first hour of work. Every process compiles the same set (SPMD).
    docs/benchmarks/compiles.md lists the sets."""
    cfg, runner = self.cfg, self.parts.runner
    # Single decode steps run only while environment steps are in flight (`AgentRunner`).
    steps = {cfg.episode.decode_steps} | (set() if runner.lockstep else {1})
    threads = cfg.compile.threads  # 0: `compiling.compile_threads`' default
    with self.timer("compile"):
      engine = self.parts.engine.compile_ahead(
        [self.parts.sampling, SamplingParams(temperature=0.0)],
        stop_ids=runner.stop_ids,
        decode_steps=sorted(steps),
        threads=threads,
      )
      rollouts = cfg.rollout.tasks_per_step * cfg.rollout.group_size
      routing = self.parts.engine.record_routing
      train = self.trainer.compile_ahead(
        rollouts, cfg.train.mini_batches, routing=routing, threads=threads
      )
    print(f"compiled ahead: {engine} engine programs, {train} train batch shapes")
    self._check_program_memory()

  def _check_program_memory(self) -> None:
    """The memory per device of the largest compiled prefill, decode and update programs on top
    of what is resident (`memory_plan.check_programs`): printed; on a GPU or TPU a program that
    would not fit stops the run here, at start-up, instead of failing inside step 1 after D0 and
    the warm-start (which holds no more than an update: `warmstart.warm_start`). On CPU the
    limit is a share of the host's memory and XLA:CPU's buffer assignment is not a device's:
    the figures are printed as estimates and nothing stops."""
    trainer, engine = self.trainer, self.parts.engine
    trainer.inference_params()  # the rollout copy, as step 1's rollouts will hold it (if any)
    copy = trainer.rollout_copy
    limit, where = memory_plan.device_memory_limit()
    check = memory_plan.check_programs(
      engine.program_memory,
      trainer.program_memory,
      memory_plan.device_bytes(),
      memory_plan.device_bytes(copy) if copy is not None else 0,
      limit,
      where,
    )
    cpu = jax.local_devices()[0].platform == "cpu"
    lines = check.lines() + (["  (CPU: estimates, not a device's figures)"] if cpu else [])
    if distributed.is_primary():
      print("\n".join(lines))
    # The primary's verdict on every process (the programs are the same SPMD programs), so that
    # all stop or none does.
    over = distributed.broadcast_json([p.name for p, _ in check.over] if not cpu else [])
    if over:
      names = ", ".join(over)
      raise RunError(
        f"the run would run out of device memory in {names}:\n" + "\n".join(lines) + "\n"
        "Use more train.micro_batches (or 0: the fewest that fit), fewer engine.num_slots, a "
        "shorter engine.cache_len or smaller engine.max_prefill_tokens, or more devices."
      )

  # ------------------------------------------------------------------ set-up, checkpoints, logs

  def _start(self) -> int | None:
    """Builds the run's parts, then loads the newest readable checkpoint or starts fresh, and
    brings the workdir's files to that point. Returns the restored step, or None (fresh)."""
    self.parts = p = components.build(self.cfg, self.workdir)
    self._closing.append(("checkpoints", p.ckpt))
    self.suite, self.pool, self.tracker, self.trainer, self.ckpt = (
      p.suite,
      p.pool,
      p.tracker,
      p.trainer,
      p.ckpt,
    )
    self.rollouts = Rollouts(p.runner, p.eval_runner, p.sampling, lambda: self.timer, self._key)
    self.evaluator = Evaluator(
      self.workdir,
      p.suite,
      self.rollouts,
      self.cfg.eval.max_tasks,
      self.cfg.signals.success_threshold,
    )
    self.rounds = RoundScheduler(self.cfg, self.workdir, p.suite, p.llm, p.pool, p.journal)
    self.critic: qevolve.Critic | None = None
    self.critic_ckpt: qevolve.CriticCheckpointer | None = None
    if "qevolve" in self.cfg and self.cfg.qevolve.enabled:
      qcfg = qevolve.QEvolveConfig.from_config(self.cfg.qevolve)
      self.critic = qevolve.make_critic(qcfg, p.trainer, self.cfg.seed)
      where = qevolve.checkpoint_dir(self.workdir)
      self.critic_ckpt = qevolve.CriticCheckpointer(where, self.cfg.checkpoint.keep)
      self._closing.append(("critic checkpoints", self.critic_ckpt))
    restored = self._load_or_init()
    self._open_logs(restored)
    return restored

  def _key(self) -> jax.Array:
    """A fresh key from the run's JAX stream (one split per rollout call)."""
    self.state.key, sub = jax.random.split(self.state.key)
    return sub

  def _load_or_init(self) -> int | None:
    """Restore latest or start fresh: sets the trainer, `self.state`, the tracker, the sampler,
    the hooks and the timer; returns the restored step, or None for a fresh start."""
    self.trainer.freeze_reference()  # gives ref_params its structure
    try:
      restored = self.ckpt.restore_latest(self.trainer.state)
    except CheckpointMismatchError as e:  # another model's checkpoint: advice, not deletion
      changes = workdir_files.model_changes(e.saved_config, self.cfg.to_json_best_effort())
      raise RunError(
        f"{e} ({changes}). Resume with the model it was saved with, or start this config in "
        "another --workdir"
      ) from e
    except RuntimeError as e:  # no readable checkpoint at all
      raise RunError(str(e)) from e
    if restored is None:
      self.state, self.timer = RunState.fresh(self.cfg.seed), PhaseTimer()
      return None
    step, train_state, meta = restored
    if step > self.cfg.train.steps:
      raise RunError(
        f"{self.workdir} holds a checkpoint at step {step}, past "
        f"train.steps={self.cfg.train.steps}; use another --workdir"
      )
    self.trainer.state = train_state
    self.state = RunState.from_json(meta)
    if self.state.signals:
      self.tracker.load_state_dict(self.state.signals)
    self.parts.sampler.load_state_dict(self.state.sampler)
    for hook in self.parts.hooks:  # a hook new since the checkpoint starts fresh
      if hook.name in self.state.hooks:
        hook.load_state_dict(self.state.hooks[hook.name])
    self.timer = PhaseTimer(self.state.phase_s)
    critic, critic_ckpt = self.critic, self.critic_ckpt
    if critic is not None and critic_ckpt is not None and not critic_ckpt.restore(step, critic):
      print(f"no Q-Evolve critic saved at step {step}: the critic starts fresh")
    print(f"resuming from checkpoint step {step}")
    return step

  def _open_logs(self, restored: int | None) -> None:
    """config.json, the workdir's logs, pool and hooks brought back to the restored step."""
    self._wall_before = self.state.wall_s
    workdir_files.check_config(self.workdir, self.cfg.to_json_best_effort(), fresh=restored is None)
    workdir_files.roll_back(
      self.workdir, restored, self.pool, self.state.pool_size, self.parts.journal
    )
    for hook in self.parts.hooks:
      hook.on_resume(-1 if restored is None else restored)
    self.metrics = MetricsWriter(self.workdir, -1 if restored is None else restored)
    self._closing.append(("metrics", self.metrics))

  def _save(self, step: int) -> None:
    with self.timer("checkpoint"):
      s = self.state
      s.step, s.signals, s.pool_size = step, self.tracker.state_dict(), len(self.pool)
      s.sampler = self.parts.sampler.state_dict()
      s.hooks = {hook.name: hook.state_dict() for hook in self.parts.hooks}
      s.phase_s, s.wall_s = dict(self.timer.totals), self._wall_s()
      meta = {**s.to_json(), "config": json.loads(self.cfg.to_json_best_effort())}
      if self.critic_ckpt is not None and self.critic is not None:
        self.critic_ckpt.save(step, self.critic)  # first: a resume looks for the run's step
      self.ckpt.save(step, self.trainer.state, meta)

  def _wall_s(self) -> float:
    """Wall seconds of the whole run: earlier sessions (from the checkpoint) plus this one."""
    return self._wall_before + time.perf_counter() - self._session_start

  def _close(self) -> None:
    """Ends a session that stops at step 0 (`bootstrap`): waits for the checkpoint, closes logs,
    the round worker and the suite."""
    self.ckpt.wait()
    self.metrics.close()
    self.ckpt.close()
    if self.critic_ckpt is not None:
      self.critic_ckpt.close()
    self.rounds.shutdown()
    self.suite.close()

  def _close_after_error(self) -> None:
    """Closes the checkpointer (waiting for its save in flight) and the metrics writer. A failure
    of theirs is the same full disk as the error being raised, or is told in one warning line."""
    for what, resource in self._closing:
      try:
        resource.close()
      except Exception as e:
        if errors.disk_full_errno(e) is None:
          print(f"warning: closing the {what} after the error failed too: {errors.describe(e)}")
