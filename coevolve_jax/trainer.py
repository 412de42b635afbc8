"""Policy updates: batches from trajectories, token log-probs, the jitted GRPO and SFT steps.

Full-vocabulary logits are computed only at the positions of sampled tokens, in chunks under
`jax.checkpoint`, so memory is O(chunk * V) instead of O(T * V).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from coevolve_jax import grpo
from coevolve_jax.models.qwen import Qwen
from coevolve_jax.trajectory import Trajectory


def _bucket(n: int, minimum: int, step: int = 512) -> int:
  """Powers of two up to `step`, then multiples of `step`: few shapes, little padding."""
  if n > step:
    return -(-n // step) * step
  return max(minimum, 1 << max(0, (n - 1).bit_length()))


@dataclasses.dataclass
class Batch:
  """Padded training arrays (numpy) for N rows.

  tokens [N, T] int32 (right-padded with 0); target_pos [N, P] int32 index of each sampled token
  (>= 1; padded with 1); target_mask [N, P] float32; sampler_logp [N, P]; advantages [N] float32.
  """

  tokens: np.ndarray
  target_pos: np.ndarray
  target_mask: np.ndarray
  sampler_logp: np.ndarray
  advantages: np.ndarray

  def rows(self, idx: np.ndarray) -> "Batch":
    return Batch(*(getattr(self, f.name)[idx] for f in dataclasses.fields(self)))

  def arrays(self) -> dict[str, jax.Array]:
    return {f.name: jnp.asarray(getattr(self, f.name)) for f in dataclasses.fields(self)}


def make_batch(trajs: Sequence[Trajectory], advantages: np.ndarray | None = None,
               min_len: int = 128, min_targets: int = 32) -> Batch:
  """Pads trajectories into bucketed shapes (powers of two) so the step compiles rarely."""
  n = len(trajs)
  t = _bucket(max(len(tr.token_ids) for tr in trajs), min_len)
  pos_lists = [[i for i, m in enumerate(tr.loss_mask) if m and i > 0] for tr in trajs]
  p = _bucket(max(1, max(len(x) for x in pos_lists)), min_targets)
  tokens = np.zeros((n, t), np.int32)
  target_pos = np.ones((n, p), np.int32)
  target_mask = np.zeros((n, p), np.float32)
  sampler_logp = np.zeros((n, p), np.float32)
  for r, (tr, pos) in enumerate(zip(trajs, pos_lists)):
    tokens[r, :len(tr.token_ids)] = tr.token_ids
    target_pos[r, :len(pos)] = pos
    target_mask[r, :len(pos)] = 1.0
    sampler_logp[r, :len(pos)] = [tr.logprobs[i] for i in pos]
  adv = np.zeros((n,), np.float32) if advantages is None else np.asarray(advantages, np.float32)
  return Batch(tokens, target_pos, target_mask, sampler_logp, adv)


def token_logprobs(model: Qwen, tokens_nt: jax.Array, target_pos_np: jax.Array,
                   temperature: float = 1.0, chunk: int = 32) -> jax.Array:
  """log pi(token[pos] | tokens[:pos]) at the target positions, under logits / temperature.

  Args:
    tokens_nt: [N, T] int32 right-padded sequences starting at position 0.
    target_pos_np: [N, P] int32 positions (>= 1) of the tokens to score.
  Returns:
    [N, P] float32 log-probs.
  """
  hidden = model.hidden_states(tokens_nt, jnp.broadcast_to(jnp.arange(tokens_nt.shape[1]),
                                                           tokens_nt.shape))
  h_sel = jnp.take_along_axis(hidden, (target_pos_np - 1)[..., None], axis=1)  # [N, P, D]
  targets = jnp.take_along_axis(tokens_nt, target_pos_np, axis=1)  # [N, P]
  n, p, d = h_sel.shape
  c = min(chunk, p)
  pad = -p % c  # P need not be a multiple of the chunk: pad, score, then drop the padding
  if pad:
    h_sel = jnp.pad(h_sel, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  h_chunks = h_sel.reshape(n, (p + pad) // c, c, d).swapaxes(0, 1)
  y_chunks = targets.reshape(n, (p + pad) // c, c).swapaxes(0, 1)

  @jax.checkpoint
  def one(args):
    h, y = args
    logp = jax.nn.log_softmax(model.logits(h) / temperature, axis=-1)
    return jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]

  out = jax.lax.map(one, (h_chunks, y_chunks))  # [P/c, N, c]
  return out.swapaxes(0, 1).reshape(n, p + pad)[:, :p]


def make_optimizer(lr: float | optax.Schedule, weight_decay: float,
                   grad_clip: float) -> optax.GradientTransformation:
  """AdamW after global-norm gradient clipping (SPEC 1.1: constant lr; a schedule is accepted)."""
  return optax.chain(optax.clip_by_global_norm(grad_clip),
                     optax.adamw(lr, weight_decay=weight_decay))


class PolicyTrainer:
  """Holds the policy's parameters and optimizer state and runs jitted updates.

  Params and optimizer state are plain pytrees (nnx.State / optax state) so they checkpoint and
  shard like any pytree. `model()` returns an nnx model view for the rollout engine.
  """

  def __init__(self, model: Qwen, tx: optax.GradientTransformation, cfg: grpo.GRPOConfig,
               temperature: float):
    self.graphdef, self.params = nnx.split(model)
    self.tx, self.cfg, self.temperature = tx, cfg, temperature
    self.opt_state = tx.init(self.params)
    self.ref_params = None
    self._logp = jax.jit(self._logp_fn)
    self._grpo_step = jax.jit(self._grpo_step_fn, donate_argnums=(0, 1))
    self._sft_step = jax.jit(self._sft_step_fn, donate_argnums=(0, 1))

  def model(self) -> Qwen:
    return nnx.merge(self.graphdef, self.params)

  def freeze_reference(self) -> None:
    """The KL reference policy = a copy of the current parameters."""
    self.ref_params = jax.tree.map(jnp.copy, self.params)

  def _logp_fn(self, params, tokens, target_pos):
    return token_logprobs(nnx.merge(self.graphdef, params), tokens, target_pos, self.temperature)

  def logprobs(self, batch: Batch, params=None) -> jax.Array:
    """[N, P] log-probs of the batch's sampled tokens under `params` (default: current)."""
    params = self.params if params is None else params
    return self._logp(params, jnp.asarray(batch.tokens), jnp.asarray(batch.target_pos))

  def _grpo_step_fn(self, params, opt_state, arrays, old_logp, ref_logp):
    def loss_fn(p):
      logp = self._logp_fn(p, arrays["tokens"], arrays["target_pos"])
      return grpo.grpo_loss(logp, old_logp, ref_logp, arrays["advantages"],
                            arrays["target_mask"], self.cfg)
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = self.tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics.update(loss=loss, grad_norm=optax.tree.norm(grads))
    return params, opt_state, metrics

  def grpo_update(self, batch: Batch, old_logp: jax.Array,
                  ref_logp: jax.Array | None) -> dict[str, float]:
    """One optimizer step on a mini-batch. Returns scalar metrics."""
    self.params, self.opt_state, metrics = self._grpo_step(
        self.params, self.opt_state, batch.arrays(), old_logp, ref_logp)
    return {k: float(v) for k, v in metrics.items()}

  def _sft_step_fn(self, params, opt_state, arrays):
    def loss_fn(p):
      graph = nnx.merge(self.graphdef, p)
      logp = token_logprobs(graph, arrays["tokens"], arrays["target_pos"], 1.0)
      mask = arrays["target_mask"]
      return -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = self.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def sft_update(self, batch: Batch) -> float:
    """One supervised (cross-entropy on sampled-token positions) step with this trainer's
    optimizer."""
    self.params, self.opt_state, loss = self._sft_step(self.params, self.opt_state, batch.arrays())
    return float(loss)
