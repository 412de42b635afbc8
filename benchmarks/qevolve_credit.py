"""Credit assignment: Q-Evolve's critic advantages against outcome-only GRPO (issue 44 item 6).

The task: an episode of K one-token replies (default 4), each followed by a step-marker token
the environment sends; the prompt is `<bos> a =` with a digit a in 0..7 (8 prompts). The reward
is 1 when the reply at the deciding step (default the first) is the digit a, whatever the other
replies are; 0 otherwise. A random policy of the 16-token vocabulary scores 1/16. The other
steps' replies decide nothing, so outcome-only GRPO, which gives every reply of an episode the
episode's advantage, also trains those replies on the outcome (noise), while the critic's
per-reply GAE gives them about none where its V is right.

Both arms run the production path: a tiny Qwen (1 layer, width 32) samples G = 8 episodes per
prompt per step (64 a step), `advantages.estimate` ("grpo", or "qevolve" with
`qevolve.Critic`: its reply advantages under the critic as it stands, then its fit, as the loop
does), `PolicyTrainer.grpo_epoch` with AdamW. The figure is the policy's exact expected reward
(over the prompts and the replies before the deciding step, the policy's own probabilities: no
sampling noise), every 5 steps; a run stops when it reaches the target (0.8) or at --max-steps.
The table gives, per seed, the GRPO steps each arm needed, and their ratio (critic / GRPO; below
1: the critic got there in fewer steps). `--oracle` adds the arm the critic approximates at
best: the deciding reply alone takes GRPO's group advantage, the others 0 (how much credit
assignment can pay on the task). Also: `--lr` (the policy's; at 1e-2 several seeds of every arm
stall with one or two prompts unlearnt), `--drop-dead-groups` (`train.drop_dead_groups` in every
arm), `--fit-first` (the critic fits the step's episodes before their advantages, the order the
paper lists: `qevolve.order = "fit_first"`; the loop's default is PPO's), `--demos` (expert episodes
per prompt in the critic's buffer from the start: the deciding reply right, the others random, as
Q-Evolve's hybrid dataset starts from demonstrations), `--warmup-rollouts` (that many steps' worth
of the initial policy's episodes in the buffer too, the agent half of the hybrid dataset; one with
`--warmup`; counted in the critic arm's steps, since they cost the environment as many episodes as
GRPO steps) and `--warmup` (critic fits before the first GRPO step, each on `--critic-updates`
batches drawn from the whole buffer). The critic arm's table also gives the mean size of its
advantages on the deciding reply and on the others (the oracle's: GRPO's on the first, 0 on the
others).

`--probe FITS` runs no arm: the critic alone is fitted on a fixed set of episodes (`--demos`
expert episodes per prompt, `--random` uniformly random ones), FITS rounds of
`--critic-updates` updates, and after each round the table gives how well V at the state after
the deciding reply (whose value is exactly the outcome) predicts held-out outcomes: whether the
critic can learn this task's V at all, and in how many updates, apart from the policy.

  python benchmarks/qevolve_credit.py [--seeds 0,1,2] [--steps 4] [--decide 0|1]
    [--critic-updates 32] [--critic-lr 1e-3] [--critic head|model] [--model-layers 2]
    [--model-width 256] [--model-batch 16] [--scale none|group_std] [--no-normalize]
    [--v-target iql|return] [--tau 0.7] [--drop-dead-groups] [--fit-first] [--lr 1e-2] [--oracle]
    [--demos 0] [--warmup 0] [--warmup-rollouts 0] [--probe FITS [--random 256]]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import machine
from flax import nnx

from coevolve_jax import advantages, grpo, qevolve
from coevolve_jax.models import Qwen, QwenConfig
from coevolve_jax.trainer import PolicyTrainer, make_optimizer
from coevolve_jax.types import Reply, Trajectory

BOS, EQ, DIGIT0, MARK0, VOCAB, DIGITS = 1, 2, 3, 11, 16, 8  # step k's marker is MARK0 + k
GROUP, LR, TARGET = 8, 1e-2, 0.8


def _config() -> QwenConfig:
  return QwenConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
  )


def _next_logp(model: Qwen, tokens_bt: jax.Array) -> jax.Array:
  """[B, V] log-probs of the token after each row."""
  return jax.nn.log_softmax(model.logits(model.hidden_states(tokens_bt)[:, -1]), axis=-1)


def _sample(model: Qwen, prompts_bt: jax.Array, key: jax.Array, steps: int):
  """K replies per row, each followed by its step marker: ([B, 3 + 2K - 1] int32 tokens, [B, K]
  float32 log-probs of the sampled replies)."""
  seq, logps = prompts_bt, []
  for k in range(steps):
    key, sub = jax.random.split(key)
    logp = _next_logp(model, seq)
    tok = jax.random.categorical(sub, logp, axis=-1).astype(jnp.int32)
    logps.append(logp[jnp.arange(tok.shape[0]), tok])
    seq = jnp.concatenate([seq, tok[:, None]], axis=1)
    if k < steps - 1:
      seq = jnp.concatenate([seq, jnp.full_like(tok[:, None], MARK0 + k)], axis=1)
  return seq, jnp.stack(logps, axis=1)


def _expected_reward(model: Qwen, decide: int) -> float:
  """Exact expected reward over the 8 prompts, for decide in {0, 1} (a deciding first reply, or
  a second one after any first reply: 16 prefixes per prompt)."""
  digits = np.arange(DIGITS)
  prompts = np.stack([np.full(DIGITS, BOS), DIGIT0 + digits, np.full(DIGITS, EQ)], 1)
  first = _next_logp(model, jnp.asarray(prompts, jnp.int32))  # [8, V]
  answer = DIGIT0 + digits
  if decide == 0:
    return float(jnp.mean(jnp.exp(first[digits, answer])))
  rows = np.concatenate(
    [np.repeat(prompts, VOCAB, 0), np.tile(np.arange(VOCAB), DIGITS)[:, None]], 1
  )
  rows = np.concatenate([rows, np.full((len(rows), 1), MARK0)], 1)
  second = _next_logp(model, jnp.asarray(rows, jnp.int32)).reshape(DIGITS, VOCAB, VOCAB)
  p_right = jnp.exp(second[digits, :, answer])  # [8, V]: P(a | prompt, first reply t)
  return float(jnp.mean(jnp.sum(jnp.exp(first) * p_right, axis=1)))


def _trajectories(tokens: np.ndarray, logps: np.ndarray, prompt_ids, steps: int, decide: int):
  out = []
  for seq, lp, a in zip(tokens, logps, prompt_ids):
    tr = Trajectory(task_id=str(a), group_id=int(a))
    tr.extend(seq[:3].tolist(), sampled=False)
    for k in range(steps):
      start = len(tr.token_ids)
      tr.extend([int(seq[3 + 2 * k])], sampled=True, logprobs=[float(lp[k])])
      tr.replies.append(Reply(start, start + 1))
      if k < steps - 1:
        tr.extend([int(seq[4 + 2 * k])], sampled=False)
    tr.reward = float(seq[3 + 2 * decide] == DIGIT0 + a)
    out.append(tr)
  return out


def _demonstrations(per_prompt: int, steps: int, decide: int, rng) -> list[Trajectory]:
  """`per_prompt` expert episodes for each prompt: the deciding reply is the prompt's digit, the
  others uniform over the vocabulary (they decide nothing); reward 1."""
  out = []
  for a in np.repeat(np.arange(DIGITS), per_prompt):
    replies = rng.integers(0, VOCAB, steps)
    replies[decide] = DIGIT0 + a
    out += _episode(int(a), replies, decide)
  return out


def _random_episodes(n: int, steps: int, decide: int, rng) -> list[Trajectory]:
  """`n` episodes of uniformly drawn prompts and replies (a success about 1 time in 16)."""
  out = []
  for a, replies in zip(rng.integers(0, DIGITS, n), rng.integers(0, VOCAB, (n, steps))):
    out += _episode(int(a), replies, decide)
  return out


def _episode(a: int, replies, decide: int) -> list[Trajectory]:
  """The one-trajectory list of prompt a's episode with these replies (log-probs 0), each reply
  but the last followed by its step marker."""
  steps = len(replies)
  seq = [BOS, DIGIT0 + a, EQ]
  for k, r in enumerate(replies):
    seq += [int(r)] + ([MARK0 + k] if k < steps - 1 else [])
  return _trajectories(np.asarray([seq]), np.zeros((1, steps)), [a], steps, decide)


def probe(
  seed: int,
  critic_cfg: qevolve.QEvolveConfig,
  demos: int,
  randoms: int,
  steps: int,
  decide: int,
  fits: int,
) -> list[tuple[int, float, float, float, float, float]]:
  """The critic alone, as supervised regression on a fixed set of episodes (no policy update):
  `demos` expert episodes per prompt and `randoms` uniformly random ones in its buffer, then
  `fits` rounds of `critic_cfg.updates` updates on batches drawn from the whole buffer. After
  each round, on held-out episodes drawn the same way (half as many), V at the state after the
  deciding reply, whose value is exactly the outcome (the reward is decided there): its
  explained variance of the outcome, how often V > 0.5 agrees with it, and its mean after a
  success and after a failure.

  Returns:
    Per round: (updates so far, held-out explained variance, held-out agreement, the same
    agreement on the training episodes, mean V after a success, after a failure).
  """
  rng = np.random.default_rng(seed)
  trainer = PolicyTrainer(
    Qwen(_config(), rngs=nnx.Rngs(seed)), make_optimizer(LR, 0.0, 1.0), grpo.GRPOConfig(), 1.0
  )
  cfg = dataclasses.replace(critic_cfg, replay=10**6, capacity=10**6)
  critic = qevolve.make_critic(cfg, trainer, seed)

  def episodes(d: int, n: int) -> list[qevolve.Episode]:
    expert = [qevolve.episode(t, cfg, "expert") for t in _demonstrations(d, steps, decide, rng)]
    agent = [qevolve.episode(t, cfg) for t in _random_episodes(n, steps, decide, rng)]
    return [e for e in expert + agent if e is not None]

  train, held_out = episodes(demos, randoms), episodes(demos // 2, randoms // 2)
  critic.buffer.extend(train)

  def after_deciding(eps):
    v = [critic.values(s)[decide + 1] for s, _ in critic.features(eps)]
    return np.asarray(v), np.asarray([e.reward for e in eps])

  rows = []
  for i in range(1, fits + 1):
    critic.fit([], [])
    v, r = after_deciding(held_out)
    v_train, r_train = after_deciding(train)
    ev = 1.0 - np.var(r - v) / np.var(r)
    agree = float(np.mean((v > 0.5) == (r > 0.5)))
    agree_train = float(np.mean((v_train > 0.5) == (r_train > 0.5)))
    rows.append((i * cfg.updates, ev, agree, agree_train, v[r > 0.5].mean(), v[r < 0.5].mean()))
  return rows


def run(
  seed: int,
  arm: str,
  steps: int,
  decide: int,
  max_steps: int,
  critic_cfg: qevolve.QEvolveConfig,
  drop_dead: bool = False,
  lr: float = LR,
  demos: int = 0,
  warmup: int = 0,
  warmup_rollouts: int = 0,
) -> tuple[int, float, float, dict]:
  """One arm on one seed; `drop_dead`: `train.drop_dead_groups` (a group whose rewards all agree
  leaves the loss, `grpo.loss_rows`); `demos`, `warmup`: the critic's buffer starts with `demos`
  expert episodes per prompt (`_demonstrations`) and `warmup_rollouts` steps' worth of the
  initial policy's episodes (at least one with `warmup`), and is fitted `warmup` times on
  episodes drawn from that whole buffer before the first GRPO step (Q-Evolve's hybrid dataset;
  a critic warm-up). Returns (steps to the target: GRPO steps plus the warm-up's rollout steps,
  which cost the environment as many episodes; max_steps + 1 when missed; the expected reward
  at the end; wall seconds; the critic's last qevolve/* metrics)."""
  start = time.perf_counter()
  model = Qwen(_config(), rngs=nnx.Rngs(seed))
  trainer = PolicyTrainer(model, make_optimizer(lr, 0.0, 1.0), grpo.GRPOConfig(), 1.0)
  trainer.freeze_reference()
  critic = qevolve.make_critic(critic_cfg, trainer, seed) if arm == "critic" else None
  metrics: dict = {}
  # per step: the mean |advantage| of the deciding reply and of the other replies (critic arm)
  sizes: list[tuple[float, float]] = []
  sample = jax.jit(_sample, static_argnums=3)
  rng, key = np.random.default_rng(seed), jax.random.key(seed)
  digits = np.arange(DIGITS)
  prompts = np.stack([np.full(DIGITS, BOS), DIGIT0 + digits, np.full(DIGITS, EQ)], 1)
  reached, reward = max_steps + 1, _expected_reward(trainer.model(), decide)
  # the warm-up's rollout steps count as steps: they cost the environment as many episodes
  offset = 0 if critic is None else max(warmup_rollouts, 1 if warmup else 0)
  if critic is not None:  # own random streams: the steps below draw as in the other arms
    own = np.random.default_rng(seed + 10**6)
    found = (
      qevolve.episode(t, critic.cfg, "expert") for t in _demonstrations(demos, steps, decide, own)
    )
    critic.buffer.extend([e for e in found if e is not None])  # as the loop's warm-start does
    rows = np.repeat(np.arange(DIGITS), GROUP)
    prompts_bt = jnp.asarray(prompts[rows], jnp.int32)
    for r in range(offset):  # the initial policy's episodes, as a step samples them
      sub = jax.random.fold_in(jax.random.key(seed + 10**6), r)
      tokens, logps = sample(trainer.model(), prompts_bt, sub, steps)
      trajs = _trajectories(np.asarray(tokens), np.asarray(logps), rows, steps, decide)
      critic.buffer.extend([e for t in trajs if (e := qevolve.episode(t, critic.cfg)) is not None])
    own_cfg = critic.cfg  # each warm-up fit draws from the whole buffer, not `replay` episodes
    critic.cfg = dataclasses.replace(own_cfg, replay=len(critic.buffer))
    for _ in range(warmup):
      critic.fit([], [])
    critic.cfg = own_cfg
  for step in range(1, max_steps + 1):
    rows = np.repeat(rng.permutation(DIGITS), GROUP)
    key, sub = jax.random.split(key)
    tokens, logps = sample(trainer.model(), jnp.asarray(prompts[rows], jnp.int32), sub, steps)
    trajs = _trajectories(np.asarray(tokens), np.asarray(logps), rows, steps, decide)
    inputs = advantages.AdvantageInputs.from_trajectories(trajs, trainer.cfg)
    keep = grpo.loss_rows(
      [t.finish for t in trajs], inputs.rewards, inputs.group_ids, (), drop_dead
    )
    inputs = dataclasses.replace(inputs, keep=keep)
    name = "grpo"
    if critic is not None:
      eps = [e for t in trajs if (e := qevolve.episode(t, critic.cfg)) is not None]
      reply_adv, metrics = critic.step(eps, range(len(eps)))  # in critic_cfg.order
      inputs = dataclasses.replace(inputs, qevolve=(critic.cfg, reply_adv))
      name = "qevolve"
    adv = advantages.estimate(name, inputs)
    if arm == "oracle":  # the deciding reply alone takes the episode's group advantage
      reply_values = [[a if k == decide else 0.0 for k in range(steps)] for a in adv]
      adv = advantages.spread_over_replies(trajs, reply_values)
    if critic is not None and keep.any():  # each reply's advantage size, over the kept episodes
      per_reply = np.abs(np.asarray(adv)[keep, :steps])  # one target token per reply
      sizes.append((per_reply[:, decide].mean(), np.delete(per_reply, decide, 1).mean()))
    trainer.grpo_epoch(trajs, adv, 1, keep=keep)
    if step % 5 == 0:
      reward = _expected_reward(trainer.model(), decide)
      if reward >= TARGET:
        reached = min(step + offset, max_steps + 1)
        break
  if sizes:
    metrics["adv_deciding"], metrics["adv_other"] = np.mean(sizes, axis=0).tolist()
  return reached, reward, time.perf_counter() - start, metrics


def _print_probe(args, critic_cfg: qevolve.QEvolveConfig, seeds) -> None:
  print(
    f"# the critic alone ({critic_cfg.critic!r}, {critic_cfg.model_layers} layers of "
    f"{critic_cfg.model_width} for 'model', lr {critic_cfg.lr:g}, V target {critic_cfg.v_target},"
    f" expectile {critic_cfg.tau:g}): {args.demos} expert episodes per prompt and {args.random} "
    f"uniformly random ones; held-out episodes drawn the same way (half as many); V at the state"
    f" after reply {args.decide + 1}, whose value is the outcome"
  )
  columns = ["seed", "updates", "held-out explained variance", "held-out agreement (V > 0.5)"]
  columns += ["training agreement", "V after a success / a failure"]
  print("| " + " | ".join(columns) + " |")
  print("|" + "---|" * len(columns))
  for seed in seeds:
    rows = probe(seed, critic_cfg, args.demos, args.random, args.steps, args.decide, args.probe)
    for updates, ev, agree, agree_train, v_s, v_f in rows:
      cells = [seed, updates, f"{ev:.2f}", f"{agree:.3f}", f"{agree_train:.3f}"]
      print("| " + " | ".join(str(c) for c in [*cells, f"{v_s:.2f} / {v_f:.2f}"]) + " |")
    sys.stdout.flush()


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--steps", type=int, default=4, help="replies per episode (K)")
  parser.add_argument("--decide", type=int, default=0, choices=(0, 1), help="the deciding reply")
  parser.add_argument("--max-steps", type=int, default=300, help="GRPO steps per run at most")
  parser.add_argument("--critic-updates", type=int, default=qevolve.QEvolveConfig.updates)
  parser.add_argument("--critic-lr", type=float, default=qevolve.QEvolveConfig.lr)
  parser.add_argument("--critic", default="head", choices=qevolve.CRITICS)
  parser.add_argument("--model-layers", type=int, default=qevolve.QEvolveConfig.model_layers)
  parser.add_argument("--model-width", type=int, default=qevolve.QEvolveConfig.model_width)
  parser.add_argument("--model-batch", type=int, default=qevolve.QEvolveConfig.model_batch)
  parser.add_argument("--scale", default="none", choices=qevolve.SCALES)
  parser.add_argument("--v-target", default="iql", choices=qevolve.V_TARGETS)
  parser.add_argument("--tau", type=float, default=qevolve.QEvolveConfig.tau, help="V's expectile")
  parser.add_argument("--no-normalize", action="store_true", help="qevolve.normalize = False")
  parser.add_argument(
    "--oracle",
    action="store_true",
    help="also run the oracle arm: the deciding reply alone gets GRPO's group advantage",
  )
  parser.add_argument("--lr", type=float, default=LR, help="the policy's AdamW learning rate")
  parser.add_argument(
    "--fit-first", action="store_true", help="fit the critic before the step's advantages"
  )
  parser.add_argument(
    "--drop-dead-groups", action="store_true", help="train.drop_dead_groups = True in both arms"
  )
  parser.add_argument("--demos", type=int, default=0, help="expert episodes per prompt (critic)")
  parser.add_argument("--warmup", type=int, default=0, help="critic fits before the first step")
  parser.add_argument(
    "--warmup-rollouts",
    type=int,
    default=0,
    help="steps' worth of the initial policy's episodes in the critic's buffer before the first "
    "step (counted in the critic arm's steps)",
  )
  parser.add_argument(
    "--probe",
    type=int,
    default=0,
    metavar="FITS",
    help="instead of the arms: the critic alone, FITS rounds of supervised fits on --demos "
    "expert episodes per prompt and --random uniformly random ones (`probe`)",
  )
  parser.add_argument("--random", type=int, default=256, help="random episodes (--probe)")
  args = parser.parse_args(argv)
  if not 1 <= args.steps <= VOCAB - MARK0 + 1:  # step markers MARK0 .. MARK0 + K - 2
    parser.error(f"--steps must be in [1, {VOCAB - MARK0 + 1}] (the step markers' token ids)")
  critic_cfg = qevolve.QEvolveConfig(
    updates=args.critic_updates,
    lr=args.critic_lr,
    critic=args.critic,
    model_layers=args.model_layers,
    model_width=args.model_width,
    model_batch=args.model_batch,
    scale=args.scale,
    normalize=not args.no_normalize,
    v_target=args.v_target,
    tau=args.tau,
    order="fit_first" if args.fit_first else "advantages_first",
  )
  seeds = [int(s) for s in args.seeds.split(",")]
  print(f"# {machine()}")
  if args.probe:
    if args.decide + 1 >= args.steps:
      parser.error("--probe reads V at the state after the deciding reply: --decide < --steps - 1")
    _print_probe(args, critic_cfg, seeds)
    return
  print(
    f"# K = {args.steps} replies, reply {args.decide + 1} decides; {DIGITS} prompts x G = "
    f"{GROUP}; target expected reward {TARGET}; at most {args.max_steps} GRPO steps; critic "
    f"{critic_cfg.critic!r}, {critic_cfg.updates} updates of "
    + (
      f"{critic_cfg.batch} transitions"
      if critic_cfg.critic == "head"
      else f"{critic_cfg.model_batch} episodes ({critic_cfg.model_layers} layers of "
      f"{critic_cfg.model_width})"
    )
    + f" at lr {critic_cfg.lr:g}, V target {critic_cfg.v_target} (expectile "
    f"{critic_cfg.tau:g}), scale {critic_cfg.scale}, normalize {critic_cfg.normalize}; "
    f"drop dead groups {args.drop_dead_groups}, fit first {args.fit_first}; {args.demos} expert "
    f"episodes per prompt, {args.warmup} warm-up fits over the whole buffer after "
    f"{max(args.warmup_rollouts, 1 if args.warmup else 0)} rollout steps of the initial policy "
    f"(counted in the critic's steps); policy lr {args.lr:g}"
  )
  oracle = ["oracle steps", "oracle / GRPO"] if args.oracle else []
  columns = ["seed", "GRPO steps", "critic steps", "critic / GRPO", *oracle, "GRPO s", "critic s"]
  columns += ["critic's last explained variance", "V at the start, success / failure"]
  columns += [
    "V at the end, success / failure",
    "critic's mean abs advantage, deciding / other replies",
  ]
  print("| " + " | ".join(columns) + " |")
  print("|" + "---|" * len(columns))
  ratios, oracle_ratios = [], []
  arm = functools.partial(
    run,
    steps=args.steps,
    decide=args.decide,
    max_steps=args.max_steps,
    critic_cfg=critic_cfg,
    drop_dead=args.drop_dead_groups,
    lr=args.lr,
    demos=args.demos,
    warmup=args.warmup,
    warmup_rollouts=args.warmup_rollouts,
  )
  miss = lambda n, r: f"> {args.max_steps} ({r:.2f})" if n > args.max_steps else str(n)  # noqa: E731
  for seed in seeds:
    g_steps, g_reward, g_s, _ = arm(seed, "grpo")
    c_steps, c_reward, c_s, m = arm(seed, "critic")
    ratios.append(c_steps / g_steps)
    cells = [seed, miss(g_steps, g_reward), miss(c_steps, c_reward), f"{ratios[-1]:.2f}"]
    if args.oracle:
      o_steps, o_reward, _, _ = arm(seed, "oracle")
      oracle_ratios.append(o_steps / g_steps)
      cells += [miss(o_steps, o_reward), f"{oracle_ratios[-1]:.2f}"]
    ev = m.get("qevolve/explained_variance", float("nan"))
    cells += [f"{g_s:.0f}", f"{c_s:.0f}", f"{ev:.2f}"]
    for at in ("start", "end"):  # V at the prompt / before the last reply, by outcome
      v = (m.get(f"qevolve/v_{at}_{k}", float("nan")) for k in ("success", "failure"))
      cells.append(" / ".join(f"{x:.2f}" for x in v))
    cells.append(
      f"{m.get('adv_deciding', float('nan')):.2f} / {m.get('adv_other', float('nan')):.2f}"
    )
    print("| " + " | ".join(str(c) for c in cells) + " |")
    sys.stdout.flush()
  geomean = lambda xs: float(np.exp(np.mean(np.log(xs))))  # noqa: E731
  if oracle_ratios:
    print(f"# geometric mean of oracle / GRPO steps: {geomean(oracle_ratios):.2f}")
  print(f"# geometric mean of critic / GRPO steps: {geomean(ratios):.2f}")


if __name__ == "__main__":
  main()
