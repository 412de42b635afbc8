"""The parts of one run, built from its config: benchmark, pool, signals, mesh, model, trainer,
engine, agent runners, explorer LLMs, checkpointer.

One mesh holds everything the job allocates: parameters, optimizer state, reference, KV cache,
the train step and the decode step (models/sharding.py holds the logical-axis table). The order
of construction is the order of the start-up's checks and messages: what can fail in seconds
(processes, the suite, the memory plan) comes before what takes minutes (model, compiles).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from coevolve_jax import compiling, diagnostics, distributed, grpo, memory_plan, models
from coevolve_jax.agent import AgentRunner, EpisodeLimits, QwenChat
from coevolve_jax.cli import import_model
from coevolve_jax.tokenizer import run_tokenizer_folder
from coevolve_jax.checkpoint import RunCheckpointer
from coevolve_jax.config import param_dtype_warning
from coevolve_jax.errors import RunError
from coevolve_jax.feedback import factory, rounds
from coevolve_jax.feedback.llm import LLMError, TextLLM
from coevolve_jax.feedback.pool import TaskPool
from coevolve_jax.feedback.sampler import TaskSampler, make_sampler, sampler_name
from coevolve_jax.feedback.signals import SignalTracker
from coevolve_jax.hooks import TrainingHook, build_hooks
from coevolve_jax.models import sharding
from coevolve_jax.rollout.engine import Engine
from coevolve_jax.rollout.sampling import SamplingParams
from coevolve_jax.suite import Suite, make_suite, suite_module
from coevolve_jax.trainer import PolicyTrainer, make_optimizer


@dataclasses.dataclass
class Components:
  """Everything a run is made of (see the module docstring); `build` makes it."""

  chat: QwenChat
  suite: Suite
  pool: TaskPool
  tracker: SignalTracker
  sampler: TaskSampler
  hooks: list[TrainingHook]
  mesh: jax.sharding.Mesh
  sampling: SamplingParams
  trainer: PolicyTrainer
  engine: Engine
  runner: AgentRunner
  eval_runner: AgentRunner
  llm: TextLLM | None  # the feedback rounds' explorer (None: programmatic)
  d0_llm: TextLLM | None  # D0's and the generated set's explorer
  journal: rounds.RoundJournal
  ckpt: RunCheckpointer


def build(cfg: Any, workdir: str) -> Components:
  """The run's components, in start-up order.

  Raises:
    RunError: several processes with a suite or explorer that cannot run on them, a mesh
      the devices cannot form, a run that does not fit its devices, or an explorer whose
      credentials are missing.
    SuiteUnavailable: the suite's environment or data is missing.
  """
  chat = QwenChat(
    enable_thinking=False,
    max_call_chars=cfg.episode.max_call_chars,
    max_calls_per_reply=cfg.episode.max_calls_per_reply,
    tokenizer_folder=run_tokenizer_folder(cfg.model),
  )
  _check_processes(cfg)
  try:
    mesh = sharding.make_mesh(dict(cfg.mesh))
  except ValueError as e:  # more devices asked for than there are
    raise RunError(f"mesh: {e}") from None
  suite = make_suite(cfg, workdir)  # the benchmark (envs/<name>/suite.py)
  pool = TaskPool(
    os.path.join(workdir, "pool.jsonl"),
    threshold=cfg.pool.near_dup_threshold,
    drop_eval_states=cfg.explore.eval_states == "disjoint",
  )
  models.apply_matmul_precision(cfg.model)
  compiling.enable_cache(cfg.compile.cache_dir, workdir, primary=distributed.is_primary())
  warning = param_dtype_warning(cfg.model.param_dtype)
  if warning and distributed.is_primary():
    print(f"warning: {warning}")
  micro_batches = _plan_memory(cfg, mesh)
  model = models.build(cfg.model, seed=cfg.seed, mesh=mesh, dtype=cfg.model.param_dtype)
  moe = sharding.expert_axis_warning(model.config.num_experts, dict(mesh.shape))
  if moe and distributed.is_primary():
    print(f"warning: {moe}")
  if chat.vocab_size > model.config.vocab_size:
    raise RunError(
      f"the tokenizer ({chat.tokenizer_folder or 'Qwen3'}) has {chat.vocab_size} ids, more than "
      f"the model's {model.config.vocab_size} embedding rows: set model.tokenizer to the "
      "checkpoint's tokenizer folder"
    )
  # One SamplingParams for the training rollouts and the trainer, which scores old, reference
  # and current log-probs under the distribution the engine sampled from (top-k / top-p too).
  sampling = SamplingParams(
    temperature=cfg.sampling.temperature, top_k=cfg.sampling.top_k, top_p=cfg.sampling.top_p
  )
  trainer = _trainer(cfg, model, sampling, mesh, micro_batches)
  llm, d0_llm = _explorer_llms(cfg, functools.partial(_policy_snapshot, trainer))
  engine = _engine(cfg, model, trainer, mesh)
  runner, eval_runner = _runners(cfg, engine, chat, suite, model.config.eos_token_ids)
  return Components(
    chat=chat,
    suite=suite,
    pool=pool,
    tracker=SignalTracker.from_config(cfg.signals),
    sampler=make_sampler(sampler_name(cfg), cfg, llm),
    hooks=build_hooks(cfg, workdir) + diagnostics.build(cfg, workdir),
    mesh=mesh,
    sampling=sampling,
    trainer=trainer,
    engine=engine,
    runner=runner,
    eval_runner=eval_runner,
    llm=llm,
    d0_llm=d0_llm,
    journal=rounds.RoundJournal(os.path.join(workdir, "rounds")),
    ckpt=RunCheckpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint.keep),
  )


def _check_processes(cfg: Any) -> None:
  """Refuses several processes with a suite that does not declare `multi_process`, before it
  starts anything (servers, workers)."""
  if jax.process_count() > 1 and not suite_module(cfg.env).Suite.multi_process:
    raise RunError(
      f"env={cfg.env!r} with several processes is not supported yet: every process would "
      f"build and serve the same environments (docs/running.md, 'Several processes'). Run it in "
      f"one process."
    )


def _plan_memory(cfg: Any, mesh: jax.sharding.Mesh) -> int:
  """Chooses `train.micro_batches` (0 = auto: the fewest slices that fit) and stops at
  start-up, with the memory planner's table, when the run cannot fit its devices
  (`memory_plan.fit_run`). GPUs and TPUs report their memory; host (CPU) devices get an equal
  share of the machine's memory and the residual estimate only (a Qwen3-4B config on a laptop
  stops here instead of being killed for memory minutes later). A checkpoint run is planned
  from its config.json.

  Returns:
    The gradient-accumulation slices per update.
  Raises:
    RunError: static memory alone, or the activations of a worst-case mini-batch with every
      allowed micro-batch count, exceed one device's memory; `model.checkpoint` has no usable
      config.json.
  """
  device = jax.local_devices()[0]
  limit, where = memory_plan.device_memory_limit()
  try:
    micro, plan = memory_plan.fit_run(
      cfg, dict(mesh.shape), limit, confirm_compiled=device.platform != "cpu"
    )
  except MemoryError as e:
    raise RunError(str(e)) from None
  except (OSError, models.CheckpointFormatError) as e:  # the checkpoint's config.json
    hint = ""
    if os.path.abspath(cfg.model.checkpoint) == str(import_model.smollm2_folder().absolute()):
      hint = "; `make real-model` imports it (the cpu_real preset's model)"
    raise RunError(f"model.checkpoint={cfg.model.checkpoint!r}: {e}{hint}") from None
  if plan is not None:
    assert limit is not None  # fit_run plans only for a known memory size
    print(
      f"memory: train.micro_batches = {micro}, {plan.total / 2**30:.1f} GiB per device "
      f"planned for a worst-case mini-batch ({plan.activation_source} activations) of "
      f"{limit / 2**30:.1f} GiB ({where})"
    )
  return micro


def _trainer(
  cfg: Any, model: Any, sampling: SamplingParams, mesh: jax.sharding.Mesh, micro_batches: int
) -> PolicyTrainer:
  tx = make_optimizer(
    lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, grad_clip=cfg.train.grad_clip
  )
  return PolicyTrainer(
    model,
    tx,
    grpo.GRPOConfig.from_config(cfg.train),
    sampling,
    mesh=mesh,
    micro_batches=micro_batches,
    compute_dtype=cfg.model.dtype,
    inference_layout=cfg.engine.weights_layout,
    inference_stacked=cfg.engine.scan_layers,
    len_buckets=cfg.train.len_buckets,
    target_buckets=cfg.train.target_buckets,
  )


def _policy_snapshot(trainer: PolicyTrainer) -> Any:
  """A copy of the current policy in the compute dtype (the trainer's buffers are donated or
  replaced at every step): what the local explorer serves."""
  return nnx.merge(trainer.graphdef, jax.tree.map(jnp.copy, trainer.inference_params()))


def _explorer_llms(cfg: Any, policy: Callable[[], Any]) -> tuple[TextLLM | None, TextLLM | None]:
  """The explorer LLMs of the rounds and of D0 (None = programmatic)."""
  ex = cfg.explore
  d0_kind = ex.d0_explorer or ex.explorer
  if jax.process_count() > 1 and "local" in (ex.explorer, d0_kind):
    raise RunError(
      "explore.explorer='local' with several processes is not supported: the local explorer "
      "decodes on the primary process only, and every process must make the same device "
      "calls (docs/running.md, 'Several processes'). Use gemini, openai or programmatic."
    )
  try:  # missing credentials: a one-line start-up error, not a traceback
    tok = run_tokenizer_folder(cfg.model)
    # The clients and their credentials on the primary only: it makes every LLM call.
    primary = distributed.is_primary()
    llm = factory.make_llm(ex.explorer, ex, policy, tok, primary)
    d0_llm = llm if d0_kind == ex.explorer else factory.make_llm(d0_kind, ex, policy, tok, primary)
  except LLMError as e:
    raise RunError(f"explore.explorer={ex.explorer!r}, d0_explorer={d0_kind!r}: {e}") from None
  return llm, d0_llm


def _engine(cfg: Any, model: Any, trainer: PolicyTrainer, mesh: jax.sharding.Mesh) -> Engine:
  r = cfg.engine
  return Engine(
    model,
    num_slots=r.num_slots,
    cache_len=r.cache_len,
    dtype=jnp.dtype(cfg.model.dtype),
    max_prefill_tokens=r.max_prefill_tokens,
    record_routing=cfg.train.replay_routing,  # MoE: trajectories carry it to the trainer
    mesh=mesh,
    # Asked at every call: the engine always decodes the trainer's current weights.
    weights=trainer.inference_params,
    scan_layers=r.scan_layers,
    prefill_rows=r.prefill_rows,
    prefill_min_chunk=r.prefill_min_chunk,
    prefill_min_kv=r.prefill_min_kv,
  )


def _runners(
  cfg: Any, engine: Engine, chat: QwenChat, suite: Suite, stop_ids: Any
) -> tuple[AgentRunner, AgentRunner]:
  """The training episodes' runner and the held-out split's (the suite's evaluation loop and
  limits: never cut before the environment ends an episode)."""
  r = cfg.episode
  common = {
    "stop_ids": stop_ids,
    "reproducible": r.reproducible,
    "decode_steps": r.decode_steps,
    "env_on_primary": suite.env_on_primary,
    "predict_next": bool(cfg.role_agent.wia.enabled),
  }
  runner = AgentRunner(
    engine,
    chat,
    suite.make_env,
    EpisodeLimits(max_new_tokens=r.max_new_tokens, max_model_steps=r.max_model_steps),
    **common,
  )
  eval_tasks = list(suite.eval_tasks)[: cfg.eval.max_tasks]
  limits = EpisodeLimits.for_evaluation(
    eval_tasks, cfg.eval.max_new_tokens, cfg.eval.max_steps_per_turn
  )
  eval_runner = AgentRunner(
    engine, chat, functools.partial(suite.make_env, eval=True), limits, **common
  )
  return runner, eval_runner
