"""The agent loop end to end on real BFCL entries, with a scripted engine replaying ground truth.

The scripted engine (tests/kit.py) implements the engine's slot interface (`SlotEngine`) and
emits, per episode, the token ids of the ground-truth replies (one call per reply, then a closing
reply per user turn). Everything else is real: chat template, token accumulation, tool-call
parsing, BFCL execution, the official checker. This pins down the loop's semantics independently
of any model.
"""

import inspect
import threading
import time

import jax
import numpy as np
import pytest

from coevolve_jax import evaluation
from coevolve_jax.agent import AgentRunner, ChatFormat, EpisodeLimits, QwenChat
from coevolve_jax.rollout.sampling import SamplingParams
from coevolve_jax.rollout.slots import SlotEngine
from coevolve_jax.rollout.slots import StepsByGenerate
from coevolve_jax.warmstart import CLOSING_REPLY, demonstration
from envs.bfcl import env as bfcl
from coevolve_jax.types import Task

import kit
from kit import FakeChat, IdChat, RunOnEngine, ScriptedEngine, StepEnv


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
    scripts[tuple(demo.token_ids[: demo.prompt_len])] = replies
  engine = ScriptedEngine(scripts, num_slots=3)  # fewer slots than episodes: slots are reused
  runner = AgentRunner(
    engine, chat, _make_env, EpisodeLimits(max_new_tokens=4096, max_model_steps=200)
  )
  trajs = runner.run(
    [(t, i) for i, t in enumerate(entries)], SamplingParams(0.0), rng=jax.random.key(0)
  )
  assert [t.task_id for t in trajs] == [t.task_id for t in entries]
  for task, traj in zip(entries, trajs):
    assert traj.finish == "done" and traj.reward == 1.0, (task.task_id, traj.info.get("checker"))
    classes = task.involved_classes

    def norm(turns, classes=classes):
      return [[bfcl.parse_call_string(c, classes) for c in turn] for turn in turns]

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
  bad = [
    '<tool_call>\n{"name": "ls", "arguments": {"a": tru}\n</tool_call>',  # malformed JSON
    '<tool_call>\n{"name": "__import__(\'os\').system", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "ls", "arguments": {"a": true}}',  # no closing tag
    '<tool_call>\n{"name": "cd", "arguments": {"folder": "a", "folder": "b"}}\n</tool_call>',
  ]
  env = _make_env(task, "probe")
  first = env.reset()
  prompt = chat.prompt_ids(
    [{"role": "system", "content": env.system_prompt}] + first.messages, env.tools
  )
  env.close()
  replies = [chat.encode(b) + [chat.im_end_id] for b in bad]
  replies.append(chat.encode(CLOSING_REPLY) + [chat.im_end_id])
  replies += [chat.encode(CLOSING_REPLY) + [chat.im_end_id]] * (len(task.turns) - 1)
  engine = ScriptedEngine({tuple(prompt): replies}, num_slots=1)
  runner = AgentRunner(engine, chat, _make_env, EpisodeLimits(4096, 50))
  (traj,) = runner.run([(task, 0)], SamplingParams(0.0), rng=jax.random.key(0))
  assert traj.finish == "done" and traj.reward == 0.0
  assert traj.parse_errors == 3  # malformed JSON, unclosed block, a repeated key
  # The one well-formed call (a name the backend refuses) is the only reply with a tool call.
  assert traj.tool_call_replies == 1
  assert evaluation.reply_rates([traj]) == {
    "tool_call_rate": 1 / traj.model_steps,
    "parse_error_rate": 3 / traj.model_steps,
  }
  observations = chat.decode(traj.token_ids[traj.prompt_len :])
  assert "invalid JSON" in observations
  assert "invalid tool call" in observations or "unknown tool" in observations
  assert "duplicate key 'folder'" in observations
  assert traj.calls == [[] for _ in task.turns]  # none of them ran


def _first_prompt(chat, task, make_env=_make_env):
  env = make_env(task, "probe")
  try:
    first = env.reset()
    return chat.prompt_ids(
      [{"role": "system", "content": env.system_prompt}] + first.messages, env.tools
    )
  finally:
    env.close()


def _ticket_task(entries):
  return next(
    t for t in bfcl.load_bfcl_tasks("multi_turn_base") if "TicketAPI" in t.involved_classes
  )


def test_masked_tokens_decode_to_exactly_the_assistant_text(entries):
  chat = QwenChat()
  task = entries[0]  # GorillaFileSystem + TwitterAPI, 4 user turns
  texts = [
    # Two calls in one reply, one with list-valued arguments.
    '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": '
    '"post_tweet", "arguments": {"content": "hi", "tags": ["#a", "#b"], "mentions": []}}\n'
    "</tool_call>",
    '<tool_call>\n{"name": "ls", "arguments": {"a": tru}\n</tool_call>',  # malformed JSON
    '<tool_call>\n{"name": "ls", "arguments": ["a"]}\n</tool_call>',  # list, not an object
    "Done.",  # ends turn 1
  ] + ["Done."] * (len(task.turns) - 1)
  cut = '<tool_call>\n{"name": "ls", "arguments": {"a": "' + "x" * 400 + '"}}\n</tool_call>'
  limit = 64  # more than any full reply above takes
  replies = [chat.encode(t) + [chat.im_end_id] for t in texts]
  cut_ids = chat.encode(cut)
  assert len(cut_ids) > limit and max(map(len, replies)) <= limit
  replies.insert(3, cut_ids)  # sampled until the token limit: cut, no end-of-turn token
  engine = ScriptedEngine({tuple(_first_prompt(chat, task)): replies}, num_slots=1)
  runner = AgentRunner(
    engine, chat, _make_env, EpisodeLimits(max_new_tokens=limit, max_model_steps=50)
  )
  (traj,) = runner.run([(task, 0)], SamplingParams(0.0), rng=jax.random.key(0))
  assert traj.finish == "done" and traj.model_steps == len(replies)
  assert traj.parse_errors == 3  # malformed JSON, list arguments, the cut reply
  mask = np.array(traj.loss_mask, bool)
  sampled = [t for t, m in zip(traj.token_ids, mask) if m]
  want_ids = (
    [t for r in replies[:3] for t in r] + cut_ids[:limit] + [t for r in replies[4:] for t in r]
  )
  assert sampled == want_ids
  want_text = (
    "".join(t + "<|im_end|>" for t in texts[:3])
    + chat.decode(cut_ids[:limit])
    + "".join(t + "<|im_end|>" for t in texts[3:])
  )
  assert chat.decode(sampled) == want_text
  # Log-probs exactly on the sampled tokens; the template closes the cut reply (mask 0).
  assert all((lp != 0.0) == m for lp, m in zip(traj.logprobs, mask))
  cut_end = [k for k in range(1, len(mask)) if mask[k - 1] and not mask[k]]
  assert any(traj.token_ids[k] == chat.im_end_id for k in cut_end)
  # The two calls of the first reply ran, in order, with the list argument intact.
  assert traj.calls[0][:2] == ["ls()", "post_tweet(content='hi', tags=['#a', '#b'], mentions=[])"]
  observations = chat.decode(traj.token_ids[traj.prompt_len :])
  assert "invalid JSON" in observations and "must be a JSON object" in observations
  assert "cut off at the token limit" in observations


def test_dict_valued_arguments_reach_the_backend(entries):
  chat = QwenChat()
  task = _ticket_task(entries)
  text = (
    '<tool_call>\n{"name": "edit_ticket", "arguments": {"ticket_id": 1, "updates": '
    '{"priority": 3, "status": "open"}}}\n</tool_call>'
  )
  replies = [chat.encode(text) + [chat.im_end_id]] + [
    chat.encode("Done.") + [chat.im_end_id]
  ] * len(task.turns)
  engine = ScriptedEngine({tuple(_first_prompt(chat, task)): replies}, num_slots=1)
  runner = AgentRunner(engine, chat, _make_env, EpisodeLimits(4096, 50))
  (traj,) = runner.run([(task, 0)], SamplingParams(0.0), rng=jax.random.key(0))
  assert traj.parse_errors == 0 and traj.finish == "done"
  assert traj.tool_call_replies == 1 and traj.model_steps == 1 + len(task.turns)
  assert traj.calls[0] == ["edit_ticket(ticket_id=1, updates={'priority': 3, 'status': 'open'})"]


def test_limits_on_steps_and_observation_length(entries):
  chat = QwenChat()
  task = entries[0]
  ls = chat.encode('<tool_call>\n{"name": "ls", "arguments": {"a": true}}\n</tool_call>') + [
    chat.im_end_id
  ]

  def short_obs_env(t, episode_id):
    return bfcl.make_env(t, episode_id, max_obs_chars=10, tool_style="compact")

  engine = ScriptedEngine({tuple(_first_prompt(chat, task, short_obs_env)): [ls] * 10}, num_slots=1)
  runner = AgentRunner(engine, chat, short_obs_env, EpisodeLimits(4096, max_model_steps=3))
  (traj,) = runner.run([(task, 0)], SamplingParams(0.0), rng=jax.random.key(0))
  assert traj.finish == "max_model_steps" and traj.model_steps == 3 and traj.reward == 0.0
  observations = chat.decode(traj.token_ids[traj.prompt_len :])
  assert observations.count("[truncated ") == 2  # the third observation is never fed


class _ThreadEnv:
  """Episode "slow" blocks in step() until released; "fast" episodes end after one step."""

  system_prompt, tools = None, []
  observations: list[list[str]] = []  # no outputs kept (`Env.observations`)

  def __init__(self, task, release, log):
    self.task, self.release, self.log = task, release, log
    self.calls = [[]]

  def reset(self):
    return _step_result([{"role": "user", "content": self.task.task_id}])

  def step(self, action):
    self.log.append(("step", self.task.task_id, threading.current_thread().name))
    if self.task.task_id == "slow":
      assert self.release.wait(timeout=10), "the device loop never ran while this step blocked"
    return _step_result([], done=True, reward=1.0)

  def close(self):
    pass


def _step_result(messages, done=False, reward=0.0):
  from coevolve_jax.types import StepResult  # noqa: PLC0415

  return StepResult(messages=messages, done=done, reward=reward)


def _reply_step(left: dict, active, num_slots: int):
  """A fake engine's decode step: each active slot spends one of its `left` tokens and samples
  "x", or the stop id 0 with its last one; every log-prob is -0.1."""
  toks = np.zeros(num_slots, np.int32)
  for s in np.flatnonzero(active):
    left[s] -= 1
    toks[s] = ord("x") if left[s] > 0 else 0
  return toks, np.full(num_slots, -0.1, np.float32)


class _CountingEngine(StepsByGenerate):
  """Replies "x" then the stop id; "fast" episodes take 6 tokens. Releases the slow env once it
  has decoded 3 steps of another slot while the slow episode was out of the batch."""

  num_slots, cache_len = 2, 1000

  def __init__(self, release, log):
    self.release, self.log = release, log
    self.left = {}
    self.steps_without_slow = 0
    self.slow_slot = None

  def reset_slot(self, slot):
    pass

  def room(self, slot):
    return 1000

  def prefill_many(self, requests, sampling):
    return [self._prefill(slot, ids) for slot, ids, _ in requests]

  def _prefill(self, slot, ids):
    name = "".join(chr(i) for i in ids)
    if name == "slow":
      self.slow_slot = slot
    self.left[slot] = 1 if name == "slow" else 5
    return ord("x"), -0.1

  def generate(self, active, rng, sampling):
    self.log.append(("generate", tuple(np.flatnonzero(active))))
    if self.slow_slot is not None and not active[self.slow_slot]:
      self.steps_without_slow += 1
      if self.steps_without_slow >= 3:
        self.release.set()
    return _reply_step(self.left, active, self.num_slots)

  def routing(self, slot):
    return None


def test_env_steps_run_on_host_threads_while_other_slots_decode():
  release, log = threading.Event(), []
  engine = _CountingEngine(release, log)
  tasks = [
    Task(task_id=n, env="fake", turns=["q"], ground_truth=[[]]) for n in ("slow", "fast", "fast2")
  ]
  runner = AgentRunner(
    engine,
    FakeChat(),
    lambda t, e: _ThreadEnv(t, release, log),
    EpisodeLimits(100, 10),
    env_threads=2,
    reproducible=False,  # the overlap this test checks is what reproducible runs give up
  )
  trajs = runner.run(
    [(t, i) for i, t in enumerate(tasks)], SamplingParams(0.0), rng=jax.random.key(0)
  )
  assert [t.finish for t in trajs] == ["done"] * 3 and [t.reward for t in trajs] == [1.0] * 3
  steps = [e for e in log if e[0] == "step"]
  assert all(name.startswith("env") for _, _, name in steps)  # host threads, not the main one
  # After the slow episode's reply (2 tokens) its step blocked on a thread while the device kept
  # decoding the other slot, which the release required.
  assert release.is_set() and engine.steps_without_slow >= 3
  slow_slot = engine.slow_slot
  slow_done = log.index(next(e for e in steps if e[1] == "slow"))
  assert any(e[0] == "generate" and slow_slot not in e[1] for e in log[slow_done:])


class _SleepyEnv:
  """Three steps per episode, each sleeping a duration drawn from `durations` (seconds)."""

  system_prompt, tools = None, []
  observations: list[list[str]] = []  # no outputs kept (`Env.observations`)

  def __init__(self, task, durations):
    self.task, self.durations, self.calls, self.left = task, durations, [[]], 3

  def reset(self):
    return _step_result([{"role": "user", "content": self.task.task_id}])

  def step(self, action):
    time.sleep(next(self.durations))
    self.left -= 1
    return _step_result([{"role": "tool", "content": "ok"}], done=not self.left, reward=1.0)

  def close(self):
    pass


class _LoggingEngine(StepsByGenerate):
  """Every reply is `len(task id)` tokens ("x", then the stop id 0); logs each device call."""

  num_slots, cache_len = 3, 1000

  def __init__(self):
    self.calls, self.left, self.length = [], {}, {}

  def reset_slot(self, slot):
    pass

  def room(self, slot):
    return 1000

  def prefill_many(self, requests, sampling):
    self.calls.append(("prefill", tuple((slot, tuple(ids)) for slot, ids, _ in requests)))
    out = []
    for slot, ids, _ in requests:
      if ids != [1, 2]:  # a first prompt: the task id's characters
        self.length[slot] = len(ids)
      self.left[slot] = self.length[slot]
      out.append((ord("x"), -0.1))
    return out

  def generate(self, active, rng, sampling):
    self.calls.append(("generate", tuple(np.flatnonzero(active))))
    return _reply_step(self.left, active, self.num_slots)

  def routing(self, slot):
    return None


@pytest.mark.parametrize("reproducible", [True, False])
def test_reproducible_runs_make_the_same_device_calls_whatever_the_step_timings(reproducible):
  """With `reproducible` the prefill batches and decode masks depend on the jobs only, not on how
  long environment steps take (a batch of another shape may round the logits differently);
  without it they follow the timings (the check that the test can tell them apart)."""
  tasks = [Task(task_id="a" * n, env="fake", turns=["q"], ground_truth=[[]]) for n in (2, 3, 5, 4)]

  def calls(seed):
    rng = np.random.default_rng(seed)
    durations = iter(rng.choice([0.0, 0.03], size=64).tolist())
    engine = _LoggingEngine()
    runner = AgentRunner(
      engine,
      FakeChat(),
      lambda t, e: _SleepyEnv(t, durations),
      EpisodeLimits(100, 10),
      env_threads=3,
      reproducible=reproducible,
    )
    trajs = runner.run(
      [(t, i) for i, t in enumerate(tasks)], SamplingParams(0.0), jax.random.key(0)
    )
    assert [t.reward for t in trajs] == [1.0] * 4
    return engine.calls

  runs = [calls(seed) for seed in range(4)]
  if reproducible:
    assert all(r == runs[0] for r in runs)
  else:
    assert any(r != runs[0] for r in runs)


def _tiny_id_model():
  """A 2-layer, 64-token-vocabulary Qwen for `IdChat` episodes (ids are its vocabulary)."""
  return kit.tiny_model(3, vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8)


def _id_tasks(seed: int, lengths) -> list[Task]:
  """One `StepEnv` task per length: a user turn of that many random ids in [7, 64)."""
  rng = np.random.default_rng(seed)
  return [
    Task(task_id=f"t{i}", env="fake", turns=[rng.integers(7, 64, n).tolist()], ground_truth=[[]])
    for i, n in enumerate(lengths)
  ]


def _assert_batching_invariant(model, make_runner, jobs, temperature):
  """`make_runner(num_slots)`'s episodes started together equal the same jobs run one at a time
  through a single slot (tokens, masks, log-probs), and the trainer's recomputed log-probs of
  every sampled token equal the engine's."""
  from coevolve_jax.trainer import token_logprobs  # noqa: PLC0415

  sampling = SamplingParams(temperature=temperature)
  together = make_runner(len(jobs)).run(jobs, sampling, rng=jax.random.key(5))
  one_slot = make_runner(1).run(jobs, sampling, rng=jax.random.key(5))  # one at a time
  for traj, alone in zip(together, one_slot):
    assert traj.model_steps >= 2  # at least one continuation after an environment step
    assert traj.token_ids == alone.token_ids and traj.loss_mask == alone.loss_mask
    np.testing.assert_allclose(traj.logprobs, alone.logprobs, atol=1e-5)
  # One batched forward for all episodes (one program, as the trainer runs it): rows padded at the
  # end, which a causal model's earlier positions do not see; padded positions repeat a row's
  # last one.
  positions = [[i for i, m in enumerate(t.loss_mask) if m] for t in together]
  width, npos = max(len(t.token_ids) for t in together), max(map(len, positions))
  tokens = np.zeros((len(together), width), np.int32)
  pos = np.zeros((len(together), npos), np.int32)
  for r, (traj, p) in enumerate(zip(together, positions)):
    tokens[r, : len(traj.token_ids)] = traj.token_ids
    pos[r] = p + [p[-1]] * (npos - len(p))
  from flax import nnx  # noqa: PLC0415

  score = nnx.jit(token_logprobs, static_argnames="temperature")
  recomputed = np.asarray(score(model, tokens, pos, temperature=temperature))
  for r, (traj, p) in enumerate(zip(together, positions)):
    np.testing.assert_allclose(recomputed[r, : len(p)], [traj.logprobs[i] for i in p], atol=1e-5)


def test_tiny_real_engine_episodes_do_not_depend_on_batching():
  """The default-run version of the slow real-engine check below: the same invariance on a tiny
  64-token model with id-level chat and environment (prompts of three lengths, each episode
  continued after two environment steps)."""
  from coevolve_jax.rollout.engine import Engine  # noqa: PLC0415

  model = _tiny_id_model()
  tasks = _id_tasks(0, (5, 9, 12))

  def make_runner(num_slots):
    return AgentRunner(
      Engine(model, num_slots, 128),
      IdChat(),
      lambda task, _: StepEnv(task),
      EpisodeLimits(max_new_tokens=4, max_model_steps=3),
    )

  _assert_batching_invariant(model, make_runner, [(t, i) for i, t in enumerate(tasks)], 0.9)


@pytest.mark.slow
def test_real_engine_episodes_do_not_depend_on_batching(entries):
  """The real engine under the loop: three episodes started together (their prompts, and their
  continuations after each environment step, prefilled in batches) produce the same tokens as
  the same jobs run one at a time through a single slot, and the trainer's recomputed log-probs
  of every sampled token equal the engine's. Slow (a 151936-token model, real BFCL prompts in a
  4096-token cache); `test_tiny_real_engine_episodes_do_not_depend_on_batching` checks the same
  on a tiny model in the default run."""
  from flax import nnx  # noqa: PLC0415

  from coevolve_jax.models import Qwen, QwenConfig  # noqa: PLC0415
  from coevolve_jax.rollout.engine import Engine  # noqa: PLC0415

  model = Qwen(QwenConfig.tiny_cpu(), rngs=nnx.Rngs(3))
  limits = EpisodeLimits(max_new_tokens=4, max_model_steps=2)

  def make_runner(num_slots):
    return AgentRunner(Engine(model, num_slots, 4096), QwenChat(), _make_env, limits)

  _assert_batching_invariant(model, make_runner, [(t, i) for i, t in enumerate(entries[:3])], 0.9)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_decode_steps_per_call_give_the_single_step_episodes(temperature):
  """`AgentRunner(decode_steps=K)` decodes up to K tokens per engine call and gets the episodes
  of one call per token: every token, mask and log-prob (bitwise), finish and step count. Six
  episodes over four slots (slots reused), replies ended by the stop id and by the token limit,
  and an episode that runs out of its 48-token cache (the 30-token prompt's)."""
  from coevolve_jax.rollout.engine import Engine  # noqa: PLC0415

  model = _tiny_id_model()
  tasks = _id_tasks(1, (5, 9, 12, 3, 30, 7))
  jobs = [(t, i) for i, t in enumerate(tasks)]

  def run(k):
    runner = AgentRunner(
      Engine(model, 4, 48),
      IdChat(),
      lambda task, _: StepEnv(task, steps=3),
      EpisodeLimits(max_new_tokens=6, max_model_steps=3),
      decode_steps=k,
    )
    return runner.run(jobs, SamplingParams(temperature=temperature), rng=jax.random.key(2))

  want = run(1)
  assert "context" in {t.finish for t in want}  # the 30-token prompt's episode runs out of cache
  sampled = [[x for x, m in zip(t.token_ids, t.loss_mask) if m] for t in want]
  assert any(0 in ids for ids in sampled)  # a reply ended by the stop id (IdChat.im_end_id)
  for k in (3, 8):
    for w, g in zip(want, run(k), strict=True):
      assert (g.token_ids, g.loss_mask, g.finish, g.model_steps) == (
        w.token_ids,
        w.loss_mask,
        w.finish,
        w.model_steps,
      ), k
      assert np.array_equal(np.float32(g.logprobs), np.float32(w.logprobs)), k


def _signature_mismatches(cls, protocol) -> list[str]:
  """The methods of `protocol` that `cls` lacks or defines with other parameters (names, kinds,
  which have defaults)."""

  def params(fn):
    return [
      (p.name, p.kind, p.default is p.empty) for p in inspect.signature(fn).parameters.values()
    ]

  bad = []
  for name, ref in vars(protocol).items():
    if name.startswith("_") or not callable(ref):
      continue
    impl = getattr(cls, name, None)
    if impl is None:
      bad.append(f"{cls.__name__}.{name} is missing")
    elif params(impl) != params(ref):
      bad.append(f"{cls.__name__}.{name}{inspect.signature(impl)} != {inspect.signature(ref)}")
  return bad


def test_engines_and_chats_implement_the_declared_protocols():
  """Every engine the loop runs on implements `SlotEngine` in full, and every chat format
  `ChatFormat`: members present on instances (runtime_checkable) and methods with the protocol's
  parameters."""
  from coevolve_jax.rollout.engine import Engine  # noqa: PLC0415
  from coevolve_jax.testing.replay_engine import ReplayEngine  # noqa: PLC0415

  tiny = kit.tiny_model(
    0,
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
  )
  engines = [
    Engine(tiny, 2, 32),
    ReplayEngine(
      [], FakeChat(), _make_env, 2, parse_call=bfcl.parse_call_string, max_steps_per_turn=20
    ),
    ScriptedEngine({}),
    _CountingEngine(threading.Event(), []),
  ]
  for engine in engines:
    assert isinstance(engine, SlotEngine), type(engine).__name__
    assert not _signature_mismatches(type(engine), SlotEngine)
  for chat in (QwenChat(), FakeChat()):
    assert isinstance(chat, ChatFormat), type(chat).__name__
    assert not _signature_mismatches(type(chat), ChatFormat)
  # A single-slot-prefill engine (the interface before prefill_many) is not a SlotEngine.
  assert _signature_mismatches(type("Old", (), {"prefill": lambda self: 0}), SlotEngine)


# ------------------------------------------------------------------ every end-of-sequence id

ENDOFTEXT = 151643  # <|endoftext|>: Qwen3 instruct's generation_config.json lists it with 151645


def _checkpoint_with_generation_config(folder, eos_token_id=(151645, ENDOFTEXT)):
  """A Hugging Face folder written by save_pretrained, plus the generation_config.json of a
  Qwen3 instruct checkpoint; returns the model `models.build` loads from it."""
  import json  # noqa: PLC0415

  from coevolve_jax import models  # noqa: PLC0415
  from coevolve_jax.models import save_pretrained  # noqa: PLC0415

  tiny = kit.tiny_model(
    0,
    vocab_size=151936,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
  )
  save_pretrained(tiny, folder)
  generation = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": list(eos_token_id)}
  (folder / "generation_config.json").write_text(json.dumps(generation))
  return models.build({"preset": "tiny_cpu", "checkpoint": str(folder), "dtype": "float32"}, seed=0)


class _CallThenDoneEnv:
  """Step 1 answers the call with a tool message; step 2 ends the episode, reward 1 when both
  replies parsed to what was scripted."""

  system_prompt, tools = None, []
  observations: list[list[str]] = []  # no outputs kept (`Env.observations`)

  def __init__(self):
    self.calls, self.actions = [[]], []

  def reset(self):
    return _step_result([{"role": "user", "content": "Go to x."}])

  def step(self, action):
    self.actions.append(action)
    if len(self.actions) == 1:
      return _step_result([{"role": "tool", "content": "ok"}])
    from coevolve_jax.types import ToolCall  # noqa: PLC0415

    first, second = self.actions
    good = first.tool_calls == [ToolCall("cd", {"folder": "x"})] and second.text == "Done."
    return _step_result([], done=True, reward=float(good and second.error is None))

  def close(self):
    pass


def test_every_eos_id_of_the_checkpoint_ends_a_reply(tmp_path):
  """A reply that ends with <|endoftext|> (151643, in the checkpoint's generation_config.json)
  stops there: it is parsed and stepped, not run on to the token limit and scored 0."""
  model = _checkpoint_with_generation_config(tmp_path / "ckpt")
  assert model.config.eos_token_ids == (151645, ENDOFTEXT)
  chat = QwenChat()
  call = chat.assistant_text("", [{"name": "cd", "arguments": {"folder": "x"}}])
  replies = [chat.encode(call) + [ENDOFTEXT], chat.encode("Done.") + [ENDOFTEXT]]
  engine = RunOnEngine(replies, filler=chat.encode("x")[0])
  env = _CallThenDoneEnv()
  task = Task(task_id="t", env="fake", turns=["Go to x."], ground_truth=[[]])
  runner = AgentRunner(
    engine, chat, lambda t, e: env, EpisodeLimits(64, 5), stop_ids=model.config.eos_token_ids
  )
  (traj,) = runner.run([(task, 0)], SamplingParams(0.0), rng=jax.random.key(0))
  assert traj.finish == "done" and traj.reward == 1.0 and traj.model_steps == 2
  assert traj.parse_errors == 0 and [a.error for a in env.actions] == [None, None]
  # Each reply's last token is the sampled <|endoftext|>, in the loss mask with its log-prob;
  # the template's <|im_end|> that closes the turn was not sampled (mask 0).
  sampled = [(t, lp) for t, m, lp in zip(traj.token_ids, traj.loss_mask, traj.logprobs) if m]
  assert [t for t, _ in sampled] == replies[0] + replies[1]
  assert all(lp == -0.25 for _, lp in sampled)
  first_end = traj.prompt_len + len(replies[0])
  assert traj.token_ids[first_end - 1] == ENDOFTEXT and traj.loss_mask[first_end - 1] == 1
  assert traj.token_ids[first_end] == chat.im_end_id and traj.loss_mask[first_end] == 0
  # What the slot was fed after the first reply: the pending <|endoftext|>, <|im_end|>, then the
  # template's continuation for the tool message.
  assert engine.fed[1] == [ENDOFTEXT, chat.im_end_id] + chat.continuation_ids(
    [{"role": "tool", "content": "ok"}]
  )
  assert traj.token_ids[traj.prompt_len :] == (replies[0] + engine.fed[1][1:] + replies[1])


def test_stop_ids_are_checked():
  with pytest.raises(ValueError, match="stop_ids"):
    AgentRunner(ScriptedEngine({}), FakeChat(), _make_env, EpisodeLimits(), stop_ids=[-1])
  with pytest.raises(ValueError, match="stop_ids"):
    AgentRunner(ScriptedEngine({}), FakeChat(), _make_env, EpisodeLimits(), stop_ids=["151643"])
  runner = AgentRunner(ScriptedEngine({}), FakeChat(), _make_env, EpisodeLimits(), stop_ids=[7])
  assert runner.stop_ids == {0, 7}  # the chat's <|im_end|> always stops a reply
