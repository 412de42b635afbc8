"""The slot-engine interface: what the agent loop (`agent.AgentRunner`) needs from an engine.

An engine offers `num_slots` decode slots, each with its own KV cache of a fixed number of
entries. A conversation holds one slot for its whole life: `reset_slot` starts it at cache index
0, `prefill_many` appends token ids to several slots and samples each one's next token, and
`generate` appends every active slot's pending token and samples the next. The last sampled
token of a slot is pending: it is not in the slot's cache until the next `generate` (or a
`prefill_many` whose ids start with it) consumes it. `routing` gives the experts a MoE model
routed each consumed token to, for routing replay in training.

Implemented by `rollout.engine.Engine` (the model), `testing.replay_engine.ReplayEngine` (scripted
ground-truth replies) and the scripted engines of the tests. `SlotEngine` is a `typing.Protocol`:
implementations do not inherit from it; `isinstance(x, SlotEngine)` checks that the members exist
(`runtime_checkable`), not their signatures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: importing this module costs no JAX import
  import jax
  import numpy as np

  from coevolve_jax.rollout.sampling import SamplingParams


@runtime_checkable
class SlotEngine(Protocol):
  """Decode slots over a KV cache, as `agent.AgentRunner` drives them.

  Attributes:
    num_slots: B, the number of decode slots; slot ids are 0 .. B - 1.
  """

  num_slots: int

  def reset_slot(self, slot: int) -> None:
    """Frees `slot`: its next request starts a new conversation at cache index 0."""
    ...

  def room(self, slot: int) -> int:
    """Cache entries still free in `slot` (an int >= 0; the pending sampled token needs one).

    The agent loop feeds n ids only while `room(slot) >= n + 1` and ends a reply once
    `room(slot) <= 1`, so an engine never has to write past its cache.
    """
    ...

  def prefill_many(
    self, requests: list[tuple[int, list[int], jax.Array]], sampling: SamplingParams
  ) -> list[tuple[int, float]]:
    """Appends each request's token ids to its slot's cache and samples that slot's next token.

    Args:
      requests: (slot, token ids, PRNG key) per request; slots distinct, ids non-empty ints in
        [0, vocab_size), at most `room(slot)` of them (the agent loop keeps one entry free for
        the pending token). The key (a scalar `jax.random.key`) samples this request's next
        token, so its result does not depend on what it is batched with.
      sampling: temperature / top-k / top-p of the draw.
    Returns:
      (sampled token id, its log-prob under the distribution sampled from) per request, in
      order; Python int and float. The token is now the slot's pending token.
    Raises:
      ValueError: a request an engine cannot serve (a real engine checks slots, ids and room for
        every request before any work).
    """
    ...

  def generate(
    self, active: np.ndarray, rng: jax.Array, sampling: SamplingParams
  ) -> tuple[np.ndarray, np.ndarray]:
    """One decode step: every active slot appends its pending token and samples the next.

    Args:
      active: [B] bool; only these slots advance.
      rng: one PRNG key for the step, or [B] keys (one per slot; the agent loop passes these).
      sampling: temperature / top-k / top-p of the draw.
    Returns:
      (tokens [B] int32, log-probs [B] float32) as numpy arrays; entries of inactive slots carry
      no meaning (the real engine repeats their last token).
    Raises:
      ValueError: an active slot with no room left (the real engine).
    """
    ...

  def routing(self, slot: int) -> np.ndarray | None:
    """The routing record of the tokens `slot` consumed since its reset, or None.

    Returns:
      [n, L_moe, k] integer expert indices (n = tokens consumed, in order; the pending token is
      not among them) for a MoE model whose engine records routing; None otherwise (dense
      models, scripted engines). The agent loop stores it in `Trajectory.routing`.
    """
    ...
