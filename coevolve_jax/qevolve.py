"""Q-Evolve's critic: weighted Implicit Q-Learning on the policy's hidden states, and the
step-wise process rewards (GAE) it gives the policy update.

Q-Evolve (Zhang et al., arXiv 2606.07367, ICML 2026; no public code) learns, from a hybrid
off-policy dataset of expert demonstrations and the agent's own trajectories, a critic by
weighted IQL, turns its value function into per-step advantages, and updates the policy on them
by a behaviour-proximal objective. This module holds its parts as pure functions (each tested
against a numpy reference) and the critic the loop trains between GRPO steps.

Transitions. A trajectory with T model replies (`Trajectory.replies`) is T transitions: the
state s_t is the context before reply t, read as the policy's final-norm hidden state at the
last context token (position `reply.start - 1`, the one that predicts the reply's first token);
the action a_t is the reply, and (s_t, a_t) is read at the reply's last token
(`reply.end - 1`). s_{t+1} is the context before the next reply (the reply, the environment's
observation, the next turn's header); the last reply ends the episode (done). The environment
reward is the outcome at the last reply and 0 before (BFCL and AppWorld score the episode).

Critic (IQL, Kostrikov et al. 2022, with the paper's weights):
  L_V = mean_t w_t L2^tau(Q_target(s_t, a_t) - V(s_t)),   L2^tau(u) = |tau - 1(u < 0)| u^2
  L_Q = mean_t w_t (r_t + c_t + gamma (1 - done_t) V(s_{t+1}) - Q(s_t, a_t))^2
  Q_target <- (1 - polyak) Q_target + polyak Q after every critic step
  w_t = 0.5 (t / T + d) + 0.5       (t = 1..T the reply's step, d = 1 for a successful episode)
where c_t are the retrospective penalties that train the critic only (`penalties`: a reply that
failed to parse -0.3, a call the environment rejected -0.2, an observation equal to the
previous one -0.1). V(s_{t+1}) is held fixed in L_Q and Q_target in L_V. With `v_target =
"return"` (not the paper's) V is regressed on the discounted return instead,
  L_V = mean_t w_t L2^tau(G_t - V(s_t)),   G_t = r_t + c_t + gamma (1 - done_t) G_{t+1},
so an early state learns its outcome without waiting for the Q / V chain to carry it back.

Process rewards: GAE (Schulman et al. 2016) on the environment reward only,
  delta_t = r_t + gamma (1 - done_t) V(s_{t+1}) - V(s_t),  A_t = sum_k (gamma lambda)^k delta_{t+k}
within each episode (`gae`). Outcome-only GRPO gives every reply of an episode the same
advantage; A_t differs between a reply that moved V up and one that moved it down.

Policy objective (`behaviour_proximal_loss`): "clip_kl", a clipped ratio to the behaviour
policy with a looser lower than upper clip plus a KL term to the reference (Q-Evolve's); "bppo",
BPPO (Zhuang et al., ICLR 2023): an asymmetric advantage weight |omega - 1(A < 0)| A and a clip
that decays by clip_decay per iteration, no KL term.

Not from the paper (it does not state them): tau 0.7, gamma 0.99, lambda 0.95, the Polyak rate,
the clip values, the KL weight, omega, the critic's architecture (a two-layer MLP head per value,
on the policy's hidden states) and its optimiser. docs/design.md §8.3.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from flax import nnx

from coevolve_jax import distributed, errors, grpo
from coevolve_jax.models import QwenConfig, builder, sharding
from coevolve_jax.trainer import bucket_size
from coevolve_jax.types import Reply, Trajectory

MODES = ("critic", "iterate")
SCALES = ("none", "group_std")  # of the critic's advantages (`combine`)
PLACEMENTS = ("instead", "between")  # mode "iterate": of CoEvolve's GRPO update, or after it
CRITICS = ("head", "model")
V_TARGETS = ("iql", "return")  # what L_V regresses V on (`iql_losses`)
ORDERS = ("advantages_first", "fit_first")  # of a step's advantages and critic fit (`Critic.step`)
BP_VARIANTS = ("clip_kl", "bppo")
ORIGINS = ("agent", "expert")


@dataclasses.dataclass(frozen=True)
class QEvolveConfig:
  """`qevolve.*` (module docstring; the defaults marked * are not from the paper).

  Attributes:
    mode: "critic" (the critic's GAE advantages feed the GRPO step) | "iterate" (each GRPO step
      is a Q-Evolve iteration: the same advantages, on the step's rollouts and `experts`
      demonstrations, by the behaviour-proximal objective, `epochs` passes).
    critic: "head" (MLPs on the policy's hidden states) | "model" (the same heads on a network
      of its own, `model_layers` decoder layers of width `model_width`, trained end to end by the
      critic's losses: `ModelCritic`).
    hidden: the heads' hidden width*.
    model_layers, model_width: the "model" critic's network* (the policy's architecture and
      vocabulary; heads of 64 or `model_width` if smaller). model_batch: episodes per "model"
      critic step*.
    tau: the expectile of L_V* (0.5 is a mean; IQL's 0.7). gamma*, lam*: GAE's.
    v_target: "iql" (the paper's: V an expectile of the target Q, Q from r + gamma V(s')) |
      "return" (V an expectile of the discounted return that follows the state, the episode's
      own outcome: no chain of bootstraps between the outcome and an early state; not the
      paper's, docs/design.md section 8.3).
    polyak: the Q target's rate per critic step*.
    lr: the critic's AdamW learning rate*. updates: critic gradient steps per GRPO step*.
    batch: transitions per critic step*.
    capacity: trajectories the replay buffer keeps (the newest). replay: buffer trajectories
      whose features are read again (under the current policy) for each step's critic fit, on
      top of the step's own.
    group_weight, critic_weight: a reply's advantage is group_weight x the episode's group
      advantage (GRPO, CoEvolve Eq. 1) + critic_weight x its (normalised) GAE advantage.
    normalize: GAE advantages whitened over the step's kept replies.
    order: "advantages_first" (PPO's: a step's advantages under the critic as it stands, then its
      fit on the step's episodes) | "fit_first" (the paper's, Alg. 1: the fit, then the
      advantages under the fitted critic); `Critic.step`.
    scale: "none" | "group_std": each reply's GAE advantage also divided by the standard
      deviation of its task group's outcome rewards (+ 1e-6; GRPO's scale_by_std, applied before
      `normalize`): a task whose group rarely succeeds gets its successes' credit raised as GRPO
      raises it*.
    penalty_format, penalty_invalid, penalty_unchanged: the critic-only retrospective
      penalties (the paper's -0.3, -0.2, -0.1). invalid_pattern: a regex an observation that
      answers a rejected call matches (case-insensitive, at its start).
    experts: expert episodes (the warm-start's demonstrations in the buffer) trained on beside
      each iteration's rollouts ("iterate"). epochs: policy passes per iteration ("iterate";
      each pass's ratio is to the policy at its start).
    placement: "instead" (each GRPO step is one Q-Evolve iteration) | "between" (CoEvolve's
      GRPO update as without Q-Evolve, then `iterations` Q-Evolve iterations on the step's
      rollouts and `experts` demonstrations, each rescored under the policy as it stands).
    variant, clip_low, clip_high, kl_beta, omega, clip_decay: `objective`'s*.
  Raises (on construction):
    ValueError: an unknown mode / critic / variant, or a value out of range.
  """

  mode: str = "critic"
  critic: str = "head"
  hidden: int = 256
  model_layers: int = 2
  model_width: int = 256
  model_batch: int = 16
  tau: float = 0.7
  v_target: str = "iql"
  order: str = "advantages_first"
  gamma: float = 0.99
  lam: float = 0.95
  polyak: float = 0.05
  lr: float = 1e-3
  updates: int = 32
  batch: int = 256
  capacity: int = 512
  replay: int = 16
  group_weight: float = 0.0
  critic_weight: float = 1.0
  normalize: bool = True
  scale: str = "none"
  penalty_format: float = -0.3
  penalty_invalid: float = -0.2
  penalty_unchanged: float = -0.1
  invalid_pattern: str = r"\s*\{?\s*\"?(error|invalid)"
  experts: int = 4
  epochs: int = 1
  placement: str = "instead"
  iterations: int = 2
  variant: str = "clip_kl"
  clip_low: float = 0.3
  clip_high: float = 0.2
  kl_beta: float = 0.01
  omega: float = 0.9
  clip_decay: float = 0.96

  def __post_init__(self):
    for name, value, known in (
      ("mode", self.mode, MODES),
      ("placement", self.placement, PLACEMENTS),
      ("scale", self.scale, SCALES),
      ("critic", self.critic, CRITICS),
      ("variant", self.variant, BP_VARIANTS),
      ("v_target", self.v_target, V_TARGETS),
      ("order", self.order, ORDERS),
    ):
      if value not in known:
        raise ValueError(f"qevolve.{name} must be one of {known}, got {value!r}")
    if not 0.0 < self.tau < 1.0:
      raise ValueError(f"qevolve.tau must be in (0, 1), got {self.tau}")
    for name in ("gamma", "lam", "polyak", "omega", "clip_decay"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(f"qevolve.{name} must be in [0, 1], got {getattr(self, name)}")
    for name in ("hidden", "updates", "batch", "capacity", "epochs", "model_layers", "iterations"):
      if getattr(self, name) < 1:
        raise ValueError(f"qevolve.{name} must be >= 1, got {getattr(self, name)}")
    if (
      self.replay < 0 or self.experts < 0 or self.lr <= 0 or self.clip_low < 0 or self.clip_high < 0
    ):
      raise ValueError("qevolve.replay, clip_low and clip_high must be >= 0 and lr > 0")
    if self.placement == "between" and self.mode != "iterate":
      raise ValueError(
        "qevolve.placement 'between' needs qevolve.mode 'iterate' (it places those iterations)"
      )
    if self.model_batch < 1 or self.model_width < 1 or self.model_width % min(64, self.model_width):
      raise ValueError(
        "qevolve.model_batch must be >= 1 and model_width below 64 or a multiple of 64, got "
        f"{self.model_batch} and {self.model_width}"
      )
    try:
      re.compile(self.invalid_pattern)
    except re.error as e:
      raise ValueError(f"qevolve.invalid_pattern is not a regex: {e}") from None

  @classmethod
  def from_config(cls, group: Mapping[str, Any]) -> "QEvolveConfig":
    """From the `qevolve` config group (a ConfigDict or its JSON dict); `enabled` is the loop's.

    Raises:
      ValueError: a setting out of range or unknown; TypeError: one of the wrong type.
    """
    kwargs = {}
    for f in dataclasses.fields(cls):
      kind: Any = type(f.default)
      value = group[f.name] if f.name in group else f.default  # runs made before a field
      if kind is bool and not isinstance(value, bool):
        raise TypeError(f"qevolve.{f.name} must be a bool, got {value!r}")
      kwargs[f.name] = kind(value)
    return cls(**kwargs)


# ---------------------------------------------------------------------------- pure functions


def step_weights(num_steps: int, success: bool) -> np.ndarray:
  """Q-Evolve's transition weights w_t = 0.5 (t / T + d) + 0.5 for t = 1..T (d = 1 for a
  successful episode): later steps and successful episodes weigh more, in (0.5, 1.5].

  Returns:
    [T] float32. Raises: ValueError for num_steps < 0.
  """
  if num_steps < 0:
    raise ValueError(f"num_steps must be >= 0, got {num_steps}")
  t = np.arange(1, num_steps + 1, dtype=np.float64)
  return (0.5 * (t / max(num_steps, 1) + float(bool(success))) + 0.5).astype(np.float32)


def expectile_loss(u: jax.Array, tau: float) -> jax.Array:
  """L2^tau(u) = |tau - 1(u < 0)| u^2, elementwise (IQL, Kostrikov et al. 2022, Eq. 5).

  Args: u: any shape, float. tau: in (0, 1). Returns: u's shape.
  """
  return jnp.abs(tau - (u < 0).astype(u.dtype)) * u * u


def iql_losses(
  v_s: jax.Array,
  q_sa: jax.Array,
  q_target_sa: jax.Array,
  v_next: jax.Array,
  rewards: jax.Array,
  dones: jax.Array,
  weights: jax.Array,
  tau: float,
  gamma: float,
  returns: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Q-Evolve's weighted IQL losses over B transitions (module docstring).

  Args:
    v_s, q_sa, q_target_sa, v_next: [B] float32 V(s_t), Q(s_t, a_t), the target Q, V(s_{t+1})
      (ignored where done). rewards: [B] the critic's reward (environment reward plus the
      retrospective penalties). dones: [B] 1.0 where the episode ends. weights: [B] w_t.
    returns: [B] the discounted return from each state (`discounted_returns`), or None: with
      it, L_V = mean_t w_t L2^tau(G_t - V(s_t)) (`v_target = "return"`) instead of the target
      Q's; L_Q is the same.
  Returns:
    (L_V, L_Q) scalars: weighted means over B; no gradient flows through q_target_sa into L_V
    or through v_next into L_Q.
  """
  q_t = jax.lax.stop_gradient(q_target_sa if returns is None else returns)
  v_loss = jnp.mean(weights * expectile_loss(q_t - v_s, tau))
  backup = rewards + gamma * (1.0 - dones) * jax.lax.stop_gradient(v_next)
  q_loss = jnp.mean(weights * (backup - q_sa) ** 2)
  return v_loss, q_loss


def discounted_returns(rewards: np.ndarray, dones: np.ndarray, gamma: float) -> np.ndarray:
  """G_t = r_t + gamma (1 - done_t) G_{t+1} along the last axis (G = 0 past it): the return from
  each state of each episode, episodes laid end to end or one per row (zero-padded after its
  last step, done there).

  Args: rewards, dones: [..., S] float (dones 1.0 at an episode's last step). Returns: [..., S]
  float32.
  """
  rewards, dones = np.asarray(rewards, np.float32), np.asarray(dones, np.float32)
  out = np.zeros_like(rewards)
  ahead: np.ndarray = np.zeros(rewards.shape[:-1], np.float32)
  for t in range(rewards.shape[-1] - 1, -1, -1):
    ahead = rewards[..., t] + gamma * (1.0 - dones[..., t]) * ahead
    out[..., t] = ahead
  return out


def gae(
  rewards: np.ndarray,
  values: np.ndarray,
  next_values: np.ndarray,
  dones: np.ndarray,
  gamma: float,
  lam: float,
) -> np.ndarray:
  """Generalised advantage estimates (Schulman et al. 2016, Eq. 16) over transitions laid out
  episode after episode, in step order; `dones[i]` ends transition i's episode (its next value
  is not used and the sum does not run into the next episode).

  Args:
    rewards, values, next_values: [M] float (r_t, V(s_t), V(s_{t+1})). dones: [M] bool.
  Returns:
    [M] float32 A_t = sum_k (gamma lam)^k delta_{t+k}, delta_t = r_t + gamma (1 - done_t)
    V(s_{t+1}) - V(s_t).
  Raises:
    ValueError: arrays of different shapes, or a last transition that does not end its episode.
  """
  r, v, nv = (np.asarray(x, np.float64) for x in (rewards, values, next_values))
  d = np.asarray(dones, bool)
  if not r.shape == v.shape == nv.shape == d.shape or r.ndim != 1:
    raise ValueError(f"rewards, values, next values and dones of shapes {r.shape}, {v.shape}, ...")
  if r.size and not d[-1]:
    raise ValueError("the last transition must end its episode (dones[-1] False)")
  delta = r + gamma * np.where(d, 0.0, nv) - v
  out = np.zeros_like(r)
  running = 0.0
  for i in range(r.size - 1, -1, -1):
    running = delta[i] + (0.0 if d[i] else gamma * lam * running)
    out[i] = running
  return out.astype(np.float32)


def objective(cfg: QEvolveConfig, iteration: int = 0) -> grpo.GRPOConfig:
  """The behaviour-proximal objective of `cfg.variant` as the GRPO objective's settings (the
  trainer's one clipped-surrogate code path, `grpo.grpo_loss`, with no dual clip, token-mean):

  "clip_kl" (Q-Evolve): -min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A) + kl_beta k3,
    rho = exp(logp - behaviour logp), k3 = exp(ref - logp) - (ref - logp) - 1 (Schulman 2020);
  "bppo" (Zhuang et al. 2023): the same surrogate with one clip eps_k = clip_high x
    clip_decay^iteration on both sides and no KL term (the advantages are weighted by
    `weighted_advantages`).
  """
  if cfg.variant == "bppo":
    low = high = cfg.clip_high * cfg.clip_decay**iteration
    beta = 0.0
  else:
    low, high, beta = cfg.clip_low, cfg.clip_high, cfg.kl_beta
  return grpo.GRPOConfig(
    clip_eps_low=low,
    clip_eps_high=high,
    dual_clip_c=0.0,
    kl_beta=beta,
    kl_estimator="k3",
    loss_agg="token-mean",
  )


def weighted_advantages(advantages, cfg: QEvolveConfig):
  """BPPO's asymmetric advantage weight |omega - 1(A < 0)| A for "bppo"; A itself for
  "clip_kl". Any shape; numpy or jax arrays alike."""
  if cfg.variant != "bppo":
    return advantages
  return abs(cfg.omega - (advantages < 0)) * advantages


def behaviour_proximal_loss(
  logp: jax.Array,
  behaviour_logp: jax.Array,
  ref_logp: jax.Array,
  advantages: jax.Array,
  mask: jax.Array,
  cfg: QEvolveConfig,
  iteration: int = 0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The behaviour-proximal policy loss of `cfg.variant` (`objective`), token-mean over mask.

  Args:
    logp, behaviour_logp, ref_logp, advantages, mask: [N, P] float32 (log-probs in nats of the
      sampled tokens under the policy, the behaviour policy and the reference; per-token
      advantages; 1.0 on real targets). iteration: BPPO's clip-decay exponent.
  Returns:
    (loss scalar, `grpo.grpo_loss`'s metrics: pg_loss, clip_frac (tokens where the clipped term
    is the one taken), ratio_mean, and kl for "clip_kl").
  """
  return grpo.grpo_loss(
    logp,
    behaviour_logp,
    ref_logp,
    weighted_advantages(advantages, cfg),
    mask,
    objective(cfg, iteration),
  )


# ---------------------------------------------------------------------------- transitions


@dataclasses.dataclass(frozen=True)
class Episode:
  """One trajectory as the critic reads it (what the replay buffer keeps).

  Attributes:
    token_ids: the trajectory's token ids. state_pos / action_pos: [T] positions of s_t (the
      last token before reply t) and of (s_t, a_t) (reply t's last token). reward: the outcome.
    penalties: [T] the critic-only retrospective penalties c_t. origin: "agent" | "expert".
    task_id: the task's id.
  """

  token_ids: tuple[int, ...]
  state_pos: tuple[int, ...]
  action_pos: tuple[int, ...]
  reward: float
  penalties: tuple[float, ...]
  origin: str
  task_id: str

  @property
  def steps(self) -> int:
    return len(self.state_pos)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def trajectory(self, group_id: int) -> Trajectory:
    """A trajectory to train on: each step's reply [state_pos + 1, action_pos + 1) sampled (loss
    mask 1, one `Reply`), the rest context; log-probs 0 (the caller scores them)."""
    mask = [0] * len(self.token_ids)
    replies = []
    for s, a in zip(self.state_pos, self.action_pos):
      mask[s + 1 : a + 1] = [1] * (a - s)
      replies.append(Reply(s + 1, a + 1))
    return Trajectory(
      self.task_id,
      group_id,
      list(self.token_ids),
      mask,
      [0.0] * len(self.token_ids),
      reward=self.reward,
      finish="done",
      replies=replies,
    )

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Episode":
    return cls(
      tuple(int(t) for t in d["token_ids"]),
      tuple(int(i) for i in d["state_pos"]),
      tuple(int(i) for i in d["action_pos"]),
      float(d["reward"]),
      tuple(float(c) for c in d["penalties"]),
      str(d["origin"]),
      str(d["task_id"]),
    )


def penalties(traj: Trajectory, cfg: QEvolveConfig) -> list[float]:
  """The critic-only retrospective penalty of each reply (module docstring), summed where
  several apply: `penalty_format` for a reply whose tool calls failed to parse
  (`Reply.parse_error`), `penalty_invalid` for a reply with calls, not the episode's last,
  whose observation matches `invalid_pattern` (the environment rejected a call),
  `penalty_unchanged` for an observation equal to the previous non-empty one.

  Returns:
    [T] floats, T = len(traj.replies).
  """
  pattern = re.compile(cfg.invalid_pattern, re.IGNORECASE)
  out, previous = [], None
  for j, reply in enumerate(traj.replies):
    c = 0.0
    if reply.parse_error:
      c += cfg.penalty_format
    elif reply.calls and j < len(traj.replies) - 1 and pattern.match(reply.observation):
      c += cfg.penalty_invalid
    if reply.observation and reply.observation == previous:
      c += cfg.penalty_unchanged
    previous = reply.observation or previous
    out.append(c)
  return out


def sampled_spans(traj: Trajectory) -> list[tuple[int, int]]:
  """[start, end) of each maximal run of loss-mask-1 tokens: the replies of a trajectory that
  records none (a warm-start demonstration, `Suite.demonstration`)."""
  spans, start = [], None
  for i, m in enumerate([*traj.loss_mask, 0]):
    if m and start is None:
      start = i
    elif not m and start is not None:
      spans.append((start, i))
      start = None
  return spans


def episode(traj: Trajectory, cfg: QEvolveConfig, origin: str = "agent") -> Episode | None:
  """The critic's view of a trajectory: its replies (`Trajectory.replies`, or the runs of
  sampled tokens where it records none, without penalties), or None when it has no sampled
  token after position 0 (nothing was decided: an episode whose environment failed to start).

  Raises:
    ValueError: an unknown origin.
  """
  if origin not in ORIGINS:
    raise ValueError(f"origin must be one of {ORIGINS}, got {origin!r}")
  if traj.replies:
    spans = [(r.start, r.end) for r in traj.replies]
    pen = penalties(traj, cfg)
  else:
    spans = sampled_spans(traj)
    pen = [0.0] * len(spans)
  kept = [(span, c) for span, c in zip(spans, pen) if span[0] >= 1 and span[1] > span[0]]
  if not kept:
    return None
  return Episode(
    tuple(traj.token_ids),
    tuple(start - 1 for (start, _), _ in kept),
    tuple(end - 1 for (_, end), _ in kept),
    float(traj.reward),
    tuple(c for _, c in kept),
    origin,
    traj.task_id,
  )


class ReplayBuffer:
  """The newest `capacity` episodes (agent and expert), oldest dropped first.

  `state_dict` / `load_state_dict` give it as JSON; `sample` draws without replacement.
  """

  def __init__(self, capacity: int):
    self.capacity = capacity
    self.episodes: deque[Episode] = deque(maxlen=capacity)

  def __len__(self) -> int:
    return len(self.episodes)

  def extend(self, episodes: Sequence[Episode]) -> None:
    self.episodes.extend(episodes)

  def sample(
    self, k: int, rng: np.random.Generator, where: Callable[[Episode], bool] | None = None
  ) -> list[Episode]:
    """min(k, available) episodes (those `where` accepts, if given) drawn uniformly without
    replacement, in buffer order."""
    pool = [e for e in self.episodes if where is None or where(e)]
    k = min(k, len(pool))
    if k == 0:
      return []
    return [pool[i] for i in sorted(rng.choice(len(pool), k, replace=False))]

  def state_dict(self) -> list[dict[str, Any]]:
    return [e.to_dict() for e in self.episodes]

  def load_state_dict(self, state: Sequence[Mapping[str, Any]]) -> None:
    self.episodes = deque((Episode.from_dict(e) for e in state), maxlen=self.capacity)


# ---------------------------------------------------------------------------- the critic


def init_head(key: jax.Array, d: int, hidden: int) -> dict[str, jax.Array]:
  """A value head's parameters: w1 [D, H], b1 [H], w2 [H], b2 [] (float32; fan-in scaled normal
  w1, zero w2 so a fresh head predicts 0)."""
  return {
    "w1": jax.random.normal(key, (d, hidden), jnp.float32) / math.sqrt(d),
    "b1": jnp.zeros((hidden,), jnp.float32),
    "w2": jnp.zeros((hidden,), jnp.float32),
    "b2": jnp.zeros((), jnp.float32),
  }


# Logical axes of a head's parameters (`models.sharding.LOGICAL_RULES`): the input dimension is
# the model's embedding, split as the policy's is; the hidden one as an MLP's.
HEAD_AXES = {"w1": ("embed", "mlp"), "b1": ("mlp",), "w2": ("mlp",), "b2": ()}


def head_apply(head: Mapping[str, jax.Array], x: jax.Array) -> jax.Array:
  """[..., D] float32 features -> [...] values: w2 . gelu(x w1 + b1) + b2."""
  return jax.nn.gelu(x @ head["w1"] + head["b1"]) @ head["w2"] + head["b2"]


def critic_step(state: dict[str, Any], batch: Mapping[str, jax.Array], tx, cfg: QEvolveConfig):
  """One critic update on a batch of transitions: L_V + L_Q (`iql_losses`) by AdamW, then the
  Polyak step of the Q target. state: {"v", "q", "q_target", "opt"}; batch: s, sa, s_next [B, D]
  float32 features and reward, done, weight, return [B]. Returns (state, {"v_loss", "q_loss"})."""

  def loss_fn(heads):
    v = head_apply(heads["v"], batch["s"])
    q = head_apply(heads["q"], batch["sa"])
    v_next = head_apply(heads["v"], batch["s_next"])
    q_t = head_apply(state["q_target"], batch["sa"])
    v_loss, q_loss = iql_losses(
      v,
      q,
      q_t,
      v_next,
      batch["reward"],
      batch["done"],
      batch["weight"],
      cfg.tau,
      cfg.gamma,
      batch["return"] if cfg.v_target == "return" else None,
    )
    return v_loss + q_loss, (v_loss, q_loss)

  heads = {"v": state["v"], "q": state["q"]}
  (_, (v_loss, q_loss)), grads = jax.value_and_grad(loss_fn, has_aux=True)(heads)
  updates, opt = tx.update(grads, state["opt"], heads)
  heads = optax.apply_updates(heads, updates)
  target = optax.incremental_update(heads["q"], state["q_target"], cfg.polyak)
  return {**heads, "q_target": target, "opt": opt}, {"v_loss": v_loss, "q_loss": q_loss}


class Critic:
  """Q-Evolve's critic on a policy's hidden states: V and Q heads, a Polyak Q target, AdamW,
  a replay buffer; `fit` trains it on a step's episodes and `reply_advantages` gives the
  process rewards.

  Features come from `trainer.hidden_states_at` (the current policy, no gradient into it), so a
  fit leaves them as they were (`OWN_FEATURES`). With
  the trainer's mesh, the heads are placed by `HEAD_AXES` under the policy's logical-axis rules
  and the features replicated.
  """

  OWN_FEATURES = False  # whether `fit` changes what `features` reads (a network of its own)

  def __init__(self, cfg: QEvolveConfig, trainer, seed: int):
    self.cfg, self.trainer = cfg, trainer
    d = trainer.model_config.hidden_size
    kv, kq = jax.random.split(jax.random.key(seed))
    self.tx = optax.adamw(cfg.lr, weight_decay=0.0)
    v, q = init_head(kv, d, cfg.hidden), init_head(kq, d, cfg.hidden)
    heads = {"v": v, "q": q}
    state = {"v": v, "q": q, "q_target": jax.tree.map(jnp.copy, q), "opt": self.tx.init(heads)}
    self.shardings = self._shardings(state)
    self.state = state if self.shardings is None else jax.device_put(state, self.shardings)
    self.buffer = ReplayBuffer(cfg.capacity)
    self.rng = np.random.default_rng([seed, 0x71657630])
    placed: dict[str, Any] = {}
    if self.shardings is not None:
      placed["out_shardings"] = (self.shardings, None)
    self._step = jax.jit(
      lambda s, b: critic_step(s, b, self.tx, cfg), donate_argnums=(0,), **placed
    )
    self._values = jax.jit(head_apply)

  def _shardings(self, state):
    mesh = self.trainer.mesh
    if mesh is None:
      return None

    def place(path, x):
      name = getattr(path[-1], "key", None)
      axes = HEAD_AXES.get(name, ()) if x.ndim else ()
      spec = sharding.param_spec(dict(mesh.shape), axes if len(axes) == x.ndim else (), x.shape)
      return jax.sharding.NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(place, state)

  # -- features

  def features(self, episodes: Sequence[Episode]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per episode, (states [T, D], state-actions [T, D]) float32 hidden states of the current
    policy: one forward over the episodes, padded to the train step's length bucket (or a power
    of two up to 512, then multiples of 512) and the replies to a power of two, so that few
    shapes compile."""
    if not episodes:
      return []
    tokens, index, steps = self._pack(episodes)
    h = self._read(tokens, index)
    return [(h[i, : e.steps], h[i, steps : steps + e.steps]) for i, e in enumerate(episodes)]

  def _read(self, tokens: np.ndarray, index: np.ndarray) -> np.ndarray:
    """[N, P, D] float32 host features at `index` of `tokens` (the policy's hidden states)."""
    return self.trainer.hidden_states_at(tokens, index)

  def _pack(
    self, episodes: Sequence[Episode], like: Sequence[Episode] = ()
  ) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens [N, T] int32 right-padded, index [N, 2S] int32: each episode's state positions
    then, from S on, its state-action positions, S): T the train step's length bucket of the
    longest of `episodes` and `like` (or a power of two up to 512, then multiples of 512), S a
    power of two, so that few shapes compile."""
    every = [*episodes, *like]
    longest = max(len(e.token_ids) for e in every)
    buckets = self.trainer.len_buckets  # the train step's lengths: a bounded set of shapes
    t = next((b for b in buckets if b >= longest), None) if buckets else None
    t = t or bucket_size(longest, 128)
    steps = bucket_size(max(e.steps for e in every), 8)
    tokens = np.zeros((len(episodes), t), np.int32)
    index = np.zeros((len(episodes), 2 * steps), np.int32)
    for i, e in enumerate(episodes):
      tokens[i, : len(e.token_ids)] = e.token_ids
      index[i, : e.steps] = e.state_pos
      index[i, steps : steps + e.steps] = e.action_pos
    return tokens, index, steps

  def transitions(
    self, episodes: Sequence[Episode], feats: Sequence[tuple[np.ndarray, np.ndarray]]
  ) -> dict[str, np.ndarray]:
    """The flat transition arrays of episodes (s, sa, s_next [M, D]; reward, done, weight,
    return [M])."""
    s, sa, s_next, reward, done, weight = [], [], [], [], [], []
    for e, (fs, fsa) in zip(episodes, feats):
      T = e.steps
      s.append(fs)
      sa.append(fsa)
      s_next.append(np.concatenate([fs[1:], np.zeros_like(fs[:1])]))
      r = np.zeros(T, np.float32)
      r[-1] = e.reward
      reward.append(r + np.asarray(e.penalties, np.float32))
      d = np.zeros(T, np.float32)
      d[-1] = 1.0
      done.append(d)
      weight.append(step_weights(T, e.reward >= 1.0))
    cat = lambda xs: np.concatenate(xs).astype(np.float32)  # noqa: E731
    return {
      "s": cat(s),
      "sa": cat(sa),
      "s_next": cat(s_next),
      "reward": cat(reward),
      "done": cat(done),
      "weight": cat(weight),
      "return": discounted_returns(cat(reward), cat(done), self.cfg.gamma),
    }

  # -- training and process rewards

  def fit(
    self, episodes: Sequence[Episode], feats: Sequence[tuple[np.ndarray, np.ndarray]]
  ) -> dict[str, float]:
    """Trains `cfg.updates` critic steps on `episodes` (with their `features`) and on
    `cfg.replay` episodes drawn from the buffer (features read under the current policy), then
    adds `episodes` to the buffer.

    Returns:
      metrics: qevolve/v_loss, qevolve/q_loss (the last step's), qevolve/transitions (trained
      on), qevolve/buffer (episodes in the buffer after).
    """
    cfg = self.cfg
    replayed = self.buffer.sample(cfg.replay, self.rng)
    episodes = list(episodes) + replayed
    feats = list(feats) + self.features(replayed)
    self.buffer.extend(episodes[: len(episodes) - len(replayed)])
    metrics: dict[str, float] = {"qevolve/buffer": len(self.buffer), "qevolve/transitions": 0}
    if not episodes:
      return metrics
    data = self.transitions(episodes, feats)
    m = len(data["reward"])
    out: dict[str, Any] = {}
    for _ in range(cfg.updates):
      idx = self.rng.choice(m, cfg.batch, replace=m < cfg.batch)  # one batch shape
      # numpy in: every process passes the same host arrays, which jit takes as replicated
      self.state, out = self._step(self.state, {k: x[idx] for k, x in data.items()})
    metrics.update({f"qevolve/{k}": float(v) for k, v in out.items()})
    metrics["qevolve/transitions"] = m
    return metrics

  def step(
    self, episodes: Sequence[Episode], fresh: Sequence[int]
  ) -> tuple[list[np.ndarray], dict[str, float]]:
    """A GRPO step's critic work on its `episodes`: their reply advantages
    (`reply_advantages`) and a `fit` on those at the indices `fresh` (the step's own rollouts;
    the others, e.g. the buffer's demonstrations, are read but not added again), in
    `cfg.order`: "advantages_first" reads the advantages under the critic as it stands, then
    fits; "fit_first" fits, then reads them under the fitted critic (the features read again
    when the critic has a network of its own).

    Returns:
      (per episode, [T_i] float32 reply advantages; the metrics of both).
    """
    feats = self.features(episodes)
    chosen = ([episodes[j] for j in fresh], [feats[j] for j in fresh])
    if self.cfg.order == "fit_first":
      fitted = self.fit(*chosen)
      if self.OWN_FEATURES:
        feats = self.features(episodes)
      reply_adv, metrics = self.reply_advantages(episodes, feats)
      metrics.update(fitted)
    else:
      reply_adv, metrics = self.reply_advantages(episodes, feats)
      metrics.update(self.fit(*chosen))
    return reply_adv, metrics

  def values(self, feats: np.ndarray) -> np.ndarray:
    """V at [M, D] state features: [M] float32 (rows padded to a power of two for the call)."""
    feats = np.asarray(feats, np.float32)
    m = len(feats)
    padded = np.zeros((bucket_size(m, 8), feats.shape[-1]), np.float32)
    padded[:m] = feats
    return distributed.fetch(self._values(self.state["v"], padded))[:m]

  def reply_advantages(
    self, episodes: Sequence[Episode], feats: Sequence[tuple[np.ndarray, np.ndarray]]
  ) -> tuple[list[np.ndarray], dict[str, float]]:
    """Per episode, the GAE advantage of each reply on the environment reward (no penalties),
    and metrics: V at the start and end of episodes by outcome, the explained variance of
    returns, the spread of the advantages within episodes."""
    cfg = self.cfg
    out: list[np.ndarray] = []
    starts: dict[str, list[float]] = {}
    ends: dict[str, list[float]] = {}
    returns: list[float] = []
    preds: list[float] = []
    spread: list[float] = []
    ends_at = np.cumsum([0, *(e.steps for e in episodes)])
    every = self.values(np.concatenate([f[0] for f in feats])) if episodes else np.zeros(0)
    for i, e in enumerate(episodes):
      v = every[ends_at[i] : ends_at[i + 1]]
      r = np.zeros(e.steps, np.float32)
      r[-1] = e.reward
      done = np.zeros(e.steps, bool)
      done[-1] = True
      adv = gae(r, v, np.concatenate([v[1:], [0.0]]), done, cfg.gamma, cfg.lam)
      out.append(adv)
      key = "success" if e.reward >= 1.0 else "failure"
      starts.setdefault(key, []).append(float(v[0]))
      ends.setdefault(key, []).append(float(v[-1]))
      returns.extend(e.reward * cfg.gamma ** np.arange(e.steps - 1, -1, -1))
      preds.extend(v.tolist())
      spread.append(float(adv.max() - adv.min()))
    metrics = {f"qevolve/v_start_{k}": float(np.mean(x)) for k, x in starts.items()}
    metrics.update({f"qevolve/v_end_{k}": float(np.mean(x)) for k, x in ends.items()})
    ret, pred = np.asarray(returns), np.asarray(preds)
    if ret.size > 1 and ret.var() > 0:
      metrics["qevolve/explained_variance"] = float(1.0 - np.var(ret - pred) / ret.var())
    if spread:
      metrics["qevolve/advantage_spread"] = float(np.mean(spread))
    return out, metrics

  # -- checkpointing

  def state_dict(self) -> tuple[dict[str, Any], np.ndarray, dict[str, Any]]:
    """(the heads, target and optimizer state as device arrays; the buffer's token ids as one
    flat int32 array with a trailing 0 (orbax stores no empty array); the buffer's episodes
    without their token ids, with their lengths, and the RNG state, as JSON)."""
    episodes = [e.to_dict() for e in self.buffer.episodes]
    lengths = [len(e.pop("token_ids")) for e in episodes]
    tokens = np.fromiter(
      (t for e in self.buffer.episodes for t in e.token_ids), np.int32, sum(lengths)
    )
    meta = {"episodes": episodes, "lengths": lengths, "rng": self.rng.bit_generator.state}
    return self.state, np.concatenate([tokens, np.zeros(1, np.int32)]), meta

  def load_state_dict(self, arrays, tokens: np.ndarray, meta: Mapping[str, Any]) -> None:
    """Inverse of `state_dict` (arrays already placed as this critic's are)."""
    self.state = arrays
    ends = np.cumsum([0, *meta["lengths"]])
    self.buffer.load_state_dict(
      [{**e, "token_ids": tokens[a:b]} for e, a, b in zip(meta["episodes"], ends[:-1], ends[1:])]
    )
    self.rng.bit_generator.state = meta["rng"]


def critic_model_config(policy: QwenConfig, cfg: QEvolveConfig) -> QwenConfig:
  """The "model" critic's network: the policy's architecture and vocabulary (its token ids),
  dense, `cfg.model_layers` layers of width `cfg.model_width` (heads of 64, or one head of the
  width below 64; as many KV heads as heads; MLP 3x the width), tied embeddings (no output
  projection: the critic reads hidden states only)."""
  head_dim = min(64, cfg.model_width)
  heads = cfg.model_width // head_dim
  return dataclasses.replace(
    policy,
    hidden_size=cfg.model_width,
    intermediate_size=3 * cfg.model_width,
    num_hidden_layers=cfg.model_layers,
    num_attention_heads=heads,
    num_key_value_heads=heads,
    head_dim=head_dim,
    tie_word_embeddings=True,
    num_experts=0,
    num_experts_per_tok=0,
    moe_intermediate_size=0,
    mlp_only_layers=(),
  )


def model_critic_step(
  state: dict[str, Any], batch: Mapping[str, jax.Array], graphdef, tx, cfg: QEvolveConfig
):
  """One "model" critic update on a batch of B episodes: the critic's network reads the
  episodes (its gradient from both losses), V and Q heads at the state and state-action
  positions, L_V + L_Q (`iql_losses`, weighted means over the real transitions) by AdamW on
  network and heads, then the Polyak step of the Q head's target (which reads the network's
  features without a gradient: the network has no target copy).

  state: {"trunk" (nnx.State), "v", "q", "q_target", "opt"}; batch: tokens [B, T] int32, index
  [B, 2S] int32 (`Critic._pack`), reward, done, weight, return, valid [B, S] float32 (valid 0
  on padding). Returns (state, {"v_loss", "q_loss"})."""
  steps = batch["reward"].shape[1]

  def loss_fn(train):
    model = nnx.merge(graphdef, train["trunk"])
    h = model.hidden_states(batch["tokens"], None, None, batch["index"]).astype(jnp.float32)
    hs, hsa = h[:, :steps], h[:, steps:]
    v = head_apply(train["v"], hs)
    q = head_apply(train["q"], hsa)
    v_next = jnp.concatenate([v[:, 1:], jnp.zeros_like(v[:, :1])], axis=1)
    q_t = head_apply(state["q_target"], jax.lax.stop_gradient(hsa))
    valid = batch["valid"]
    scale = valid.size / jnp.maximum(valid.sum(), 1.0)  # a mean over the real transitions
    v_loss, q_loss = iql_losses(
      *(x.ravel() for x in (v, q, q_t, v_next, batch["reward"], batch["done"])),
      (batch["weight"] * valid).ravel(),
      cfg.tau,
      cfg.gamma,
      batch["return"].ravel() if cfg.v_target == "return" else None,
    )
    return (v_loss + q_loss) * scale, (v_loss * scale, q_loss * scale)

  train = {"trunk": state["trunk"], "v": state["v"], "q": state["q"]}
  (_, (v_loss, q_loss)), grads = jax.value_and_grad(loss_fn, has_aux=True)(train)
  updates, opt = tx.update(grads, state["opt"], train)
  train = optax.apply_updates(train, updates)
  target = optax.incremental_update(train["q"], state["q_target"], cfg.polyak)
  return {**train, "q_target": target, "opt": opt}, {"v_loss": v_loss, "q_loss": q_loss}


class ModelCritic(Critic):
  """Q-Evolve's critic as a network of its own (`critic = "model"`): `critic_model_config`'s
  network (float32, random init from the run's seed) with V and Q heads, trained end to end by
  `model_critic_step` on `model_batch` episodes a step; its features (the network's hidden
  states, no gradient) give the values of the process rewards. With the trainer's mesh the
  network and its AdamW moments are placed by their logical axes (`sharding.tree_shardings`,
  the policy's rules) and the heads as `Critic`'s; the read episodes are replicated."""

  OWN_FEATURES = True

  def __init__(self, cfg: QEvolveConfig, trainer, seed: int):
    self.cfg, self.trainer = cfg, trainer
    mesh = trainer.mesh
    network = builder.init(
      critic_model_config(trainer.model_config, cfg),
      seed=seed + 1,
      dtype=jnp.float32,
      mesh=mesh,
      remat="none",
    )
    self.graphdef, trunk = nnx.split(network)
    kv, kq = jax.random.split(jax.random.key(seed))
    self.tx = optax.adamw(cfg.lr, weight_decay=0.0)
    v, q = init_head(kv, cfg.model_width, cfg.hidden), init_head(kq, cfg.model_width, cfg.hidden)
    heads = {"v": v, "q": q, "q_target": jax.tree.map(jnp.copy, q)}
    self.shardings = None
    if mesh is not None:
      head_sh = self._shardings(heads)
      opt_shapes = jax.eval_shape(self.tx.init, {"trunk": trunk, "v": v, "q": q})
      self.shardings = {
        "trunk": sharding.tree_shardings(trunk, mesh),
        **head_sh,
        "opt": sharding.tree_shardings(opt_shapes, mesh),
      }
      heads = jax.device_put(heads, head_sh)
    init_opt = jax.jit(self.tx.init, out_shardings=None if mesh is None else self.shardings["opt"])
    opt = init_opt({"trunk": trunk, "v": heads["v"], "q": heads["q"]})
    self.state = {"trunk": trunk, **heads, "opt": opt}
    self.buffer = ReplayBuffer(cfg.capacity)
    self.rng = np.random.default_rng([seed, 0x71657630])
    placed: dict[str, Any] = {}
    if self.shardings is not None:
      placed["out_shardings"] = (self.shardings, None)
    graphdef = self.graphdef
    self._step = jax.jit(
      lambda s, b: model_critic_step(s, b, graphdef, self.tx, cfg), donate_argnums=(0,), **placed
    )
    self._values = jax.jit(head_apply)

    def hidden(trunk, tokens, index):
      model = nnx.merge(graphdef, trunk)
      return model.hidden_states(tokens, None, None, index).astype(jnp.float32)

    self._hidden = jax.jit(hidden)

  def _read(self, tokens: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The critic network's own hidden states at `index` (no gradient), on the host."""
    return distributed.fetch(self._hidden(self.state["trunk"], tokens, index))

  def fit(
    self, episodes: Sequence[Episode], feats: Sequence[tuple[np.ndarray, np.ndarray]]
  ) -> dict[str, float]:
    """`cfg.updates` steps, each on `cfg.model_batch` episodes drawn from `episodes` and
    `cfg.replay` buffer episodes (the network reads them in the step: `feats` is not used),
    then adds `episodes` to the buffer. Returns `Critic.fit`'s metrics."""
    del feats
    cfg = self.cfg
    replayed = self.buffer.sample(cfg.replay, self.rng)
    every = list(episodes) + replayed
    self.buffer.extend(list(episodes))
    metrics: dict[str, float] = {"qevolve/buffer": len(self.buffer), "qevolve/transitions": 0}
    if not every:
      return metrics
    out: dict[str, Any] = {}
    for _ in range(cfg.updates):
      pick = self.rng.choice(len(every), cfg.model_batch, replace=len(every) < cfg.model_batch)
      chosen = [every[i] for i in pick]
      tokens, index, steps = self._pack(chosen, like=every)  # one shape per fit
      batch = {"tokens": tokens, "index": index}
      for key in ("reward", "done", "weight", "valid"):
        batch[key] = np.zeros((len(chosen), steps), np.float32)
      for i, e in enumerate(chosen):
        n = e.steps
        batch["reward"][i, :n] = np.asarray(e.penalties, np.float32)
        batch["reward"][i, n - 1] += e.reward
        batch["done"][i, n - 1] = 1.0
        batch["weight"][i, :n] = step_weights(n, e.reward >= 1.0)
        batch["valid"][i, :n] = 1.0
      batch["return"] = discounted_returns(batch["reward"], batch["done"], cfg.gamma)
      self.state, out = self._step(self.state, batch)
    metrics.update({f"qevolve/{k}": float(v) for k, v in out.items()})
    metrics["qevolve/transitions"] = sum(e.steps for e in every)
    return metrics


def make_critic(cfg: QEvolveConfig, trainer, seed: int) -> Critic:
  """The critic `cfg.critic` names: `Critic` ("head") or `ModelCritic` ("model")."""
  return ModelCritic(cfg, trainer, seed) if cfg.critic == "model" else Critic(cfg, trainer, seed)


class CriticCheckpointer:
  """The critic's checkpoints in `directory` (beside the run's: `checkpoint_dir`), one per run
  checkpoint step, newest `keep` kept: items "critic" (heads, Q target, AdamW state), "buffer"
  (the replay buffer's token ids) and "meta" (episodes, RNG). Saved synchronously: the critic
  is small next to the policy, and its step must be on disk when the run's is."""

  def __init__(self, directory: str, keep: int):
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=True, enable_async_checkpointing=False
    )
    self._mgr = ocp.CheckpointManager(
      directory, options=options, item_names=("critic", "buffer", "meta")
    )

  def save(self, step: int, critic: Critic) -> None:
    """Raises: DiskFullError (a RunError) for a full disk; orbax's errors."""
    arrays, tokens, meta = critic.state_dict()
    args = ocp.args.Composite(
      critic=ocp.args.StandardSave(arrays),
      buffer=ocp.args.StandardSave({"tokens": tokens}),
      meta=ocp.args.JsonSave(meta),
    )
    with errors.writing(os.fspath(self._mgr.directory)):
      self._mgr.save(step, args=args, force=True)

  def restore(self, step: int, critic: Critic) -> bool:
    """Loads `step` into `critic` (onto its shardings). Returns False (critic untouched) when no
    critic checkpoint of that step exists (a run that turned Q-Evolve on after it)."""
    if step not in self._mgr.all_steps():
      return False
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, critic.state)
    out = self._mgr.restore(
      step,
      args=ocp.args.Composite(
        critic=ocp.args.StandardRestore(abstract),
        buffer=ocp.args.StandardRestore(),
        meta=ocp.args.JsonRestore(),
      ),
    )
    critic.load_state_dict(out.critic, np.asarray(out.buffer["tokens"])[:-1], out.meta)
    return True

  def close(self) -> None:
    self._mgr.close()


# A group's reward deviation at or below this counts as none (`combine`, scale "group_std").
GROUP_STD_MIN = 1e-6


def combine(
  outcome: np.ndarray,
  reply_adv: Sequence[np.ndarray],
  keep: np.ndarray,
  cfg: QEvolveConfig,
  rewards: np.ndarray | None = None,
  groups: np.ndarray | None = None,
) -> list[list[float]]:
  """Per trajectory, each reply's advantage: group_weight x outcome[i] + critic_weight x the
  GAE advantage (divided by its group's reward deviation with `scale = "group_std"`: by the
  step's, over every kept row, for a group whose rewards all agree, and by 1 when those agree
  too; then whitened over the kept replies with `normalize`); 0 for dropped rows.

  Args:
    outcome: [N] group advantages. reply_adv: per trajectory, [T_i] GAE advantages. keep: [N]
      bool. rewards, groups: [N] outcome rewards and group ids (read by `scale = "group_std"`:
      the deviation over the group's kept rows).
  Returns:
    N lists of per-reply floats (`advantages.spread_over_replies`'s input).
  Raises:
    ValueError: `scale = "group_std"` without rewards and groups.
  """
  reply_adv = [np.asarray(a, np.float64) for a in reply_adv]
  if cfg.scale == "group_std":
    if rewards is None or groups is None:
      raise ValueError("qevolve.scale 'group_std' needs the rows' rewards and group ids")
    rewards, groups = np.asarray(rewards, np.float64), np.asarray(groups)
    # A group whose kept rewards all agree has no deviation of its own: its critic advantages
    # (not 0, unlike GRPO's there) are scaled by the step's kept rewards' deviation, or left as
    # they are when that is 0 too; dividing by GRPO's epsilon alone multiplied them by 1e6 (the
    # credit benchmark's policy collapsed on it).
    pooled = float(rewards[keep].std()) if keep.any() else 0.0
    for g in np.unique(groups):
      rows = np.flatnonzero((groups == g) & keep)
      std = float(rewards[rows].std()) if len(rows) else 0.0
      std = std if std > GROUP_STD_MIN else (pooled if pooled > GROUP_STD_MIN else 1.0)
      for i in np.flatnonzero(groups == g):
        reply_adv[i] = reply_adv[i] / (std + 1e-6)
  kept = [a for a, k in zip(reply_adv, keep) if k]
  mean, std = 0.0, 1.0
  if cfg.normalize and kept:
    flat = np.concatenate(kept)
    mean, std = float(flat.mean()), float(flat.std()) + 1e-6
  return [
    [float(cfg.group_weight * outcome[i] + cfg.critic_weight * (a - mean) / std) for a in adv]
    if keep[i]
    else [0.0] * len(adv)
    for i, adv in enumerate(reply_adv)
  ]


def checkpoint_dir(workdir: str) -> str:
  """Where the critic's checkpoints live, beside the run's."""
  return os.path.join(workdir, "qevolve")
