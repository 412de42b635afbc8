"""Start-up validation of a whole run config (configs/bfcl.py, configs/appworld.py).

`validate(cfg)` checks the fields a run reads, once, before any work, and raises ValueError naming
the first bad field (`rollout.group_size must be an int >= 2 ..., got 1`). Where the module that
uses a field already checks it in a function of its own (signal kinds and feedback mode in
`feedback.rounds.check_selection`, the `signals` fields in `SignalTracker`, sampling in
`SamplingParams`, the preset in `QwenConfig.preset`), that function is called and its message is
prefixed with the field; accepted values are read from the owners' constants
(`grpo.KL_ESTIMATORS`, `grpo.LOSS_AGGS`, `feedback.factory.EXPLORERS`, ...). The suite named by
`cfg.env` checks its own fields (`suite.validate_config`, with the helpers below). It computes
nothing on a device, so it is safe to call before `jax.distributed.initialize`.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from coevolve_jax import advantages, diagnostics, grpo, suite
from coevolve_jax.feedback import factory, rounds
from coevolve_jax.feedback.pool import EVAL_STATES
from coevolve_jax.feedback.aiw import AIWSampler
from coevolve_jax.feedback.llm import PrimaryOnlyLLM
from coevolve_jax.qevolve import QEvolveConfig
from coevolve_jax.wia import WIAConfig
from coevolve_jax.feedback.sampler import make_sampler, sampler_name
from coevolve_jax.feedback.signals import SignalTracker
from coevolve_jax.hooks import check_hooks
from coevolve_jax.models import QwenConfig
from coevolve_jax.models.kernels import ATTENTION_KERNELS
from coevolve_jax.models.qwen import EXPERT_DISPATCH, REMAT_POLICIES
from coevolve_jax.models.builder import MATMUL_PRECISIONS
from coevolve_jax.models.hf import CheckpointFormatError, read_config
from coevolve_jax.models.sharding import MESH_AXES
from coevolve_jax.rollout.sampling import SamplingParams
from coevolve_jax.types import FINISHES


def _moved() -> dict[str, str]:
  out = {f"rollout.{k}": f"sampling.{k}" for k in ("temperature", "top_p", "top_k")}
  engine: tuple[str, ...] = (
    "num_slots",
    "cache_len",
    "max_prefill_tokens",
    "weights_layout",
    "scan_layers",
  )
  engine += ("prefill_rows", "prefill_min_chunk", "prefill_min_kv")
  out.update({f"rollout.{k}": f"engine.{k}" for k in engine})
  episode = ("max_new_tokens", "max_model_steps", "reproducible", "decode_steps")
  out.update({f"rollout.{k}": f"episode.{k}" for k in episode})
  out["rollout.max_steps_per_turn"] = "bfcl.max_steps_per_turn"
  data = ("category", "eval_size", "tool_style", "max_obs_chars", "max_obs_tokens")
  out.update({f"data.{k}": f"bfcl.{k}" for k in (*data, "explore_category")})
  out["data.max_call_chars"] = "episode.max_call_chars"
  out.update({f"explore.{k}": f"bfcl.{k}" for k in ("only_classes", "max_classes")})
  out.update(
    {f"backends.{k}": f"bfcl.backends.{k}" for k in ("call_wall_s", "worker_memory_mib", "workers")}
  )
  return out


# Fields that moved when the config was grouped by consumer (2026-12-03): old dotted name -> new.
MOVED = _moved()


def moved_error(field: str) -> str | None:
  """The one-line error for a field that moved (`MOVED`), or None for any other field."""
  if field in MOVED:
    return f"config field {field} is now {MOVED[field]} (fields were regrouped by consumer)"
  return None


def check_moved(cfg: Mapping[str, Any]) -> None:
  """Raises ValueError naming the new field when `cfg` (a config file written for the old
  layout) still holds a field that moved (`MOVED`)."""
  for field in MOVED:
    group, name = field.split(".", 1)
    try:
      present = name in cfg[group]
    except (KeyError, AttributeError, TypeError):  # no such group (any more)
      continue
    if present:
      raise ValueError(moved_error(field))


def validate(cfg: Mapping[str, Any]) -> None:
  """Checks a run config (an ml_collections ConfigDict from configs/*.py, possibly overridden).

  Covers: fields that moved (`MOVED`: one error naming the new field); env; seed; model (preset
  unless a checkpoint is set, dtype, remat); mesh (sizes >= 1 or one -1); explore (explorers, D0
  and synthesis sizes); pool (near-duplicate threshold, synth_fraction, sampler); signals
  (through `SignalTracker`); warmstart; rollout (group_size >= 2, tasks_per_step); episode
  (limits); engine (sizes, weights layout); sampling (through `SamplingParams` with temperature
  >= 0, top_p in (0, 1] and top_k at most the model's vocabulary); train (steps, hooks,
  advantage estimator, optimizer, the GRPO objective of `grpo.GRPOConfig.from_config`,
  mini-/micro-batches that divide the step's tasks_per_step * group_size rollouts as
  `PolicyTrainer.grpo_epoch` splits them, drop_from_loss: finishes of `types.FINISHES` other
  than "done", replay_routing a bool);
  feedback (kinds and mode through `rounds.check_selection`, max_contexts, every >= 1,
  0 <= lag < every); diagnostics (registered names, alert rules, bounds); eval; checkpoint; and
  the suite's own fields (`suite.validate_config`). File
  system and data (checkpoint folders, BFCL categories, AppWorld servers) are checked where they
  are opened, not here; only a checkpoint's config.json is read, for its vocabulary size.

  Args:
    cfg: the whole run config.
  Raises:
    ValueError: the first bad or missing field; the message starts with its dotted name.
  """
  check_moved(cfg)
  env = get(cfg, "env")
  if not isinstance(env, str) or (env not in suite.SUITES and "." not in env):
    fail("env", f"must be one of {tuple(suite.SUITES)} or a suite module path", env)
  int_at_least(cfg, "seed", 0)  # numpy's default_rng refuses negative seeds
  _model(cfg)
  _mesh(cfg)
  _explore(cfg)
  _pool(cfg)
  _signals(cfg)
  _warmstart(cfg)
  _rollout(cfg)
  _episode(cfg)
  _engine(cfg)
  _sampling(cfg)
  _train(cfg)
  _feedback(cfg)
  _diagnostics(cfg)
  _compile(cfg)
  for field in ("eval.max_new_tokens", "eval.max_steps_per_turn"):
    int_at_least(cfg, field, 1)
  int_at_least(cfg, "eval.max_tasks", 0)
  int_at_least(cfg, "eval.generated_tasks", 0)
  if not isinstance(get(cfg, "eval.pool_after"), bool):
    fail("eval.pool_after", "must be a bool", get(cfg, "eval.pool_after"))
  int_at_least(cfg, "checkpoint.every", 1)
  int_at_least(cfg, "checkpoint.keep", 1)  # RunCheckpointer's rule
  suite.validate_config(cfg)  # the suite's own group (`bfcl`, `appworld`)


# ---------------------------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------------------------


def get(cfg: Mapping[str, Any], field: str) -> Any:
  node = cfg
  for part in field.split("."):
    try:
      node = node[part]
    except (KeyError, AttributeError, TypeError):
      raise ValueError(f"{field} is missing from the config") from None
  return node


def fail(field: str, rule: str, value: Any) -> None:
  raise ValueError(f"{field} {rule}, got {value!r}")


def is_int(x: Any) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def int_at_least(cfg: Mapping[str, Any], field: str, lo: int, why: str = "") -> int:
  value = get(cfg, field)
  if not is_int(value) or value < lo:
    fail(field, f"must be an int >= {lo}{why}", value)
  return int(value)


def number(
  cfg: Mapping[str, Any],
  field: str,
  *,
  lo: float | None = None,
  hi: float | None = None,
  lo_open: bool = False,
  hi_open: bool = False,
) -> float:
  """A finite number in the interval [lo, hi] (ends open as asked; None = unbounded)."""
  value = get(cfg, field)
  ok = _is_num(value) and math.isfinite(value)
  if ok and lo is not None:
    ok = value > lo if lo_open else value >= lo
  if ok and hi is not None:
    ok = value < hi if hi_open else value <= hi
  if not ok:
    left = "(-inf" if lo is None else f"{'(' if lo_open else '['}{lo}"
    right = "inf)" if hi is None else f"{hi}{')' if hi_open else ']'}"
    fail(field, f"must be a finite number in {left}, {right}", value)
  return float(value)


def owner(field: str, check: Callable[[], Any]) -> None:
  """Runs the owning module's own check of `field`; its ValueError gets the field's name."""
  try:
    check()
  except ValueError as e:
    raise ValueError(f"{field}: {e}") from e


def _float_dtype(cfg: Mapping[str, Any], field: str) -> None:
  value = get(cfg, field)
  try:
    ok = jnp.issubdtype(jnp.dtype(value), jnp.floating)
  except TypeError:
    ok = False
  if not ok:
    fail(field, "must name a float dtype (float32, bfloat16)", value)


def param_dtype_warning(param_dtype: str) -> str | None:
  """What to tell the user about `model.param_dtype`, or None for float32 (every preset's).

  Another float dtype is accepted (a memory experiment may want it) but said: the master
  weights, gradients and AdamW moments are kept in it, and an update smaller than its
  resolution relative to a weight rounds to no change (bfloat16 keeps 8 significant bits:
  AdamW's step at lr 1e-6 is about 1e-6 of a weight of size 1, far below 2^-8).
  """
  dtype = jnp.dtype(param_dtype)
  if dtype == jnp.float32:
    return None
  resolution = float(jnp.finfo(dtype).eps)
  return (
    f"model.param_dtype = {dtype}: master weights, gradients and AdamW moments are kept in "
    f"{dtype}, whose steps are {resolution:.1g} of a weight: smaller updates (lr 1e-6 gives "
    "~1e-6) round to no change; every preset uses float32"
  )


# ---------------------------------------------------------------------------------------------
# Groups.
# ---------------------------------------------------------------------------------------------


def _episode(cfg: Mapping[str, Any]) -> None:
  for field in (
    "episode.max_new_tokens",
    "episode.max_model_steps",
    "episode.max_call_chars",
    "episode.max_calls_per_reply",
  ):
    int_at_least(cfg, field, 1)
  int_at_least(cfg, "episode.decode_steps", 1)
  if not isinstance(get(cfg, "episode.reproducible"), bool):
    fail("episode.reproducible", "must be a bool", get(cfg, "episode.reproducible"))


def _model(cfg: Mapping[str, Any]) -> None:
  checkpoint = get(cfg, "model.checkpoint")
  if not isinstance(checkpoint, str):
    fail("model.checkpoint", "must be a folder path or ''", checkpoint)
  if not checkpoint:  # a checkpoint's config.json replaces the preset
    preset = get(cfg, "model.preset")
    owner("model.preset", lambda: QwenConfig.preset(preset))
    if not get(cfg, "model.allow_random_init"):
      fail(
        "model.checkpoint",
        "is empty, and this config does not start from random weights: give a Hugging Face "
        "folder (--config.model.checkpoint=DIR) or set --config.model.allow_random_init=True",
        checkpoint,
      )
  _float_dtype(cfg, "model.dtype")
  _float_dtype(cfg, "model.param_dtype")
  if get(cfg, "model.remat") not in REMAT_POLICIES:
    fail("model.remat", f"must be one of {REMAT_POLICIES}", get(cfg, "model.remat"))
  if get(cfg, "model.attention") not in ATTENTION_KERNELS:  # the backend is checked at trace
    fail("model.attention", f"must be one of {ATTENTION_KERNELS}", get(cfg, "model.attention"))
  if get(cfg, "model.expert_dispatch") not in EXPERT_DISPATCH:
    fail(
      "model.expert_dispatch",
      f"must be one of {EXPERT_DISPATCH}",
      get(cfg, "model.expert_dispatch"),
    )
  if get(cfg, "model.matmul_precision") not in MATMUL_PRECISIONS:
    fail(
      "model.matmul_precision",
      f"must be one of {MATMUL_PRECISIONS}",
      get(cfg, "model.matmul_precision"),
    )


def _mesh(cfg: Mapping[str, Any]) -> None:
  sizes = {}
  for axis in MESH_AXES:
    field = f"mesh.{axis}"
    value = get(cfg, field)
    if not is_int(value) or not (value >= 1 or value == -1):
      fail(field, "must be an int >= 1, or -1 for all remaining devices", value)
    sizes[axis] = value
  if list(sizes.values()).count(-1) > 1:  # `sharding.make_mesh`'s rule
    fail("mesh", "may have at most one axis of size -1", sizes)


def _explore(cfg: Mapping[str, Any]) -> None:
  explorer = get(cfg, "explore.explorer")
  if explorer not in factory.EXPLORERS:
    fail("explore.explorer", f"must be one of {factory.EXPLORERS}", explorer)
  d0 = get(cfg, "explore.d0_explorer")
  if d0 and d0 not in factory.EXPLORERS:
    fail(
      "explore.d0_explorer", f"must be '' (= explore.explorer) or one of {factory.EXPLORERS}", d0
    )
  why = " (an empty D0 leaves nothing to train on)"
  int_at_least(cfg, "explore.initial_tasks", 1, why)
  min_calls = int_at_least(cfg, "explore.min_calls", 1)
  max_calls = get(cfg, "explore.max_calls")
  if not is_int(max_calls) or max_calls < min_calls:
    fail("explore.max_calls", f"must be an int >= explore.min_calls = {min_calls}", max_calls)
  for field in ("explore.turns_per_task", "explore.rounds", "explore.steps_per_round"):
    int_at_least(cfg, field, 1)
  if get(cfg, "explore.eval_states") not in EVAL_STATES:
    fail("explore.eval_states", f"must be one of {EVAL_STATES}", get(cfg, "explore.eval_states"))
  for field in ("d0_tokens", *(f"{k}.tokens_per_round" for k in ("gemini", "openai", "local"))):
    int_at_least(cfg, f"explore.{field}", 0, " (0 = no cap)")
  _float_dtype(cfg, "explore.local.dtype")


def _pool(cfg: Mapping[str, Any]) -> None:
  number(cfg, "pool.near_dup_threshold", lo=0.0, hi=1.0)  # a MinHash LSH threshold
  owner("role_agent.aiw", lambda: AIWSampler.settings(cfg))  # checked when off too
  aiw_llm = get(cfg, "role_agent.aiw.enabled") and get(cfg, "role_agent.aiw.analyser") == "llm"
  if aiw_llm and get(cfg, "explore.explorer") == "programmatic":
    fail(
      "role_agent.aiw.analyser",
      "must be 'template' with explore.explorer='programmatic' (the 'llm' analyser calls the "
      "explorer LLM)",
      "llm",
    )
  owner("role_agent.wia", lambda: WIAConfig.from_config(get(cfg, "role_agent.wia")))
  _option_estimator(cfg, "role_agent.wia.enabled", "role_agent")
  _qevolve(cfg)
  # the sampler's own checks; an LLM that is never called stands in for the explorer's
  owner("pool.sampler", lambda: make_sampler(sampler_name(cfg), cfg, PrimaryOnlyLLM("check")))
  synth = get(cfg, "pool.synth_fraction")
  if not _is_num(synth) or not (synth < 0 or 0.0 <= synth <= 1.0):
    fail("pool.synth_fraction", "must be in [0, 1], or negative for proportional", synth)


def _option_estimator(cfg: Mapping[str, Any], switch: str, estimator: str) -> None:
  """An option (`switch` on) that trains with its own advantage estimator needs
  train.advantage_estimator left at "grpo"."""
  if get(cfg, switch) and get(cfg, "train.advantage_estimator") != "grpo":
    fail(
      switch,
      f"trains with the '{estimator}' advantage estimator; leave train.advantage_estimator at "
      "'grpo'",
      get(cfg, "train.advantage_estimator"),
    )


def _qevolve(cfg: Mapping[str, Any]) -> None:
  """qevolve.* (checked when off too); on: the default estimator, and no WIA."""
  if "qevolve" not in cfg:  # a config written before Q-Evolve: off
    return
  owner("qevolve", lambda: QEvolveConfig.from_config(get(cfg, "qevolve")))
  if not isinstance(get(cfg, "qevolve.enabled"), bool):
    fail("qevolve.enabled", "must be a bool", get(cfg, "qevolve.enabled"))
  if not get(cfg, "qevolve.enabled"):
    return
  _option_estimator(cfg, "qevolve.enabled", "qevolve")
  if get(cfg, "role_agent.wia.enabled"):
    fail("qevolve.enabled", "and role_agent.wia.enabled both replace the advantages", True)


def _signals(cfg: Mapping[str, Any]) -> None:
  names = ("window", "rare_theta_percent", "rare_min_total", "pattern", "success_threshold")
  for name in (*names, "forgetting", "rare_min_count", "rare_count"):
    value = get(cfg, f"signals.{name}")
    owner(f"signals.{name}", functools.partial(SignalTracker, **{name: value}))


def _warmstart(cfg: Mapping[str, Any]) -> None:
  if int_at_least(cfg, "warmstart.steps", 0) > 0:
    int_at_least(cfg, "warmstart.batch_size", 1)
    number(cfg, "warmstart.lr", lo=0.0, lo_open=True)


def _rollout(cfg: Mapping[str, Any]) -> None:
  int_at_least(cfg, "rollout.group_size", 2, " (GRPO's advantages compare rollouts of a group)")
  int_at_least(cfg, "rollout.tasks_per_step", 1)


def _engine(cfg: Mapping[str, Any]) -> None:
  # with cache_len and max_prefill_tokens: the Engine's rule
  for field in ("engine.num_slots", "engine.cache_len", "engine.max_prefill_tokens"):
    int_at_least(cfg, field, 1)
  layout = get(cfg, "engine.weights_layout")
  if layout not in ("gathered", "train"):
    fail("engine.weights_layout", "must be 'gathered' or 'train'", layout)
  if not isinstance(get(cfg, "engine.scan_layers"), bool):
    fail("engine.scan_layers", "must be a bool", get(cfg, "engine.scan_layers"))


def _sampling(cfg: Mapping[str, Any]) -> None:
  temperature, top_k, top_p = (get(cfg, f"sampling.{k}") for k in ("temperature", "top_k", "top_p"))
  owner("sampling.temperature", lambda: SamplingParams(temperature=temperature))
  owner("sampling.top_k", lambda: SamplingParams(top_k=top_k))
  owner("sampling.top_p", lambda: SamplingParams(top_p=top_p))
  # Stricter than sampling: below 0 is greedy too (write 0), top_p = 0 keeps the top token only.
  number(cfg, "sampling.temperature", lo=0.0)
  number(cfg, "sampling.top_p", lo=0.0, hi=1.0, lo_open=True)
  vocab = _vocab_size(cfg)
  if vocab is not None and top_k > vocab:  # jax.lax.top_k would fail at the first rollout
    fail("sampling.top_k", f"must be at most the model's vocabulary ({vocab} ids; 0 = off)", top_k)


def _vocab_size(cfg: Mapping[str, Any]) -> int | None:
  """The vocabulary of the configured model: the preset's, or the checkpoint's config.json
  (None when that file is missing or unreadable: the model's loading reports it)."""
  checkpoint = get(cfg, "model.checkpoint")
  if not checkpoint:
    return QwenConfig.preset(get(cfg, "model.preset")).vocab_size
  try:
    return read_config(checkpoint).vocab_size
  except (OSError, CheckpointFormatError):
    return None


def _train(cfg: Mapping[str, Any]) -> None:
  int_at_least(cfg, "train.steps", 1)
  number(cfg, "train.lr", lo=0.0, lo_open=True)
  number(cfg, "train.weight_decay", lo=0.0)
  number(cfg, "train.grad_clip", lo=0.0, lo_open=True)
  rows = get(cfg, "rollout.tasks_per_step") * get(cfg, "rollout.group_size")
  mini = int_at_least(cfg, "train.mini_batches", 1)
  if mini > rows:
    fail("train.mini_batches", f"must be <= the step's {rows} rollouts", mini)
  micro = int_at_least(cfg, "train.micro_batches", 0)  # 0 = auto (plan_device_memory.fit_run)
  sizes = sorted({len(x) for x in np.array_split(np.arange(rows), mini)})  # as grpo_epoch splits
  if micro and any(s % micro for s in sizes):
    fail(
      "train.micro_batches",
      f"must divide every mini-batch's rows ({rows} rollouts in {mini} mini-batches of {sizes})",
      micro,
    )
  for field in ("kl_estimator", "loss_agg"):
    known = grpo.KL_ESTIMATORS if field == "kl_estimator" else grpo.LOSS_AGGS
    if get(cfg, f"train.{field}") not in known:
      fail(f"train.{field}", f"must be one of {known}", get(cfg, f"train.{field}"))
  number(cfg, "train.clip_eps_low", lo=0.0, hi=1.0, hi_open=True)
  number(cfg, "train.clip_eps_high", lo=0.0)
  c = number(cfg, "train.dual_clip_c", lo=0.0)
  if 0.0 < c <= 1.0:  # Ye et al. 2020: the bound -A c must lie above the clipped objective
    fail("train.dual_clip_c", "must be 0 (off) or > 1", c)
  number(cfg, "train.kl_beta", lo=0.0)
  number(cfg, "train.loss_norm_tokens", lo=0.0, lo_open=True)
  number(cfg, "train.adv_eps", lo=0.0)
  hooks = get(cfg, "train.hooks")
  if not isinstance(hooks, (tuple, list)):
    fail("train.hooks", "must be a tuple of training hook names", hooks)
  owner("train.hooks", lambda: check_hooks(tuple(hooks)))
  estimator = get(cfg, "train.advantage_estimator")
  owner("train.advantage_estimator", lambda: advantages.get(estimator))
  if estimator == "qevolve":  # it reads the critic's advantages, which only the option makes
    fail("train.advantage_estimator", "'qevolve' is chosen by qevolve.enabled = True", estimator)
  for field in ("train.scale_by_std", "train.replay_routing", "train.drop_dead_groups"):
    if not isinstance(get(cfg, field), bool):
      fail(field, "must be a bool", get(cfg, field))
  drop, droppable = get(cfg, "train.drop_from_loss"), tuple(f for f in FINISHES if f != "done")
  if not isinstance(drop, (tuple, list)) or not all(f in droppable for f in drop):
    fail("train.drop_from_loss", f"must be a tuple of episode finishes from {droppable}", drop)
  grpo.GRPOConfig.from_config(get(cfg, "train"))  # every objective field is a known keyword


def _feedback(cfg: Mapping[str, Any]) -> None:
  kinds, mode = get(cfg, "feedback.kinds"), get(cfg, "feedback.mode")
  if not isinstance(kinds, (tuple, list)) or not all(isinstance(k, str) for k in kinds):
    fail("feedback.kinds", "must be a tuple of signal kinds", kinds)
  owner("feedback.kinds", lambda: rounds.check_selection(tuple(kinds), rounds.MODES[0]))
  owner("feedback.mode", lambda: rounds.check_selection((), mode))
  int_at_least(cfg, "feedback.max_contexts", 0)
  every = int_at_least(cfg, "feedback.every", 1)
  lag = get(cfg, "feedback.lag")
  if not is_int(lag) or not 0 <= lag < every:
    fail("feedback.lag", f"must be an int in [0, feedback.every = {every})", lag)


def _diagnostics(cfg: Mapping[str, Any]) -> None:
  for field in ("diagnostics.enabled", "diagnostics.rollout_log"):
    if not isinstance(get(cfg, field), bool):
      fail(field, "must be a bool", get(cfg, field))
  for field in ("modules", "names", "alerts", "relative"):
    value = get(cfg, f"diagnostics.{field}")
    if not isinstance(value, (tuple, list)) or not all(isinstance(x, str) for x in value):
      fail(f"diagnostics.{field}", "must be a tuple of str", value)
  owner("diagnostics.modules", lambda: diagnostics.import_modules(get(cfg, "diagnostics.modules")))
  names, alerts = get(cfg, "diagnostics.names"), get(cfg, "diagnostics.alerts")
  owner("diagnostics.names", lambda: diagnostics.check_names(tuple(names)))
  owner("diagnostics.alerts", lambda: diagnostics.parse_rules(tuple(alerts)))
  number(cfg, "diagnostics.leak_similarity", lo=0.0, hi=1.0)
  int_at_least(cfg, "diagnostics.min_answer_chars", 1)
  int_at_least(cfg, "diagnostics.baseline_steps", 1)
  number(cfg, "diagnostics.rollout_log_max_mb", lo=0.0, lo_open=True)
  skills = get(cfg, "diagnostics.skills")
  if not isinstance(skills, str) or (skills and not os.path.isfile(skills)):
    fail("diagnostics.skills", "must be a skills file the gate wrote ('' for none)", skills)


def _compile(cfg: Mapping[str, Any]) -> None:
  """Shape buckets (the engine's and `make_batch`'s rules) and compile.ahead's needs."""
  rows = get(cfg, "engine.prefill_rows")
  if rows not in ("fit", "full"):
    fail("engine.prefill_rows", "must be 'fit' or 'full'", rows)
  for field, top in (("engine.prefill_min_chunk", 512), ("engine.prefill_min_kv", None)):
    value = int_at_least(cfg, field, 1)
    if value & (value - 1) or (top is not None and value > top):
      fail(field, "must be a power of two" + (f" <= {top}" if top else ""), value)
  bounds = {
    "train.len_buckets": get(cfg, "engine.cache_len"),
    "train.target_buckets": min(
      get(cfg, "engine.cache_len") - 1,
      get(cfg, "episode.max_model_steps") * get(cfg, "episode.max_new_tokens"),
    ),
  }
  ahead = get(cfg, "compile.ahead")
  if not isinstance(ahead, bool):
    fail("compile.ahead", "must be a bool", ahead)
  int_at_least(cfg, "compile.threads", 0)
  cache_dir = get(cfg, "compile.cache_dir")
  if not isinstance(cache_dir, str):
    fail(
      "compile.cache_dir",
      'must be a path string ("auto": the user\'s cache folder; "" = JAX\'s own setting)',
      cache_dir,
    )
  for field, bound in bounds.items():
    buckets = get(cfg, field)
    if not isinstance(buckets, (tuple, list)) or not all(is_int(b) and b >= 1 for b in buckets):
      fail(field, "must be a tuple of ints >= 1", buckets)
    if ahead and not buckets:
      fail(field, "must list the buckets for compile.ahead (empty = an unbounded rule)", buckets)
    if buckets and max(buckets) < bound:  # a longer batch would stop the run
      what = "trajectory" if field == "train.len_buckets" else "trajectory's reply total"
      fail(
        field,
        f"must hold every batch: a largest bucket >= {bound}, the longest a {what} can be",
        buckets,
      )
