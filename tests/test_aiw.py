"""Role-Agent's Agent-In-World as a task sampler (feedback/aiw.py): which tasks a failure boosts,
that the pool's draws follow the weights, decay, and a state that survives a checkpoint."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from coevolve_jax.config import validate
from coevolve_jax.feedback import aiw
from coevolve_jax.feedback.llm import LLMError, TokenBudget
from coevolve_jax.feedback.pool import TaskPool
from coevolve_jax.feedback.sampler import UniformSampler, make_sampler, sampler_name
from coevolve_jax.types import Task, Trajectory

_ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


def _task(task_id: str, truth: list[str], query: str = "do it") -> Task:
  return Task(task_id, "bfcl", [query], [truth], source="explore")


def _traj(group: int, calls: list[str], reward: float, outputs=None) -> Trajectory:
  outputs = outputs or ["ok"] * len(calls)
  return Trajectory(
    f"t{group}", group, reward=reward, calls=[calls], observations=[outputs], finish="done"
  )


FS = ["cd(folder='a')", "ls()", "cat(file_name='x')"]  # a file-system task's ground truth
MATH = ["mean(numbers=[1, 2])", "standard_deviation(numbers=[1, 2])"]


def test_fingerprint_names_tools_sequence_departure_and_errors():
  task = _task("fs", FS)
  got = aiw.fingerprint(
    task, [_traj(0, ["cd(folder='a')", "cat(file_name='x')"], 0.0, ["ok", "Error: no file"])]
  )
  assert got == {
    "tool:cd",
    "tool:ls",
    "tool:cat",
    "seq:cd>cat",
    "depart:ls>cat",  # the second call left the ground truth
    "error:cat",
  }
  cut = aiw.fingerprint(task, [_traj(0, ["cd(folder='a')"], 0.0)])
  assert "depart:ls>END" in cut


def test_a_failure_boosts_its_task_and_similar_earlier_failures_not_dissimilar_ones():
  sampler = aiw.AIWSampler(aiw.AIWConfig())
  tasks = [_task("fs1", FS), _task("math", MATH), _task("ok", FS)]
  # Step 1: fs1 and math fail in their own ways; "ok" succeeds (no boost).
  sampler.observe(
    tasks,
    [
      _traj(0, ["cd(folder='a')", "cat(file_name='x')"], 0.0),
      _traj(1, ["mean(numbers=[1, 2])"], 0.0),
      _traj(2, FS, 1.0),
    ],
  )
  assert sampler.task_weights == pytest.approx({"fs1": 1.15, "math": 1.15})
  assert sampler.metrics()["aiw/boosted_similar"] == 0  # the library was empty before
  # Step 2: a new file-system task fails like fs1: fs2 +0.15, fs1 +0.35 x similarity, math 0.
  fs2 = _task("fs2", FS)
  sampler.observe([fs2], [_traj(0, ["cd(folder='a')", "cat(file_name='x')"], 0.0)])
  sim = aiw.jaccard(
    aiw.fingerprint(fs2, [_traj(0, ["cd(folder='a')", "cat(file_name='x')"], 0.0)]),
    frozenset(sampler.library[0]["features"]),
  )
  assert sim == 1.0
  assert sampler.task_weights["fs2"] == pytest.approx(1.15)
  assert sampler.task_weights["fs1"] == pytest.approx(1.15 + 0.35 * sim)
  assert sampler.task_weights["math"] == pytest.approx(1.15)  # dissimilar: untouched
  assert sampler.metrics()["aiw/boosted_similar"] == 1
  weights = sampler.weights(tasks + [fs2])
  np.testing.assert_allclose(weights, [1.5, 1.15, 1.0, 1.15])
  assert 0.9 < sampler.metrics()["aiw/weight_entropy"] < 1.0


def test_top_k_and_decay():
  sampler = aiw.AIWSampler(aiw.AIWConfig(top_k=1, decay=0.5))
  tasks = [_task(f"fs{i}", FS) for i in range(3)]
  sampler.observe(tasks[:2], [_traj(0, ["ls()"], 0.0), _traj(1, ["cd(folder='a')"], 0.0)])
  sampler.observe(tasks[2:], [_traj(0, ["cd(folder='a')"], 0.0)])
  # Decay first (1.15 -> 1.075), then fs2's failure: fs1 failed the same way (similarity 1),
  # fs0 less so, and only the top 1 is boosted.
  assert sampler.task_weights["fs1"] == pytest.approx(1.075 + 0.35)
  assert sampler.task_weights["fs0"] == pytest.approx(1.075)


def test_the_pools_draws_follow_the_weights(tmp_path):
  """Chi-square of 6,000 single draws against the sampler's weights (5 degrees of freedom:
  critical value 20.5 at p = 0.001)."""
  sampler = aiw.AIWSampler(aiw.AIWConfig())
  sampler.task_weights = {"t0": 4.0, "t1": 2.0, "t3": 0.5}
  words = ["alpha beta gamma", "delta epsilon zeta", "eta theta iota", "kappa lambda mu"]
  words += ["nu xi omicron", "pi rho sigma"]
  tasks = [_task(f"t{i}", [f"f{i}()"], f"please {w} now") for i, w in enumerate(words)]
  weights = sampler.weights(tasks)
  rng = np.random.default_rng(0)
  pool = TaskPool(tmp_path / "pool.jsonl")
  assert pool.add(tasks).added == len(tasks)
  counts = np.zeros(6)
  for _ in range(6000):
    (task,) = pool.sample(1, rng, None, weights)
    counts[int(task.task_id[1:])] += 1
  expected = 6000 * weights / weights.sum()
  chi2 = float(np.sum((counts - expected) ** 2 / expected))
  assert chi2 < 20.5, (counts, expected)
  uniform = np.bincount([int(pool.sample(1, rng)[0].task_id[1:]) for _ in range(600)], minlength=6)
  assert counts[0] / 6000 > 2 * uniform[0] / 600  # t0's weight is 4 / 9.5 of the total


def test_state_survives_a_checkpoint_and_gives_the_same_updates():
  a = aiw.AIWSampler(aiw.AIWConfig(decay=0.9))
  tasks = [_task("fs1", FS), _task("math", MATH)]
  a.observe(tasks, [_traj(0, ["ls()"], 0.0), _traj(1, ["mean(numbers=[1])"], 0.2)])
  b = aiw.AIWSampler(aiw.AIWConfig(decay=0.9))
  b.load_state_dict(json.loads(json.dumps(a.state_dict())))
  step = [_traj(0, ["cd(folder='a')"], 0.0), _traj(1, MATH, 1.0)]
  a.observe(tasks, step)
  b.observe(tasks, step)
  assert a.state_dict() == b.state_dict()
  np.testing.assert_array_equal(a.weights(tasks), b.weights(tasks))


def test_config_switch_and_bad_settings():
  spec = importlib.util.spec_from_file_location("bfcl_cfg", os.path.join(_ROOT, "configs/bfcl.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config("cpu")
  assert sampler_name(cfg) == "uniform"  # off by default: the paper's draw
  assert isinstance(make_sampler(sampler_name(cfg), cfg), UniformSampler)
  cfg.role_agent.aiw.enabled = True
  assert isinstance(make_sampler(sampler_name(cfg), cfg), aiw.AIWSampler)
  validate(cfg)
  cfg.role_agent.aiw.decay = 1.5
  with pytest.raises(ValueError, match=r"role_agent.aiw: decay must be in \[0, 1\]"):
    validate(cfg)
  cfg.role_agent.aiw.decay = 1.0
  cfg.role_agent.aiw.analyser = "bogus"
  with pytest.raises(ValueError, match="analyser must be one of"):
    validate(cfg)
  cfg.role_agent.aiw.analyser = "llm"  # the CPU preset's explorer is programmatic: no LLM
  with pytest.raises(ValueError, match="must be 'template' with explore.explorer='programmatic'"):
    validate(cfg)
  cfg.explore.explorer = "gemini"
  validate(cfg)  # the check builds no client
  with pytest.raises(ValueError, match="needs the explorer LLM"):
    make_sampler("aiw", cfg)


# ---------------------------------------------------------------- the llm analyser


class ScriptedAnalyst:
  """An explorer LLM that analyses by a task's query ("fs-like" / "math-like" in it) and, asked
  to retrieve, chooses the candidates whose analysis names the same root cause; it is charged
  100 tokens per call. `broken` replies are not JSON."""

  name = "scripted"

  def __init__(self, limit: int = 0, broken: str = ""):
    self.budget = TokenBudget(limit)
    self.broken = broken
    self.calls: list[str] = []

  def complete(self, system: str, prompt: str, *, json_output: bool = False) -> str:
    del json_output
    self.budget.check()
    self.budget.charge(100)
    kind = "analysis" if system == aiw.ANALYSIS_SYSTEM else "choice"
    self.calls.append(kind)
    if self.broken == kind:
      return "I think the agent should try harder."
    if kind == "analysis":
      cause = "wrong_order" if "fs-like" in prompt else "wrong_arguments"
      return json.dumps(
        {
          "root_cause_type": cause,
          "root_cause_detail": f"the agent made a {cause} mistake",
          "critical_step": 1,
          "lesson": "read the reference order",
          "retrieval_query": cause,
        }
      )
    new, _, shown = prompt.partition("Candidates:")
    cause = json.loads(new.split("\n")[1])["root_cause_type"]
    chosen = [
      {"id": i, "similarity": 0.8}
      for i, line in enumerate(shown.strip().split("\n"))
      if f'"root_cause_type": "{cause}"' in line
    ]
    return json.dumps({"similar": chosen})

  def refresh(self) -> None:
    pass


def _llm_steps(sampler):
  """Step 1: fs1 (an fs-like query) and math fail; step 2: task new fails with an fs-like query
  but the calls of the math task (so the template's fingerprint is like math's)."""
  first = [_task("fs1", FS, "fs-like query"), _task("math", MATH, "math-like query")]
  sampler.observe(
    first, [_traj(0, ["cd(folder='a')", "cat(file_name='x')"], 0.0), _traj(1, ["mean()"], 0.0)]
  )
  sampler.observe([_task("new", MATH, "fs-like query")], [_traj(0, ["mean()"], 0.0)])


def test_the_llm_analyser_boosts_what_the_llm_chooses_and_keeps_its_analyses():
  llm = ScriptedAnalyst()
  sampler = aiw.AIWSampler(aiw.AIWConfig(analyser="llm"), llm)
  _llm_steps(sampler)
  # two analyses in step 1 (an empty library: no choice), one analysis and one choice in step 2
  assert sorted(llm.calls) == ["analysis"] * 3 + ["choice"]
  w = sampler.task_weights
  assert w["new"] == pytest.approx(1.15)
  assert w["fs1"] == pytest.approx(1.15 + 0.35 * 0.8)  # the LLM's choice: the same root cause
  assert w["math"] == pytest.approx(1.15)  # the template would have chosen math (same calls)
  assert sampler.metrics()["aiw/llm_fallbacks"] == 0
  assert sampler.metrics()["aiw/llm_tokens"] == 200
  assert sampler.library[-1]["analysis"]["root_cause_type"] == "wrong_order"
  template = aiw.AIWSampler(aiw.AIWConfig())
  _llm_steps(template)
  assert template.task_weights["math"] > 1.15 and template.task_weights["fs1"] == 1.15
  restored = aiw.AIWSampler(aiw.AIWConfig(analyser="llm"), ScriptedAnalyst())
  restored.load_state_dict(json.loads(json.dumps(sampler.state_dict())))
  assert restored.state_dict() == sampler.state_dict()


@pytest.mark.parametrize("broken", ["analysis", "choice", "budget"])
def test_the_template_stands_in_when_the_llm_fails_and_the_run_goes_on(broken):
  """A reply that is not the JSON asked for, or a spent token budget (200 tokens: step 1's two
  analyses): the failure is still boosted; the template's retrieval chooses; counted."""
  llm = ScriptedAnalyst(limit=200 if broken == "budget" else 0, broken=broken)
  sampler = aiw.AIWSampler(aiw.AIWConfig(analyser="llm"), llm)
  _llm_steps(sampler)
  template = aiw.AIWSampler(aiw.AIWConfig())
  _llm_steps(template)
  assert sampler.task_weights == pytest.approx(template.task_weights)
  assert sampler.metrics()["aiw/llm_fallbacks"] == 1
  if broken == "choice":  # the analysis was had: it is kept
    assert sampler.library[-1]["analysis"]["root_cause_type"] == "wrong_order"
  else:
    assert "analysis" not in sampler.library[-1]


def test_analysis_and_choice_replies_are_read_strictly():
  ok = {
    "root_cause_type": "wrong_tool",
    "root_cause_detail": "d",
    "critical_step": 0,
    "lesson": "l",
    "retrieval_query": "q",
  }
  assert aiw.read_analysis(json.dumps(ok)) == ok
  for bad in (
    {**ok, "root_cause_type": "bad luck"},
    {**ok, "critical_step": "1"},
    {**ok, "critical_step": True},
    {k: v for k, v in ok.items() if k != "lesson"},
    [ok],
  ):
    with pytest.raises(LLMError):
      aiw.read_analysis(json.dumps(bad))
  with pytest.raises(LLMError):  # a repeated key is a guess, not a value
    aiw.read_analysis('{"root_cause_type": "other", "root_cause_type": "wrong_tool"}')
  ids = ["a", "b"]
  got = aiw.read_choice(
    '{"similar": [{"id": 1, "similarity": 0.5}, {"id": 0, "similarity": 0}]}', ids
  )
  assert got == [["b", 0.5]]
  for bad in ('{"similar": [{"id": 2, "similarity": 0.5}]}', '{"similar": [{"id": 0, '
              '"similarity": 1.5}]}', '{"similar": {}}', '{"similar": [{"id": 0, "similarity": '
              'NaN}]}'):  # fmt: skip
    with pytest.raises(LLMError):
      aiw.read_choice(bad, ids)
