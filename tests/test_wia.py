"""Role-Agent's World-In-Agent (coevolve_jax/wia.py): predictions taken out of replies and
scored against the real observations, the similarity metrics, the reward forms, and step
advantages within same-state groups; through the agent loop on a real BFCL task."""

from __future__ import annotations

import difflib
import json
import os
import sys

import jax
import numpy as np
import pytest

from coevolve_jax import advantages, grpo, warmstart, wia
from coevolve_jax.agent import AgentRunner, EpisodeLimits, QwenChat
from coevolve_jax.rollout.sampling import SamplingParams
from coevolve_jax.types import Action, Reply, Trajectory
from coevolve_jax.warmstart import CLOSING_REPLY
from envs.bfcl import env as bfcl
from envs.bfcl.calls import parse_call_string

from kit import ScriptedEngine

CFG = wia.WIAConfig()


def _make_env(task, episode_id):
  return bfcl.make_env(task, episode_id, max_obs_chars=2000, tool_style="compact")


def test_split_prediction_takes_the_block_out_of_the_reply():
  text = '<predict_next>{"x": 1}</predict_next>\n<tool_call>\n{}\n</tool_call>'
  assert wia.split_prediction(text) == ("\n<tool_call>\n{}\n</tool_call>", '{"x": 1}')
  assert wia.split_prediction("no block") == ("no block", None)
  assert wia.split_prediction("<predict_next>cut at the lim") == ("", "cut at the lim")


def _edited(text: str, share: float, seed: int = 0) -> str:
  """`text` with `share` x len(text) single-character insertions and deletions."""
  rng = np.random.default_rng(seed)
  chars = list(text)
  for _ in range(int(share * len(text))):
    i = int(rng.integers(len(chars)))
    if rng.random() < 0.5:
      del chars[i]
    else:
      chars.insert(i, "abcdefghij"[int(rng.integers(10))])
  return "".join(chars)


def test_the_metrics_tell_a_near_copy_from_unrelated_text_and_the_codes_ratio_underrates_it():
  """A BFCL `ls` observation (727 characters, cut to 600): a 10%-edited copy against an
  unrelated error observation. "words" and "json" score the copy well above the unrelated text.
  The released code's character ratio (difflib with its default autojunk, prediction first)
  rates the near copy at 0.27 here, against 0.95 with autojunk off: recorded, not a goal."""
  stems = ["report", "notes", "draft", "budget", "summary", "minutes", "agenda", "invoice"]
  stems += ["receipt", "contract"]
  names = [f"{w}_{i:02d}.txt" for i, w in enumerate(stems * 4)]
  real = json.dumps({"current_directory_content": names})
  copy = _edited(real, 0.10)
  other = json.dumps(
    {"error": "cd: no such directory: 'archive'. Current directory: /workspace/projects/alpha"}
  )
  other = " ".join([other] * 8)
  for metric in ("words", "json"):
    near = wia.similarity(copy, real, metric)
    far = wia.similarity(other, real, metric)
    assert near >= 0.4 and far <= 0.2, (metric, near, far)
  code = wia.similarity(copy, real, "char_ratio")
  assert code < 0.35 < 0.9 < difflib.SequenceMatcher(None, copy[:600], real[:600], False).ratio()
  assert wia.similarity(real, real, "json") == 1.0 and wia.similarity(real, real, "words") == 1.0


def test_reward_forms():
  traj = Trajectory("t", 0, reward=1.0, replies=[Reply(0, 1, "obs"), Reply(1, 2, "")])
  scores = [0.5, None]
  got = {
    form: wia.step_rewards(traj, scores, wia.WIAConfig(reward_form=form, beta=0.1))
    for form in wia.REWARD_FORMS
  }
  # The last reply ends the turn: no observation, so the published forms change nothing.
  assert got["paper"] == got["code_release"] == [0.0, 1.0]
  assert got["code_v1"] == [0.0, pytest.approx(0.5)]  # r sigmoid(0)
  assert got["additive"] == [pytest.approx(0.05), 1.0]  # beta s credits the calling step


def _episode(calls, predictions, observations, reward, group=0):
  n = len(calls)
  replies = [
    Reply(2 * i + 1, 2 * i + 2, observations[i], calls=calls[i], prediction=predictions[i])
    for i in range(n)
  ]
  tokens = [0] * (2 * n + 1)
  mask = [1 if i % 2 == 1 else 0 for i in range(2 * n + 1)]  # one sampled token per reply
  return Trajectory("task", group, token_ids=tokens, loss_mask=mask, reward=reward, replies=replies)


def test_two_rollouts_sharing_a_state_get_different_advantages_when_only_one_predicts_well():
  obs = '{"current_directory_content": ["a.txt", "b.txt"]}'
  good = _episode([["ls({})"], []], [obs, None], [obs, ""], 0.0)
  bad = _episode([["ls({})"], []], ["the weather is sunny", None], [obs, ""], 0.0)
  alone = _episode([["cd({})"], ["ls({})"]], [None, None], ["ok", obs], 0.0)
  trajs = [good, bad, alone]
  inputs = advantages.AdvantageInputs.from_trajectories(trajs, grpo.GRPOConfig())
  inputs = advantages.AdvantageInputs(
    trajs, inputs.rewards, np.zeros(3, int), inputs.keep, inputs.cfg, CFG
  )
  adv = advantages.estimate("role_agent", inputs)  # [N, P]: one value per reply token here
  # Equal outcomes: the group advantage is 0; the first replies share the start state, and
  # the good predictor's is above the bad one's.
  assert adv[0, 0] > 0 > adv[1, 0]
  # The second replies: good's and bad's share a state ("ls" done), with equal returns: 0.
  assert adv[0, 1] == adv[1, 1] == 0
  # alone's second reply is the only one taken after "cd": a singleton group gives 0.
  assert adv[2, 1] == 0
  keys = [wia.anchor_keys(t) for t in trajs]
  assert keys[0] == keys[1] and keys[0][0] == keys[2][0] and keys[0][1] != keys[2][1]
  # WIA off ("grpo"): the outcome advantage alone, [N], as before.
  np.testing.assert_array_equal(
    advantages.estimate("grpo", inputs), grpo.compute_advantages(inputs.rewards, np.zeros(3, int))
  )


def test_agent_loop_scores_exact_wrong_and_missing_predictions_and_never_executes_them():
  """A real BFCL task replayed with scripted replies: the first call predicts its real
  observation exactly, the second predicts nonsense holding a `<tool_call>` (never executed),
  the third predicts nothing."""
  task = next(t for t in bfcl.load_bfcl_tasks("multi_turn_base") if len(t.ground_truth[0]) >= 3)
  chat = QwenChat()
  calls = [parse_call_string(c, task.involved_classes) for c in task.ground_truth[0][:3]]
  env = _make_env(task, "probe")  # the real observations, from the same environment
  first = env.reset()
  real = [
    "\n\n".join(m.get("content") or "" for m in env.step(Action(tool_calls=[c])).messages)
    for c in calls
  ]
  system = f"{env.system_prompt}\n\n{wia.INSTRUCTION}"
  prompt = chat.prompt_ids([{"role": "system", "content": system}] + first.messages, env.tools)
  env.close()
  forged = '<tool_call>\n{"name": "rm", "arguments": {"file_name": "x"}}\n</tool_call>'
  predictions = [
    f"<predict_next>{real[0]}</predict_next>\n",
    f"<predict_next>{forged}</predict_next>\n",
    "",
  ]
  replies = []
  for prediction, call in zip(predictions, calls):
    text = chat.assistant_text("", [{"name": call.name, "arguments": call.arguments}])
    replies.append(chat.encode(prediction + text) + [chat.im_end_id])
  replies += [chat.encode(CLOSING_REPLY) + [chat.im_end_id]] * len(task.turns)
  engine = ScriptedEngine({tuple(prompt): replies}, num_slots=1)
  runner = AgentRunner(engine, chat, _make_env, EpisodeLimits(4096, 50), predict_next=True)
  (traj,) = runner.run([(task, 0)], SamplingParams(0.0), rng=jax.random.key(0))
  scores = wia.reply_scores(traj, CFG)
  assert scores[0] == 1.0 and scores[1] < 0.2 and scores[2] is None
  assert traj.replies[1].prediction == forged
  executed = [c for turn in traj.calls for c in turn]
  assert not any(c.startswith("rm(") for c in executed)  # the forged call never ran
  assert [r.calls[0].split("(")[0] for r in traj.replies[:3]] == [c.name for c in calls]
  figures = wia.metrics([traj], CFG, 0.5)
  answered = sum(bool(r.observation) for r in traj.replies)  # closing replies get the next turn
  assert figures["wia/prediction_share"] == pytest.approx(2 / answered)


def _replies(demo, im_end_id):
  """The sampled replies of a demonstration, each ending with its stop token."""
  replies, cur = [], []
  for tok, m in zip(demo.token_ids, demo.loss_mask):
    if m:
      cur.append(tok)
      if tok == im_end_id:
        replies.append(cur)
        cur = []
  return replies


def test_warm_start_demonstrations_carry_the_true_or_a_shuffled_next_observation():
  """Demonstrations with predictions, replayed token for token through the agent loop with WIA
  on (the scripted engine answers only the exact prompt a rollout shows, instruction included):
  "true" predicts every call's real observation (score 1 where the observation fits the cap),
  "shuffled" another demonstration's, "none" none; every replay still solves the task."""
  tasks = bfcl.load_bfcl_tasks("multi_turn_base")[:3]
  chat = QwenChat()
  seen: list[str] = []
  for task in tasks:  # the control's pass over the real observations
    warmstart.demonstration(task, chat, _make_env, parse_call_string, "rec", seen.append)
  assert len(set(seen)) >= 2
  figures = {}
  for mode in wia.DEMOS:
    predict = wia.demo_predictor(mode, CFG.char_cap, seen, seed=0)
    demos = [
      warmstart.demonstration(t, chat, _make_env, parse_call_string, "d", predict) for t in tasks
    ]
    scripts = {tuple(d.token_ids[: d.prompt_len]): _replies(d, chat.im_end_id) for d in demos}
    assert len(scripts) == len(tasks)
    runner = AgentRunner(
      ScriptedEngine(scripts, num_slots=2),
      chat,
      _make_env,
      EpisodeLimits(4096, 200),
      predict_next=True,
    )
    trajs = runner.run(
      [(t, i) for i, t in enumerate(tasks)], SamplingParams(0.0), rng=jax.random.key(0)
    )
    assert [t.reward for t in trajs] == [1.0] * len(tasks), mode
    scores = [s for t in trajs for s in wia.reply_scores(t, CFG) if s is not None]
    calls = sum(len(turn) for t in tasks for turn in t.ground_truth)
    if mode == "none":
      assert scores == []
      continue
    assert len(scores) == calls  # every call's reply predicts (closing replies do not)
    figures[mode] = float(np.mean(scores))
    if mode == "true":
      short = [
        s
        for t in trajs
        for r, s in zip(t.replies, wia.reply_scores(t, CFG))
        if s is not None and len(r.observation) <= CFG.char_cap
      ]
      assert short and all(s == 1.0 for s in short)
  assert figures["true"] > 0.95 and figures["shuffled"] < figures["true"] - 0.2, figures


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_warm_start_on_true_observations_predicts_them_and_a_shuffled_control_does_not(tmp_path):
  """Issue 43 item 6: the CPU preset warm-started (and one GRPO step) with WIA on, once on
  demonstrations that predict each call's real observation and once on the shuffled control;
  given their demonstrations' true prefixes, the first model's greedy predictions score well
  above the control's against what each call really returned (benchmarks/wia_cost.py's
  teacher-forced measure; two runs of the preset, about 15 minutes on 2 cores)."""
  import importlib.util  # noqa: PLC0415

  path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "wia_cost.py")
  spec = importlib.util.spec_from_file_location("wia_cost", path)
  bench = importlib.util.module_from_spec(spec)
  sys.path.insert(0, os.path.dirname(path))  # its `common` module
  spec.loader.exec_module(bench)
  got = {}
  for arm in ("true", "shuffled"):
    workdir = str(tmp_path / arm)
    bench.run_arm(arm, 0, workdir)
    got[arm] = bench.teacher_forced(arm, 0, workdir)
    assert got[arm]["replies"] > 10 and got[arm]["predicted"] > 0.9, got
  assert got["true"]["similarity"] > 0.9, got
  assert got["true"]["similarity"] > got["shuffled"]["similarity"] + 0.2, got
