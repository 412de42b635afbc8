"""Advantage estimators by name (`train.advantage_estimator`), and their two output forms.

An estimator maps one step's `AdvantageInputs` (its trajectories, rewards, groups, the kept rows
and the objective's settings) to the advantages `PolicyTrainer.grpo_epoch` trains on, in either
of the forms the trainer takes (`trainer.make_batch`, `grpo.grpo_loss`):

  [N] float32: one per trajectory, broadcast over its generated tokens (GRPO's outcome
    advantage, CoEvolve paper Eq. 1: "grpo", the default);
  [N, P] float32: one per target token, row r holding trajectory r's targets in order (the
    positions i > 0 with loss_mask[i] == 1, `trainer.target_positions`), P >= every row's
    target count; the entries past a row's targets are ignored. A step-level advantage (a
    process reward per reply, a learned critic's GAE per token) takes this form;
    `spread_over_replies` turns one value per model reply (`Trajectory.replies`) into it.

Estimators register under a name with `register`; `get` looks one up, `estimate` calls it and
checks its output's shape. The loop calls

  advantages.estimate(cfg.train.advantage_estimator, AdvantageInputs(trajs, rewards, groups,
                      keep, gcfg))

which for "grpo" is exactly `grpo.compute_advantages(rewards, groups, gcfg.adv_eps,
gcfg.scale_by_std, keep_n=keep)`, the same array.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from coevolve_jax import grpo, qevolve, wia
from coevolve_jax.trainer import target_positions
from coevolve_jax.types import Trajectory


@dataclasses.dataclass(frozen=True)
class AdvantageInputs:
  """What an advantage estimator may read: one GRPO step's N rollouts.

  Attributes:
    trajectories: the N trajectories (token ids, loss masks, `replies`, `step_rewards`, ...).
    rewards: [N] float32 outcome rewards (`Trajectory.reward`).
    group_ids: [N] group id of each trajectory (rollouts of one task share one; any numpy
      dtype `grpo.compute_advantages` takes).
    keep: [N] bool, False for trajectories dropped from the loss (`train.drop_from_loss`);
      None is taken as every row kept.
    cfg: the objective's settings (adv_eps, scale_by_std, ...).
    wia: Role-Agent's World-In-Agent settings (`role_agent.wia`), read by "role_agent"; None
      for the other estimators.
    qevolve: Q-Evolve's settings and, per trajectory, its critic's GAE advantage of each reply
      ([T_i] float, `qevolve.Critic.reply_advantages`), read by "qevolve"; None otherwise.

  Raises (on construction):
    ValueError: rewards, group_ids or keep not of shape [N] (N = len(trajectories)), or keep
      not bool.
  """

  trajectories: Sequence[Trajectory]
  rewards: np.ndarray
  group_ids: np.ndarray
  keep: np.ndarray | None
  cfg: grpo.GRPOConfig
  wia: wia.WIAConfig | None = None
  qevolve: tuple[qevolve.QEvolveConfig, Sequence[np.ndarray]] | None = None

  def __post_init__(self):
    n = len(self.trajectories)
    if self.keep is None:
      object.__setattr__(self, "keep", np.ones((n,), bool))
    for name in ("rewards", "group_ids", "keep"):
      if np.shape(getattr(self, name)) != (n,):
        raise ValueError(
          f"{name} of shape {np.shape(getattr(self, name))}, want [{n}] (one per trajectory)"
        )
    if np.asarray(self.keep).dtype != bool:
      raise ValueError(f"keep must be a bool array, got dtype {np.asarray(self.keep).dtype}")

  @classmethod
  def from_trajectories(
    cls,
    trajectories: Sequence[Trajectory],
    cfg: grpo.GRPOConfig,
    keep: np.ndarray | None = None,
  ) -> "AdvantageInputs":
    """The record with rewards ([N] float32) and group ids ([N] int) read off the trajectories,
    as the loop builds them.

    Raises:
      ValueError: keep not a bool array of shape [N].
    """
    rewards = np.array([t.reward for t in trajectories], np.float32)
    groups = np.array([t.group_id for t in trajectories])
    return cls(trajectories, rewards, groups, keep, cfg)

  @property
  def n(self) -> int:
    return len(self.trajectories)


Estimator = Callable[[AdvantageInputs], np.ndarray]
_REGISTRY: dict[str, Estimator] = {}


def register(name: str) -> Callable[[Estimator], Estimator]:
  """Decorator: registers `fn(inputs: AdvantageInputs) -> [N] or [N, P] float32` under `name`
  and returns fn unchanged.

  Raises:
    ValueError: a name that is not a non-empty str, or one already registered (a second
      estimator never replaces the first silently).
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"an advantage estimator's name must be a non-empty str, got {name!r}")

  def wrap(fn: Estimator) -> Estimator:
    if name in _REGISTRY:
      raise ValueError(f"advantage estimator {name!r} is already registered ({_REGISTRY[name]})")
    _REGISTRY[name] = fn
    return fn

  return wrap


def names() -> tuple[str, ...]:
  """The registered estimators' names, in registration order ("grpo" first)."""
  return tuple(_REGISTRY)


def get(name: str) -> Estimator:
  """The estimator registered under `name`.

  Raises:
    ValueError: no estimator of that name; the message lists the known ones.
  """
  try:
    return _REGISTRY[name]
  except (KeyError, TypeError):  # TypeError: an unhashable name
    raise ValueError(f"unknown advantage estimator {name!r}; known: {names()}") from None


def estimate(name: str, inputs: AdvantageInputs) -> np.ndarray:
  """`get(name)(inputs)` as float32, its shape checked: what `PolicyTrainer.grpo_epoch` takes.

  A float32 result is returned as it is (for "grpo", `grpo.compute_advantages`'s own array).

  Returns:
    [N] float32 (one per trajectory) or [N, P] float32 (one per target token, P >= every row's
    target count `len(trainer.target_positions(t))`).
  Raises:
    ValueError: an unknown name (`get`); a result not [N] or [N, P], or with P short of a
      row's target count; whatever the estimator raises.
  """
  out = np.asarray(get(name)(inputs), np.float32)
  n = inputs.n
  if out.ndim not in (1, 2) or out.shape[0] != n:
    raise ValueError(f"advantage estimator {name!r} gave shape {out.shape}, want [{n}] or [{n}, P]")
  if out.ndim == 2:
    most = max((len(target_positions(t)) for t in inputs.trajectories), default=0)
    if out.shape[1] < most:
      raise ValueError(
        f"advantage estimator {name!r} gave {out.shape[1]} per-token advantages per row, but a "
        f"trajectory has {most} target tokens"
      )
  return out


@register("grpo")
def grpo_outcome(inputs: AdvantageInputs) -> np.ndarray:
  """GRPO's group-relative outcome advantage (CoEvolve paper Eq. 1): per group,
  A_k = (R_k - mean(R)) / (std(R) + adv_eps), or R_k - mean(R) without scale_by_std (Dr. GRPO);
  dropped rows get 0 and are left out of their group's statistics.

  Exactly `grpo.compute_advantages(rewards, group_ids, cfg.adv_eps, cfg.scale_by_std,
  keep_n=keep)`, the loop's call before this registry existed.

  Returns:
    [N] float32.
  Raises:
    ValueError: `compute_advantages`'s (a non-finite reward, ...).
  """
  cfg = inputs.cfg
  return grpo.compute_advantages(
    inputs.rewards, inputs.group_ids, cfg.adv_eps, cfg.scale_by_std, keep_n=inputs.keep
  )


def spread_over_replies(
  trajectories: Sequence[Trajectory], reply_values: Sequence[Sequence[float]]
) -> np.ndarray:
  """Per-target-token advantages from one value per model reply: each of a trajectory's target
  tokens gets the value of the reply whose span (`Reply.start` <= i < `Reply.end`) holds it.

  A target of trajectory r is a position i > 0 with loss_mask[i] == 1 (`trainer.
  target_positions`, the order of `make_batch`'s rows); a reply's token at position 0 is not a
  target and takes no value. Row r of the result holds trajectory r's targets in order, then 0
  up to P_max.

  Args:
    trajectories: N trajectories with `replies` in order, non-overlapping, within token_ids and
      of loss mask 1, covering every target token (as `agent.AgentRunner` records them).
    reply_values: per trajectory, one float per reply (len == len(trajectories[r].replies)).
  Returns:
    [N, P_max] float32, P_max = the largest target count (0 for no targets at all): the [N, P]
    form `PolicyTrainer.grpo_epoch` takes.
  Raises:
    ValueError: len(reply_values) != N; a row whose value count is not its reply count; a
      reply span out of order, overlapping, outside the token ids or over a token of loss
      mask 0; a target token in no reply; a non-finite value.
  """
  if len(reply_values) != len(trajectories):
    raise ValueError(
      f"{len(reply_values)} rows of reply values for {len(trajectories)} trajectories"
    )
  rows = []
  for r, (tr, given) in enumerate(zip(trajectories, reply_values)):
    values = np.asarray(given, np.float64)
    if values.shape != (len(tr.replies),):
      raise ValueError(
        f"trajectory {r} ({tr.task_id}): {values.shape} reply values for {len(tr.replies)} replies"
      )
    if not np.all(np.isfinite(values)):
      raise ValueError(f"trajectory {r} ({tr.task_id}): non-finite reply values {values}")
    per_token = np.full(len(tr.token_ids), np.nan)  # NaN: in no reply
    end = 0
    for j, reply in enumerate(tr.replies):
      if not end <= reply.start <= reply.end <= len(tr.token_ids):
        raise ValueError(
          f"trajectory {r} ({tr.task_id}): reply {j} spans [{reply.start}, {reply.end}), after "
          f"a reply ending at {end}, in {len(tr.token_ids)} tokens"
        )
      if not all(tr.loss_mask[reply.start : reply.end]):
        raise ValueError(
          f"trajectory {r} ({tr.task_id}): reply {j} [{reply.start}, {reply.end}) covers "
          "tokens of loss mask 0"
        )
      per_token[reply.start : reply.end] = values[j]
      end = reply.end
    targets = per_token[target_positions(tr)]
    if np.isnan(targets).any():
      missing = np.asarray(target_positions(tr))[np.isnan(targets)]
      raise ValueError(
        f"trajectory {r} ({tr.task_id}): target tokens at positions {missing.tolist()} are "
        "in no reply"
      )
    rows.append(targets)
  out = np.zeros((len(rows), max((len(x) for x in rows), default=0)), np.float32)
  for r, x in enumerate(rows):
    out[r, : len(x)] = x
  return out


@register("role_agent")
def role_agent(inputs: AdvantageInputs) -> np.ndarray:
  """Role-Agent's advantages with World-In-Agent process rewards (`wia` module docstring;
  GiGPO's combination): per reply, the episode's group advantage ("grpo") plus
  `wia.step_weight` x the reply's step advantage within its anchor-state group, spread over the
  reply's tokens. Settings: `inputs.wia` (default `wia.WIAConfig()`).

  Returns:
    [N, P] float32 (`spread_over_replies`); dropped rows 0.
  Raises:
    ValueError: `grpo_outcome`'s or `spread_over_replies`'s.
  """
  cfg = inputs.wia or wia.WIAConfig()
  trajs, keep = inputs.trajectories, np.asarray(inputs.keep)
  outcome = grpo_outcome(inputs)
  rewards = [wia.step_rewards(t, wia.reply_scores(t, cfg), cfg) for t in trajs]
  steps = wia.step_advantages(trajs, rewards, cfg, keep.tolist())
  values = [
    [float(outcome[i]) + cfg.step_weight * a if keep[i] else 0.0 for a in steps[i]]
    for i in range(len(trajs))
  ]
  return spread_over_replies(trajs, values)


@register("qevolve")
def qevolve_critic(inputs: AdvantageInputs) -> np.ndarray:
  """Q-Evolve's process rewards (`qevolve` module docstring): per reply, group_weight x the
  episode's group advantage ("grpo") + critic_weight x the critic's GAE advantage of the reply
  (whitened over the kept replies with `normalize`), spread over the reply's tokens.

  Returns:
    [N, P] float32 (`spread_over_replies`); dropped rows 0.
  Raises:
    ValueError: no critic advantages in `inputs.qevolve`, a row whose count is not its reply
      count, or `spread_over_replies`'s errors.
  """
  if inputs.qevolve is None:
    raise ValueError("the 'qevolve' estimator needs the critic's reply advantages (qevolve=)")
  cfg, reply_adv = inputs.qevolve
  outcome = grpo_outcome(inputs)
  keep = np.asarray(inputs.keep)
  values = qevolve.combine(outcome, reply_adv, keep, cfg, inputs.rewards, inputs.group_ids)
  return spread_over_replies(inputs.trajectories, values)
