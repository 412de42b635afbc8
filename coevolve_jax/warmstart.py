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

import numpy as np

from coevolve_jax.chat import ChatFormat
from coevolve_jax.types import Trajectory
from coevolve_jax.types import Action, Task, ToolCall
from envs.base import Env

CLOSING_REPLY = "Done."


def demonstration(
  task: Task,
  chat: ChatFormat,
  make_env: Callable[[Task, str], Env],
  parse_call: Callable[[str, list[str]], ToolCall],
  episode_id: str,
) -> Trajectory:
  """Teacher-forced trajectory of `task`'s ground truth. Raises if the environment fails."""
  env = make_env(task, episode_id)
  traj = Trajectory(task_id=task.task_id, group_id=-1)
  try:
    first = env.reset()
    system = [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
    ids = chat.prompt_ids(system + first.messages, env.tools)
    traj.prompt_len = len(ids)
    traj.extend(ids, sampled=False)
    result = first
    for turn_calls in task.ground_truth:
      for call_text in turn_calls:
        call = parse_call(call_text, task.involved_classes)
        reply = chat.assistant_text("", [{"name": call.name, "arguments": call.arguments}])
        result = _reply(traj, chat, env, reply, Action(tool_calls=[call], text=reply))
        if result.done:  # the environment ended the episode (e.g. its per-turn step limit)
          break
      if result.done:
        break
      result = _reply(traj, chat, env, CLOSING_REPLY, Action(text=CLOSING_REPLY))
      if result.done:
        break
    traj.reward, traj.finish = float(result.reward), "done" if result.done else "incomplete"
    return traj
  finally:
    env.close()


def _reply(traj: Trajectory, chat: ChatFormat, env: Env, text: str, action: Action):
  traj.extend(chat.encode(text) + [chat.im_end_id], sampled=True)
  result = env.step(action)
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
    batch = []
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
