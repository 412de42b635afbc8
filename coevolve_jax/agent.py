"""Multi-turn agent episodes with continuous batching over the engine's decode slots.

Each episode holds one decode slot for its whole life: its conversation stays in that slot's KV
cache across turns, so a new turn only prefills the new tokens (tool observations or the next user
message). While an episode's environment step runs on a host thread, its slot sits out of the
batch and the device decodes the others. When an episode ends its slot is freed and the next
waiting episode is inserted.

Token-in / token-out: the trajectory records exactly the sampled ids (loss mask 1) and the ids the
chat template inserts around them (mask 0); the conversation is never re-rendered.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from concurrent import futures
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from coevolve_jax import distributed, wia
from coevolve_jax.chat import ChatFormat
from coevolve_jax.rollout.generate import decode_tokens
from coevolve_jax.rollout.sampling import SamplingParams
from coevolve_jax.rollout.slots import SlotEngine, slot_order
from coevolve_jax.suite import Env
from coevolve_jax.types import Action, Reply, StepResult, Task, Trajectory

# The StepResult.info key by which an environment names the tools one step called, for actions
# that are not `<tool_call>` blocks (AppWorld's code: the APIs it calls). When a step's result
# has it, its names replace the parsed calls' names of that reply in `Trajectory.tool_names`,
# the action pattern of the rare signal; it is not copied into `Trajectory.info`.
STEP_TOOL_NAMES = "tool_names"


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
  """Per-episode limits (docs/design.md §1.1): 30 model steps, 4096 tokens per reply; an episode
  over a limit is a failure.

  Per-user-turn step limits belong to the environment (BFCL's official loop ends the episode).
  """

  max_new_tokens: int = 4096  # per model reply
  max_model_steps: int = 30  # model replies per episode

  @classmethod
  def for_evaluation(
    cls, tasks: Sequence[Task], max_new_tokens: int, max_steps_per_turn: int
  ) -> EpisodeLimits:
    """Limits that never cut an evaluation episode before its environment ends it: per user
    turn, `max_steps_per_turn` steps plus the replies that close the turn (BFCL's official loop
    has no episode-wide limit)."""
    turns = max((len(t.turns) for t in tasks), default=1)
    return cls(max_new_tokens, turns * (max_steps_per_turn + 2))


@dataclasses.dataclass
class _Episode:
  index: int
  traj: Trajectory
  env: Env
  slot: int
  key: jax.Array  # the episode's PRNG key; token n samples with fold_in(key, n)
  sampled: int = 0  # tokens sampled so far (all replies)
  last_tok: int = 0  # the last sampled token: pending, not yet in the slot's cache
  turn_ids: list[int] = dataclasses.field(default_factory=list)
  turn_logprobs: list[float] = dataclasses.field(default_factory=list)
  names_at: int = 0  # where the last reply's tool names start in traj.tool_names


def _timed_step(env: Env, action: Action) -> tuple[StepResult, float]:
  start = time.perf_counter()
  result = env.step(action)
  return result, time.perf_counter() - start


class _EnvOnPrimary:
  """What a process other than the primary holds for an episode whose environment runs on
  process 0 (`AgentRunner(env_on_primary=True)`): the tools and system prompt the primary's
  reset broadcast; its steps run on the primary (`AgentRunner._collect_steps` broadcasts their
  results), so it never executes anything itself.

  Raises:
    RuntimeError: from `reset` / `step`: calling them here is a bug in the caller.
  """

  def __init__(self, tools: list[dict], system_prompt: str | None):
    self.tools, self.system_prompt = tools, system_prompt
    self.calls: list[list[list[str]]] = []
    self.observations: list[list[str]] = []

  def reset(self) -> StepResult:
    raise RuntimeError("an environment on the primary was reset on another process")

  def step(self, action: Action) -> StepResult:
    raise RuntimeError("an environment on the primary was stepped on another process")

  def close(self) -> None:
    pass


def _outcome(fut: futures.Future, to_share: bool = False) -> dict:
  """A finished environment step: {"result": StepResult fields, "seconds": s}, or {"error":
  repr of what it raised}. `to_share` (it goes to the other processes as JSON): a result that
  JSON cannot carry is that step's error, so the collective never fails half-way."""
  try:
    result, seconds = fut.result()
    out = {"result": dataclasses.asdict(result), "seconds": seconds}
    if to_share:
      json.dumps(out)
  except Exception as e:  # environment failure: that episode fails, the batch goes on
    return {"error": repr(e)}
  return out


class AgentRunner:
  """Runs batches of episodes on an engine.

  Continuous batching: every episode holds a decode slot; when a reply ends, its environment step
  runs on a host thread while the device keeps decoding the other slots, and the episode rejoins
  the batch once the step's observation is prefilled. A finished episode frees its slot for the
  next job. Each episode samples with its own key (fold_in(rng, job index), then per token), so
  its sampling does not depend on which episodes share a step. The logits can: episodes that
  resume together are prefilled in one batch, and a batch of another shape is another XLA
  program whose float32 sums may round differently. With `reproducible` (the default) the
  batches are therefore fixed by the jobs, not by thread timing: every environment step in
  flight is awaited and the steps are handled in episode order (`_collect_steps`), so a seed
  gives the same rollouts run after run and on any number of processes.

  Args:
    engine: decode slots and KV cache (`rollout.slots.SlotEngine`: `num_slots`, `reset_slot`,
      `room`, `prefill_many` for the episodes that start or resume together, `generate`,
      `generate_steps`, `routing`: a MoE engine's routing record goes into
      `Trajectory.routing`).
    chat: the chat format (`ChatFormat`: `prompt_ids`, `continuation_ids`, `parse_tool_calls`,
      `decode`, `im_end_id`).
    make_env: `(task, episode_id) -> Env`.
    limits: episode limits.
    env_threads: host threads for environment steps (at least 1).
    reproducible: handle environment steps in episode order once all in flight are done (the
      same device calls whatever the step timings); False handles each step as it finishes and
      decodes the other slots meanwhile, faster with slow environments (AppWorld servers) but
      not reproducible run to run. Always on with several processes, which must make the same
      device calls in the same order.
    stop_ids: end-of-sequence ids of the checkpoint (`model.config.eos_token_ids`, from its
      config.json and generation_config.json); a reply ends at any of them or at
      `chat.im_end_id`. The id that ended a reply is the reply's last sampled token (loss mask
      1); when it is not `im_end_id`, an `<|im_end|>` (mask 0) closes the turn before the next
      messages, as the template writes every assistant turn.
    decode_steps: K, decode steps per device call (`Engine.generate_steps`: the engine stops at
      the step in which a reply ends, so the episodes, every token and log-prob included, are
      the same for every K, bit for bit: `decode_tokens`); 1 = one device call per token.
    env_on_primary: with several processes, the environments run on process 0 only (`make_env`
      is called there only) and each reset's, step's and episode record's result is broadcast
      to the other processes (`distributed.broadcast_json`, in episode order), which hold an
      `_EnvOnPrimary` instead: for environments that are one set of servers and files per job
      (AppWorld), and a guarantee that every process trains on the same results. Without it
      every process runs its own environments, which must then be deterministic (BFCL's). No
      effect in a single-process run.
    predict_next: Role-Agent's World-In-Agent (`wia`): the system prompt asks for a prediction of
      each call's result in `<predict_next>` blocks, which are taken out of each reply before
      its tool calls are parsed (never executed) and recorded as `Reply.prediction`.

  Raises:
    ValueError: env_threads or decode_steps < 1, or a stop id that is not a non-negative int.
  """

  def __init__(
    self,
    engine: SlotEngine,
    chat: ChatFormat,
    make_env: Callable[[Task, str], Env],
    limits: EpisodeLimits,
    env_threads: int = 4,
    stop_ids: Iterable[int] = (),
    reproducible: bool = True,
    decode_steps: int = 1,
    env_on_primary: bool = False,
    predict_next: bool = False,
  ):
    if env_threads < 1:
      raise ValueError(f"env_threads must be >= 1, got {env_threads}")
    if decode_steps < 1:
      raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
    stop_ids = list(stop_ids)
    if not all(
      isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in stop_ids
    ) or any(i < 0 for i in stop_ids):
      raise ValueError(f"stop_ids must be non-negative ints, got {stop_ids!r}")
    self.engine, self.chat, self.make_env, self.limits = engine, chat, make_env, limits
    self.env_threads = env_threads
    self.stop_ids = frozenset({chat.im_end_id, *(int(i) for i in stop_ids)})
    self._episode_counter = 0
    self.timings: dict[str, float] = collections.defaultdict(float)  # seconds in env steps
    self.lockstep = reproducible or jax.process_count() > 1  # see `_collect_steps`
    self.decode_steps = decode_steps
    self.env_on_primary = env_on_primary and jax.process_count() > 1
    self.predict_next = predict_next

  def run(
    self,
    jobs: Sequence[tuple[Task, int]],
    sampling: SamplingParams,
    rng: jax.Array,
    on_done: Callable[[Trajectory], None] | None = None,
  ) -> list[Trajectory]:
    """Runs one episode per (task, group_id) job; returns trajectories in job order."""
    pending = collections.deque(enumerate(jobs))
    # Per-run state, read by the episode callbacks below.
    self._sampling, self._on_done = sampling, on_done
    self._results: list[Trajectory | None] = [None] * len(jobs)
    self._free = slot_order(self.engine)[::-1]  # popped from the end: the order's first first
    self._active: dict[int, _Episode] = {}  # slot -> episode being decoded
    self._stepping: dict[futures.Future, _Episode] = {}  # env step in flight on a host thread
    self._slot_keys = jax.random.split(rng, self.engine.num_slots)
    self._to_prefill: list[tuple[_Episode, list[int]]] = []  # fed, prefilled together
    pool = futures.ThreadPoolExecutor(self.env_threads, thread_name_prefix="env")
    self._pool, interrupted = pool, False
    try:
      while pending or self._active or self._stepping:
        while pending and self._free:
          index, (task, group_id) = pending.popleft()
          self._start(index, task, group_id, self._free.pop(), jax.random.fold_in(rng, index))
        self._collect_steps(block=not self._active)
        self._flush_prefills()
        if not self._active:
          continue
        self._decode(sampling)
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM: environment steps in flight are not waited for
      interrupted = True
      raise
    finally:
      pool.shutdown(wait=not interrupted, cancel_futures=interrupted)
    return self._results  # type: ignore[return-value]

  def _decode(self, sampling: SamplingParams) -> None:
    """One decode step of every active episode, or up to `decode_steps` in one engine call; the
    tokens are handled step by step, as single steps would have been. While environment steps
    are in flight one step is taken, as single steps would be: the loop goes back to them (and
    to prefilling their episodes) after every step."""
    b = self.engine.num_slots
    mask, counts, limits = np.zeros((b,), bool), np.zeros((b,), np.int32), np.zeros((b,), np.int32)
    room = {slot: self.engine.room(slot) for slot in self._active}  # before the call
    for slot, ep in self._active.items():
      mask[slot], counts[slot] = True, ep.sampled
      # `_on_token`'s length rules as a count: the reply's token limit, or room <= 1.
      limits[slot] = min(self.limits.max_new_tokens - len(ep.turn_ids), room[slot] - 1)
    k = 1 if self._stepping else self.decode_steps
    tokens, logprobs = decode_tokens(
      self.engine, mask, self._slot_keys, counts, limits, self.stop_ids, sampling, k
    )
    slots = list(self._active)
    for j in range(len(tokens)):  # replies end at the engine call's last step, if at all
      for slot in slots:
        if slot not in self._active:
          raise RuntimeError(f"slot {slot}'s reply ended before the engine's last step")
        tok, logp = int(tokens[j, slot]), float(logprobs[j, slot])
        self._on_token(self._active[slot], tok, logp, room[slot] - j - 1)

  def _collect_steps(self, block: bool) -> None:
    """Handles finished environment steps; waits for one when nothing else can run.

    Lockstep (`reproducible`, and always with several processes, which must make the same device
    calls in the same order): which steps are handled cannot depend on thread timing, so each
    call waits for every step in flight and handles them in episode order (the environments are
    deterministic, so every process sees the same results). Otherwise the steps that are done
    are handled and the other slots decode meanwhile.
    """
    if not self._stepping:
      return
    if self.lockstep:
      futures.wait(list(self._stepping))
    elif block:
      futures.wait(list(self._stepping), return_when=futures.FIRST_COMPLETED)
    done = [f for f in self._stepping if f.done()]  # in submission order
    if self.lockstep:
      done.sort(key=lambda f: self._stepping[f].index)
    if self.env_on_primary:  # the primary's results, in episode order, on every process
      outcomes = distributed.broadcast_json(
        [_outcome(f, to_share=True) for f in done] if distributed.is_primary() else None
      )
    else:
      outcomes = [_outcome(f) for f in done]
    for fut, out in zip(done, outcomes):
      ep = self._stepping.pop(fut)
      if "error" in out:
        self._finish(ep, "error", info={"error": f"step: {out['error']}"})
        continue
      result = StepResult(**out["result"])
      self.timings["reward" if result.done else "env"] += out["seconds"]
      self._after_step(ep, result)

  def _finish(self, ep: _Episode, how: str, reward: float = 0.0, info: dict | None = None):
    """Ends an episode: records the outcome, closes its environment, frees its slot."""
    ep.traj.finish, ep.traj.reward = how, reward
    ep.traj.info.update(info or {})
    if ep.traj.token_ids:  # the slot was reset for this episode: its record is this episode's
      ep.traj.set_routing(self.engine.routing(ep.slot))
    if not ep.traj.calls:  # episodes cut short still report what they called, per user turn
      env = ep.env
      record = lambda: [  # noqa: E731
        [[c for step in turn for c in step] for turn in env.calls],
        [list(t) for t in env.observations],
      ]
      shared = self.env_on_primary
      ep.traj.calls, ep.traj.observations = distributed.on_primary(record) if shared else record()
    ep.env.close()
    self._results[ep.index] = ep.traj
    self._active.pop(ep.slot, None)
    self._free.append(ep.slot)
    if self._on_done:
      self._on_done(ep.traj)

  def _start(self, index, task, group_id, slot, key):
    self._episode_counter += 1
    episode_id = f"ep{self._episode_counter}"
    if self.env_on_primary:
      env, first = self._start_on_primary(task, episode_id)
    else:
      env = self.make_env(task, episode_id)
      try:
        first = env.reset()
      except Exception as e:  # an environment that fails to start fails this episode only
        first = repr(e)
    traj = Trajectory(task_id=task.task_id, group_id=group_id)
    ep = _Episode(index, traj, env, slot, key)
    self._active[slot] = ep
    self._slot_keys = self._slot_keys.at[slot].set(key)
    if not isinstance(first, StepResult):
      self._finish(ep, "error", info={"error": f"reset: {first}"})
      return
    system = env.system_prompt
    if self.predict_next:  # Role-Agent's WIA instruction, in training and evaluation alike
      system = wia.system_prompt(system)
    messages = [{"role": "system", "content": system}] if system else []
    ids = self.chat.prompt_ids(messages + first.messages, env.tools)
    traj.prompt_len = len(ids)
    traj.extend(ids, sampled=False)
    self.engine.reset_slot(slot)
    self._feed(ep, ids)

  def _start_on_primary(self, task: Task, episode_id: str) -> tuple[Env, StepResult | str]:
    """`env_on_primary`: the episode's environment made and reset on the primary, and what
    every process holds: the environment (the primary's own, an `_EnvOnPrimary` elsewhere) and
    the reset's result, or the repr of what it raised. A collective."""
    made: list[Env] = []

    def reset() -> dict:
      env = self.make_env(task, episode_id)  # its failure stops the job on every process
      made.append(env)
      head = {"tools": env.tools, "system_prompt": env.system_prompt}
      try:
        return {**head, "result": dataclasses.asdict(env.reset())}
      except Exception as e:  # an environment that fails to start fails this episode only
        return {**head, "error": repr(e)}

    out = distributed.on_primary(reset)
    env = made[0] if made else _EnvOnPrimary(out["tools"], out["system_prompt"])
    return env, out["error"] if "error" in out else StepResult(**out["result"])

  def _feed(self, ep: _Episode, ids: list[int]) -> None:
    """Queues `ids` for the episode's slot (`_flush_prefills` runs them before the next step)."""
    if self.engine.room(ep.slot) < len(ids) + 1:
      self._finish(ep, "context")
      return
    self._active[ep.slot] = ep
    self._to_prefill.append((ep, ids))

  def _flush_prefills(self) -> None:
    """Prefills every fed episode in one batched call and handles their first tokens."""
    batch, self._to_prefill = self._to_prefill, []
    if not batch:
      return
    requests = [(ep.slot, ids, jax.random.fold_in(ep.key, ep.sampled)) for ep, ids in batch]
    firsts = self.engine.prefill_many(requests, self._sampling)
    for (ep, _), (tok, logp) in zip(batch, firsts):
      self._on_token(ep, tok, logp)

  def _on_token(self, ep: _Episode, tok: int, logp: float, room: int | None = None) -> None:
    """Records a sampled token; ends the reply on a stop id, the token limit or a cache with
    room for no more (`room`: the slot's room after this token's step; default the engine's)."""
    ep.sampled += 1
    ep.turn_ids.append(tok)
    ep.turn_logprobs.append(logp)
    stopped = tok in self.stop_ids
    room = self.engine.room(ep.slot) if room is None else room
    if stopped or len(ep.turn_ids) >= self.limits.max_new_tokens or room <= 1:
      self._end_reply(ep, stopped)

  def _end_reply(self, ep: _Episode, stopped: bool) -> None:
    """Records the reply, parses it and hands the environment step to a host thread."""
    traj = ep.traj
    body = ep.turn_ids[:-1] if stopped else ep.turn_ids
    text = self.chat.decode(body)
    start = len(traj.token_ids)
    traj.extend(ep.turn_ids, sampled=True, logprobs=ep.turn_logprobs)
    prediction = None
    if self.predict_next:  # the prediction is recorded, never executed
      text, prediction = wia.split_prediction(text)
    ep.last_tok = ep.turn_ids[-1]
    ep.turn_ids, ep.turn_logprobs = [], []
    traj.model_steps += 1
    action = self.chat.parse_tool_calls(text, truncated=not stopped)
    executed = action.tool_calls if action.error is None else []
    calls = [f"{c.name}({json.dumps(c.arguments, sort_keys=True)})" for c in executed]
    failed = action.error is not None
    end = len(traj.token_ids)
    traj.replies.append(Reply(start, end, calls=calls, prediction=prediction, parse_error=failed))
    traj.parse_errors += failed
    traj.tool_call_replies += action.error is None and bool(action.tool_calls)
    ep.names_at = len(traj.tool_names)
    traj.tool_names.extend(c.name for c in action.tool_calls)
    del self._active[ep.slot]  # the slot keeps its cache but sits out of the batch meanwhile
    if isinstance(ep.env, _EnvOnPrimary):  # the primary steps it; `_collect_steps` shares it
      step: futures.Future = futures.Future()
      step.set_result(None)
    else:
      step = self._pool.submit(_timed_step, ep.env, action)
    self._stepping[step] = ep

  def _after_step(self, ep: _Episode, result: StepResult) -> None:
    traj = ep.traj
    info = result.info
    if STEP_TOOL_NAMES in info:  # the environment's own names for the reply's tools
      del traj.tool_names[ep.names_at :]
      traj.tool_names.extend(str(n) for n in info[STEP_TOOL_NAMES])
      info = {k: v for k, v in info.items() if k != STEP_TOOL_NAMES}
    if not result.done:  # the observation that answers the reply just taken
      traj.replies[-1].observation = wia.observation_text(result.messages)
    if result.done:
      traj.calls = info.get("per_turn_calls", traj.calls)
      traj.observations = info.get("per_turn_observations", traj.observations)
      self._finish(ep, "done", float(result.reward), info)
      return
    if traj.model_steps >= self.limits.max_model_steps:
      self._finish(ep, "max_model_steps")
      return
    # The template closes every assistant turn with <|im_end|>: a reply cut at the token limit,
    # or ended by another stop id (<|endoftext|>), gets one that was not sampled (mask 0).
    closed = ep.last_tok == self.chat.im_end_id
    cont = ([] if closed else [self.chat.im_end_id]) + self.chat.continuation_ids(result.messages)
    traj.extend(cont, sampled=False)
    self._feed(ep, [ep.last_tok] + cont)


class QwenChat:
  """The chat format the agent loop uses (`ChatFormat`): Qwen's tool prompt format, a ChatML
  tokenizer (Qwen3's shipped one, or a checkpoint's own: `tokenizer_folder`) and the tool-call
  parser.

  Args:
    enable_thinking: as in `chat.render` (False: the generation prompt closes an empty think
      block). Ignored (left undefined) for a tokenizer without a `<think>` token, whose model
      was never taught the block.
    max_call_chars: the longest JSON text of one tool call, in characters, that
      `parse_tool_calls` accepts (a run passes `episode.max_call_chars`); longer calls become parse
      errors. Default `chat.DEFAULT_MAX_CALL_CHARS`.
    max_calls_per_reply: the most tool calls one reply may make (a run passes
      `episode.max_calls_per_reply`); a reply with more runs none of them and gets an error
      observation. Default `chat.DEFAULT_MAX_CALLS_PER_REPLY`.

  Raises:
    ValueError: `max_call_chars` or `max_calls_per_reply` is not an int >= 1.
  """

  def __init__(
    self,
    enable_thinking: bool | None = False,
    max_call_chars: int | None = None,
    max_calls_per_reply: int | None = None,
    tokenizer_folder: str | None = None,
  ):
    from coevolve_jax import chat as chat_lib  # noqa: PLC0415
    from coevolve_jax.tokenizer import get_tokenizer  # noqa: PLC0415

    if max_call_chars is None:
      max_call_chars = chat_lib.DEFAULT_MAX_CALL_CHARS
    if max_calls_per_reply is None:
      max_calls_per_reply = chat_lib.DEFAULT_MAX_CALLS_PER_REPLY
    for name, value in (
      ("max_call_chars", max_call_chars),
      ("max_calls_per_reply", max_calls_per_reply),
    ):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    self._chat, self._tok = chat_lib, get_tokenizer(tokenizer_folder)
    self.tokenizer_folder = tokenizer_folder
    if self._tok.token_to_id(chat_lib.THINK_OPEN) is None:
      enable_thinking = None
    self.enable_thinking = enable_thinking
    self.max_call_chars = max_call_chars
    self.max_calls_per_reply = max_calls_per_reply
    self.im_end_id = self._tok.im_end_id
    self.vocab_size = self._tok.vocab_size

  def prompt_ids(self, messages, tools) -> list[int]:
    return self._chat.prompt_ids(
      messages, tools, enable_thinking=self.enable_thinking, tokenizer=self._tok
    )

  def continuation_ids(self, messages) -> list[int]:
    return self._chat.continuation_ids(
      messages, enable_thinking=self.enable_thinking, tokenizer=self._tok
    )

  def assistant_text(self, content: str, tool_calls=()) -> str:
    return self._chat.assistant_text(content, tool_calls, tokenizer=self._tok)

  def assistant_ids(self, content: str, tool_calls=()) -> list[int]:
    return self._chat.assistant_ids(content, tool_calls, tokenizer=self._tok)

  def parse_tool_calls(self, text: str, truncated: bool = False) -> Action:
    return self._chat.parse_tool_calls(
      text,
      truncated=truncated,
      max_call_chars=self.max_call_chars,
      max_calls_per_reply=self.max_calls_per_reply,
    )

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text)

  def decode(self, ids: list[int]) -> str:
    return self._tok.decode(ids)


if TYPE_CHECKING:  # mypy checks QwenChat against the ChatFormat protocol

  def _conforms(chat: QwenChat) -> ChatFormat:
    return chat
