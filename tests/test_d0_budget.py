"""D0 under the paper variant (issue 40 item 1): with the explorer charged what its prompts and
replies really cost (Qwen-tokenizer counts of the product's own prompts), D0 reaches N = 100
validated tasks; the round budget it used to inherit (200k tokens) would have stopped it after a
few contexts."""

import collections
import json
import re

import numpy as np
import pytest

from coevolve_jax import config
from coevolve_jax.feedback import synthesis
from coevolve_jax.feedback.llm import TokenBudget
from coevolve_jax.testing.gemini_stub import feedback_responder
from coevolve_jax.tokenizer import get_tokenizer
from envs.bfcl.suite import BfclSuite
from tests.test_config import _get_config

OLD_BUDGET = 200_000  # what every variant's explore.*.tokens_per_round was before


def _abstraction(prompt: str, max_calls: int) -> str:
  """Every 3-step window of every run (the log's own step indices), one one-turn task each."""
  runs = collections.Counter(int(r) for r in re.findall(r"^run (\d+) step", prompt, re.M))
  tasks = [
    {
      "run_id": run,
      "turns": [{"query": f"Do steps {i}-{i + 2} of run {run}.", "steps": [i, i + 1, i + 2]}],
      "description": "a window of the exploration",
      "completion": "the three calls are made",
    }
    for run, n in sorted(runs.items())
    for i in range(0, min(n, max_calls) - 2, 3)
  ]
  return json.dumps({"tasks": tasks})


class CountedLLM:
  """A scripted explorer, abstractor, attempting agent and judge (the stub's answers) that is
  charged the Qwen tokens of each system prompt, prompt and reply, as an endpoint reports them."""

  name = "scripted"

  def __init__(self, limit: int, max_calls: int):
    self.budget = TokenBudget(limit)
    self.max_calls = max_calls
    self.tokenizer = get_tokenizer()

  def complete(self, system: str, prompt: str, *, json_output: bool = False) -> str:
    del json_output
    self.budget.check()
    if system.startswith("You turn"):
      reply = _abstraction(prompt, self.max_calls)
    else:
      reply = feedback_responder(system, prompt)
    self.budget.charge(sum(len(self.tokenizer.encode(t)) for t in (system, prompt, reply)))
    return reply

  def refresh(self) -> None:
    pass


@pytest.fixture(scope="module")
def paper_cfg():
  cfg = _get_config("bfcl.py", "paper")
  cfg.model.checkpoint = "/some/hf/folder"
  config.validate(cfg)
  return cfg


def test_paper_d0_reaches_n_tasks_at_realistic_token_costs(paper_cfg, tmp_path):
  cfg = paper_cfg
  suite = BfclSuite(cfg, str(tmp_path))
  try:
    ex = cfg.explore
    llm = CountedLLM(ex.openai.tokens_per_round, ex.max_calls)  # the paper's explorer's budget
    tasks, counts = synthesis.initial_tasks(
      suite.synthesizer(llm),
      suite.train_tasks,
      ex.initial_tasks,
      np.random.default_rng(0),
      token_limit=ex.d0_tokens,
    )
  finally:
    suite.close()
  assert ex.initial_tasks == 100 and len(tasks) == 100 and "stopped" not in counts
  per_context = counts["llm_usage"]["tokens"] / counts["attempted"]
  print(f"D0: {counts}; {per_context:,.0f} tokens per context")
  # What the old cap would have let through: a fraction of the contexts D0 needed.
  assert counts["llm_usage"]["tokens"] > 4 * OLD_BUDGET
  assert all(len(c) >= ex.min_calls for t in tasks for c in [sum(t.ground_truth, [])])


def test_a_d0_cap_finishes_the_context_in_progress_and_records_the_skip(paper_cfg, tmp_path):
  """With a D0 cap of about two contexts' cost, the context in progress when the cap is reached
  runs to its end (its tasks are kept, not lost with it), then D0 stops and says how many
  contexts it did not explore; the LLM's round limit is back in force afterwards."""
  cfg = paper_cfg
  suite = BfclSuite(cfg, str(tmp_path))
  try:
    llm = CountedLLM(7, cfg.explore.max_calls)
    tasks, counts = synthesis.initial_tasks(
      suite.synthesizer(llm),
      suite.train_tasks,
      100,
      np.random.default_rng(0),
      token_limit=150_000,
    )
  finally:
    suite.close()
  stopped = counts["stopped"]
  done = counts["attempted"]
  assert stopped["contexts_done"] == done >= 2 and stopped["reason"] == "token_budget"
  assert counts["llm_usage"]["tokens"] >= 150_000
  assert stopped["contexts_skipped"] == 3 * 100 - done and stopped["tasks_missing"] == 100 - len(
    tasks
  )
  assert len(tasks) == counts["abstracted"] > 0  # every context's tasks, all validated
  assert llm.budget.limit == 7
