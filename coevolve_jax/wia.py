"""Role-Agent's World-In-Agent (WIA): the agent predicts the next observation after each action,
and how well the prediction matches the real observation is a process reward.

Role-Agent (Wang et al., arXiv 2606.10917, Sec. 3.2; public code AMAP-ML/roleagent). The agent
writes its prediction inside `<predict_next>...</predict_next>` (`INSTRUCTION`, added to the
system prompt in training and evaluation alike); `split_prediction` takes it out of the reply
before the tool calls are parsed, so prediction text never reaches an environment, and the
agent loop records it per reply (`Reply.prediction`).

Per reply t with a prediction and a real observation to compare (`reply_scores`), a similarity
s_t in [0, 1] (`similarity`: "words", the longest-matching-subsequence ratio over words and
punctuation marks; "json", over the real observation's JSON leaves, the mean share of each
leaf's key and value words that the prediction states; "char_ratio",
`difflib.SequenceMatcher(None, a, b).ratio()` over characters with its default `autojunk`, the
released code's metric, kept for parity). `horizon` 2 compares with the next two observations
joined. Step rewards (`step_rewards`) from the episode's outcome r, which the environment gives
at the last reply only (r_t = r there, 0 before):

  "paper"         r_t (1 + s_t)            (two readings of the paper's Eq. 5)
  "code_v1"       r_t sigmoid(s_t)         (the code's first version, "Paper Eq.5 style")
  "code_release"  r_t (1 + 0.2 s_t)        (the released code)
  "additive"      r_t + beta s_t           (this project's default, below)

With terminal-only rewards a multiplicative form changes only the last reply's reward, and in
BFCL and AppWorld the last reply is the call-free one that ends the turn, which has no next
observation: the three published forms then leave every reward as it was. The additive form
credits every tool-calling step whose prediction matched.

Advantages (`advantages.role_agent`, GiGPO's as Role-Agent uses them): the episode's group
advantage (GRPO, paper Eq. 1) plus `step_weight` x a step advantage, the discounted return
G_t = sum_k gamma^(k - t) step_reward_k (gamma 0.95) normalised within the replies taken from
the same environment state (`anchor_keys`: the task and every call executed before the reply;
BFCL's backends are deterministic, so equal keys are equal states): (G - mean) / (std + eps),
0 for a state only one reply was taken from. The result is spread over each reply's tokens.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from coevolve_jax.types import Trajectory

INSTRUCTION = (
  "After each tool call, also write what you expect the tool to return, inside "
  "<predict_next>...</predict_next>, before the <tool_call> block."
)
REWARD_FORMS = ("paper", "code_v1", "code_release", "additive")
SIMILARITIES = ("words", "json", "char_ratio")
_WORDS = re.compile(r"\w+|[^\w\s]")  # words and punctuation marks: JSON's keys, values, quotes
_BLOCK = re.compile(r"<predict_next>(.*?)(?:</predict_next>|$)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class WIAConfig:
  """`role_agent.wia.*` (module docstring for each)."""

  reward_form: str = "additive"
  beta: float = 0.1
  similarity: str = "words"
  char_cap: int = 600
  horizon: int = 1
  step_weight: float = 1.0
  gamma: float = 0.95
  demos: str = "true"

  def __post_init__(self):
    if self.reward_form not in REWARD_FORMS:
      raise ValueError(f"reward_form must be one of {REWARD_FORMS}, got {self.reward_form!r}")
    if self.similarity not in SIMILARITIES:
      raise ValueError(f"similarity must be one of {SIMILARITIES}, got {self.similarity!r}")
    if self.horizon not in (1, 2):
      raise ValueError(f"horizon must be 1 or 2, got {self.horizon}")
    if self.char_cap < 1 or self.beta < 0 or self.step_weight < 0:
      raise ValueError("char_cap must be >= 1, beta and step_weight >= 0")
    if not 0.0 <= self.gamma <= 1.0:
      raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")
    if self.demos not in DEMOS:
      raise ValueError(f"demos must be one of {DEMOS}, got {self.demos!r}")

  @classmethod
  def from_config(cls, wia: Mapping[str, Any]) -> "WIAConfig":
    """From `role_agent.wia` (a ConfigDict or its JSON dict).

    Raises:
      ValueError: a setting out of range or unknown.
    """
    return cls(
      reward_form=str(wia["reward_form"]),
      beta=float(wia["beta"]),
      similarity=str(wia["similarity"]),
      char_cap=int(wia["char_cap"]),
      horizon=int(wia["horizon"]),
      step_weight=float(wia["step_weight"]),
      gamma=float(wia["gamma"]),
      demos=str(wia.get("demos", "true")),  # absent from the configs of runs made before it
    )


DEMOS = ("true", "shuffled", "none")


def system_prompt(system: str | None) -> str:
  """`system` with `INSTRUCTION` appended (the instruction alone for an empty one): the system
  prompt of a WIA episode, rollout, evaluation and warm-start demonstration alike."""
  return f"{system}\n\n{INSTRUCTION}" if system else INSTRUCTION


def observation_text(messages: Sequence[Mapping[str, Any]]) -> str:
  """The observation a prediction is scored against: the contents of the messages the
  environment answered a reply with, joined by blank lines (`Reply.observation`)."""
  return "\n\n".join(m.get("content") or "" for m in messages)


def prediction_block(text: str) -> str:
  """A reply's prediction as the agent is asked to write it, before its tool calls."""
  return f"<predict_next>{text}</predict_next>\n"


def demo_predictor(
  mode: str, char_cap: int, observations: Sequence[str] = (), seed: int = 0
) -> Callable[[str], str | None]:
  """What a warm-start demonstration predicts for a call whose real observation is `obs`
  (`role_agent.wia.demos`; `warmstart.demonstration`'s `predict`):

    "true"      the real observation, cut to `char_cap` characters (the length scored);
    "shuffled"  a control: another observation of the demonstrations, by a seeded derangement
                of the distinct texts in `observations` (every text maps to a different one;
                a text not among them maps to the first of them), cut the same way: the format
                is taught, the content says nothing of the call;
    "none"      no prediction (None) for any call; the instruction is still in the prompt.

  Raises:
    ValueError: an unknown mode, or "shuffled" with fewer than two distinct observations.
  """
  if mode == "none":
    return lambda obs: None
  if mode == "true":
    return lambda obs: obs[:char_cap]
  if mode != "shuffled":
    raise ValueError(f"demos must be one of {DEMOS}, got {mode!r}")
  texts = sorted(set(observations))
  if len(texts) < 2:
    raise ValueError("a shuffled control needs demonstrations with two distinct observations")
  rng = np.random.default_rng(seed)
  order = rng.permutation(len(texts))
  # a cyclic shift along a random order: a derangement (no text maps to itself)
  other = {texts[order[i]]: texts[order[(i + 1) % len(texts)]] for i in range(len(texts))}
  return lambda obs: other.get(obs, texts[0] if obs != texts[0] else texts[1])[:char_cap]


def split_prediction(text: str) -> tuple[str, str | None]:
  """(the reply without its prediction blocks, the first block's text stripped, or None).

  An unclosed block runs to the end of the reply (a reply cut at the token limit)."""
  found = _BLOCK.search(text)
  if found is None:
    return text, None
  return _BLOCK.sub("", text), found.group(1).strip()


def _leaves(value: Any, path: str = "") -> list[tuple[str, str]]:
  """(key path, JSON of the value) of every leaf of a parsed JSON value."""
  if isinstance(value, dict):
    return [leaf for k, v in value.items() for leaf in _leaves(v, f"{path}.{k}" if path else k)]
  if isinstance(value, list):
    return [leaf for i, v in enumerate(value) for leaf in _leaves(v, f"{path}[{i}]")]
  return [(path, json.dumps(value))]


def similarity(prediction: str, observation: str, metric: str, char_cap: int = 600) -> float:
  """How well `prediction` states `observation`, in [0, 1] (module docstring); for "words" and
  "char_ratio" both are cut to their first `char_cap` characters ("json" reads them whole).
  "json" falls back to "words" for an observation that is not a JSON object or array.

  Raises:
    ValueError: an unknown metric.
  """
  a, b = prediction[:char_cap], observation[:char_cap]
  if metric == "char_ratio":
    return difflib.SequenceMatcher(None, a, b).ratio()
  if metric == "json":
    try:
      parsed = json.loads(observation)
    except ValueError:
      parsed = None
    if isinstance(parsed, (dict, list)) and (leaves := _leaves(parsed)):
      said = set(re.findall(r"\w+", prediction.lower()))
      shares = []
      for key, value in leaves:
        name = key.rsplit(".", 1)[-1].split("[", 1)[0]  # the leaf's own key, no list indices
        words = re.findall(r"\w+", f"{name} {value}".lower())
        shares.append(sum(w in said for w in words) / len(words) if words else 1.0)
      return float(np.mean(shares))
    metric = "words"
  if metric == "words":
    words_a, words_b = _WORDS.findall(a), _WORDS.findall(b)
    if not words_a and not words_b:
      return 1.0
    return difflib.SequenceMatcher(None, words_a, words_b, autojunk=False).ratio()
  raise ValueError(f"unknown similarity {metric!r}; known: {SIMILARITIES}")


def reply_scores(traj: Trajectory, cfg: WIAConfig) -> list[float | None]:
  """Per reply of `traj`, the similarity of its prediction to the observation that answered it
  (with horizon 2, that and the next one joined), or None: no prediction, or no observation
  (the episode ended on the reply)."""
  out: list[float | None] = []
  replies = traj.replies
  for t, reply in enumerate(replies):
    if reply.prediction is None or not reply.observation:
      out.append(None)
      continue
    seen = [r.observation for r in replies[t : t + cfg.horizon] if r.observation]
    out.append(similarity(reply.prediction, "\n\n".join(seen), cfg.similarity, cfg.char_cap))
  return out


def step_rewards(traj: Trajectory, scores: Sequence[float | None], cfg: WIAConfig) -> list[float]:
  """Per reply, the step reward of `cfg.reward_form` (module docstring): the outcome reward at
  the last reply, 0 before, combined with the reply's similarity (0 where it has none)."""
  n = len(traj.replies)
  out = []
  for t in range(n):
    r = float(traj.reward) if t == n - 1 else 0.0
    s = scores[t] or 0.0
    if cfg.reward_form == "paper":
      out.append(r * (1.0 + s))
    elif cfg.reward_form == "code_v1":
      out.append(r / (1.0 + math.exp(-s)))
    elif cfg.reward_form == "code_release":
      out.append(r * (1.0 + 0.2 * s))
    else:
      out.append(r + cfg.beta * s)
  return out


def anchor_keys(traj: Trajectory) -> list[str]:
  """Per reply, the environment state it was taken from: the task and the calls every earlier
  reply of the episode executed (`Reply.calls`), as one string."""
  keys: list[str] = []
  done: list[str] = []
  for reply in traj.replies:
    keys.append(json.dumps([traj.task_id, done]))
    done = done + list(reply.calls)
  return keys


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
  """G_t = sum_{k >= t} gamma^(k - t) rewards[k]."""
  out, g = [0.0] * len(rewards), 0.0
  for t in range(len(rewards) - 1, -1, -1):
    g = rewards[t] + gamma * g
    out[t] = g
  return out


def step_advantages(
  trajectories: Sequence[Trajectory],
  rewards: Sequence[Sequence[float]],
  cfg: WIAConfig,
  keep: Sequence[bool] | None = None,
  eps: float = 1e-6,
) -> list[list[float]]:
  """Per trajectory and reply, the step advantage: the reply's discounted return normalised
  within the replies of kept trajectories taken from the same state (`anchor_keys`), 0 for a
  state only one reply was taken from and for dropped trajectories."""
  keep = [True] * len(trajectories) if keep is None else list(keep)
  returns = [discounted_returns(r, cfg.gamma) for r in rewards]
  groups: dict[str, list[tuple[int, int]]] = {}
  for i, traj in enumerate(trajectories):
    if keep[i]:
      for t, key in enumerate(anchor_keys(traj)):
        groups.setdefault(key, []).append((i, t))
  out = [[0.0] * len(t.replies) for t in trajectories]
  for members in groups.values():
    if len(members) < 2:
      continue
    g = np.array([returns[i][t] for i, t in members])
    normed = (g - g.mean()) / (g.std() + eps)
    for (i, t), v in zip(members, normed):
      out[i][t] = float(v)
  return out


def metrics(
  trajectories: Sequence[Trajectory],
  cfg: WIAConfig,
  success_threshold: float,
  keep: Sequence[bool] | None = None,
) -> dict[str, float]:
  """One step's WIA figures: `wia/prediction_share` (replies with a prediction, of replies
  answered by an observation), `wia/similarity_success` and `wia/similarity_failure` (mean
  similarity in episodes at or above / below `success_threshold`, and `wia/similarity` over
  all; absent without scores), and
  `wia/step_advantage_abs` (mean |step advantage| over the replies of kept episodes)."""
  answered = predicted = 0
  by_outcome: dict[bool, list[float]] = {True: [], False: []}
  every = [reply_scores(t, cfg) for t in trajectories]  # the difflib matches: once each
  for traj, scores in zip(trajectories, every):
    for reply, s in zip(traj.replies, scores):
      answered += bool(reply.observation)
      predicted += bool(reply.observation) and reply.prediction is not None
      if s is not None:
        by_outcome[traj.reward >= success_threshold].append(s)
  out = {"wia/prediction_share": predicted / answered if answered else 0.0}
  rewards = [step_rewards(t, scores, cfg) for t, scores in zip(trajectories, every)]
  keep = [True] * len(trajectories) if keep is None else list(keep)
  steps = step_advantages(trajectories, rewards, cfg, keep)
  kept = [abs(a) for row, k in zip(steps, keep) if k for a in row]
  out["wia/step_advantage_abs"] = float(np.mean(kept)) if kept else 0.0
  for ok, name in ((True, "success"), (False, "failure")):
    if by_outcome[ok]:
      out[f"wia/similarity_{name}"] = float(np.mean(by_outcome[ok]))
  if by_outcome[True] or by_outcome[False]:
    out["wia/similarity"] = float(np.mean(by_outcome[True] + by_outcome[False]))
  return out
