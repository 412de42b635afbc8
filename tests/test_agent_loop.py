"""The agent loop end to end on real BFCL entries, with a scripted engine replaying ground truth.

The scripted engine implements the engine's slot interface and emits, per episode, the token ids
of the ground-truth replies (one call per reply, then a closing reply per user turn). Everything
else is real: chat template, token accumulation, tool-call parsing, BFCL execution, the official
checker. This pins down the loop's semantics independently of any model.
"""

import jax
import numpy as np
import pytest

from coevolve_jax.agent import AgentRunner, EpisodeLimits, QwenChat
from coevolve_jax.rollout.sampling import SamplingParams
from coevolve_jax.warmstart import CLOSING_REPLY, demonstration
from envs import bfcl


class ScriptedEngine:
  """Decode slots that replay a fixed list of replies (token ids) per episode, in order."""

  def __init__(self, scripts_by_prompt_prefix, num_slots=3, cache_len=100_000):
    self.scripts = scripts_by_prompt_prefix  # first prompt token ids (tuple) -> list of replies
    self.num_slots, self.cache_len = num_slots, cache_len
    self.pos = [0] * num_slots
    self.queue: list[list[int]] = [[] for _ in range(num_slots)]
    self.replies: list[list[list[int]]] = [[] for _ in range(num_slots)]
    self.fed: list[list[int]] = [[] for _ in range(num_slots)]

  def reset_slot(self, slot):
    self.pos[slot], self.fed[slot], self.queue[slot] = 0, [], []

  def room(self, slot):
    return self.cache_len - self.pos[slot]

  def prefill(self, slot, ids, rng, sampling):
    if not self.fed[slot]:
      self.replies[slot] = [list(r) for r in self.scripts[tuple(ids)]]
    self.fed[slot] += ids
    self.pos[slot] += len(ids)
    self.queue[slot] = self.replies[slot].pop(0)
    return self.queue[slot].pop(0), -0.5

  def generate(self, active, rng, sampling):
    toks = np.zeros(self.num_slots, np.int32)
    for s in np.flatnonzero(active):
      toks[s] = self.queue[s].pop(0)
      self.pos[s] += 1
    return toks, np.full(self.num_slots, -0.5, np.float32)


def _make_env(task, episode_id):
  return bfcl.make_env(task, episode_id, max_obs_chars=2000, tool_style="compact")


@pytest.fixture(scope="module")
def entries():
  return bfcl.load_bfcl_tasks("multi_turn_base")[:5]


def test_ground_truth_replay_through_the_full_loop_scores_one(entries):
  chat = QwenChat()
  scripts = {}
  for task in entries:
    demo = demonstration(task, chat, _make_env, bfcl.parse_call_string, "script")
    assert demo.reward == 1.0, task.task_id
    replies, cur = [], []
    for tok, m in zip(demo.token_ids, demo.loss_mask):
      if m:
        cur.append(tok)
        if tok == chat.im_end_id:
          replies.append(cur)
          cur = []
    scripts[tuple(demo.token_ids[:demo.prompt_len])] = replies
  engine = ScriptedEngine(scripts, num_slots=3)  # fewer slots than episodes: slots are reused
  runner = AgentRunner(engine, chat, _make_env, EpisodeLimits(max_new_tokens=4096,
                                                              max_model_steps=200))
  trajs = runner.run(
    [(t, i) for i, t in enumerate(entries)], SamplingParams(0.0), rng=jax.random.key(0)
  )
  assert [t.task_id for t in trajs] == [t.task_id for t in entries]
  for task, traj in zip(entries, trajs):
    assert traj.finish == "done" and traj.reward == 1.0, (task.task_id, traj.info.get("checker"))
    norm = lambda turns: [[bfcl.parse_call_string(c, task.involved_classes) for c in turn]  # noqa
                          for turn in turns]
    assert norm(traj.calls) == norm(task.ground_truth)
    # The masked tokens decode to exactly the assistant replies, and nothing else is masked.
    sampled = [t for t, m in zip(traj.token_ids, traj.loss_mask) if m]
    text = chat.decode(sampled)
    assert text.count("<tool_call>") == sum(len(turn) for turn in task.ground_truth)
    assert text.count(CLOSING_REPLY) == len(task.ground_truth)
    assert "<tool_response>" not in text and "<|im_start|>" not in text


def test_malformed_and_code_like_replies_become_error_observations(entries):
  chat = QwenChat()
  task = entries[0]
  bad = ['<tool_call>\n{"name": "ls", "arguments": {"a": tru}\n</tool_call>',  # malformed JSON
         '<tool_call>\n{"name": "__import__(\'os\').system", "arguments": {}}\n</tool_call>',
         '<tool_call>\n{"name": "ls", "arguments": {"a": true}}']  # no closing tag
  env = _make_env(task, "probe")
  first = env.reset()
  prompt = chat.prompt_ids([{"role": "system", "content": env.system_prompt}] + first.messages,
                           env.tools)
  env.close()
  replies = [chat.encode(b) + [chat.im_end_id] for b in bad]
  replies.append(chat.encode(CLOSING_REPLY) + [chat.im_end_id])
  replies += [chat.encode(CLOSING_REPLY) + [chat.im_end_id]] * (len(task.turns) - 1)
  engine = ScriptedEngine({tuple(prompt): replies}, num_slots=1)
  runner = AgentRunner(engine, chat, _make_env, EpisodeLimits(4096, 50))
  (traj,) = runner.run([(task, 0)], SamplingParams(0.0), rng=jax.random.key(0))
  assert traj.finish == "done" and traj.reward == 0.0
  assert traj.parse_errors == 2  # malformed JSON, unclosed block
  observations = chat.decode(traj.token_ids[traj.prompt_len:])
  assert "invalid JSON" in observations
  assert "invalid tool call" in observations or "unknown tool" in observations
