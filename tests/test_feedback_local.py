"""The local explorer LLM: our engine serving a Qwen model behind the TextLLM interface."""

import jax
import numpy as np
import pytest
from flax import nnx

from coevolve_jax.feedback.exploration import ExplorationContext
from coevolve_jax.feedback.llm import BudgetExhausted, LLMError
from envs.bfcl.llm_explorer import LLMExplorer
from coevolve_jax import chat as chat_lib
from coevolve_jax.feedback.local_llm import LocalLLM
from coevolve_jax.models import Qwen, QwenConfig
from coevolve_jax.rollout.engine import Engine


@pytest.fixture(scope="module")
def model():
  return Qwen(QwenConfig.preset("tiny_cpu"), rngs=nnx.Rngs(0), dtype=np.float32)


def test_local_llm_generates_charges_tokens_and_feeds_the_explorer(model):
  llm = LocalLLM(
    lambda: model, cache_len=1024, max_new_tokens=8, temperature=1.0, tokens_per_round=10**6
  )
  text = llm.complete("You are terse.", "Say something.")
  assert isinstance(text, str) and text
  assert llm.budget.requests == 1 and llm.budget.used > 8  # prompt + reply tokens
  llm.refresh()  # re-reads the (same) model from the callable
  explorer = LLMExplorer(llm)
  ctx = ExplorationContext("x", {}, ["MessageAPI"], signal="rare", rounds=1, steps_per_round=2)
  triplets = explorer.explore(ctx, np.random.default_rng(0))
  # A random-init model writes no valid call: every step is logged and nothing is executed.
  assert len(explorer.trace) == 2 and not any(r["ok"] for r in explorer.trace)
  assert triplets == []


def test_local_llm_limits(model):
  llm = LocalLLM(model, cache_len=1024, max_new_tokens=4, temperature=1.0, tokens_per_round=1)
  with pytest.raises(LLMError, match="does not fit"):
    llm.complete("word " * 1100, "user")
  assert llm.budget.requests == 0  # nothing was generated
  try:
    llm.complete("s", "u")
  except LLMError:  # an empty reply is possible from random weights; the tokens are still spent
    pass
  with pytest.raises(BudgetExhausted):
    llm.complete("s", "u")


def test_local_explorer_from_another_checkpoint(model, tmp_path):
  import ml_collections  # noqa: PLC0415

  from coevolve_jax.feedback import factory  # noqa: PLC0415
  from coevolve_jax.models.hf import save_pretrained  # noqa: PLC0415

  save_pretrained(model, tmp_path / "explorer-ckpt")
  cfg = ml_collections.ConfigDict(
    {
      "local": {
        "checkpoint": str(tmp_path / "explorer-ckpt"),
        "cache_len": 1024,
        "max_new_tokens": 4,
        "temperature": 0.0,
        "tokens_per_round": 0,
        "dtype": "float32",
      }
    }
  )
  llm = factory.make_llm("local", cfg)
  assert llm.name == "local:explorer-ckpt"
  ref = LocalLLM(model, cache_len=1024, max_new_tokens=4, temperature=0.0)
  for a, b in zip(
    jax.tree.leaves(nnx.state(llm.engine.params)),  # same weights were loaded
    jax.tree.leaves(nnx.state(ref.engine.params)),
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="policy"):
    factory.make_llm("local", ml_collections.ConfigDict({"local": {**cfg.local, "checkpoint": ""}}))


class _EndOfTextEngine(Engine):
  """The engine interface `generate` drives, scripted: the reply's ids, then filler ("x") for as
  long as it is asked (a reply the stop set misses runs on to max_new_tokens)."""

  def __init__(self, config, script, filler):  # pylint: disable=super-init-not-called
    self.config, self.num_slots, self.cache_len = config, 1, 1024
    self.slot_shards = 1  # one device: `Engine.slot_order` hands out slot 0
    self.script, self.filler = list(script), filler

  def reset_slot(self, slot):
    pass

  def room(self, slot):
    return 1000

  def prefill_many(self, requests, sampling):
    return [(self.script.pop(0), -0.5)]

  def generate(self, active, rng, sampling):
    tok = self.script.pop(0) if self.script else self.filler
    return np.array([tok], np.int32), np.array([-0.5], np.float32)

  def generate_steps(self, active, keys, counts, limits, stop_ids, sampling, max_steps):
    tokens, logprobs = self.generate(active, None, sampling)  # one step per call (n = 1)
    return tokens[None], logprobs[None]

  def routing(self, slot):
    return None  # scripted: no experts


def test_local_llm_stops_at_every_eos_id_of_its_checkpoint(model, tmp_path):
  """Qwen3 instruct's generation_config.json lists 151645 and 151643 (<|endoftext|>): a reply
  ending with 151643 ends there, whether the explorer serves that checkpoint
  (`explore.local.checkpoint`) or the policy loaded from it."""
  import json  # noqa: PLC0415

  import ml_collections  # noqa: PLC0415

  from coevolve_jax.feedback import factory  # noqa: PLC0415
  from coevolve_jax.models.hf import save_pretrained  # noqa: PLC0415
  from coevolve_jax.tokenizer import get_tokenizer  # noqa: PLC0415

  folder = save_pretrained(model, tmp_path / "qwen3-instruct")
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
  section = {
    "checkpoint": str(folder),
    "cache_len": 1024,
    "max_new_tokens": 32,
    "temperature": 0.0,
    "tokens_per_round": 0,
    "dtype": "float32",
  }
  served = factory.make_llm("local", ml_collections.ConfigDict({"local": section}))
  policy = served.engine.graphdef, served.engine.params  # the policy, as the loop snapshots it
  as_policy = LocalLLM(lambda: nnx.merge(*policy), cache_len=1024, max_new_tokens=32)
  tok = get_tokenizer()
  for llm in (served, as_policy):
    assert llm.stop_ids == {151645, 151643}
    reply = tok.encode('{"name": "ls"}') + [151643]
    llm.engine = _EndOfTextEngine(llm.engine.config, reply, filler=tok.encode("x")[0])
    assert llm.complete("s", "u") == '{"name": "ls"}'
    prompt = len(
      chat_lib.prompt_ids(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        None,
        enable_thinking=False,
      )
    )
    assert llm.budget.used == prompt + len(reply)  # stopped at 151643, not at 32 tokens
  # A model without a checkpoint stops at <|im_end|> only.
  assert LocalLLM(model, cache_len=1024).stop_ids == {151645}
