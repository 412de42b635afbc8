"""A local explorer LLM: a Qwen checkpoint (the policy or another one) served by our own engine.

Implements `coevolve_jax.feedback.llm.TextLLM`: the system and user texts are rendered with the
Qwen chat template (thinking off), one completion is sampled with the KV-cached engine
(`coevolve_jax.rollout.generate`) until a stop id (`<|im_end|>`, or any end-of-sequence id of the
model's checkpoint, `model.config.eos_token_ids`) or `max_new_tokens`, and the reply text comes
back with any reasoning block removed. Tokens (prompt + completion) are charged to the round's
`TokenBudget` like Gemini's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax

from coevolve_jax import chat as chat_lib
from coevolve_jax.feedback.llm import LLMError, TokenBudget
from coevolve_jax.models.qwen import Qwen
from coevolve_jax.rollout.engine import Engine
from coevolve_jax.rollout.generate import generate
from coevolve_jax.rollout.sampling import SamplingParams
from coevolve_jax.tokenizer import get_tokenizer


class LocalLLM:
  """TextLLM over a Qwen model served by our engine (one slot, fixed cache, so one compile).

  Args:
    model: a Qwen model, or a zero-argument callable returning the model to use now (e.g. the
      current policy: called once per `refresh()`). A reply ends at the tokenizer's `<|im_end|>`
      and at every id of the model's `config.eos_token_ids` (its checkpoint's config.json and
      generation_config.json); `stop_ids` holds the set.
    cache_len: KV cache length; prompt + reply must fit (longer prompts raise LLMError).
    max_new_tokens: cap per reply. temperature: sampling temperature (0 = greedy).
    tokens_per_round: the TokenBudget limit (0 = unlimited).
    seed: PRNG seed for sampling; each request advances the key.
    name: provenance name. dtype: KV cache dtype (the model's compute dtype).
    tokenizer_folder: the model's tokenizer (`tokenizer.get_tokenizer`; None: Qwen3's shipped one).
  """

  def __init__(
    self,
    model: Qwen | Callable[[], Qwen],
    *,
    cache_len: int = 4096,
    max_new_tokens: int = 256,
    temperature: float = 0.7,
    tokens_per_round: int = 0,
    seed: int = 0,
    name: str = "local:policy",
    dtype: str = "float32",
    tokenizer_folder: str | None = None,
  ):
    self._source = model
    self.name = name
    self.budget = TokenBudget(tokens_per_round)
    self.max_new_tokens = int(max_new_tokens)
    self.sampling = SamplingParams(temperature=temperature)
    self._tok = get_tokenizer(tokenizer_folder)
    self._key = jax.random.key(seed)
    self._lock = threading.Lock()
    current = model() if callable(model) and not isinstance(model, Qwen) else model
    self.stop_ids = frozenset({self._tok.im_end_id, *current.config.eos_token_ids})
    # Nothing is trained on the explorer's replies: no routing record.
    self.engine = Engine(current, 1, cache_len, jax.numpy.dtype(dtype), record_routing=False)

  def refresh(self) -> None:
    """Re-reads the model from the callable given at construction (e.g. the newest policy)."""
    if callable(self._source) and not isinstance(self._source, Qwen):
      self.engine.load_params(self._source())

  def complete(self, system: str, prompt: str, *, json_output: bool = False) -> str:
    """One completion for (system, user) messages.

    Raises:
      BudgetExhausted: the round's budget is spent. LLMError: the prompt does not fit the cache,
        or the reply is empty.
    """
    del json_output  # the prompts already ask for JSON; no constrained decoding here
    self.budget.check()
    ids = chat_lib.prompt_ids(
      [{"role": "system", "content": system}, {"role": "user", "content": prompt}],
      None,
      enable_thinking=False,
    )
    if len(ids) + 1 >= self.engine.cache_len:
      raise LLMError(
        f"prompt of {len(ids)} tokens does not fit the local cache of {self.engine.cache_len}"
      )
    with self._lock:
      self._key, sub = jax.random.split(self._key)
      (out,) = generate(
        self.engine,
        [ids],
        self.sampling,
        max_new_tokens=min(self.max_new_tokens, self.engine.cache_len - len(ids)),
        stop_ids=self.stop_ids,
        rng=sub,
      )
    self.budget.charge(len(ids) + len(out.token_ids))
    reply = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
    text = chat_lib.strip_thinking(self._tok.decode(reply)).strip()
    if not text:
      raise LLMError("empty reply from the local model")
    return text


if TYPE_CHECKING:  # mypy checks LocalLLM against the TextLLM protocol
  from coevolve_jax.feedback.llm import TextLLM

  def _conforms(llm: LocalLLM) -> TextLLM:
    return llm
