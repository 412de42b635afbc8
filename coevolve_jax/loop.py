"""The CoEvolve main loop (paper Sec. 3, Algorithm 1): GRPO on a task pool that grows by feedback.

    D0 <- unguided exploration (suite)            pool <- D0
    [a generated held-out set, frozen before D0 (eval.generated_tasks)]
    warm-start on D0's solutions; freeze the reference policy; evaluate (before)
    for step = 1 .. T:
      tasks <- sample(pool); G rollouts each (engine + agent loop); rewards (suite's evaluator)
      advantages per group (Eq. 1); one GRPO epoch over the step's rollouts (trainer)
      events += signals(rollouts)                  forgetting, boundary, rare (Sec. 3.1)
      every F steps: select contexts from events; synthesize in a worker thread (suite:
        explore -> abstract -> validate, Sec. 3.2-3.3); commit to the pool after `lag` steps
      checkpoint every `checkpoint.every` steps (train state + RunState)
    evaluate (after) [and every pool task: eval.pool_after]; summary.json

The loop only orchestrates and times phases; the benchmark is behind `envs.base.Suite`, the
update behind `PolicyTrainer`, the signals behind `SignalTracker`, and a round's bookkeeping in
`feedback.rounds`. Host-side work is plain Python; the model, the engine and the update are jitted.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tqdm
from flax import nnx

from coevolve_jax import compiling, config, distributed, errors, grpo, models
from coevolve_jax.agent import AgentRunner, EpisodeLimits, QwenChat
from coevolve_jax.checkpoint import RunCheckpointer
from coevolve_jax import memory_plan
from coevolve_jax.errors import CorruptFileError, RunError
from coevolve_jax.feedback import factory, rounds
from coevolve_jax.feedback.llm import LLMError
from coevolve_jax.feedback.pool import SYNTH_SOURCES, TaskPool
from coevolve_jax.feedback.signals import SignalTracker
from coevolve_jax.models import sharding
from coevolve_jax.metrics import (
  CompileCounter,
  MetricsWriter,
  PhaseTimer,
  append_lines,
  call_recall,
  truncate_jsonl,
  write_atomic,
)
from coevolve_jax.rollout.engine import Engine
from coevolve_jax.rollout.sampling import SamplingParams
from coevolve_jax.run_state import RoundInFlight, RunState
from coevolve_jax.trainer import PolicyTrainer, make_batch, make_optimizer
from coevolve_jax.types import FINISHES, Task, Trajectory
from coevolve_jax.warmstart import describe, sft_batches, target_buckets
from envs import make_suite

log = logging.getLogger(__name__)
PHASES = (
  "explore",
  "warmstart",
  "compile",
  "rollout",
  "reward",
  "train",
  "feedback",
  "eval",
  "checkpoint",
)
# Entropy that, with the run's seed, seeds the generated held-out set's exploration: another
# stream than D0's (`RunState.np_rng`, seeded by the seed alone) and the rounds' ([seed, r, i]).
GENERATED_EVAL_STREAM = 0x6576616C


def flat_config(d: dict, prefix: str = "") -> dict[str, Any]:
  """A config's JSON dict as {"dotted.key": value} (nested dicts flattened)."""
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flat_config(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _host_memory_bytes() -> int | None:
  """The machine's physical memory in bytes, or None where the OS does not say."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


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
    if (done := self._completed_summary()) is not None:
      return done
    return self._session(self._run)

  def _session(self, body: Callable[[], Any]) -> Any:
    """`body()` with this session's clock and compile counter; on an error, the checkpointer and
    logs are closed before it propagates."""
    self._session_start = time.perf_counter()
    # XLA compilations of this process, logged per step (`compile/count`, `compile/seconds`).
    self.compiles = CompileCounter()
    try:
      return body()
    except Exception:
      self._close_after_error()
      raise
    finally:
      self.compiles.close()

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

  def _step0(self) -> int:
    self._setup()
    restored = self._restore()
    self._open_logs(restored)
    if restored is None:
      self._bootstrap()
      self.metrics.write(0, {**self.compiles.pop(), **self.timer.pop_last()})
    self.ckpt.wait()
    self.metrics.close()
    self.ckpt.close()
    self._executor.shutdown()
    self.suite.close()
    return self.state.step

  def _run(self) -> dict[str, Any]:
    self._setup()
    restored = self._restore()  # the newest readable checkpoint's step, or None: a fresh start
    self._open_logs(restored)
    if restored is not None:
      self.eval_generated = self._generated_eval_set(resumed=True)  # as frozen at the start
    if restored is None:
      self._bootstrap()  # D0 -> warm-start -> eval before -> checkpoint 0
    elif self.state.pending is not None:
      self._submit(self.state.pending)  # the round in flight at the checkpoint, redone exactly
    if self.cfg.compile.ahead:
      self._compile_ahead()
    before = self.compiles.pop()  # set-up, D0, warm-start, eval before: not step 1's
    if restored is None:  # step 0's row: what compiled, and the phases, before GRPO step 1
      self.metrics.write(0, {**before, **self.timer.pop_last()})
    count, seconds, hits = (before[f"compile/{k}"] for k in ("count", "seconds", "cache_hits"))
    print(f"compiled {count} programs before GRPO ({seconds:.1f} s; {hits} from the cache)")
    with tqdm.tqdm(
      total=self.cfg.train.steps, initial=self.state.step, desc="grpo", unit="step"
    ) as bar:
      while self.state.step < self.cfg.train.steps:
        info = self._step(self.state.step + 1)
        bar.set_postfix(reward=f"{info['reward/mean']:.2f}", pool=len(self.pool))
        bar.update(1)
    return self._finish(restored or 0)

  def _compile_ahead(self) -> None:
    """compile.ahead: every program a GRPO step can run, compiled before step 1 (after the
    reference is frozen, so its log-prob forward is compiled in its own dtype): the engine's
    prefill and decode shapes for the rollouts' sampling and the evaluations' greedy one, and the
    train step and log-prob forward at every (T, P) bucket. Every process compiles the same set
    (SPMD). docs/benchmarks/compiles.md lists the sets."""
    cfg = self.cfg
    greedy = SamplingParams(temperature=0.0)  # evaluations and greedy training episodes
    # Single decode steps run only while environment steps are in flight (`AgentRunner`).
    steps = {cfg.rollout.decode_steps} | (set() if self.runner.lockstep else {1})
    threads = cfg.compile.threads  # 0: `compiling.compile_threads`' default
    with self.timer("compile"):
      engine = self.engine.compile_ahead(
        [self.sampling, greedy],
        stop_ids=self.runner.stop_ids,
        decode_steps=sorted(steps),
        threads=threads,
      )
      rollouts = cfg.rollout.tasks_per_step * cfg.rollout.group_size
      routing = self.engine.record_routing
      train = self.trainer.compile_ahead(
        rollouts, cfg.train.mini_batches, routing=routing, threads=threads
      )
    print(f"compiled ahead: {engine} engine programs, {train} train batch shapes")

  def _bootstrap(self) -> None:
    """Step 0: D0 by unguided exploration, supervised warm-start, eval before, checkpoint."""
    with self.timer("explore"):  # the pool is empty here: a fresh start rolls it back to 0
      self.eval_generated = self._generated_eval_set(resumed=False)  # frozen before D0
      d0, counts = self._initial_tasks()
      report = self.pool.add(d0, eval_tasks=self._held_out())
      self.state.d0 = {**counts, "added": report.added, "dropped": len(report.dropped)}
      print(f"D0: {self.state.d0}")
      if not len(self.pool):
        raise RunError(
          f"D0 exploration left the task pool empty ({self.state.d0}): there is nothing to "
          f"train on. Raise explore.initial_tasks or explore.rounds, or check the explorer "
          f"(its errors are logged above)."
        )
    with self.timer("warmstart"):
      self._warmstart()
    self.trainer.freeze_reference()
    with self.timer("eval"):
      self.state.eval_before = self.evaluate("before")
      self.state.eval_generated_before = self.evaluate_generated("before")
    print(f"eval before training: {self.state.eval_before:.3f}")
    if self.state.eval_generated_before is not None:
      print(f"generated held-out set before training: {self.state.eval_generated_before}")
    self._save(0)

  def _initial_tasks(self) -> tuple[list[Task], dict[str, int]]:
    """D0 from the suite, made once by the primary process and given to every process
    (`distributed.on_primary`: explorer and judge LLM calls and environment writes happen once)
    with the run's RNG state after it, so every process goes on from the same state."""
    rng = self.state.np_rng

    def make() -> dict[str, Any]:
      d0, counts = self.suite.initial_tasks(self.cfg.explore.initial_tasks, rng, self.d0_llm)
      tasks = [json.loads(t.to_json()) for t in d0]
      return {"tasks": tasks, "counts": counts, "rng": rng.bit_generator.state}

    out = distributed.on_primary(make)
    rng.bit_generator.state = out["rng"]
    return [Task.from_dict(t) for t in out["tasks"]], out["counts"]

  def _generated_eval_set(self, *, resumed: bool) -> list[Task]:
    """The generated held-out set (`eval.generated_tasks`; [] when 0), frozen in
    eval_generated.jsonl: made by the primary process on a fresh start (the suite's
    `generated_eval_tasks`, seeded by (seed, `GENERATED_EVAL_STREAM`), so D0's random stream is
    untouched) and written there; read back from there on a resume. A resume that finds the file
    gone makes it again, the same tasks for the same seed, and says so.

    Raises:
      RunError: the exploration found no valid task (nothing to evaluate on).
      CorruptFileError: the file is not JSON lines of tasks.
    """
    n = self.cfg.eval.generated_tasks
    if n <= 0:
      return []
    path = os.path.join(self.workdir, "eval_generated.jsonl")
    if resumed and os.path.exists(path):
      try:
        with open(path, encoding="utf-8") as f:
          return [Task.from_json(line) for line in f if line.strip()]
      except (ValueError, TypeError) as e:
        raise CorruptFileError(
          f"{path} is damaged ({e}): the generated held-out set of this run cannot be read; "
          f"delete it to have it made again (the same tasks for the same seed)"
        ) from e
    if resumed:
      print(f"warning: {path} is missing; making the generated held-out set again")

    def make() -> list[dict[str, Any]]:
      rng = np.random.default_rng([self.cfg.seed, GENERATED_EVAL_STREAM])
      return [json.loads(t.to_json()) for t in self.suite.generated_eval_tasks(n, rng, self.d0_llm)]

    tasks = [Task.from_dict(t) for t in distributed.on_primary(make)]
    if not tasks:
      raise RunError(
        f"eval.generated_tasks={n}: exploring the held-out entries' states gave no valid task; "
        f"set eval.generated_tasks=0 or check the explorer (its errors are logged above)"
      )
    write_atomic(path, "".join(t.to_json() + "\n" for t in tasks))
    print(f"generated held-out set: {len(tasks)} tasks frozen in {path}")
    return tasks

  def _held_out(self) -> list[Task]:
    """What the pool's leak filter keeps out: the held-out split and the generated set."""
    return [*self.eval_split, *self.eval_generated]

  def _step(self, step: int) -> dict[str, Any]:
    """One GRPO step, then the feedback round's bookkeeping, metrics and (maybe) a checkpoint."""
    cfg = self.cfg
    tasks = self.pool.sample(
      cfg.rollout.tasks_per_step,
      self.state.np_rng,
      None if cfg.pool.synth_fraction < 0 else cfg.pool.synth_fraction,
    )
    trajs = self._rollout(
      [(t, g) for g, t in enumerate(tasks) for _ in range(cfg.rollout.group_size)]
    )
    rewards = np.array([t.reward for t in trajs], np.float32)
    groups = np.array([t.group_id for t in trajs])
    keep = np.array([t.finish not in cfg.train.drop_from_loss for t in trajs])
    adv = grpo.compute_advantages(
      rewards, groups, self.gcfg.adv_eps, self.gcfg.scale_by_std, keep_n=keep
    )
    with self.timer("train"):
      info = self.trainer.grpo_epoch(trajs, adv, cfg.train.mini_batches, keep=keep)
    events = self.tracker.observe(trajs, tasks)
    self.state.events.extend(events)
    self._log_groups(step, tasks, trajs, events)
    info.update(self._rollout_metrics(trajs, rewards, groups, keep))
    self.state.step = step
    if cfg.feedback.enabled:
      info.update(self._feedback_tick(step))
    info["pool/size"] = len(self.pool)
    info.update(self.timer.pop_last())
    # The engine's copy of the weights (cast, gathered over fsdp) made for this step's rollouts.
    info["timing/weight_sync_s"] = self.trainer.last_sync_s
    info.update(self.compiles.pop())
    self.metrics.write(step, info)  # before the save: a resume rewrites rows after its step
    if step % cfg.checkpoint.every == 0 or step == cfg.train.steps:
      self._save(step)
    return info

  def _finish(self, resumed_from: int) -> dict[str, Any]:
    """Joins a round still in flight, evaluates (after), writes summary.json, frees resources."""
    if self.state.pending is not None:  # resumed with fewer steps than a round in flight needed
      with self.timer("feedback"):
        self._commit_round()
    self._executor.shutdown()
    with self.timer("eval"):
      eval_after = self.evaluate("after")
      extra = {}
      if (generated := self.evaluate_generated("after")) is not None:
        extra["eval_generated_after"] = generated
      if self.cfg.eval.pool_after:
        extra["eval_pool_after"] = self.evaluate_pool()
    self.ckpt.wait()
    summary = {**self._summary(eval_after, resumed_from, self._wall_s()), **extra}
    write_atomic(self.summary_path, json.dumps(summary, indent=1, sort_keys=True))
    self.metrics.close()
    self.ckpt.close()
    self.suite.close()  # stops what the suite started (servers, workers), also at exit on failure
    return summary

  def _close_after_error(self) -> None:
    """Closes the checkpointer (waiting for its save in flight) and the metrics writer. A failure
    of theirs is the same full disk as the error being raised, or is told in one warning line."""
    for what, attr in (("checkpoints", "ckpt"), ("metrics", "metrics")):
      if (resource := getattr(self, attr, None)) is None:
        continue
      try:
        resource.close()
      except Exception as e:
        if errors.disk_full_errno(e) is None:
          print(f"warning: closing the {what} after the error failed too: {errors.describe(e)}")

  # ------------------------------------------------------------------ set-up

  def _setup(self) -> None:
    cfg = self.cfg
    self.chat = QwenChat(enable_thinking=False, max_call_chars=cfg.data.max_call_chars)
    if jax.process_count() > 1 and cfg.env == "appworld":
      raise RunError(
        "AppWorld with several processes is not supported yet: every process would build and "
        "serve the same world root (README, Several processes). Run it in one process."
      )
    self.suite = make_suite(cfg, self.workdir)  # the benchmark (envs/<name>/suite.py)
    self.eval_split = list(self.suite.eval_tasks)
    self.eval_generated: list[Task] = []  # `_generated_eval_set`, once the run state is known
    self.eval_tasks = self.eval_split[: cfg.eval.max_tasks]
    self.pool = TaskPool(
      os.path.join(self.workdir, "pool.jsonl"), threshold=cfg.pool.near_dup_threshold
    )
    self.tracker = SignalTracker.from_config(cfg.signals)
    # One mesh for everything the job allocates: parameters, optimizer state, reference, KV cache,
    # the train step and the decode step (models/sharding.py holds the logical-axis table).
    self.mesh = sharding.make_mesh(dict(cfg.mesh))
    models.apply_matmul_precision(cfg.model)
    if compiling.use_persistent_cache(cfg.compile.cache_dir):  # before the run's first compile
      print(f"compilation cache: {cfg.compile.cache_dir}")
    micro_batches = self._check_memory()
    model = models.build(cfg.model, seed=cfg.seed, mesh=self.mesh, dtype=cfg.model.param_dtype)
    self.gcfg = grpo.GRPOConfig.from_config(cfg.train)
    tx = make_optimizer(
      lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, grad_clip=cfg.train.grad_clip
    )
    # One SamplingParams for the training rollouts and the trainer, which scores old, reference
    # and current log-probs under the distribution the engine sampled from (top-k / top-p too).
    self.sampling = SamplingParams(
      temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p
    )
    self.trainer = PolicyTrainer(
      model,
      tx,
      self.gcfg,
      self.sampling,
      mesh=self.mesh,
      micro_batches=micro_batches,
      compute_dtype=cfg.model.dtype,
      inference_layout=cfg.rollout.weights_layout,
      inference_stacked=cfg.rollout.scan_layers,
      len_buckets=cfg.train.len_buckets,
      target_buckets=cfg.train.target_buckets,
    )
    self._setup_feedback()
    self.engine = Engine(
      model,
      num_slots=cfg.rollout.num_slots,
      cache_len=cfg.rollout.cache_len,
      dtype=jnp.dtype(cfg.model.dtype),
      max_prefill_tokens=cfg.rollout.max_prefill_tokens,
      record_routing=cfg.train.replay_routing,  # MoE: trajectories carry it to the trainer
      mesh=self.mesh,
      # Asked at every call: the engine always decodes the trainer's current weights.
      weights=self.trainer.inference_params,
      scan_layers=cfg.rollout.scan_layers,
      prefill_rows=cfg.rollout.prefill_rows,
      prefill_min_chunk=cfg.rollout.prefill_min_chunk,
      prefill_min_kv=cfg.rollout.prefill_min_kv,
    )
    self.runner = AgentRunner(
      self.engine,
      self.chat,
      self.suite.make_env,
      EpisodeLimits(
        max_new_tokens=cfg.rollout.max_new_tokens, max_model_steps=cfg.rollout.max_model_steps
      ),
      stop_ids=model.config.eos_token_ids,
      reproducible=cfg.rollout.reproducible,
      decode_steps=cfg.rollout.decode_steps,
    )
    self.eval_runner = AgentRunner(
      self.engine,
      self.chat,
      functools.partial(self.suite.make_env, eval=True),
      EpisodeLimits.for_evaluation(
        self.eval_tasks, cfg.eval.max_new_tokens, cfg.eval.max_steps_per_turn
      ),
      stop_ids=model.config.eos_token_ids,
      reproducible=cfg.rollout.reproducible,
      decode_steps=cfg.rollout.decode_steps,
    )
    self.ckpt = RunCheckpointer(os.path.join(self.workdir, "checkpoints"), cfg.checkpoint.keep)

  def _check_memory(self) -> int:
    """Chooses `train.micro_batches` (0 = auto: the fewest slices that fit) and stops at
    start-up, with the memory planner's table, when the run cannot fit its devices
    (`memory_plan.fit_run`). GPUs and TPUs report their memory; host (CPU) devices get an
    equal share of the machine's memory and the residual estimate only (a Qwen3-4B config on a
    laptop stops here instead of being killed for memory minutes later). A checkpoint run is
    planned from its config.json.

    Returns:
      The gradient-accumulation slices per update.
    Raises:
      RunError: static memory alone, or the activations of a worst-case mini-batch with every
        allowed micro-batch count, exceed one device's memory; `model.checkpoint` has no
        usable config.json.
    """
    mesh = dict(self.mesh.shape)
    device = jax.local_devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
    where = "device"
    if limit is None and device.platform == "cpu" and (host := _host_memory_bytes()):
      limit, where = host // jax.local_device_count(), "host-memory share per CPU device"
    try:
      micro, plan = memory_plan.fit_run(
        self.cfg, mesh, limit, confirm_compiled=device.platform != "cpu"
      )
    except MemoryError as e:
      raise RunError(str(e)) from None
    except (OSError, models.CheckpointFormatError) as e:  # the checkpoint's config.json
      raise RunError(f"model.checkpoint={self.cfg.model.checkpoint!r}: {e}") from None
    if plan is not None:
      print(
        f"memory: train.micro_batches = {micro}, {plan.total / 2**30:.1f} GiB per device "
        f"planned for a worst-case mini-batch ({plan.activation_source} activations) of "
        f"{limit / 2**30:.1f} GiB ({where})"
      )
    return micro

  def _setup_feedback(self) -> None:
    """The explorer LLMs (D0 and feedback rounds; None = programmatic) and the round worker."""
    ex = self.cfg.explore
    d0_kind = ex.d0_explorer or ex.explorer
    if jax.process_count() > 1 and "local" in (ex.explorer, d0_kind):
      raise RunError(
        "explore.explorer='local' with several processes is not supported: the local explorer "
        "decodes on the primary process only, and every process must make the same device "
        "calls (README, Several processes). Use gemini, openai or programmatic."
      )
    try:  # missing credentials: a one-line start-up error, not a traceback
      self.llm = factory.make_llm(ex.explorer, ex, self._policy_snapshot)
      self.d0_llm = (
        self.llm if d0_kind == ex.explorer else factory.make_llm(d0_kind, ex, self._policy_snapshot)
      )
    except LLMError as e:
      raise RunError(f"explore.explorer={ex.explorer!r}, d0_explorer={d0_kind!r}: {e}") from None
    self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="feedback")
    self.journal = rounds.RoundJournal(os.path.join(self.workdir, "rounds"))

  def _policy_snapshot(self):
    """A copy of the current policy in the compute dtype (the trainer's buffers are donated or
    replaced at every step)."""
    return nnx.merge(self.trainer.graphdef, jax.tree.map(jnp.copy, self.trainer.inference_params()))

  def _warmstart(self) -> None:
    cfg = self.cfg.warmstart
    if cfg.steps <= 0:
      return
    demos = [
      self.suite.demonstration(t, self.chat, f"demo{i}") for i, t in enumerate(self.pool.tasks)
    ]
    print(f"warm-start on {describe(demos)}")
    warmup = min(10, max(1, cfg.steps // 5))
    schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1), cfg.lr * 0.05
    )
    sft = PolicyTrainer(
      self.trainer.model(),
      make_optimizer(schedule, 0.0, self.cfg.train.grad_clip),
      self.gcfg,
      1.0,
      mesh=self.mesh,
      compute_dtype=self.cfg.model.dtype,
    )
    t_max = max(len(d.token_ids) for d in demos)  # T: t_max, or a batch's bucket above it
    p_buckets = target_buckets(demos)  # P: a few multiples of 32
    batches = sft_batches(demos, cfg.batch_size, self.state.np_rng, cfg.steps)
    for i, batch in enumerate(tqdm.tqdm(batches, total=cfg.steps, desc="warm-start")):
      loss = sft.sft_update(make_batch(batch, min_len=t_max, target_buckets=p_buckets))
      if i % 10 == 0 or i == cfg.steps - 1:
        self.metrics.write(0, {"warmstart/loss": loss, "warmstart/step": i})
    self.trainer.params = sft.params
    self.trainer.reset_optimizer()

  # ------------------------------------------------------------------ rollouts and evaluation

  def _rollout(
    self, jobs: list[tuple[Task, int]], *, eval: bool = False, greedy: bool = False
  ) -> list[Trajectory]:
    """Episodes of (task, group id) jobs under the trainer's current weights; the evaluator's
    seconds are moved from the "rollout" phase to "reward".

    `eval`: the held-out split's episodes (the suite's evaluation loop and limits), greedy.
    `greedy`: training episodes decoded greedily (the generated held-out set and the pool
    evaluation); they draw no key from the run's stream, so switching them on leaves the
    training rollouts' samples as they were.
    """
    runner = self.eval_runner if eval else self.runner
    sampling = SamplingParams(temperature=0.0) if eval or greedy else self.sampling
    if greedy and not eval:
      sub = jax.random.key(0)  # unused by greedy decoding
    else:
      self.state.key, sub = jax.random.split(self.state.key)
    before = runner.timings.get("reward", 0.0)
    with self.timer("rollout"):
      trajs = runner.run(jobs, sampling, sub)
    self.timer.move(runner.timings["reward"] - before, src="rollout", dst="reward")
    return trajs

  def _rollout_metrics(
    self, trajs, rewards: np.ndarray, groups: np.ndarray, keep: np.ndarray
  ) -> dict[str, Any]:
    finishes = [t.finish for t in trajs]
    return {
      "reward/mean": float(rewards.mean()),
      "reward/max": float(rewards.max()),
      "rollout/tokens_generated": int(sum(t.num_generated for t in trajs)),
      "rollout/parse_errors": int(sum(t.parse_errors for t in trajs)),
      # rollout/finished_done, _context, _max_model_steps, _error: how the episodes ended
      **{f"rollout/finished_{f}": finishes.count(f) for f in FINISHES},
      "rollout/dropped_from_loss": int(np.sum(~keep)),  # train.drop_from_loss
      "rollout/mixed_groups": int(
        sum(len(set(rewards[groups == g])) > 1 for g in np.unique(groups))
      ),
      **{f"signals/{k}": v for k, v in self.tracker.counts.items()},
    }

  def evaluate(self, tag: str) -> float:
    """Greedy success rate on the held-out split; per-task results in eval_<tag>.jsonl."""
    trajs = self._rollout([(t, i) for i, t in enumerate(self.eval_tasks)], eval=True)
    write_atomic(
      os.path.join(self.workdir, f"eval_{tag}.jsonl"),
      "".join(json.dumps(self._eval_row(t)) + "\n" for t in trajs),
    )
    suite_metrics = self.suite.metrics(trajs)  # the suite's own figures (e.g. TGC / SGC)
    if suite_metrics:
      self.state.suite_eval[tag] = suite_metrics
    return float(np.mean([t.reward for t in trajs])) if trajs else 0.0

  def evaluate_generated(self, tag: str) -> dict[str, float] | None:
    """Greedy figures on the generated held-out set (None when there is none): "success" (share
    of tasks with reward >= signals.success_threshold), "reward" (mean), "call_recall" and
    "name_recall" (mean shares of each task's ground-truth calls made, exactly and by function
    name: `metrics.call_recall`, graded where the checker's reward is all or nothing) and
    "tasks"; per-task results in eval_generated_<tag>.jsonl. Training episodes and limits, as
    the pool's tasks get (an in-distribution proxy, not a benchmark score)."""
    if not self.eval_generated:
      return None
    trajs = self._rollout([(t, i) for i, t in enumerate(self.eval_generated)], greedy=True)
    write_atomic(
      os.path.join(self.workdir, f"eval_generated_{tag}.jsonl"),
      "".join(json.dumps(self._eval_row(t)) + "\n" for t in trajs),
    )
    recall = [call_recall(t.ground_truth, r.calls) for t, r in zip(self.eval_generated, trajs)]
    return {
      **self._success_figures([t.reward for t in trajs]),
      "call_recall": float(np.mean([e for e, _ in recall])),
      "name_recall": float(np.mean([n for _, n in recall])),
    }

  def evaluate_pool(self) -> dict[str, dict[str, float]]:
    """Greedy figures on every pool task after training, grouped by where the task came from:
    "d0" and "synth:<signal>" (the signal whose context the task was synthesized from;
    "synth:unguided" for random re-exploration); per-task results in eval_pool_after.jsonl."""
    tasks = self.pool.tasks
    trajs = self._rollout([(t, i) for i, t in enumerate(tasks)], greedy=True)
    rows = []
    for task, traj in zip(tasks, trajs, strict=True):
      rows.append({**self._eval_row(traj), "origin": _origin(task)})
    write_atomic(
      os.path.join(self.workdir, "eval_pool_after.jsonl"),
      "".join(json.dumps(r) + "\n" for r in rows),
    )
    out = {}
    for origin in sorted({r["origin"] for r in rows}):
      out[origin] = self._success_figures([r["reward"] for r in rows if r["origin"] == origin])
    return out

  def _success_figures(self, rewards: list[float]) -> dict[str, float]:
    thr = self.cfg.signals.success_threshold
    return {
      "success": float(np.mean([r >= thr for r in rewards])) if rewards else 0.0,
      "reward": float(np.mean(rewards)) if rewards else 0.0,
      "tasks": len(rewards),
    }

  @staticmethod
  def _eval_row(t: Trajectory) -> dict[str, Any]:
    return {
      "task_id": t.task_id,
      "reward": t.reward,
      "finish": t.finish,
      "model_steps": t.model_steps,
      "parse_errors": t.parse_errors,
      "calls": t.calls,
    }

  def _log_groups(self, step: int, tasks: list[Task], trajs: list[Trajectory], events) -> None:
    """One groups.jsonl row per GRPO group of the step: the task, its origin (`_origin`), the
    group's rewards and the signals it fired, for the per-signal accounting of
    scripts/ablations.py (did a boundary task's group turn from mixed to solved? did a
    forgotten task recover?)."""
    fired: dict[str, set[str]] = {}
    for e in events:
      fired.setdefault(e.task.task_id, set()).add(e.signal)
    rows = []
    for g, task in enumerate(tasks):
      rows.append(
        json.dumps(
          {
            "step": step,
            "task_id": task.task_id,
            "origin": _origin(task),
            "rewards": [t.reward for t in trajs if t.group_id == g],
            "fired": sorted(fired.get(task.task_id, ())),
          }
        )
      )
    append_lines(os.path.join(self.workdir, "groups.jsonl"), rows)

  # ------------------------------------------------------------------ feedback rounds

  def _feedback_tick(self, step: int) -> dict[str, Any]:
    """Starts a round after every F-th step; joins the round in flight once its step is due.

    With `feedback.concurrent` the round's synthesis (exploration, abstraction, validation) runs
    in a worker thread while the next `feedback.lag` GRPO steps go on; its tasks join the pool
    after step start + lag, a step fixed in advance, so a run's pool does not depend on timing.
    Time the loop spends here (selection, waiting, pool commit) is the "feedback" phase.
    """
    info: dict[str, Any] = {}
    with self.timer("feedback"):
      if step % self.cfg.feedback.every == 0:
        if self.state.pending is not None:  # never with lag < every (validated); a guard
          info.update(self._commit_round())
        self._start_round(step)
      if self.state.pending is not None and step >= self.state.pending.commit_at:
        info.update(self._commit_round())
    return info

  def _round_rngs(self, round_idx: int) -> tuple[np.random.Generator, np.random.Generator]:
    """Selection and synthesis RNGs of a round: fixed by (seed, round), so a resumed run redoes a
    round in flight exactly."""
    return (
      np.random.default_rng([self.cfg.seed, round_idx, 0]),
      np.random.default_rng([self.cfg.seed, round_idx, 1]),
    )

  def _start_round(self, step: int) -> None:
    fb = self.cfg.feedback
    self.state.round += 1
    chosen = rounds.select_events(
      self.state.events,
      self._round_rngs(self.state.round)[0],
      fb.max_contexts,
      kinds=tuple(fb.kinds),
      mode=fb.mode,
      pool_tasks=self.pool.tasks,
    )
    shares = rounds.signal_shares(self.state.events)
    self.state.events = []
    # the last step's round is joined at once, before the final checkpoint
    commit_at = min(step + fb.lag, self.cfg.train.steps) if fb.concurrent else step
    self._submit(RoundInFlight(self.state.round, step, commit_at, chosen, shares))

  def _submit(self, round_: RoundInFlight) -> None:
    """Hands the round to the suite's synthesis: in the worker thread, or here when not
    `feedback.concurrent`. A round this run committed before a kill is not synthesized again:
    its recorded result is reused (`RoundJournal`), so its tasks keep their ids and content."""
    recorded = self.journal.load(round_.round_idx, rounds.events_digest(round_.events))
    if recorded is not None:
      round_.future = concurrent.futures.Future()
      round_.future.set_result(recorded)
      self.state.pending = round_
      return
    if not distributed.is_primary():  # the primary synthesizes; `_commit_round` shares it
      round_.future = concurrent.futures.Future()
      round_.future.set_result(None)
      self.state.pending = round_
      return
    if self.llm is not None:
      self.llm.refresh()  # the local explorer serves the policy as of this step
    args = (round_.events, self._round_rngs(round_.round_idx)[1], round_.round_idx, self.llm)
    if self.cfg.feedback.concurrent:
      round_.future = self._executor.submit(self.suite.synthesize_round, *args)
    else:
      round_.future = concurrent.futures.Future()
      round_.future.set_result(self.suite.synthesize_round(*args))
    self.state.pending = round_

  def _commit_round(self) -> dict[str, Any]:
    """Waits for the round in flight, adds its tasks to the pool and logs the round."""
    pending, self.state.pending = self.state.pending, None
    start = time.perf_counter()
    if jax.process_count() > 1:  # the primary's round (or its failure) on every process
      result = rounds.RoundResult.from_json(
        distributed.on_primary(lambda: pending.future.result().to_json())
      )
    else:
      result = pending.future.result()
    wait_s = time.perf_counter() - start
    self.journal.save(result, rounds.events_digest(pending.events))  # before the pool sees it
    report = rounds.commit_round(result, self.pool, self._held_out())
    s = self.state
    s.tasks_synthesized += report.synthesized
    s.tasks_accepted += report.accepted
    s.tasks_dropped += len(report.dropped)
    s.validation.append(report.pass_rate if report.synthesized else None)
    s.feedback_synth_s += result.wall_s
    row = {
      "round": pending.round_idx,
      "step": s.step,
      "start_step": pending.start_step,
      "synthesized": report.synthesized,
      "accepted": report.accepted,
      "pass_rate": report.pass_rate,
      "per_signal": report.per_signal,
      "signal_events": pending.signals.get("events", {}),
      "signal_shares": pending.signals.get("shares", {}),
      "dropped": report.dropped,
      "rejected": report.rejected,
      "llm_usage": report.llm_usage,
      "synth_s": round(result.wall_s, 3),
      "wait_s": round(wait_s, 3),
      "eval_similarity": report.eval_similarity,
      "pool_size": len(self.pool),
    }
    append_lines(os.path.join(self.workdir, "feedback.jsonl"), [json.dumps(row)])
    append_lines(
      os.path.join(self.workdir, "exploration.jsonl"),
      (
        json.dumps({"round": pending.round_idx, "step": s.step, **t}, ensure_ascii=False)
        for t in result.trace
      ),
    )
    out = {
      "feedback/synthesized": report.synthesized,
      "feedback/accepted": report.accepted,
      "feedback/pass_rate": report.pass_rate,
      "feedback/dropped": len(report.dropped),
      "feedback/synth_s": result.wall_s,
      "feedback/wait_s": wait_s,
    }
    if report.llm_usage:
      out["feedback/llm_tokens"] = report.llm_usage["tokens"]
    for kind, share in pending.signals.get("shares", {}).items():
      out[f"feedback/share_{kind}"] = share  # the round's events per kind (paper Fig. 4)
    return out

  # ------------------------------------------------------------------ checkpoints and logs

  def _save(self, step: int) -> None:
    with self.timer("checkpoint"):
      s = self.state
      s.step, s.signals, s.pool_size = step, self.tracker.state_dict(), len(self.pool)
      s.phase_s, s.wall_s = dict(self.timer.totals), self._wall_s()
      meta = {**s.to_json(), "config": json.loads(self.cfg.to_json_best_effort())}
      self.ckpt.save(step, self.trainer.state, meta)

  def _restore(self) -> int | None:
    """Restore latest or start fresh: sets the trainer, `self.state`, the tracker and the timer;
    returns the restored step, or None for a fresh start."""
    self.trainer.freeze_reference()  # gives ref_params its structure
    try:
      restored = self.ckpt.restore_latest(self.trainer.state)
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
    self.timer = PhaseTimer(self.state.phase_s)
    print(f"resuming from checkpoint step {step}")
    return step

  def _open_logs(self, restored: int | None) -> None:
    """config.json, the workdir's logs and pool brought back to the restored step, metrics."""
    self._wall_before = self.state.wall_s
    self._check_config(fresh=restored is None)
    step = -1 if restored is None else restored
    # Tasks accepted after that checkpoint move to pool.jsonl.rolled-back (the resumed run
    # synthesizes them again), so the resumed run continues exactly from the checkpoint.
    moved = self.pool.rollback(
      self.state.pool_size, os.path.join(self.workdir, "pool.jsonl.rolled-back")
    )
    if moved:
      print(f"task pool: {moved} tasks from after the checkpoint moved to pool.jsonl.rolled-back")
    if restored is None:
      self.journal.clear()  # a fresh start: no round of an earlier run may be reused
    truncate_jsonl(os.path.join(self.workdir, "feedback.jsonl"), step)
    truncate_jsonl(os.path.join(self.workdir, "exploration.jsonl"), step)
    truncate_jsonl(os.path.join(self.workdir, "groups.jsonl"), step)
    self.metrics = MetricsWriter(self.workdir, step)

  def _check_config(self, fresh: bool) -> None:
    """Writes config.json on a fresh start; on resume, warns about every changed field."""
    path = os.path.join(self.workdir, "config.json")
    now = json.loads(self.cfg.to_json_best_effort())
    if fresh or not os.path.exists(path):
      write_atomic(path, json.dumps(now, indent=1, sort_keys=True))
      return
    with open(path, encoding="utf-8") as f:
      before = flat_config(json.load(f))
    now = flat_config(now)
    for key in sorted(k for k in set(now) | set(before) if now.get(k) != before.get(k)):
      print(
        f"warning: config {key} changed since this run started: "
        f"{before.get(key)!r} -> {now.get(key)!r}"
      )

  # ------------------------------------------------------------------ summary

  def _completed_summary(self) -> dict[str, Any] | None:
    """The summary of a run that already finished its configured steps, else None."""
    if not os.path.exists(self.summary_path):
      return None
    try:
      with open(self.summary_path, encoding="utf-8") as f:
        summary = json.load(f)
      if not isinstance(summary, dict):
        raise ValueError(f"a JSON {type(summary).__name__}, not an object")
    except ValueError as e:
      raise CorruptFileError(
        f"{self.summary_path} is damaged ({e}); move it aside and rerun the same command: the "
        f"run resumes from its last checkpoint and writes the summary again"
      ) from e
    if summary.get("complete") and summary.get("steps") == self.cfg.train.steps:
      print(f"run in {self.workdir} is complete ({summary['steps']} steps); nothing to do")
      return summary
    return None

  def _wall_s(self) -> float:
    """Wall seconds of the whole run: earlier sessions (from the checkpoint) plus this one."""
    return self._wall_before + time.perf_counter() - self._session_start

  def _summary(self, eval_after: float, resumed_from: int, wall_s: float) -> dict[str, Any]:
    s = self.state
    phase = {k: round(float(self.timer.totals.get(k, 0.0)), 2) for k in PHASES}
    return {
      "complete": True,
      "steps": s.step,
      "resumed_from_step": resumed_from,
      "eval_before": s.eval_before,
      "eval_after": eval_after,
      "eval_tasks": len(self.eval_tasks),
      **(
        {"eval_generated_before": s.eval_generated_before}
        if s.eval_generated_before is not None
        else {}
      ),
      "signals": dict(self.tracker.counts),
      "tasks_synthesized": s.tasks_synthesized,
      "tasks_accepted": s.tasks_accepted,
      "tasks_dropped_as_duplicates": s.tasks_dropped,
      "d0": s.d0,
      "validation_pass_rate": s.validation,
      "pool_size": len(self.pool),
      "wall_s": round(wall_s, 1),
      "phase_s": phase,
      # Share of wall time the training loop spent on feedback work (selecting, waiting for
      # the round in flight, committing to the pool); synthesis itself overlaps GRPO steps.
      "feedback_share": round(phase["feedback"] / wall_s, 4) if wall_s > 0 else 0.0,
      "feedback_synth_s": round(float(s.feedback_synth_s), 2),
      "feedback_rounds": s.round,
      **({"suite_eval": s.suite_eval} if s.suite_eval else {}),
    }


def _origin(task: Task) -> str:
  """Where a pool task came from: "d0" (unguided exploration before training) or
  "synth:<signal>" (a feedback round; "synth:unguided" for random re-exploration)."""
  if task.source not in SYNTH_SOURCES:
    return "d0"
  return f"synth:{task.provenance.get('signal') or rounds.UNGUIDED}"
