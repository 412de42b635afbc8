"""Policy updates: batches from trajectories, token log-probs, the jitted GRPO and SFT steps.

Full-vocabulary logits are computed only at the positions of sampled tokens, in chunks under
`jax.checkpoint`, so memory is O(chunk * V) instead of O(T * V).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, overload

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from coevolve_jax import compiling, distributed, grpo
from coevolve_jax.models import sharding
from coevolve_jax.models.qwen import Qwen, routing_dtype, unrolled_template, unstack_state
from coevolve_jax.rollout.sampling import SamplingParams, filtered_logits, gathered_logprobs
from coevolve_jax.types import Trajectory

# Jitted GRPO steps a trainer keeps, one per objective (`PolicyTrainer.set_objective`).
OBJECTIVES_KEPT = 4


def bucket_size(n: int, minimum: int, step: int = 512) -> int:
  """Powers of two up to `step`, then multiples of `step`: few shapes, little padding."""
  if n > step:
    return -(-n // step) * step
  return max(minimum, 1 << max(0, (n - 1).bit_length()))


@dataclasses.dataclass
class Batch:
  """Padded training arrays (numpy) for N rows.

  tokens [N, T] int32 (right-padded with 0); target_pos [N, P] int32 index of each sampled token
  (>= 1; padded with 1); target_mask [N, P] float32; sampler_logp [N, P]; advantages float32,
  either [N] (one per trajectory, broadcast over its targets: GRPO's outcome advantage) or
  [N, P] (one per target, aligned with target_pos; 0 past a row's targets); routing
  [N, T, L_moe, k] (`models.qwen.routing_dtype`, int16) expert indices the rollout engine routed
  each token to (`Trajectory.routing`; -1 where none was recorded: padding, tokens never fed to
  the engine, trajectories without a record), or None when no trajectory has one.
  The trainer replays it (`token_logprobs`); 2 * L_moe * k bytes per token (768 for
  Qwen3-30B-A3B, about 25 MB for a row of 32k tokens).
  """

  tokens: np.ndarray
  target_pos: np.ndarray
  target_mask: np.ndarray
  sampler_logp: np.ndarray
  advantages: np.ndarray
  routing: np.ndarray | None = None

  def rows(self, idx: np.ndarray) -> "Batch":
    return Batch(*(_take(getattr(self, f.name), idx) for f in dataclasses.fields(self)))

  def arrays(self) -> dict[str, jax.Array]:
    """The fields as device arrays; `routing` only when present."""
    fields = (f.name for f in dataclasses.fields(self))
    return {k: jnp.asarray(getattr(self, k)) for k in fields if getattr(self, k) is not None}


@overload
def _take(x: np.ndarray, idx: np.ndarray) -> np.ndarray: ...
@overload
def _take(x: None, idx: np.ndarray) -> None: ...
def _take(x: np.ndarray | None, idx: np.ndarray) -> np.ndarray | None:
  """The rows `idx` of a field (None stays None: `routing`)."""
  return None if x is None else x[idx]


def _listed_bucket(n: int, buckets: Sequence[int], what: str) -> int:
  """The smallest of the ascending `buckets` that holds n."""
  for b in buckets:
    if b >= n:
      return b
  raise ValueError(f"{what} of {n} exceed the largest bucket of {list(buckets)}")


def target_positions(traj: Trajectory) -> list[int]:
  """The positions a trajectory is trained on, in order: every i > 0 with loss_mask[i] == 1 (a
  token at position 0 has nothing before it to be scored from). Row r of `make_batch`'s
  target_pos / target_mask / per-token advantages holds them, then padding."""
  return [i for i, m in enumerate(traj.loss_mask) if m and i > 0]


def make_batch(
  trajs: Sequence[Trajectory],
  advantages: np.ndarray | None = None,
  min_len: int = 128,
  min_targets: int = 32,
  len_buckets: Sequence[int] = (),
  target_buckets: Sequence[int] = (),
) -> Batch:
  """Pads trajectories into bucketed shapes so the step compiles rarely.

  T (tokens per row) is the smallest of `len_buckets` that holds the longest trajectory, and P
  (targets per row) the smallest of `target_buckets` that holds the most generated tokens of a
  row: a fixed set of shapes (`train.len_buckets`, `train.target_buckets`) that can be compiled
  ahead (`PolicyTrainer.compile_ahead`). Empty lists: powers of two from `min_len` /
  `min_targets` up to 512, then multiples of 512 (few shapes, little padding, but not a bounded
  set).

  Routing records (`Trajectory.routing`, [len(token_ids), L_moe, k]) are padded with -1 into
  `Batch.routing` when any trajectory has one; rows without one are all -1 (the router chooses).

  `advantages`: None (zeros [N]); [N] (one per trajectory), kept as it is in float32; or [N, P']
  (one per target, the form of `coevolve_jax.advantages.spread_over_replies`): row r's first k_r
  entries (k_r = len(target_positions(trajs[r]))) are its targets' advantages, in order, and its
  entries past them are ignored. It becomes [N, P] float32 with those k_r values and 0 after
  them (truncated or padded to the batch's P, which holds every k_r), so padding adds nothing
  even where a caller left NaN there.

  Raises:
    ValueError: a trajectory longer, or with more generated tokens, than the largest listed
      bucket; routing records of different [L_moe, k] shapes, or one whose length is not its
      trajectory's token count; advantages neither [N] nor [N, P'], [N, P'] ones whose P' is
      less than some row's target count k_r, or a non-finite one at a target.
  """
  n = len(trajs)
  longest = max(len(tr.token_ids) for tr in trajs)
  if len_buckets:
    t = _listed_bucket(longest, sorted(len_buckets), "trajectory tokens")
  else:
    t = bucket_size(longest, min_len)
  pos_lists = [target_positions(tr) for tr in trajs]
  most = max(1, max(len(x) for x in pos_lists))
  if target_buckets:
    p = _listed_bucket(most, sorted(target_buckets), "generated tokens")
  else:
    p = bucket_size(most, min_targets)
  tokens = np.zeros((n, t), np.int32)
  target_pos = np.ones((n, p), np.int32)
  target_mask = np.zeros((n, p), np.float32)
  sampler_logp = np.zeros((n, p), np.float32)
  for r, (tr, pos) in enumerate(zip(trajs, pos_lists)):
    tokens[r, : len(tr.token_ids)] = tr.token_ids
    target_pos[r, : len(pos)] = pos
    target_mask[r, : len(pos)] = 1.0
    sampler_logp[r, : len(pos)] = [tr.logprobs[i] for i in pos]
  adv = np.zeros((n,), np.float32) if advantages is None else np.asarray(advantages, np.float32)
  if adv.ndim != 1:
    adv = _per_target_advantages(adv, [len(x) for x in pos_lists], p)
  return Batch(tokens, target_pos, target_mask, sampler_logp, adv, _routing_rows(trajs, t))


def _per_target_advantages(adv: np.ndarray, counts: Sequence[int], p: int) -> np.ndarray:
  """[N, P'] float32 per-target advantages -> [N, p]: row r's first counts[r] entries, then 0.

  Raises:
    ValueError: not [N, P'] with N = len(counts); P' < some counts[r]; a non-finite value
      among a row's first counts[r].
  """
  n = len(counts)
  if adv.ndim != 2 or adv.shape[0] != n:
    raise ValueError(f"advantages of shape {adv.shape}, want [{n}] or [{n}, P]")
  short = [r for r, k in enumerate(counts) if k > adv.shape[1]]
  if short:
    r = short[0]
    raise ValueError(
      f"per-target advantages of shape {adv.shape} cover {adv.shape[1]} targets, but row {r} "
      f"has {counts[r]} (rows {short} are short)"
    )
  out = np.zeros((n, p), np.float32)
  for r, k in enumerate(counts):
    out[r, :k] = adv[r, :k]
  bad = sorted({int(r) for r in np.nonzero(~np.isfinite(out))[0]})
  if bad:
    raise ValueError(f"non-finite per-target advantages in rows {bad}")
  return out


def _routing_rows(trajs: Sequence[Trajectory], t: int) -> np.ndarray | None:
  """[N, t, L_moe, k] routing records padded with -1, or None when no trajectory has one."""
  records = [tr.routing for tr in trajs]
  shapes = {r.shape[1:] for r in records if r is not None}
  if not shapes:
    return None
  if len(shapes) > 1:
    raise ValueError(f"routing records of different [L_moe, k] shapes: {sorted(shapes)}")
  dtype = np.result_type(*(r.dtype for r in records if r is not None))
  out = np.full((len(trajs), t, *shapes.pop()), -1, dtype)
  for row, (tr, rec) in enumerate(zip(trajs, records)):
    if rec is None:
      continue
    if len(rec) != len(tr.token_ids):
      raise ValueError(
        f"trajectory {row} ({tr.task_id}): routing of {len(rec)} tokens for "
        f"{len(tr.token_ids)} token ids"
      )
    out[row, : len(rec)] = rec
  return out


def token_logprobs(
  model: Qwen,
  tokens_nt: jax.Array,
  target_pos_np: jax.Array,
  temperature: float = 1.0,
  chunk_rows: int = 128,
  sampling: SamplingParams | None = None,
  routing_ntlk: jax.Array | None = None,
) -> jax.Array:
  """log pi(token[pos] | tokens[:pos]) at the target positions, under the sampler's distribution.

  The distribution is `rollout.sampling.filtered_logits`'s: logits / T, restricted to the tokens
  top-k / top-p keep and renormalised over them (`sampling`), or logits / `temperature` over the
  whole vocabulary when `sampling` is None. It is the function the engine samples with, so the
  trainer's log-probs are the sampler's (docs/design.md §1.1, "Sampling distribution"). The kept
  set is stop-gradient: a gradient flows into the kept tokens' logits only. Without top-k / top-p
  (top_k = 0, top_p = 1) this is exactly the full tempered log-softmax.

  Vocabulary logits are computed only at the target positions, in chunks of about `chunk_rows`
  scored tokens (N rows x ceil(chunk_rows / N) positions, so the batch axis and its sharding are
  kept) under `jax.checkpoint`: peak memory O(chunk_rows * V), and each chunk's logits are small
  enough to be reduced while still in cache (on a 2-core CPU, 128 rows of 152k logits score at
  the bare matmul's rate; 1024 rows at once cost a third more). Top-p adds a sort of each chunk's
  [chunk_rows, V] logits (no gradient through it; recomputed in the backward pass).

  Args:
    tokens_nt: [N, T] int32 right-padded sequences starting at position 0.
    target_pos_np: [N, P] int32 positions (>= 1) of the tokens to score.
    temperature: static; logits are divided by it (used only when `sampling` is None).
    chunk_rows: static; scored tokens per vocabulary-projection chunk (>= 1).
    sampling: static; the sampler's parameters (temperature, top_k, top_p), or None for
      `SamplingParams(temperature)`.
    routing_ntlk: optional [N, T, L_moe, k] integer expert indices (-1: not recorded) that the
      rollout engine's forward used for each token (`Batch.routing`): the MoE layers route by
      them (routing replay, `Qwen.hidden_states`), so tokens are scored under the experts they
      were sampled with; the router still gets its gradient through the routing weights.
  Returns:
    [N, P] float32 log-probs; -inf for a token outside the kept set (`grpo.grpo_loss` gives such
    tokens no gradient; padding positions may score -inf too).
  Raises:
    ValueError: top_k larger than the vocabulary; routing_ntlk not of shape [N, T, L_moe, k].
  """
  params = SamplingParams(temperature) if sampling is None else sampling
  h_sel = model.hidden_states(  # [N, P, D]: the last layer runs only at the scored positions
    tokens_nt,
    jnp.broadcast_to(jnp.arange(tokens_nt.shape[1]), tokens_nt.shape),
    output_index_bp=target_pos_np - 1,
    routing_btlk=routing_ntlk,
  )
  targets = jnp.take_along_axis(tokens_nt, target_pos_np, axis=1)  # [N, P]
  n, p, d = h_sel.shape
  c = min(p, max(1, -(-chunk_rows // n)))  # positions per chunk
  pad = -p % c  # P need not be a multiple of the chunk: pad, score, then drop the padding
  if pad:
    h_sel = jnp.pad(h_sel, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  h_chunks = h_sel.reshape(n, (p + pad) // c, c, d).swapaxes(0, 1)
  y_chunks = targets.reshape(n, (p + pad) // c, c).swapaxes(0, 1)

  @jax.checkpoint
  def one(args):
    h, y = args
    # The sampler's own processing: tempering (below T = 0.25 it shifts by the row max first,
    # so trainer and engine round alike at every temperature), then top-k / top-p.
    return gathered_logprobs(filtered_logits(model.logits(h), params), y)

  out = jax.lax.map(one, (h_chunks, y_chunks))  # [P/c, N, c]
  return out.swapaxes(0, 1).reshape(n, p + pad)[:, :p]


def make_optimizer(
  lr: float | optax.Schedule, weight_decay: float, grad_clip: float
) -> optax.GradientTransformation:
  """AdamW after global-norm gradient clipping (docs/design.md §1.1: constant lr; a schedule is
  accepted)."""
  return optax.chain(
    optax.clip_by_global_norm(grad_clip), optax.adamw(lr, weight_decay=weight_decay)
  )


# ---------------------------------------------------------------------------------------------
# Sharding of parameters, optimizer state and batches.
# ---------------------------------------------------------------------------------------------


def _is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)


def inference_rules() -> dict[str, str | tuple[str, ...] | None]:
  """The logical-axis table of the rollout engine's copy of the weights ("gathered" layout).

  `sharding.LOGICAL_RULES` with the fsdp-sharded parameter dimension ("embed") replicated: the
  weights are gathered over fsdp once per parameter version (`PolicyTrainer.inference_params`)
  instead of inside every decode step's every layer, and stay split over tensor and expert.
  Costs one compute-dtype parameter copy of size params / (tensor * expert) per device.
  """
  return {**sharding.LOGICAL_RULES, "embed": None}


def cast_floating(tree, dtype):
  """`tree` with every floating-point array cast to `dtype` (a no-op for None or equal dtypes);
  integer and boolean leaves are kept."""
  if dtype is None:
    return tree

  def cast(x):
    return x.astype(dtype) if _is_float(x) and x.dtype != dtype else x

  return jax.tree.map(cast, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows (the leading dimension) split over the data-parallel axes ("batch" logical axis)."""
  return NamedSharding(mesh, PartitionSpec(sharding.LOGICAL_RULES["batch"]))


# ---------------------------------------------------------------------------------------------
# Micro-batch gradient accumulation.
# ---------------------------------------------------------------------------------------------


def split_micro_batches(x, k: int):
  """[N, ...] -> [k, N / k, ...]; micro-batch j holds rows j, j + k, j + 2k, ...

  Strided rows keep each device's block of a row-sharded batch on that device.
  """
  return x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)


def accumulate_gradients(loss_fn: Callable, params, micro, k: int):
  """Sum over micro-batches of value_and_grad(loss_fn)(params, micro_j).

  `loss_fn(params, micro_j) -> (loss, metrics)` must already divide by whole-batch denominators,
  so the sum equals the loss of the unsplit batch (up to float summation order).

  Args:
    loss_fn: the per-micro-batch loss. params: the differentiated pytree.
    micro: pytree of [k, M, ...] arrays (see `split_micro_batches`). k: static micro-batch count.
  Returns:
    (loss, metrics, grads), gradients accumulated in float32.
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if k == 1:
    (loss, metrics), grads = grad_fn(params, jax.tree.map(lambda x: x[0], micro))
    return loss, metrics, grads

  def body(carry, mb):
    (loss, metrics), grads = grad_fn(params, mb)
    acc_grads, acc_loss, acc_metrics = carry
    acc_grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc_grads, grads)
    acc_metrics = jax.tree.map(jnp.add, acc_metrics, metrics)
    return (acc_grads, acc_loss + loss, acc_metrics), None

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  shapes = jax.eval_shape(lambda: loss_fn(params, jax.tree.map(lambda x: x[0], micro))[1])
  init = (zeros, jnp.zeros((), jnp.float32), jax.tree.map(lambda m: jnp.zeros_like(m), shapes))
  (grads, loss, metrics), _ = jax.lax.scan(body, init, micro)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  return loss, metrics, grads


def grpo_micro_loss(logp_fn: Callable, cfg: grpo.GRPOConfig, mask_np: jax.Array) -> Callable:
  """The GRPO loss of one micro-batch, normalised by the whole batch (see `aggregate`).

  Args:
    logp_fn: (params, tokens [M, T], target_pos [M, P]) -> [M, P] log-probs; called with the
      keyword routing=[M, T, L_moe, k] too when the micro-batch holds "routing".
    cfg: the objective. mask_np: [N, P] target mask of the WHOLE batch (its denominators).
  Returns:
    loss_fn(params, micro) -> (loss, metrics) for `accumulate_gradients`; `micro` holds tokens,
    target_pos, target_mask, advantages ([M] or [M, P], `grpo.grpo_loss`), old and optionally
    ref and routing (each with M rows).
  """
  loss_den = grpo.aggregate_denominator(mask_np, cfg.loss_agg)
  token_den = grpo.aggregate_denominator(mask_np, "token-mean")

  def loss_fn(params, mb):
    logp = logp_fn(params, mb["tokens"], mb["target_pos"], **_routing_kwarg(mb))
    return grpo.grpo_loss(
      logp, mb["old"], mb.get("ref"), mb["advantages"], mb["target_mask"], cfg, loss_den, token_den
    )

  return loss_fn


def _routing_kwarg(arrays: dict) -> dict:
  """{"routing": the batch's routing record} when the batch has one, else {}."""
  return {"routing": arrays["routing"]} if arrays.get("routing") is not None else {}


def _check_epoch_args(n: int, advantages: np.ndarray, mini_batches: int, keep) -> None:
  """`PolicyTrainer.grpo_epoch`'s checks of its arguments for n trajectories.

  Raises:
    ValueError: mini_batches outside [1, n]; advantages neither [n] nor [n, P]; keep (unless
      None) not of shape [n].
  """
  if not 1 <= mini_batches <= n:
    raise ValueError(f"mini_batches must be in [1, {n}] for {n} trajectories, got {mini_batches}")
  if np.ndim(advantages) not in (1, 2) or np.shape(advantages)[0] != n:
    raise ValueError(f"advantages of shape {np.shape(advantages)}, want [{n}] or [{n}, P]")
  if keep is not None and np.shape(keep) != (n,):
    raise ValueError(f"keep of shape {np.shape(keep)}, want [{n}]")


def _checked_trainer_options(micro_batches: int, inference_layout: str, compute_dtype):
  """`PolicyTrainer`'s checks of its options; returns the compute dtype (None: the parameters').

  Raises:
    ValueError: micro_batches < 1, an unknown inference_layout, or a compute_dtype that is not a
      float dtype.
  """
  if micro_batches < 1:
    raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
  if inference_layout not in ("gathered", "train"):
    raise ValueError(f"inference_layout must be 'gathered' or 'train', got {inference_layout!r}")
  compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)
  if compute_dtype is not None and not jnp.issubdtype(compute_dtype, jnp.floating):
    raise ValueError(f"compute_dtype must be a float dtype, got {compute_dtype}")
  return compute_dtype


def _inference_template(model: Qwen, keep_stacked: bool):
  """(graphdef, nnx.State template) of the layout the rollout engine decodes.

  The engine decodes the unrolled layout (`qwen.unstack`; the weight sync also unstacks) or,
  with keep_stacked (`inference_stacked` on a stacked model), the stacked one (its scan over
  layers).
  """
  if keep_stacked:
    return nnx.split(model)
  return unrolled_template(model)


@struct.dataclass
class TrainState:
  """Everything a run's policy update carries from step to step, as one pytree.

  Attributes:
    params: the policy's parameters (nnx.State of Params, as `nnx.split` gives them).
    opt_state: the optimizer state of `params` (optax state; mirrors params for AdamW moments).
    ref_params: the frozen KL reference policy (same structure as params), or None before
      `PolicyTrainer.freeze_reference`.

  A flax.struct dataclass: a pytree whose leaves are the arrays of the three fields (so it
  checkpoints, shards and maps like any pytree); immutable, `replace(...)` gives a changed copy.
  """

  params: Any
  opt_state: Any
  ref_params: Any = None


class PolicyTrainer:
  """Holds the policy's parameters and optimizer state and runs jitted updates.

  Params and optimizer state are plain pytrees (nnx.State / optax state) so they checkpoint and
  shard like any pytree. `model()` returns an nnx model view for the rollout engine.

  With a `mesh`, parameters and optimizer state are placed by their logical axes
  (`sharding.tree_shardings`), batch rows are split over the data axes, and every step is jitted
  with those shardings fixed in and out (state buffers donated), so shardings never change between
  steps and the step compiles once per batch shape. Each update accumulates gradients over
  `micro_batches` strided slices of its batch, dividing by the whole batch's denominators, so
  the result does not depend on the split.

  Mixed precision: the parameters the trainer holds are the master copy, in the dtype the model
  was built with (a run builds them in `model.param_dtype`, float32); with a `compute_dtype`
  (`model.dtype`, e.g. bfloat16) every forward and backward runs on a copy cast to it inside the
  step, so gradients, optimizer moments and the update are in the master dtype. In bfloat16
  itself an update of lr 1e-6 rounds away on most weights (bfloat16 keeps 8 bits of mantissa);
  in the float32 master it does not. The frozen reference is kept in the compute dtype.

  Weight sync: `inference_params()` is what the rollout engine decodes with: the current
  parameters cast to the compute dtype, unrolled (`qwen.unstack`: the engine decodes layer by
  layer while training scans stacked layers; stacked with `inference_stacked`) and laid out for
  decoding, made once per parameter version (every update, restore or assignment of `params` is
  a new version).
  """

  def __init__(
    self,
    model: Qwen,
    tx: optax.GradientTransformation,
    cfg: grpo.GRPOConfig,
    sampling: SamplingParams | float,
    mesh: Mesh | None = None,
    micro_batches: int = 1,
    compute_dtype=None,
    inference_layout: str = "gathered",
    inference_stacked: bool = False,
    len_buckets: Sequence[int] = (),
    target_buckets: Sequence[int] = (),
  ):
    """Args:
      model: the policy (its parameters are taken over; the trainer donates them at each step).
      tx: the optimizer (`make_optimizer`). cfg: the GRPO objective.
      sampling: the rollout's sampling parameters (temperature, top_k, top_p): old, reference and
        current log-probs are all scored under the distribution the engine sampled from
        (`token_logprobs`); a float is a temperature with neither top-k nor top-p.
      mesh: a `models.sharding.make_mesh` mesh, or None for one device.
      micro_batches: gradient-accumulation slices per update (a batch whose rows do not divide
        by micro_batches x data-parallel devices is padded with rows that add nothing).
      compute_dtype: the float dtype forwards and backwards run in (None: the parameters' own
        dtype); the parameters themselves stay in theirs (the master copy).
      inference_layout: the layout of `inference_params()` on a mesh: "gathered" (the fsdp
        dimension replicated, `inference_rules`) or "train" (the training layout; no extra copy
        when the model is unrolled and no cast is needed either).
      inference_stacked: `inference_params()` keeps a stacked model's layers stacked, for an
        engine that decodes them under a scan (`Engine(scan_layers=True)`); default: unrolled.
      len_buckets, target_buckets: the padded lengths T and P of `grpo_epoch`'s batches
        (`make_batch`); empty: its default rule. With both, `compile_ahead` compiles them all.
    Raises:
      ValueError: micro_batches < 1, an unknown inference_layout, or a compute_dtype that is not
        a float dtype.
    """
    self.compute_dtype = _checked_trainer_options(micro_batches, inference_layout, compute_dtype)
    self._version = 0  # bumped by every new `params` (update, restore, assignment)
    self._infer, self._infer_version = None, -1
    self.last_sync_s = 0.0  # seconds the last `inference_params()` copy took
    # Per device, each update `compile_ahead` compiled (`compiling.ProgramMemory`).
    self.program_memory: list[compiling.ProgramMemory] = []
    self.graphdef, params = nnx.split(model)
    self.model_config = model.config
    keep_stacked = inference_stacked and model.stacked
    self.inference_graphdef, infer_template = _inference_template(model, keep_stacked)
    self.tx, self.cfg = tx, cfg
    self.sampling = (
      sampling if isinstance(sampling, SamplingParams) else SamplingParams(temperature=sampling)
    )
    self.mesh, self.micro_batches = mesh, micro_batches
    self.len_buckets, self.target_buckets = (
      tuple(sorted(len_buckets)),
      tuple(sorted(target_buckets)),
    )
    self._place_state(params, infer_template, inference_layout)
    self.ref_params = None
    self._needs_copy = self._inference_needs_copy(
      params, inference_layout, model.stacked and not keep_stacked
    )
    self._to_compute, self._to_reference = self._weight_copy_fns(
      model.config, keep_stacked, infer_template
    )
    self._logp, self._grpo_step, self._sft_step = self._jitted_steps()
    self._grpo_steps = {self.cfg: self._grpo_step}  # objective -> its jitted step (set_objective)
    self._hidden: Any = None  # `hidden_states_at`'s program, jitted at its first call

  def _place_state(self, params, infer_template, inference_layout: str) -> None:
    """Sets the shardings (None without a mesh), the master parameters and the optimizer state.

    With a mesh: parameters, optimizer state and the inference weights (`infer_template`'s
    structure) are sharded by their logical axes (`sharding.tree_shardings`; the inference ones
    under `inference_rules()` for the "gathered" layout), batch rows over the data axes
    (`batch_sharding`); `params` are put onto the devices and the optimizer state is made there.

    Args:
      params: the model's nnx.State (arrays of any float dtype, taken over as the master copy).
      infer_template: the nnx.State structure of `inference_params()`.
      inference_layout: "gathered" | "train".
    """
    mesh, tx = self.mesh, self.tx
    if mesh is None:
      self._param_sh = self._opt_sh = self._rows_sh = self._infer_sh = None
      self.params = params
      self.opt_state = tx.init(params)
    else:
      self._param_sh = sharding.tree_shardings(params, mesh)
      self._opt_sh = sharding.tree_shardings(jax.eval_shape(tx.init, params), mesh)
      self._rows_sh = batch_sharding(mesh)
      rules = inference_rules() if inference_layout == "gathered" else sharding.LOGICAL_RULES
      self._infer_sh = sharding.tree_shardings(infer_template, mesh, rules)
      self.params = jax.device_put(params, self._param_sh)
      self.opt_state = self._jit(tx.init, (self._param_sh,), self._opt_sh)(self.params)

  def _inference_needs_copy(self, params, inference_layout: str, unstacks: bool) -> bool:
    """Whether `inference_params()` must be a new buffer rather than `params` itself.

    Casting (and, on a mesh, resharding) for the engine and the reference: a new buffer always.

    Args:
      params: the master nnx.State (only its float dtypes are read).
      inference_layout: "gathered" | "train". unstacks: the engine's layout unrolls a stacked
        model (`qwen.unstack`).
    """
    return (
      (
        self.compute_dtype is not None
        and any(x.dtype != self.compute_dtype for x in jax.tree.leaves(params) if _is_float(x))
      )
      or (self.mesh is not None and inference_layout == "gathered")
      or unstacks
    )

  def _weight_copy_fns(self, model_config, keep_stacked: bool, infer_template):
    """The jitted copies of the parameters for the rollout engine and for the reference policy.

    Args:
      model_config: the policy's QwenConfig. keep_stacked: the engine decodes stacked layers.
      infer_template: the nnx.State structure of `inference_params()`.
    Returns:
      (to_compute: params -> the inference weights, in the compute dtype, unrolled unless
      keep_stacked, with the inference shardings; to_reference: params -> a copy in the compute
      dtype with the parameters' shardings).
    """

    def to_compute(p):
      p = cast_floating(p, self.compute_dtype)
      return p if keep_stacked else unstack_state(p, model_config, infer_template)

    to_compute = self._jit(
      to_compute,
      (self._param_sh,),
      self._infer_sh,
    )
    to_reference = self._jit(
      lambda p: jax.tree.map(jnp.copy, cast_floating(p, self.compute_dtype)),
      (self._param_sh,),
      self._param_sh,
    )
    return to_compute, to_reference

  def _jitted_steps(self):
    """The jitted log-prob forward, GRPO step and SFT step, with the shardings fixed in and out.

    Batch arrays are row-sharded ([N, ...] over the data axes); the steps donate the parameters
    and optimizer state (arguments 0 and 1) and return their metrics replicated.

    Returns:
      (logp: `_logp_fn`, [N, P] float32 out; grpo_step: `_grpo_step_fn`; sft_step:
      `_sft_step_fn`).
    """
    logp = self._jit(
      self._logp_fn, (self._param_sh, self._rows_sh, self._rows_sh, self._rows_sh), self._rows_sh
    )
    state_sh = (self._param_sh, self._opt_sh)
    sft_step = self._jit(self._sft_step_fn, (*state_sh, self._rows_sh), (*state_sh, None), (0, 1))
    return logp, self._jit_grpo_step(self.cfg), sft_step

  def _jit(self, fn, in_sh, out_sh, donate=()):
    if self.mesh is None:
      return jax.jit(fn, donate_argnums=donate)
    replicated = NamedSharding(self.mesh, PartitionSpec())
    fix = lambda sh: replicated if sh is None else sh  # noqa: E731
    out_sh = tuple(fix(s) for s in out_sh) if isinstance(out_sh, tuple) else fix(out_sh)
    return jax.jit(
      fn, in_shardings=tuple(fix(s) for s in in_sh), out_shardings=out_sh, donate_argnums=donate
    )

  def _ctx(self):
    """The mesh for activation sharding constraints while tracing."""
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _check_batch(self, batch: Batch) -> None:
    """A routing record that fits the model.

    Raises:
      ValueError: `batch.routing` is not [N, T, L_moe, k] or holds an index outside
        [-1, num_experts).
    """
    if batch.routing is None:
      return
    cfg = self.model_config
    want = (*batch.tokens.shape, len(cfg.moe_layers), cfg.num_experts_per_tok)
    if batch.routing.shape != want:
      raise ValueError(
        f"batch routing of shape {batch.routing.shape}, want [N, T, L_moe, k] = {list(want)}"
      )
    if batch.routing.size and (batch.routing.min() < -1 or batch.routing.max() >= cfg.num_experts):
      raise ValueError(f"batch routing holds expert indices outside [-1, {cfg.num_experts})")

  def _row_multiple(self) -> int:
    """Rows a device batch must be a multiple of: micro-batches x row shards (the devices the
    "batch" logical axis splits over: data x fsdp x expert)."""
    data = 1 if self.mesh is None else sharding.axis_devices(self.mesh.shape, "batch")
    return self.micro_batches * data

  def _padded(self, batch: Batch, *per_row) -> tuple[Batch, ...]:
    """`batch` (and [N, ...] arrays `per_row`, None kept) with rows appended up to a multiple of
    `_row_multiple()`: padding rows have an all-zero target mask and advantage (token 0,
    routing -1), so they add nothing to any loss, gradient, denominator or metric
    (`grpo.aggregate_denominator` counts masked tokens or non-empty rows)."""
    n = batch.tokens.shape[0]
    pad = -n % self._row_multiple()
    if not pad:
      return (batch, *per_row)
    fill = {"target_pos": 1, "routing": -1}

    def grow(name, x):
      if x is None:
        return None
      extra = np.full((pad, *x.shape[1:]), fill.get(name, 0), np.asarray(x).dtype)
      return np.concatenate([np.asarray(x), extra])

    padded = Batch(*(grow(f.name, getattr(batch, f.name)) for f in dataclasses.fields(batch)))
    return (padded, *(grow("", x) for x in per_row))

  def _rows(self, tree):
    """Batch arrays onto the devices: rows split over the data axes with a mesh."""
    if self.mesh is None:
      return jax.tree.map(jnp.asarray, tree)
    return jax.device_put(tree, self._rows_sh)

  @property
  def params(self):
    """The master parameters (nnx.State); assigning new ones starts a new parameter version."""
    return self._params

  @params.setter
  def params(self, value) -> None:
    self._params = value
    self._version += 1

  def model(self) -> Qwen:
    """An nnx view of the master parameters (their own dtype; the next update donates them)."""
    return nnx.merge(self.graphdef, self.params)

  def _merge(self, params) -> Qwen:
    """The model on `params` cast to the compute dtype (traced inside the jitted steps)."""
    return nnx.merge(self.graphdef, cast_floating(params, self.compute_dtype))

  def inference_params(self):
    """The weights the rollout engine decodes with: the current parameters in the compute dtype
    and the inference layout (`inference_layout`), unrolled (`qwen.unstack`) or, with
    `inference_stacked`, stacked: an nnx.State for `inference_graphdef`.

    Made once per parameter version (the previous copy is released first, so two copies never
    coexist; `grpo_epoch` releases it before training, so it and the step's activations never
    coexist either) and timed into `last_sync_s`; for an unrolled model without a cast or a layout
    change it is `params` itself. The arrays stay valid until the next update: an engine must
    ask again after it (`rollout.engine.Engine(weights=...)` does, at every call).
    """
    if self._infer_version != self._version:
      self._infer = None
      start = time.perf_counter()
      with self._ctx():
        infer = self._to_compute(self.params) if self._needs_copy else self.params
      jax.block_until_ready(infer)
      self.last_sync_s = time.perf_counter() - start
      self._infer, self._infer_version = infer, self._version
    return self._infer

  def release_rollout_copy(self) -> None:
    """Drops the rollout weight copy (`inference_params`); the next call makes it again.

    Called before training steps (`grpo_epoch`, the warm-start): the copy is stale after their
    first update and made again at the next rollout call anyway, so its memory (7.5 GiB per
    device for Qwen3-4B gathered over fsdp in bfloat16) is free for the steps' activations, as
    the memory check assumes (`memory_plan.check_programs`: updates run without the copy)."""
    self._infer, self._infer_version = None, -1

  @property
  def rollout_copy(self):
    """The rollout weight copy `inference_params` made, while it is alive (an nnx.State), or
    None: none made since the last update, released (`grpo_epoch`), or no copy needed (the
    engine decodes `params` themselves)."""
    return None if self._infer is None or self._infer is self.params else self._infer

  @property
  def state(self) -> TrainState:
    """The current parameters, optimizer state and reference as one `TrainState` (the trainer's
    own buffers, not copies: the next update donates them)."""
    return TrainState(self.params, self.opt_state, self.ref_params)

  @state.setter
  def state(self, value: TrainState) -> None:
    """Takes over a `TrainState` of this trainer's structure (e.g. restored from a checkpoint
    onto `self.state`'s shardings); its arrays are used as they are, not re-placed."""
    self.params, self.opt_state, self.ref_params = value.params, value.opt_state, value.ref_params

  def freeze_reference(self) -> None:
    """The KL reference policy = a copy of the current parameters in the compute dtype (same
    shardings as the parameters)."""
    with self._ctx():
      self.ref_params = self._to_reference(self.params)

  def reset_optimizer(self) -> None:
    """Fresh optimizer state for the current parameters (e.g. after a warm-start)."""
    init = (
      self.tx.init
      if self.mesh is None
      else self._jit(self.tx.init, (self._param_sh,), self._opt_sh)
    )
    self.opt_state = init(self.params)

  def _logp_fn(self, params, tokens, target_pos, routing):
    k = self.micro_batches
    graph = self._merge(params)
    if k == 1:
      return token_logprobs(graph, tokens, target_pos, sampling=self.sampling, routing_ntlk=routing)
    split = lambda x: None if x is None else split_micro_batches(x, k)  # noqa: E731
    out = jax.lax.map(
      lambda a: token_logprobs(graph, *a[:2], sampling=self.sampling, routing_ntlk=a[2]),
      (split(tokens), split(target_pos), split(routing)),
    )
    return out.swapaxes(0, 1).reshape(target_pos.shape)  # undo the strided split

  def logprobs(self, batch: Batch, params=None) -> jax.Array:
    """[N, P] float32 log-probs of the batch's sampled tokens under `params` (default: current).

    No gradient is taken: this is how old (sampler-side) and reference log-probs are computed.
    With `batch.routing`, the MoE layers replay the recorded routing (`token_logprobs`). Rows
    are padded to a multiple of micro_batches x data-parallel devices (`_padded`) and the
    padding dropped from the result.
    Raises:
      ValueError: a routing record that does not fit the model (`_check_batch`).
    """
    n = batch.tokens.shape[0]
    with self._ctx():
      out = self._logp(*self._logp_args(batch, params))
    return out if out.shape[0] == n else out[:n]

  def _logp_args(self, batch: Batch, params=None) -> tuple:
    """`_logp`'s arguments (rows padded by `_padded`, placed by `_rows`), made alike for
    `logprobs` and `compile_ahead`; call under `_ctx()`."""
    params = self.params if params is None else params
    self._check_batch(batch)
    (batch,) = self._padded(batch)
    return (params, *self._rows((batch.tokens, batch.target_pos, batch.routing)))

  def fits(self, traj: Trajectory) -> bool:
    """Whether `grpo_epoch` can train on `traj`: its tokens and targets within the largest
    listed buckets (`len_buckets`, `target_buckets`; always, for the default rule)."""
    if self.len_buckets and len(traj.token_ids) > self.len_buckets[-1]:
      return False
    return not (self.target_buckets and len(target_positions(traj)) > self.target_buckets[-1])

  def set_objective(self, cfg: grpo.GRPOConfig) -> None:
    """Trains with the objective `cfg` from the next update on (Q-Evolve's behaviour-proximal
    objective, `qevolve.objective`); the same settings change nothing. The jitted GRPO steps of
    the last `OBJECTIVES_KEPT` objectives are kept, so alternating between two (GRPO and a
    behaviour-proximal iteration) compiles each once; an objective not among them compiles at
    its next update (BPPO's decaying clip: every iteration)."""
    if cfg == self.cfg:
      return
    self.cfg = cfg
    step = self._grpo_steps.pop(cfg, None) or self._jit_grpo_step(cfg)
    self._grpo_steps[cfg] = step  # the newest last
    while len(self._grpo_steps) > OBJECTIVES_KEPT:
      self._grpo_steps.pop(next(iter(self._grpo_steps)))
    self._grpo_step = step

  def hidden_states_at(self, tokens_nt: np.ndarray, index_np: np.ndarray) -> np.ndarray:
    """The policy's final-norm hidden states at chosen positions, without a gradient: what a
    critic head on the policy reads (`coevolve_jax.qevolve`).

    Runs the current parameters in the compute dtype (`_merge`), rows padded to a multiple of
    micro-batches x data-parallel devices, split over the data axes and run one micro-batch at a
    time as the log-prob forward's are; compiled at the first call of each shape (a run that
    never calls it compiles nothing for it).

    Args:
      tokens_nt: [N, T] int32 right-padded token ids starting at position 0.
      index_np: [N, P] int32 positions in [0, T) to read (padding entries may repeat any
        position).
    Returns:
      [N, P, D] float32 numpy hidden states (D = hidden_size), on the host.
    Raises:
      ValueError: tokens and index of different row counts, or an index outside [0, T).
    """
    tokens_nt, index_np = np.asarray(tokens_nt, np.int32), np.asarray(index_np, np.int32)
    n, t = tokens_nt.shape
    if index_np.ndim != 2 or index_np.shape[0] != n:
      raise ValueError(f"index of shape {index_np.shape} for tokens of shape {tokens_nt.shape}")
    if index_np.size and (index_np.min() < 0 or index_np.max() >= t):
      raise ValueError(f"hidden-state positions outside [0, {t})")
    pad = -n % self._row_multiple()
    if pad:
      tokens_nt = np.concatenate([tokens_nt, np.zeros((pad, t), np.int32)])
      index_np = np.concatenate([index_np, np.zeros((pad, index_np.shape[1]), np.int32)])
    if self._hidden is None:

      def hidden(params, tokens, index):
        graph = self._merge(params)

        def one(rows):
          toks, idx = rows
          positions = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
          return graph.hidden_states(toks, positions, None, idx).astype(jnp.float32)

        k = self.micro_batches  # one slice's activations alive at a time, as `_logp_fn`'s
        if k == 1:
          return jax.lax.stop_gradient(one((tokens, index)))
        out = jax.lax.map(one, (split_micro_batches(tokens, k), split_micro_batches(index, k)))
        out = out.swapaxes(0, 1).reshape(*index.shape, out.shape[-1])  # undo the strided split
        return jax.lax.stop_gradient(out)

      self._hidden = self._jit(hidden, (self._param_sh, self._rows_sh, self._rows_sh), None)
    with self._ctx():
      out = self._hidden(self.params, *self._rows((tokens_nt, index_np)))
    return distributed.fetch(out)[:n]  # replicated: every process holds it whole

  def _grpo_step_for(self, cfg: grpo.GRPOConfig):
    """The GRPO step function of objective `cfg` (bound here, not read from `self.cfg` at trace
    time: a jitted step keeps its objective when `set_objective` changes the trainer's)."""

    def _grpo_step_fn(params, opt_state, arrays, old_logp, ref_logp):
      k = self.micro_batches
      logp_fn = lambda p, tokens, pos, routing=None: token_logprobs(  # noqa: E731
        self._merge(p), tokens, pos, sampling=self.sampling, routing_ntlk=routing
      )
      loss_fn = grpo_micro_loss(logp_fn, cfg, arrays["target_mask"])
      inputs = {**arrays, "old": old_logp}
      if ref_logp is not None:
        inputs["ref"] = ref_logp
      micro = jax.tree.map(lambda x: split_micro_batches(x, k), inputs)
      loss, metrics, grads = accumulate_gradients(loss_fn, params, micro, k)
      updates, opt_state = self.tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      metrics.update(loss=loss, grad_norm=optax.tree.norm(grads))
      return params, opt_state, metrics

    return _grpo_step_fn

  def _jit_grpo_step(self, cfg: grpo.GRPOConfig):
    """`_grpo_step_for(cfg)` jitted, shardings fixed in and out, parameters and optimizer state
    donated."""
    state_sh = (self._param_sh, self._opt_sh)
    return self._jit(
      self._grpo_step_for(cfg),
      (*state_sh, self._rows_sh, self._rows_sh, self._rows_sh),
      (*state_sh, None),
      (0, 1),
    )

  def grpo_update(
    self, batch: Batch, old_logp: jax.Array, ref_logp: jax.Array | None
  ) -> dict[str, float]:
    """One optimizer step on a mini-batch of N rows; gradients accumulated over micro-batches.

    Args:
      batch: N rows (`make_batch`); its routing record, if any, is replayed. old_logp, ref_logp:
        [N, P] from `logprobs` (ref may be None).
    Returns:
      Scalar metrics: loss, pg_loss, clip_frac, ratio_mean, kl (with a reference), grad_norm
      (global norm before clipping).
    Rows are padded to a multiple of micro_batches x data-parallel devices with rows that add
    nothing (`_padded`).
    Raises:
      ValueError: a routing record that does not fit the model.
    """
    args = self._update_args(batch, old_logp, ref_logp)
    with self._ctx():
      self.params, self.opt_state, metrics = self._grpo_step(*args)
    return {k: float(v) for k, v in metrics.items()}

  def _update_args(self, batch: Batch, old_logp, ref_logp) -> tuple:
    """`_grpo_step`'s arguments, made alike for an update and for `compile_ahead`."""
    self._check_batch(batch)
    batch, old_logp, ref_logp = self._padded(batch, old_logp, ref_logp)
    arrays = {k: getattr(batch, k) for k in ("tokens", "target_pos", "target_mask", "advantages")}
    arrays.update(_routing_kwarg(vars(batch)))
    arrays, old_logp, ref_logp = self._rows((arrays, old_logp, ref_logp))
    return self.params, self.opt_state, arrays, old_logp, ref_logp

  def compile_ahead(
    self, rollouts: int, mini_batches: int, routing: bool = False, threads: int = 0
  ) -> int:
    """Compiles `grpo_epoch`'s programs for every batch shape it can meet, before the first
    step: the update and the log-prob forward (under the current parameters and, when they
    differ in dtype or layout, the frozen reference's) at each (T, P) pair of `len_buckets` x
    `target_buckets` a batch can have (P below T), for each mini-batch row count that
    `rollouts` split into `mini_batches` gives. Nothing runs: each program is lowered with
    the arguments a step gives it and compiled, so that a step finds it in JAX's cache. The
    update is compiled for [N] advantages (one per trajectory,
    `train.advantage_estimator = "grpo"`); an estimator that gives per-target ones ([N, P])
    compiles its own update program at its first step of each shape.

    Args:
      rollouts: N, the trajectories of a GRPO step (`rollout.tasks_per_step x group_size`).
      mini_batches: `train.mini_batches`.
      routing: the batches carry routing records (a MoE policy with routing replay).
      threads: shapes compiled at once (`compiling.compile_threads`: 0 = the host's CPU
        count, at most 8).
    Returns:
      The number of (rows, T, P) shapes compiled; each update's memory per device, and the
      weight sync's (the rollout copy's cast) where one is needed, is appended to
      `program_memory`.
    Raises:
      ValueError: no `len_buckets` or `target_buckets` (the default rule is not a bounded set).
    """
    if not (self.len_buckets and self.target_buckets):
      raise ValueError("compile_ahead needs len_buckets and target_buckets (train.*_buckets)")
    sizes = sorted({len(s) for s in np.array_split(np.arange(rollouts), mini_batches)})
    pairs = [
      (t, p)
      for t in self.len_buckets
      for i, p in enumerate(self.target_buckets)
      if (self.target_buckets[i - 1] if i else 0) < t - 1  # some target count <= T - 1 lands here
    ]
    cfg = self.model_config

    def compile_shape(rows: int, t: int, p: int) -> None:
      route = None
      if routing and cfg.moe_layers:
        shape = (rows, t, len(cfg.moe_layers), cfg.num_experts_per_tok)
        route = np.full(shape, -1, routing_dtype(cfg.num_experts))
      z = np.zeros((rows, p), np.float32)
      tokens, pos = np.zeros((rows, t), np.int32), np.ones((rows, p), np.int32)
      batch = Batch(tokens, pos, z, z, np.zeros((rows,), np.float32), route)
      with self._ctx():  # per thread: the mesh context is thread-local
        # Compiled, not run: a forward left running here (dispatch is asynchronous) would
        # share the devices with the first rollouts (8.5 minutes of them on the 2-core
        # preset `cpu_real`). The reference's program is another one only where its dtype or
        # layout differs from the parameters'.
        for params in (self.params, self.ref_params):
          self._logp.lower(*self._logp_args(batch, params)).compile()
        # z stands for the old and reference log-probs: `logprobs` gives [N, P] float32.
        compiled = self._grpo_step.lower(*self._update_args(batch, z, z)).compile()
      memory = compiling.ProgramMemory.of(f"grpo update rows={rows} T={t} P={p}", compiled)
      if memory is not None:
        self.program_memory.append(memory)  # list.append: one at a time under the GIL

    shapes = [(rows, t, p) for rows in sizes for t, p in pairs]
    compiling.run_all([functools.partial(compile_shape, *shape) for shape in shapes], threads)
    if self._needs_copy:  # the weight sync: the rollout copy's cast (and unstacking)
      with self._ctx():
        compiled = self._to_compute.lower(self.params).compile()
      memory = compiling.ProgramMemory.of("weight sync", compiled)
      if memory is not None:
        self.program_memory.append(memory)
    return len(shapes)

  def grpo_epoch(
    self,
    trajectories: Sequence[Trajectory],
    advantages: np.ndarray,
    mini_batches: int,
    keep: np.ndarray | None = None,
  ) -> dict[str, float]:
    """One GRPO epoch over a step's rollouts: one optimizer step per mini-batch (paper Eq. 1).

    The N trajectories are padded into one batch (`make_batch`) and split into `mini_batches`
    consecutive row ranges (`np.array_split`, so sizes differ by at most one). The old (sampler
    side) log-probs of every mini-batch are computed first, then the reference log-probs of every
    mini-batch under `ref_params` (the current parameters when no reference was frozen), all
    before the first update; then `grpo_update` runs on each mini-batch in order.

    A trajectory with `keep` False stays in its mini-batch (shapes and splits do not change) with
    a loss mask of zeros: its tokens add nothing to the loss and are left out of the normalisers
    (token count or row count of `train.loss_agg`), as if it had not been sampled.

    Args:
      trajectories: the N rollouts of the step (`Trajectory` with token ids, loss mask and the
        sampler's log-probs; for a MoE policy, the engine's routing records, which the old,
        reference and updated forwards all replay).
      advantages: float advantages, [N] (one per trajectory, `grpo.compute_advantages`) or
        [N, P'] (one per target token, in `target_positions` order, P' >= every row's target
        count; `advantages.spread_over_replies`); see `make_batch`. The [N] form runs the
        program `compile_ahead` compiles; the [N, P] form compiles its own, once per shape.
      mini_batches: optimizer steps in the epoch, 1 <= mini_batches <= N.
      keep: [N] bool, False for trajectories dropped from the loss (`train.drop_from_loss`), or
        None to train on all.
    Returns:
      The mean over mini-batches of each `grpo_update` metric as `train/<name>` (loss, pg_loss,
      clip_frac, ratio_mean, kl with a reference, grad_norm), and `train/sampler_logp_gap`: the
      largest |old - sampler| log-prob over the generated tokens the trainer scores finite
      (dropped trajectories included),
      float32 (the trainer / sampler mismatch, 0 in exact arithmetic). With top-k or top-p also
      `train/sampler_set_misses`: generated tokens whose old log-prob is -inf (the trainer's kept
      set, rounded differently at its edge, leaves out a token the sampler drew; 0 in exact
      arithmetic; `grpo.grpo_loss` gives them ratio 1 and no gradient). `train/padded_len` and
      `train/padded_targets`: the batch's padded token and target lengths (`make_batch`'s
      buckets), the shape the step's programs are compiled for.
    Raises:
      ValueError: mini_batches outside [1, N]; advantages not of shape [N] or [N, P'] (or P'
        short of a row's target count, or a non-finite per-target value: `make_batch`); keep
        not of shape [N].
    """
    n = len(trajectories)
    _check_epoch_args(n, advantages, mini_batches, keep)
    self.release_rollout_copy()
    batch = make_batch(
      trajectories,
      advantages,
      len_buckets=self.len_buckets,
      target_buckets=self.target_buckets,
    )
    splits = np.array_split(np.arange(n), mini_batches)
    generated = [batch.target_mask[idx] > 0 for idx in splits]  # dropped trajectories included
    if keep is not None:
      batch.target_mask = batch.target_mask * np.asarray(keep, np.float32)[:, None]
    minis = [batch.rows(idx) for idx in splits]
    old = [self.logprobs(mb) for mb in minis]  # all before the first update
    ref = [self.logprobs(mb, self.ref_params) for mb in minis]
    metrics = self._mean_update_metrics(minis, old, ref)
    metrics.update(self._sampler_mismatch_metrics(minis, old, generated))
    # The padded shape the step ran at (`make_batch`'s buckets): a new one compiles the step.
    metrics["train/padded_len"] = batch.tokens.shape[1]
    metrics["train/padded_targets"] = batch.target_pos.shape[1]
    return metrics

  def _mean_update_metrics(
    self, minis: Sequence[Batch], old: Sequence[jax.Array], ref: Sequence[jax.Array | None]
  ) -> dict[str, float]:
    """One `grpo_update` per mini-batch, in order; each metric's mean as `train/<name>`.

    Args:
      minis: the epoch's mini-batches. old, ref: their [N_i, P] float32 old and reference
        log-probs (`logprobs`; ref entries may be None).
    """
    out: dict[str, list[float]] = {}
    for mb, o, r in zip(minis, old, ref):
      for k, v in self.grpo_update(mb, o, r).items():
        out.setdefault(f"train/{k}", []).append(v)
    return {k: float(np.mean(v)) for k, v in out.items()}

  def _sampler_mismatch_metrics(
    self, minis: Sequence[Batch], old: Sequence[jax.Array], generated: Sequence[np.ndarray]
  ) -> dict[str, float]:
    """`train/sampler_logp_gap` and, with top-k or top-p, `train/sampler_set_misses` (see
    `grpo_epoch`): the trainer's old log-probs against the sampler's.

    Args:
      minis: the epoch's mini-batches (their sampler_logp [N_i, P] float32). old: their [N_i, P]
        float32 old log-probs. generated: [N_i, P] bool, the generated targets of each
        (dropped trajectories included).
    """
    metrics = {}
    # On the host, in numpy: eager jnp ops here compiled a program per new batch shape.
    old_np = [distributed.fetch(o) for o in old]
    misses = [gen & (o == -np.inf) for gen, o in zip(generated, old_np)]
    with np.errstate(invalid="ignore"):  # -inf - -inf where a token is outside the sampled set
      metrics["train/sampler_logp_gap"] = max(
        float(np.max(np.where(gen & ~miss, np.abs(o - mb.sampler_logp), 0.0), initial=0.0))
        for mb, o, gen, miss in zip(minis, old_np, generated, misses)
      )
    if self.sampling.truncates:
      metrics["train/sampler_set_misses"] = int(sum(m.sum() for m in misses))
    return metrics

  def _sft_step_fn(self, params, opt_state, arrays):
    k, mask = self.micro_batches, arrays["target_mask"]
    den = jnp.maximum(jnp.sum(mask), 1.0)

    def loss_fn(p, mb):
      logp = token_logprobs(
        self._merge(p),
        mb["tokens"],
        mb["target_pos"],
        1.0,
        routing_ntlk=mb.get("routing"),
      )
      return -jnp.sum(logp * mb["target_mask"]) / den, {}

    micro = jax.tree.map(lambda x: split_micro_batches(x, k), arrays)
    loss, _, grads = accumulate_gradients(loss_fn, params, micro, k)
    updates, opt_state = self.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def sft_update(self, batch: Batch) -> float:
    """One supervised step (token-mean cross-entropy on the sampled-token positions) with this
    trainer's optimizer. Returns the loss before the step.

    Rows are padded as in `grpo_update`.
    Raises:
      ValueError: a routing record that does not fit the model.
    """
    self._check_batch(batch)
    (batch,) = self._padded(batch)
    arrays = {k: getattr(batch, k) for k in ("tokens", "target_pos", "target_mask")}
    arrays = self._rows({**arrays, **_routing_kwarg(vars(batch))})
    with self._ctx():
      self.params, self.opt_state, loss = self._sft_step(self.params, self.opt_state, arrays)
    return float(loss)
