"""Per-device memory plan for a model preset on a mesh, from shapes only (nothing is allocated).

`plan` gives parameter, gradient, optimizer-state (AdamW m and v), reference-policy,
rollout-weights, activation and KV-cache memory per device (a `MemoryPlan`), `format_table` a
markdown table of plans and whether each fits a chip's HBM, and `fit_run` the training job's
start-up check (`loop.CoEvolveRun`: gradient-accumulation slices that fit one device). The
command line is `coevolve_jax.cli.plan_device_memory`.

How each figure is obtained (the job's own rules, so the figures are what it allocates):
- Parameters: `nnx.eval_shape` of the real `Qwen` module in the master dtype (`param_dtype`,
  the run's `model.param_dtype`); each parameter carries its logical axes (`out_sharding`),
  mapped to mesh axes by `sharding.param_spec`, the function the job shards with: a mesh axis
  that does not divide a dimension leaves that dimension replicated over it.
- Optimizer state: `jax.eval_shape` of the trainer's own optax transformation (`make_optimizer`)
  on the abstract master parameters; each moment leaf is sharded like its parameter.
- Gradients: one master-dtype parameter copy. Reference policy: one copy in the compute dtype
  (`dtype`, the run's `model.dtype`), sharded like the parameters.
- Rollout weights (`PolicyTrainer.inference_params`): one compute-dtype copy in the engine's
  layout (`weights_layout`: "gathered" = `trainer.inference_rules`, the fsdp dimension
  replicated; "train" = the parameters' layout); none when neither a cast nor a layout change is
  needed (the engine then decodes the parameters themselves).
- Activations (`activations="compiled"`, the command line's default): XLA's own
  `memory_analysis()` of the trainer's loss and gradient compiled for one device's share of a
  micro-batch, minus the same step at 16 tokens (`compiled_activation_bytes`). This counts the
  layer being recomputed and every transient; it costs two compiles (seconds for Qwen3-4B on an
  idle CPU). With tensor > 1 it is scaled by the share of the residuals (below) that the tensor
  axis splits.
- Activations (`activations="residuals"`): the residuals that `jax.vjp` of the trainer's
  `token_logprobs` keeps for the backward pass, read with `jax.eval_shape` at batch 1 and 2.
  Residual leaves whose shape changes with the batch are activations (the rest are parameters,
  counted above); per device they scale with the sequences per device
  (batch / (data * fsdp * expert)) and are divided by the tensor axis when a dimension is a
  tensor-sharded one (heads, kv heads, MLP, vocab; the `act_*`/`mlp` rules). With
  `remat="full"` (the default, as in the full-scale configs) the decoder keeps only each layer's
  input; the layer being recomputed in the backward pass, like any transient buffer inside one
  op, is not counted: a lower bound.
- KV cache: `KVCache.zeros` shapes ([slots, K, H, cache_len] keys and [slots, K, cache_len, H]
  values per layer) in the compute dtype, slots over (data, fsdp, expert), kv heads over tensor
  where they divide, as the rollout engine allocates it (`sharding.param_spec` of its logical axes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from coevolve_jax import qevolve
from coevolve_jax.models import sharding
from coevolve_jax.models.hf import read_config
from coevolve_jax.models.kernels import resolve_attention
from coevolve_jax.models.qwen import KVCache, Qwen, QwenConfig
from coevolve_jax.trainer import inference_rules, make_optimizer, token_logprobs

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Bytes per device of each component (integers), for one preset, mesh and workload."""

  preset: str
  mesh: dict[str, int]
  dtype: str
  param_dtype: str
  batch: int
  seq_len: int
  num_slots: int
  cache_len: int
  num_params: int
  params: int
  gradients: int
  optimizer: int
  reference: int
  rollout_weights: int
  activations: int
  kv_cache: int
  micro_batches: int = 1
  activation_source: str = "residuals"
  critic: int = 0  # Q-Evolve's critic (`critic_bytes`); 0 when qevolve is off

  @property
  def static(self) -> int:
    """Everything but activations: what the job holds from start-up on, whatever it trains on."""
    return (
      self.params
      + self.gradients
      + self.optimizer
      + self.reference
      + self.rollout_weights
      + self.kv_cache
      + self.critic
    )

  @property
  def total(self) -> int:
    return self.static + self.activations


def parse_mesh(text: str) -> dict[str, int]:
  """Parses "fsdp=8,tensor=2" into {"data": 1, "fsdp": 8, "tensor": 2, "expert": 1}.

  Raises:
    ValueError: an unknown axis name, a malformed entry, or a size that is not a positive integer.
  """
  mesh = {a: 1 for a in sharding.MESH_AXES}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, sep, value = part.partition("=")
    if not sep or name not in mesh:
      raise ValueError(f"bad mesh entry {part!r}: want AXIS=SIZE with AXIS in {sharding.MESH_AXES}")
    try:
      mesh[name] = int(value)
    except ValueError:
      raise ValueError(f"bad mesh size in {part!r}: not an integer") from None
    if mesh[name] < 1:
      raise ValueError(f"bad mesh size in {part!r}: must be >= 1")
  return mesh


def shard_bytes(
  shape: Sequence[int],
  dtype,
  axes: Sequence[str | None],
  mesh: Mapping[str, int],
  rules: Mapping[str, str | tuple[str, ...] | None] = sharding.LOGICAL_RULES,
) -> int:
  """Bytes one device holds of an array of `shape` sharded by logical `axes` over `mesh`, by the
  job's rule (`sharding.param_spec`: non-dividing mesh axes leave the dimension replicated).

  Raises:
    KeyError: a logical axis with no rule in `rules`.
    ValueError: `axes` and `shape` of different lengths.
  """
  spec = sharding.param_spec(mesh, axes, shape, rules)
  return math.prod(sharding.shard_shape(mesh, spec, shape)) * jnp.dtype(dtype).itemsize


def critic_bytes(
  policy: QwenConfig | int,
  cfg: qevolve.QEvolveConfig,
  rows: int,
  max_replies: int,
  mesh: Mapping[str, int],
) -> int:
  """Bytes per device of Q-Evolve's critic (`qevolve.Critic`): the V and Q heads, the Q target
  and AdamW's two moments of V and Q (7 head copies, float32, sharded by `qevolve.HEAD_AXES`),
  plus the hidden-state features of one step's reads, replicated: [rows, 2 max_replies, D]
  float32 and, for the "head" critic, a batch of [batch, 3 D]. The "model" critic
  (`qevolve.ModelCritic`) adds its network's float32 parameters and AdamW's two moments (3
  copies, sharded by their logical axes), D being its width; its training activations are not
  counted (a `model_batch` of episodes through `model_layers` small layers).

  Args:
    policy: the policy's config (an int: its hidden size D, for the "head" critic only).
    cfg: the critic's settings. rows: episodes read per step (the step's rollouts plus
      `cfg.replay`). max_replies: replies per episode at most (`episode.max_model_steps`).
    mesh: axis sizes.
  """
  if cfg.critic == "model":
    if not isinstance(policy, QwenConfig):
      raise TypeError("the 'model' critic is planned from the policy's QwenConfig")
    network = qevolve.critic_model_config(policy, cfg)
    d = network.hidden_size
    trunk = 3 * parameter_bytes(network, mesh, "float32")[1]
    batch = 0
  else:
    d = policy.hidden_size if isinstance(policy, QwenConfig) else int(policy)
    trunk, batch = 0, 3 * cfg.batch
  shapes = jax.eval_shape(lambda: qevolve.init_head(jax.random.key(0), d, cfg.hidden))
  head = sum(shard_bytes(x.shape, x.dtype, qevolve.HEAD_AXES[k], mesh) for k, x in shapes.items())
  features = 4 * d * (rows * 2 * max_replies + batch)
  return 7 * head + features + trunk


Model = str | QwenConfig  # a preset name, or the config of a checkpoint (`hf.read_config`)


def model_config(model: Model) -> QwenConfig:
  """The QwenConfig of a preset name, or `model` itself.

  Raises:
    ValueError: unknown preset.
  """
  return model if isinstance(model, QwenConfig) else QwenConfig.preset(model)


def model_label(model: Model) -> str:
  """A preset's name; for a checkpoint's config, its family, depth and width."""
  if isinstance(model, str):
    return model
  return f"{model.model_type}-{model.num_hidden_layers}x{model.hidden_size}"


def abstract_model(
  cfg: QwenConfig, dtype, remat: str = "full", attention: str = "blocked"
) -> tuple[nnx.GraphDef, nnx.State]:
  """The model's graph and abstract parameter state (ShapeDtypeStructs with their metadata)."""
  model = nnx.eval_shape(
    lambda: Qwen(cfg, rngs=nnx.Rngs(0), dtype=dtype, remat=remat, attention=attention)
  )
  return nnx.split(model)


def planned_attention(attention: str, backend: str | None = None) -> str:
  """The attention kernel the planner traces for `model.attention` = `attention` on `backend`
  (default: this machine's): the kernel that runs there (`kernels.resolve_attention`), except that
  cuDNN's fused attention, which compiles only on an NVIDIA GPU, is planned elsewhere by splash
  attention in interpret mode, which keeps the same residuals for the backward pass (each head's
  output and log-sum-exp, no [T, T] scores).

  Raises:
    ValueError: an unknown kernel, or "cudnn" for a backend other than GPU.
  """
  kernel = resolve_attention(attention, backend)
  if kernel == "cudnn" and jax.default_backend() != "gpu":
    return "splash"
  return kernel


def _param_axes(state: nnx.State) -> dict[tuple, tuple]:
  """Path (of the value leaf) -> logical axes, for every parameter."""
  out = {}
  flat = jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  for path, var in flat:
    axes = var.get_metadata().get("out_sharding")
    shape = var.get_value().shape
    if axes is None or len(axes) != len(shape):
      raise ValueError(f"parameter {jax.tree_util.keystr(path)} has no logical axes for {shape}")
    out[tuple(str(k) for k in path)] = (shape, var.get_value().dtype, tuple(axes))
  return out


def _sharded_tree_bytes(tree, param_axes: dict[tuple, tuple], mesh) -> int:
  """Bytes per device of a tree whose array leaves mirror parameters (optimizer moments)."""
  total = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    keys = tuple(str(k) for k in path if not str(k).endswith(".value"))
    match = next(
      (v for p, v in param_axes.items() if keys[-len(p) :] == p and v[0] == leaf.shape), None
    )
    if match is None:  # scalars such as the step count: replicated
      total += leaf.size * leaf.dtype.itemsize
    else:
      total += shard_bytes(leaf.shape, leaf.dtype, match[2], mesh)
  return total


@functools.lru_cache(maxsize=8)
def _activation_leaves(
  preset: Model, dtype: str, seq_len: int, targets: int, remat: str, attention: str = "blocked"
):
  """Residual shapes of the training forward that depend on the batch, at batch 1, with the
  decoder layers rematerialised by `remat` (`qwen.REMAT_POLICIES`) and attention by the kernel
  `attention` (`planned_attention`)."""
  graphdef, state = abstract_model(model_config(preset), jnp.dtype(dtype), remat, attention)

  def residuals(batch):
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    pos = jax.ShapeDtypeStruct((batch, targets), jnp.int32)

    def loss(p, t, q):
      return jnp.sum(token_logprobs(nnx.merge(graphdef, p), t, q))

    vjp = jax.eval_shape(lambda p, t, q: jax.vjp(lambda x: loss(x, t, q), p)[1], state, tokens, pos)
    return jax.tree.leaves(vjp)

  one, two = residuals(1), residuals(2)
  if len(one) != len(two):
    raise RuntimeError(
      "residual structure changed with the batch size; cannot separate activations from parameters"
    )
  return [a for a, b in zip(one, two) if a.shape != b.shape]


def _activation_bytes(leaves, cfg: QwenConfig, mesh: Mapping[str, int], seqs_per_device: int):
  tensor_dims = {
    cfg.num_attention_heads: "act_heads",
    cfg.num_key_value_heads: "act_kv_heads",
    cfg.intermediate_size: "mlp",
    cfg.vocab_size: "act_vocab",
  }
  total = 0
  for leaf in leaves:
    size = leaf.size * leaf.dtype.itemsize * seqs_per_device
    # The first dimension is the batch or, for the residuals a layer scan stacks, the layer axis
    # (either way the size is already scaled); divide by one tensor-sharded dimension.
    logical = next((tensor_dims[d] for d in leaf.shape[1:] if d in tensor_dims), None)
    total += -(-size // sharding.axis_devices(mesh, logical)) if logical else size
  return total


ACTIVATION_SOURCES = ("compiled", "residuals")
FLOOR_TOKENS = 16  # the compiled figure's floor: a sequence this short needs next to nothing


@functools.lru_cache(maxsize=16)
def _compiled_temp_bytes(
  preset: Model,
  dtype: str,
  seqs: int,
  seq_len: int,
  targets: int,
  remat: str,
  attention: str = "blocked",
) -> int | None:
  """`temp_size_in_bytes` of the compiled loss and gradient of the trainer's forward
  (`token_logprobs`) over `seqs` sequences of `seq_len` tokens with `targets` scored positions,
  compiled for the default backend from abstract inputs (nothing is allocated); None where the
  backend gives no memory analysis."""
  graphdef, state = abstract_model(model_config(preset), jnp.dtype(dtype), remat, attention)

  def loss(p, tokens, pos):
    return jnp.sum(token_logprobs(nnx.merge(graphdef, p), tokens, pos))

  tokens = jax.ShapeDtypeStruct((seqs, seq_len), jnp.int32)
  pos = jax.ShapeDtypeStruct((seqs, targets), jnp.int32)
  compiled = jax.jit(jax.value_and_grad(loss)).lower(state, tokens, pos).compile()
  analysis = compiled.memory_analysis()
  return None if analysis is None else int(analysis.temp_size_in_bytes)


def compiled_activation_bytes(
  preset: Model,
  dtype: str,
  seq_len: int,
  targets: int,
  remat: str,
  seqs: int,
  attention: str = "blocked",
) -> int | None:
  """Activation memory of `seqs` sequences from XLA's own buffer assignment: the temporaries of
  the compiled training step (loss and gradient of `token_logprobs`, `remat` as the job runs it)
  at `seq_len` tokens minus those at FLOOR_TOKENS tokens. The difference removes what does not
  grow with the sequence (on XLA:CPU, float32 copies of every bfloat16 weight, as that backend
  has no bfloat16 products), and keeps what does: the residuals kept for the backward pass, the
  layer being recomputed, attention and logit blocks, gradient buffers of activations. XLA:CPU
  computes bfloat16 activations in float32, so there the figure is up to 2x an accelerator's.
  `attention` is the kernel compiled (`planned_attention`).

  Returns None where the backend reports no memory analysis.
  """
  floor = min(seq_len, FLOOR_TOKENS)
  full = _compiled_temp_bytes(preset, dtype, seqs, seq_len, targets, remat, attention)
  short = _compiled_temp_bytes(
    preset, dtype, seqs, floor, max(1, targets * floor // seq_len), remat, attention
  )
  if full is None or short is None:
    return None
  return max(0, full - short)


# Keyed by (model, dtype): every preset in both dtypes fits (a smaller cache that a caller cycles
# through, as tests/test_mesh.py does, misses on every call: each miss traces the model).
@functools.lru_cache(maxsize=32)
def _abstract_params(preset: Model, dtype: str):
  graphdef, state = abstract_model(model_config(preset), jnp.dtype(dtype))
  params_state = nnx.state(nnx.merge(graphdef, state), nnx.Param)
  return params_state, _param_axes(params_state)


def parameter_bytes(
  preset: Model, mesh: Mapping[str, int], dtype: str = "bfloat16"
) -> tuple[int, int]:
  """(parameter count, parameter bytes per device) of `preset` on `mesh`, from shapes only.

  Raises:
    ValueError: unknown preset.
  """
  _, axes = _abstract_params(preset, str(jnp.dtype(dtype)))
  count = sum(math.prod(s) for s, _, _ in axes.values())
  return count, sum(shard_bytes(s, d, a, mesh) for s, d, a in axes.values())


def rollout_weights_bytes(
  preset: Model, mesh: Mapping[str, int], dtype: str, param_dtype: str, layout: str = "gathered"
) -> int:
  """Bytes per device of the engine's weight copy (`PolicyTrainer.inference_params`): the
  parameters in `dtype` and the `layout`'s rules. The job makes it whenever the compute dtype
  is not the master's, the layout is "gathered" on a mesh, or the engine decodes an unrolled copy
  (`engine.scan_layers=False`): in every full-scale configuration. Counted always (a float32
  single-device run with the scanned engine decodes the master weights themselves).

  Raises:
    ValueError: unknown preset or layout.
  """
  del param_dtype  # the copy's size depends on the compute dtype only
  if layout not in ("gathered", "train"):
    raise ValueError(f"layout must be 'gathered' or 'train', got {layout!r}")
  rules = inference_rules() if layout == "gathered" else sharding.LOGICAL_RULES
  _, axes = _abstract_params(preset, str(jnp.dtype(dtype)))
  return sum(shard_bytes(s, dtype, a, mesh, rules) for s, _, a in axes.values())


def kv_cache_bytes(
  preset: Model, mesh: Mapping[str, int], num_slots: int, cache_len: int, dtype: str = "bfloat16"
) -> int:
  """Bytes per device of the rollout engine's KV cache (`KVCache.zeros` shapes, k and v for every
  layer), slots over the batch mesh axes and kv heads over the tensor axis; the same in the
  stacked layout (`scan_layers`), whose leading layer axis is not sharded.

  Raises:
    ValueError: unknown preset.
  """
  cfg = model_config(preset)
  cache = jax.eval_shape(lambda: KVCache.zeros(cfg, num_slots, cache_len, jnp.dtype(dtype)))
  key_axes, value_axes = KVCache.axes(stacked=False)
  return sum(
    shard_bytes(x.shape, x.dtype, axes, mesh)
    for arrays, axes in ((cache.k, key_axes), (cache.v, value_axes))
    for x in arrays
  )


def _check_workload(
  batch: int, seq_len: int, num_slots: int, cache_len: int, micro_batches: int, activations: str
) -> None:
  """Checks `plan`'s workload sizes and activation source.

  Raises:
    ValueError: a size below 1, or an unknown activation source.
  """
  if min(batch, seq_len, num_slots, cache_len, micro_batches) < 1:
    raise ValueError("batch, seq_len, num_slots, cache_len and micro_batches must be >= 1")
  if activations not in ACTIVATION_SOURCES:
    raise ValueError(f"activations must be one of {ACTIVATION_SOURCES}, got {activations!r}")


def _training_state_bytes(
  preset: Model, mesh: Mapping[str, int], dtype: str, param_dtype: str
) -> tuple[int, int, int, int]:
  """(parameter count, parameter bytes, reference bytes, optimizer bytes) per device: the master
  parameters in `param_dtype` (the gradients are one more such copy), the reference policy in
  `dtype`, and the AdamW moments of the trainer's `make_optimizer`, each moment leaf sharded like
  its parameter (`_sharded_tree_bytes`)."""
  params_state, axes = _abstract_params(preset, str(jnp.dtype(param_dtype)))
  num_params, param_bytes = parameter_bytes(preset, mesh, param_dtype)
  _, reference = parameter_bytes(preset, mesh, dtype)
  tx = make_optimizer(1e-6, 0.01, 1.0)
  opt_state = jax.eval_shape(tx.init, params_state)
  return num_params, param_bytes, reference, _sharded_tree_bytes(opt_state, axes, mesh)


def _sequences_per_device(mesh: Mapping[str, int], batch: int, micro_batches: int) -> int:
  """Sequences one device trains on at a time: its share of the batch axes (data, fsdp, expert)
  of one of `micro_batches` slices of `batch` sequences, rounded up."""
  batch_shards = sharding.axis_devices(mesh, "batch")
  return -(-batch // (batch_shards * micro_batches))


def _activation_figure(
  preset: Model,
  cfg: QwenConfig,
  mesh: Mapping[str, int],
  dtype: str,
  seq_len: int,
  targets: int,
  remat: str,
  seqs: int,
  activations: str,
  attention: str = "blocked",
) -> tuple[int, str]:
  """(activation bytes per device, their source) of `seqs` sequences of `seq_len` tokens
  ([seqs, seq_len] token ids, [seqs, targets] scored positions) under `remat`: the residual
  estimate, or with `activations="compiled"` the compiled step's figure scaled by the share of
  the residuals the tensor axis splits; "residuals" where the backend gives no memory analysis."""
  leaves = _activation_leaves(preset, dtype, seq_len, targets, remat, attention)
  act = _activation_bytes(leaves, cfg, mesh, seqs)
  source = "residuals"
  if activations == "compiled":
    compiled = compiled_activation_bytes(preset, dtype, seq_len, targets, remat, seqs, attention)
    if compiled is not None:
      unsplit = _activation_bytes(leaves, cfg, {**mesh, "tensor": 1}, seqs)
      act, source = (compiled * act) // max(1, unsplit), "compiled"
  return act, source


def plan(
  preset: Model,
  mesh: Mapping[str, int],
  *,
  batch: int,
  seq_len: int,
  num_slots: int,
  cache_len: int,
  dtype: str = "bfloat16",
  param_dtype: str = "float32",
  weights_layout: str = "gathered",
  targets: int | None = None,
  micro_batches: int = 1,
  remat: str = "full",
  activations: str = "residuals",
  attention: str = "blocked",
  critic: int = 0,
) -> MemoryPlan:
  """Memory per device for training and rollout of `preset` on a mesh of `mesh` axis sizes.

  Args:
    preset: a `QwenConfig` preset name, or a checkpoint's `QwenConfig` (`hf.read_config`).
    mesh: sizes of (data, fsdp, tensor, expert); missing axes are 1.
    batch: sequences per optimizer step (one mini-batch), global.
    seq_len: tokens per training sequence.
    num_slots: concurrent rollout episodes (KV-cache rows), global.
    cache_len: KV-cache tokens per slot.
    dtype: the compute dtype (`model.dtype`): activations, reference, rollout weights, cache.
    param_dtype: the master parameters' dtype (`model.param_dtype`): parameters, gradients and
      optimizer moments.
    weights_layout: the engine's weight layout (`engine.weights_layout`).
    targets: sampled (trained) positions per sequence; default seq_len // 2.
    micro_batches: gradient-accumulation slices per step (the trainer's `micro_batches`): only
      one slice's activations are alive at a time.
    remat: the decoder layers' rematerialisation (`model.remat`; "full" keeps only each layer's
      input for the backward pass, "none" everything).
    activations: "residuals" (fast, shapes only: what the backward pass keeps, without the
      transients of the layer being recomputed) or "compiled" (`compiled_activation_bytes`: the
      compiled step's own temporaries for one device's sequences; with tensor > 1 scaled by the
      share of the residuals the tensor axis splits). "compiled" falls back to "residuals"
      where the backend gives no memory analysis (`MemoryPlan.activation_source` says which).
    attention: the attention kernel traced for the activations (`planned_attention`; the
      "blocked" XLA paths by default; "splash" plans the fused kernels: no [T, T] scores).
    critic: bytes per device of Q-Evolve's critic (`critic_bytes`), counted as static.
  Returns:
    A `MemoryPlan` in bytes per device.
  Raises:
    ValueError: unknown preset, remat policy or activation source, or non-positive sizes.
  """
  _check_workload(batch, seq_len, num_slots, cache_len, micro_batches, activations)
  mesh = {a: int(mesh.get(a, 1)) for a in sharding.MESH_AXES}
  cfg = model_config(preset)
  dt, pdt = jnp.dtype(dtype), jnp.dtype(param_dtype)
  num_params, param_bytes, reference, opt_bytes = _training_state_bytes(
    preset, mesh, dtype, param_dtype
  )
  targets = targets or max(1, seq_len // 2)
  seqs = _sequences_per_device(mesh, batch, micro_batches)
  act, source = _activation_figure(
    preset, cfg, mesh, str(dt), seq_len, targets, remat, seqs, activations, attention
  )
  kv = kv_cache_bytes(preset, mesh, num_slots, cache_len, dtype)
  return MemoryPlan(
    preset=model_label(preset),
    mesh=mesh,
    dtype=str(dt),
    param_dtype=str(pdt),
    batch=batch,
    seq_len=seq_len,
    num_slots=num_slots,
    cache_len=cache_len,
    num_params=num_params,
    params=param_bytes,
    gradients=param_bytes,
    optimizer=opt_bytes,
    reference=reference,
    rollout_weights=rollout_weights_bytes(preset, mesh, dtype, param_dtype, weights_layout),
    activations=act,
    kv_cache=kv,
    micro_batches=micro_batches,
    activation_source=source,
    critic=critic,
  )


def format_table(
  plans: Sequence[MemoryPlan], hbm_gib: float | None = None, headroom: float = 0.9
) -> str:
  """Markdown table of plans in GiB per device; `fits` compares the total with headroom * HBM."""
  cols = [
    "preset",
    "mesh (data,fsdp,tensor,expert)",
    "params",
    "grads",
    "optimizer",
    "reference",
    "rollout weights",
    "activations",
    "kv cache",
    "total",
  ]
  critic = any(p.critic for p in plans)  # a column only where Q-Evolve's critic is planned
  if critic:
    cols.insert(-1, "critic")
  if hbm_gib:
    cols.append(f"fits {headroom:.0%} of {hbm_gib:g} GiB")
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for p in plans:
    m = p.mesh
    row = [p.preset, f"{m['data']},{m['fsdp']},{m['tensor']},{m['expert']}"]
    row += [
      f"{b / GIB:.2f}"
      for b in (
        p.params,
        p.gradients,
        p.optimizer,
        p.reference,
        p.rollout_weights,
        p.activations,
        p.kv_cache,
        *((p.critic,) if critic else ()),
        p.total,
      )
    ]
    if hbm_gib:
      row.append("yes" if p.total <= headroom * hbm_gib * GIB else "no")
    lines.append("| " + " | ".join(row) + " |")
  return "\n".join(lines)


def _mini_batch_rows(cfg: Mapping[str, Any]) -> list[int]:
  """Row counts of a step's mini-batches (`PolicyTrainer.grpo_epoch` splits the step's
  tasks_per_step x group_size rollouts with `np.array_split`)."""
  rows = cfg["rollout"]["tasks_per_step"] * cfg["rollout"]["group_size"]
  mini = cfg["train"]["mini_batches"]
  return sorted({rows // mini + (i < rows % mini) for i in range(mini)}, reverse=True)


def micro_batch_choices(cfg: Mapping[str, Any], mesh: Mapping[str, int]) -> list[int]:
  """`train.micro_batches` when it is set (> 0); for 0 ("auto") every k that divides every
  mini-batch's rows and still gives each data-parallel device a row per slice, ascending."""
  if cfg["train"]["micro_batches"] > 0:
    return [int(cfg["train"]["micro_batches"])]
  sizes = _mini_batch_rows(cfg)
  shards = sharding.axis_devices(mesh, "batch")
  return [1] + [
    k for k in range(2, sizes[-1] + 1) if all(n % k == 0 for n in sizes) and sizes[0] // k >= shards
  ]


def warmstart_micro_batches(
  cfg: Mapping[str, Any], mesh: Mapping[str, int], micro_batches: int
) -> int:
  """Gradient-accumulation slices of a warm-start step: the fewest whose slice puts no more
  sequences on a device than a GRPO update's slice does with `micro_batches`, so the warm-start
  fits wherever the update was planned to (`fit_run` plans the update; a warm-start batch of
  `warmstart.batch_size` rows in one slice could need several times its activations). 1 when
  the warm-start's batch is no larger than a GRPO mini-batch's per slice (every preset here)."""
  sizes = {a: int(mesh.get(a, 1)) for a in sharding.MESH_AXES}
  update = _sequences_per_device(sizes, _mini_batch_rows(cfg)[0], micro_batches)
  batch = int(cfg["warmstart"]["batch_size"])
  k = 1
  while _sequences_per_device(sizes, batch, k) > update:
    k += 1
  return k


def plan_for_run(
  cfg: Mapping[str, Any],
  mesh: Mapping[str, int],
  micro_batches: int | None = None,
  activations: str = "residuals",
) -> MemoryPlan:
  """The plan of a run's config (configs/bfcl.py groups) on `mesh` (axis sizes, -1 resolved).

  The training sequence is taken at its longest, `engine.cache_len` tokens (a trajectory never
  holds more), and a mini-batch holds tasks_per_step * group_size / mini_batches rows (rounded
  up), in `micro_batches` slices (default: `train.micro_batches`, or 1 where that is 0 = auto).
  With `model.checkpoint` set, the model is the checkpoint's config.json (`hf.read_config`).

  Raises:
    FileNotFoundError, CheckpointFormatError: `model.checkpoint` has no usable config.json.
  """
  engine, train = cfg["engine"], cfg["train"]
  checkpoint = cfg["model"].get("checkpoint", "")
  model = read_config(checkpoint) if checkpoint else cfg["model"]["preset"]
  critic = 0
  if cfg.get("qevolve", {}).get("enabled"):
    qcfg = qevolve.QEvolveConfig.from_config(cfg["qevolve"])
    rows = cfg["rollout"]["tasks_per_step"] * cfg["rollout"]["group_size"] + qcfg.replay
    steps = cfg["episode"]["max_model_steps"]
    sizes = {a: int(mesh.get(a, 1)) for a in sharding.MESH_AXES}
    critic = critic_bytes(model_config(model), qcfg, rows, steps, sizes)
  return plan(
    model,
    mesh,
    batch=_mini_batch_rows(cfg)[0],
    seq_len=engine["cache_len"],
    num_slots=engine["num_slots"],
    cache_len=engine["cache_len"],
    dtype=cfg["model"]["dtype"],
    param_dtype=cfg["model"]["param_dtype"],
    weights_layout=engine["weights_layout"],
    micro_batches=micro_batches or train["micro_batches"] or 1,
    remat=cfg["model"]["remat"],
    activations=activations,
    attention=planned_attention(cfg["model"].get("attention", "auto")),
    critic=critic,
  )


def fit_run(
  cfg: Mapping[str, Any],
  mesh: Mapping[str, int],
  device_bytes: int | None,
  confirm_compiled: bool = True,
) -> tuple[int, MemoryPlan | None]:
  """Chooses the run's gradient-accumulation slices and checks that the run fits one device,
  before anything is allocated.

  The worst case is checked: every row of a mini-batch `engine.cache_len` tokens long. For each
  candidate of `micro_batch_choices` (the configured value, or with `train.micro_batches = 0`
  every valid one, fewest first) the fast residual estimate is tried first, and the first that
  fits is confirmed with the compiled step's figure (`plan(activations="compiled")`).

  Args:
    cfg: the run's config. mesh: axis sizes of the run's mesh.
    device_bytes: memory of one device (`jax.Device.memory_stats()["bytes_limit"]`, or a host
      device's share of the machine's memory), or None: nothing is checked.
    confirm_compiled: confirm the choice with the compiled step's figure; False keeps the
      residual estimate (a lower bound), as the job does on CPU, where the compile would cost
      seconds per run and XLA:CPU's float32 figure would overstate a bfloat16 run.
  Returns:
    (micro_batches to run with, the plan that fits, or None when nothing was checked).
  Raises:
    MemoryError: parameters, gradients, optimizer, reference, rollout weights and KV cache alone
      exceed the device, or the activations of a worst-case batch do not fit with any allowed
      `train.micro_batches`; the message holds the planner's table and what to change.
  """
  choices = micro_batch_choices(cfg, mesh)
  if not device_bytes:
    return choices[0], None
  gib = device_bytes / GIB
  p = plan_for_run(cfg, mesh, choices[0])
  if p.static > device_bytes:
    raise MemoryError(
      f"the run does not fit its devices: {p.static / GIB:.1f} GiB per device before any "
      f"activation, {gib:.1f} GiB available (memory planner, GiB per device):\n"
      f"{format_table([p], gib, headroom=1.0)}\nUse more devices (mesh.fsdp = -1 spreads "
      f"parameters and optimizer over all), fewer engine.num_slots or a shorter "
      f"engine.cache_len, or engine.weights_layout=train."
    )
  for k in choices:
    p = plan_for_run(cfg, mesh, k)
    if p.total > device_bytes:
      continue
    if confirm_compiled:
      p = plan_for_run(cfg, mesh, k, activations="compiled")
    if p.total <= device_bytes:
      return k, p
  raise MemoryError(
    f"the run does not fit its devices: a mini-batch of {p.batch} rows of engine.cache_len = "
    f"{p.seq_len} tokens needs {p.total / GIB:.1f} GiB per device with "
    f"train.micro_batches = {p.micro_batches} ({p.activation_source} activations), "
    f"{gib:.1f} GiB available (tried train.micro_batches in {choices}):\n"
    f"{format_table([p], gib, headroom=1.0)}\nSet train.micro_batches = 0 (the fewest slices "
    f"that fit), use more devices, or a shorter engine.cache_len."
  )


# ------------------------------------------------------------------ the job's compiled programs


def device_memory_limit() -> tuple[int | None, str]:
  """(bytes one local device may use, what that figure is): the device's own limit on GPUs and
  TPUs (`memory_stats()["bytes_limit"]`); on CPU an equal share of the machine's memory per host
  device (an estimate: the devices share it); (None, ...) where neither is known."""
  device = jax.local_devices()[0]
  limit = (device.memory_stats() or {}).get("bytes_limit")
  if limit is not None:
    return int(limit), "device"
  if device.platform == "cpu":
    try:
      host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
      return None, "unknown"
    return host // jax.local_device_count(), "host-memory share per CPU device"
  return None, "unknown"


def device_bytes(arrays: Any = None) -> int:
  """The most bytes any local device holds of `arrays` (a pytree of jax.Arrays; None: every live
  array of this process, `jax.live_arrays()`): what is resident per device, shards counted
  where they are (a replicated array counts on every device), each buffer once. Arrays that
  share a buffer are one: a checkpoint writer keeps each saved array's shards as arrays of their
  own (`shard.data`, alive until its save finishes; on CPU its host copies are views of them),
  which counted twice made the CPU preset's resident figure after a save 1.8x the real one."""
  leaves = jax.live_arrays() if arrays is None else jax.tree.leaves(arrays)
  per_device: dict[int, int] = {}
  seen: set[tuple[int, int]] = set()
  for x in leaves:
    if not isinstance(x, jax.Array) or x.is_deleted():
      continue
    for shard in x.addressable_shards:
      try:
        buffer = (shard.device.id, shard.data.unsafe_buffer_pointer())
      except (RuntimeError, NotImplementedError, AttributeError):  # no pointers: counted as is
        buffer = None
      if buffer in seen:
        continue
      if buffer is not None:
        seen.add(buffer)
      size = math.prod(shard.data.shape) * x.dtype.itemsize
      per_device[shard.device.id] = per_device.get(shard.device.id, 0) + size
  return max(per_device.values(), default=0)


@dataclasses.dataclass(frozen=True)
class ProgramCheck:
  """The job's memory per device while its largest compiled programs run.

  Attributes:
    resident: bytes every live array holds now (parameters, optimizer state, reference, KV
      cache, the rollout copy when one is made), on the fullest device.
    rollout_copy: bytes of that total that are the rollout weight copy, which the trainer
      releases before an update (`PolicyTrainer.grpo_epoch`).
    peaks: (program, peak bytes) of the largest program of each kind: an engine program runs
      beside everything resident, an update or a weight sync beside everything but the
      rollout copy.
    limit: bytes one device may use (None: unknown); where: what `limit` is.
  """

  resident: int
  rollout_copy: int
  peaks: tuple[tuple[Any, int], ...]
  limit: int | None
  where: str

  @property
  def over(self) -> list[tuple[Any, int]]:
    """The programs whose peak exceeds `limit`."""
    return [(p, b) for p, b in self.peaks if self.limit is not None and b > self.limit]

  def lines(self) -> list[str]:
    """The check as text: one line per program, then the limit."""
    out = [
      f"memory per device, from the compiled programs (XLA's buffer assignment): resident "
      f"{self.resident / GIB:.2f} GiB (of which rollout weight copy "
      f"{self.rollout_copy / GIB:.2f} GiB)"
    ]
    for program, peak in self.peaks:
      out.append(f"  {program.name}: +{program.added / GIB:.2f} GiB -> {peak / GIB:.2f} GiB")
    if self.limit is not None:
      out.append(f"  limit {self.limit / GIB:.1f} GiB ({self.where})")
    return out


def check_programs(
  engine_programs: Sequence[Any],
  update_programs: Sequence[Any],
  resident: int,
  rollout_copy: int,
  limit: int | None,
  where: str,
) -> ProgramCheck:
  """The peak per device of the largest program of each kind (`compiling.ProgramMemory`, what
  `compile_ahead` compiled; the kind is the name's first word): resident bytes plus what the
  program allocates (`ProgramMemory.added`). The trainer's programs (the update, the weight
  sync) run without the rollout copy: it is released before an update, and the sync releases
  the old copy before it makes the new one."""
  peaks = []
  for programs, base in ((engine_programs, resident), (update_programs, resident - rollout_copy)):
    kinds: dict[str, list[Any]] = {}
    for p in programs:
      kinds.setdefault(p.name.split()[0], []).append(p)
    for same in kinds.values():
      top = max(same, key=lambda p: p.added)
      peaks.append((top, base + top.added))
  return ProgramCheck(resident, rollout_copy, tuple(peaks), limit, where)
