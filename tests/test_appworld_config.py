"""AppWorld's full-scale and paper configs against what the paper's own AppWorld example needs
(11 code steps in one synthesized task; every signal-annotated context explored), and the
abstraction path under those values. No AppWorld environment needed."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(variant):
  spec = importlib.util.spec_from_file_location(
    f"_cfg_appworld_{variant}", os.path.join(ROOT, "configs", "appworld.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)


@pytest.mark.parametrize("variant", ["", "paper"])
def test_full_and_paper_configs_allow_long_tasks_and_every_context(variant):
  c = _config(variant)
  assert c.explore.max_calls >= 18  # the paper's example has 11 code steps
  assert c.explore.min_calls == 3  # the paper's ">= 3 steps"
  # A run has room for a task's every step plus steps that fail (they are not triplets).
  assert c.explore.steps_per_round > c.explore.max_calls
  assert c.feedback.max_contexts == 0  # every candidate context, no cap per round


class _OneReply:
  """A TextLLM that answers every prompt with `text` and keeps the prompts."""

  name = "one-reply"

  def __init__(self, text):
    from coevolve_jax.feedback.llm import TokenBudget  # noqa: PLC0415

    self.budget, self.text, self.prompts = TokenBudget(), text, []

  def complete(self, system, prompt, *, json_output=False):
    self.prompts.append(prompt)
    return self.text

  def refresh(self):
    pass


@pytest.mark.parametrize("variant", ["", "paper"])
def test_an_abstraction_of_twelve_code_steps_is_accepted_with_the_full_values(variant):
  from coevolve_jax.feedback.exploration import ExplorationContext, Triplet  # noqa: PLC0415
  from envs.appworld import llm_explorer  # noqa: PLC0415

  c = _config(variant)
  steps = [f"x{i} = {i}\nprint(x{i})" for i in range(14)]
  triplets = [Triplet(code, str(i), 0) for i, code in enumerate(steps)]
  chosen = list(range(1, 13))  # 12 steps
  reply = {"run_id": 0, "steps": chosen, "query": "q?", "answer_step": 12, "completion": "c"}
  llm = _OneReply(json.dumps({"tasks": [reply]}))
  context = ExplorationContext("w_1", {"appworld_task_id": "w_1"}, [])
  (choice,) = llm_explorer.abstract_tasks(
    llm, triplets, context, min_calls=c.explore.min_calls, max_calls=c.explore.max_calls
  )
  assert choice.steps == chosen and f"At most {c.explore.max_calls} steps" in llm.prompts[0]
  spec = llm_explorer.derive_spec(choice, "dd1_1", "w_1")
  assert spec["steps"] == steps[1:13] and spec["answer_step"] == 11
