"""The slot-engine interface: what the agent loop (`agent.AgentRunner`) needs from an engine.

An engine offers `num_slots` decode slots, each with its own KV cache of a fixed number of
entries. A conversation holds one slot for its whole life: `reset_slot` starts it at cache index
0, `prefill_many` appends token ids to several slots and samples each one's next token, and
`generate` appends every active slot's pending token and samples the next (`generate_steps`: up to
K such steps in one call, stopping where a reply ends). The last sampled
token of a slot is pending: it is not in the slot's cache until the next `generate` (or a
`prefill_many` whose ids start with it) consumes it. `routing` gives the experts a MoE model
routed each consumed token to, for routing replay in training.

Implemented by `rollout.engine.Engine` (the model), `testing.replay_engine.ReplayEngine` (scripted
ground-truth replies) and the scripted engines of the tests. `SlotEngine` is a `typing.Protocol`:
implementations do not inherit from it; `isinstance(x, SlotEngine)` checks that the members exist
(`runtime_checkable`), not their signatures.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
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
    self, requests: Sequence[tuple[int, Sequence[int], jax.Array]], sampling: SamplingParams
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

  def generate_steps(
    self,
    active: np.ndarray,
    keys: jax.Array,
    counts: np.ndarray,
    limits: np.ndarray,
    stop_ids: Collection[int],
    sampling: SamplingParams,
    max_steps: int,
  ) -> tuple[np.ndarray, np.ndarray]:
    """Up to `max_steps` decode steps (`rollout.engine.Engine.generate_steps` states the
    contract): step j is what `generate(active, per_row_keys(keys, counts + j), sampling)` would
    do, and the call stops after the step in which an active slot samples one of `stop_ids` or
    reaches its limit (`limits[b]` more tokens), so a caller that handles the tokens step by step
    sees what single steps would have given. Engines that decode one token per `generate` get it
    from `StepsByGenerate`.

    Args:
      active: [B] bool. keys: [B] PRNG keys. counts: [B] int, tokens each slot sampled so far.
      limits: [B] int >= 1 for active slots. stop_ids: ids that end a reply.
      sampling: temperature / top-k / top-p. max_steps: K >= 1.
    Returns:
      (tokens [n, B] int32, log-probs [n, B] float32) as numpy, n in [1, max_steps].
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


class StepsByGenerate:
  """`SlotEngine.generate_steps` for engines that decode one token per `generate` call (the
  scripted engines: `testing.replay_engine.ReplayEngine`, the tests' engines): K calls of
  `generate`, stopping after the step in which an active slot samples a stop id or reaches its
  limit, with the keys `per_row_keys(keys, counts + j)` of step j, as `Engine.generate_steps`.
  Mixed into such an engine's class."""

  def generate_steps(
    self,
    active: np.ndarray,
    keys: jax.Array,
    counts: np.ndarray,
    limits: np.ndarray,
    stop_ids: Collection[int],
    sampling: SamplingParams,
    max_steps: int,
  ) -> tuple[np.ndarray, np.ndarray]:
    import jax.numpy as jnp  # noqa: PLC0415 (this module imports no JAX)
    import numpy as np  # noqa: PLC0415

    from coevolve_jax.rollout.sampling import per_row_keys  # noqa: PLC0415

    active = np.asarray(active, bool)
    counts, limits = np.asarray(counts), np.asarray(limits)
    if max_steps < 1 or not active.any():
      raise ValueError(f"generate_steps needs max_steps >= 1 ({max_steps}) and an active slot")
    stops = np.asarray(sorted(stop_ids), np.int64)
    tokens, logprobs = [], []
    for j in range(max_steps):
      step_keys = per_row_keys(keys, jnp.asarray(counts + j))
      tok, logp = self.generate(active, step_keys, sampling)  # type: ignore[attr-defined]
      tokens.append(np.asarray(tok))
      logprobs.append(np.asarray(logp))
      ended = active & (np.isin(tokens[-1], stops) | (limits <= j + 1))
      if ended.any():
        break
    return np.stack(tokens), np.stack(logprobs)


def slot_order(engine: SlotEngine) -> list[int]:
  """The order in which to hand out `engine`'s slots: its own `slot_order()` where it has one
  (`rollout.engine.Engine` on a mesh: round-robin over the devices that hold the cache, so a
  batch of new requests prefills evenly on all of them), else 0 .. num_slots - 1."""
  own = getattr(engine, "slot_order", None)
  return list(own()) if callable(own) else list(range(engine.num_slots))
