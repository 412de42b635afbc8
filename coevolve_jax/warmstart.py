"""Supervised warm-start on validated task solutions (teacher-forced demonstrations).

A demonstration is built exactly like a rollout (same chat template, same token-in/token-out
accumulation, same environment), but the assistant replies are the ground-truth calls, one call per
reply, then a short closing reply per user turn. The environment really executes each call, so the
observations in the demonstration are real, and its final reward (official checker) is returned
as a sanity check.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import optax
import tqdm

from coevolve_jax import wia
from coevolve_jax.chat import ChatFormat
from coevolve_jax.types import Trajectory
from coevolve_jax.suite import Env
from coevolve_jax.trainer import PolicyTrainer, make_batch, make_optimizer
from coevolve_jax.types import Action, Task, ToolCall

CLOSING_REPLY = "Done."


def demonstration(
  task: Task,
  chat: ChatFormat,
  make_env: Callable[[Task, str], Env],
  parse_call: Callable[[str, list[str]], ToolCall],
  episode_id: str,
  predict: Callable[[str], str | None] | None = None,
) -> Trajectory:
  """Teacher-forced trajectory of `task`'s ground truth. Raises if the environment fails.

  The replies are `chat.assistant_ids` (a call's arguments are plain text: a ground-truth
  argument holding `<|im_end|>` does not end its reply); prompt and observations are tokenized
  as in a rollout.

  Args:
    predict: Role-Agent's World-In-Agent (`wia.demo_predictor`): None for none; else the system
      prompt carries `wia.INSTRUCTION` as in a rollout, and each call's reply opens with
      `<predict_next>predict(observation)</predict_next>` (none where it returns None),
      `observation` being the text the environment then answers the call with
      (`wia.observation_text`; the call is executed before its reply is tokenized). A reply the
      episode ends on has no observation and no prediction.
  """
  env = make_env(task, episode_id)
  traj = Trajectory(task_id=task.task_id, group_id=-1)
  try:
    first = env.reset()
    system = env.system_prompt if predict is None else wia.system_prompt(env.system_prompt)
    messages = [{"role": "system", "content": system}] if system else []
    ids = chat.prompt_ids(messages + first.messages, env.tools)
    traj.prompt_len = len(ids)
    traj.extend(ids, sampled=False)
    result = first
    for turn_calls in task.ground_truth:
      for call_text in turn_calls:
        call = parse_call(call_text, task.involved_classes)
        calls = [{"name": call.name, "arguments": call.arguments}]
        action = Action(tool_calls=[call], text=chat.assistant_text("", calls))
        result = _reply(traj, chat, env, action, "", calls, predict)
        if result.done:  # the environment ended the episode (e.g. its per-turn step limit)
          break
      if result.done:
        break
      result = _reply(traj, chat, env, Action(text=CLOSING_REPLY), CLOSING_REPLY, [], None)
      if result.done:
        break
    traj.reward, traj.finish = float(result.reward), "done" if result.done else "incomplete"
    return traj
  finally:
    env.close()


def _reply(
  traj: Trajectory,
  chat: ChatFormat,
  env: Env,
  action: Action,
  content: str,
  calls: list[dict],
  predict: Callable[[str], str | None] | None,
):
  """Steps `env` with `action`, then appends its reply (`content` and `calls`, with the
  prediction of what `env` answered when `predict` is given) and its stop token, and what `env`
  answered."""
  result = env.step(action)
  if predict is not None and not result.done:
    prediction = predict(wia.observation_text(result.messages))
    if prediction is not None:
      content = wia.prediction_block(prediction) + content
  traj.extend(chat.assistant_ids(content, calls) + [chat.im_end_id], sampled=True)
  if not result.done:
    traj.extend(chat.continuation_ids(result.messages), sampled=False)
  return result


TARGET_GRANULE = 32  # `token_logprobs`' positions per vocabulary chunk for 4 rows (128 / 4)


def target_buckets(demos: Sequence[Trajectory], granule: int = TARGET_GRANULE) -> tuple[int, ...]:
  """The target counts P a warm-start batch is padded to (`make_batch`'s `target_buckets`):
  the multiples of `granule` up to the first that holds the demonstration with the most sampled
  tokens. A batch takes the smallest that holds its rows, so the vocabulary projection (most of
  a small model's SFT step) scores few padding positions, and the step compiles once per bucket
  (at most ceil(max / granule) shapes). CPU preset, D0 of 600: replies of 48 tokens on average,
  83 at most; P is 64 for most batches of 4 and 96 for the rest, against 96 or 128 before.

  Raises:
    ValueError: no demonstrations, or `granule` < 1.
  """
  if not demos or granule < 1:
    raise ValueError(f"target_buckets needs demonstrations and granule >= 1, got {granule}")
  most = max(1, max(d.num_generated for d in demos))
  return tuple(range(granule, -(-most // granule) * granule + 1, granule))


def sft_batches(
  demos: Sequence[Trajectory], batch_size: int, rng: np.random.Generator, steps: int
) -> Iterator[list[Trajectory]]:
  """`steps` batches drawn by epochs of shuffled demonstrations."""
  order: list[int] = []
  for _ in range(steps):
    batch: list[Trajectory] = []
    while len(batch) < batch_size:
      if not order:
        order = list(rng.permutation(len(demos)))
      batch.append(demos[order.pop()])
    yield batch


def describe(demos: Sequence[Trajectory]) -> str:
  lens = [len(d.token_ids) for d in demos]
  return json.dumps(
    {
      "demos": len(demos),
      "tokens_mean": float(np.mean(lens)),
      "tokens_max": int(max(lens)),
      "reward_mean": float(np.mean([d.reward for d in demos])),
    }
  )


def warm_start(
  trainer: PolicyTrainer,
  demos: Sequence[Trajectory],
  *,
  steps: int,
  batch_size: int,
  lr: float,
  grad_clip: float,
  rng: np.random.Generator,
  mesh: Any,
  compute_dtype: Any,
  log: Callable[[int, float], None],
  micro_batches: int = 1,
) -> None:
  """Supervised steps on `demos` (token-mean cross-entropy on their sampled tokens), then hands
  the weights to `trainer` with a fresh optimizer state.

  The learning rate warms up over min(10, steps / 5) steps to `lr`, then decays by a cosine to
  5% of it; batches are drawn by epochs of shuffled demonstrations (`sft_batches`, from `rng`);
  a batch is padded to the longest demonstration's tokens (T) and to `target_buckets`' P.

  Memory: the steps hold what a GRPO update holds, so a run that the start-up check let
  through fits its warm-start too. `trainer`'s own optimizer state (fresh: the warm-start runs
  before any update) is dropped while the warm-start's exists, instead of both being held, and
  its rollout weight copy is released (`PolicyTrainer.release_rollout_copy`); each step is cut
  into `micro_batches` gradient-accumulation slices (`memory_plan.warmstart_micro_batches`:
  no more rows per device at a time than an update's slice).

  Args:
    trainer: the run's policy trainer (its objective, mesh and compute dtype are reused).
    demos: teacher-forced trajectories (`Suite.demonstration`), at least one.
    log: called with (step, loss) every 10 steps and at the last.
    micro_batches: gradient-accumulation slices per step (the accumulated gradient is the
      whole batch's: token-mean over the batch).
  """
  print(f"warm-start on {describe(demos)}")
  warmup = min(10, max(1, steps // 5))
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * 0.05)
  trainer.release_rollout_copy()
  trainer.opt_state = None  # made again below (`reset_optimizer`): one optimizer state at a time
  sft = PolicyTrainer(
    trainer.model(),
    make_optimizer(schedule, 0.0, grad_clip),
    trainer.cfg,
    1.0,
    mesh=mesh,
    micro_batches=micro_batches,
    compute_dtype=compute_dtype,
  )
  t_max = max(len(d.token_ids) for d in demos)  # T: t_max, or a batch's bucket above it
  p_buckets = target_buckets(demos)  # P: a few multiples of 32
  batches = sft_batches(demos, batch_size, rng, steps)
  for i, batch in enumerate(tqdm.tqdm(batches, total=steps, desc="warm-start")):
    loss = sft.sft_update(make_batch(batch, min_len=t_max, target_buckets=p_buckets))
    if i % 10 == 0 or i == steps - 1:
      log(i, loss)
  trainer.params = sft.params
  trainer.reset_optimizer()
