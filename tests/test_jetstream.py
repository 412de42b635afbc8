"""The JetStream-contract engine: prefill of padded tokens, insert, generate for all slots.

The first test always runs (our own ResultTokens when google-jetstream is absent); the second
drives the engine through JetStream's own classes and runs only where `jetstream` is importable.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coevolve_jax.contrib.jetstream import JETSTREAM_AVAILABLE, JetStreamEngine

CACHE, SLOTS = 64, 3


@pytest.fixture(scope="module")
def model(tiny_model):
  return tiny_model  # the kit's default tiny Qwen (conftest.py)


def _greedy_reference(model, ids, steps):
  """Greedy tokens from full uncached forwards (one per step)."""
  ids, out = list(ids), []
  fwd = nnx.jit(lambda m, x: m(x))
  for _ in range(steps):
    padded = np.zeros((1, CACHE), np.int32)
    padded[0, : len(ids)] = ids
    tok = int(np.argmax(np.asarray(fwd(model, jnp.asarray(padded)))[0, len(ids) - 1]))
    out.append(tok)
    ids.append(tok)
  return out


def _drive(engine, model, prompts):
  """Prefill (padded to 16), insert into slots 2 and 0, then 5 generate steps for all slots."""
  params = engine.load_params()
  state = engine.init_decode_state()
  got = {}
  for slot, prompt in zip((2, 0), prompts):
    padded = np.zeros((16,), np.int32)
    padded[: len(prompt)] = prompt
    prefix = engine.prefill(
      params=params, padded_tokens=jnp.asarray(padded), true_length=len(prompt)
    )
    assert prefix.length == len(prompt)
    state = engine.insert(prefix, state, slot)
    got[slot] = [prefix.token]
  results = []
  for _ in range(5):
    state, result = engine.generate(params, state)
    results.append(result)
    for slot in got:
      slot_data = result.get_result_at_slot(slot)
      assert int(np.asarray(slot_data.valid)[0, 0]) == 1
      got[slot].append(int(np.asarray(slot_data.tokens)[0, 0]))
  return got, results, state


def test_contract_prefill_insert_generate_matches_full_forward(model):
  engine = JetStreamEngine(model, SLOTS, CACHE)
  assert engine.max_concurrent_decodes == SLOTS and engine.samples_per_slot == 1
  prompts = [[5, 17, 301, 44, 9, 250, 3], [88, 12, 400]]
  got, results, state = _drive(engine, model, prompts)
  for slot, prompt in zip((2, 0), prompts):
    assert got[slot] == _greedy_reference(model, prompt, 6), slot
    lengths = np.asarray(results[-1].get_result_at_slot(slot).lengths)
    assert lengths.tolist() == [len(prompt) + 5]
  assert np.all(np.asarray(state.logprobs)[[0, 2]] < 0)
  # A continuation prefix: prefill on top of an existing prefix equals one prefill of both.
  params = engine.load_params()
  first = engine.prefill(params=params, padded_tokens=jnp.asarray([5, 17, 301, 0]), true_length=3)
  both = engine.prefill(
    params=params,
    existing_prefix=first,
    padded_tokens=jnp.asarray([44, 9, 250, 3, 0, 0, 0, 0]),
    true_length=4,
  )
  assert both.length == 7 and both.token == got[2][0]
  with pytest.raises(ValueError, match="true_length"):
    engine.prefill(params=params, padded_tokens=jnp.asarray([1, 2]), true_length=3)


@pytest.mark.skipif(not JETSTREAM_AVAILABLE, reason="google-jetstream is not installed (optional)")
def test_conformance_through_jetstream_interfaces(model):
  from jetstream.engine import engine_api  # noqa: PLC0415

  engine = JetStreamEngine(model, SLOTS, CACHE)
  assert isinstance(engine, engine_api.Engine)
  got, results, _ = _drive(engine, model, [[5, 17, 301], [7, 7, 7, 7]])
  assert all(isinstance(r, engine_api.ResultTokens) for r in results)
  host = results[0].convert_to_numpy()
  assert isinstance(host.data, np.ndarray) and host.data.shape == (SLOTS, 3)
  assert got[2] == _greedy_reference(model, [5, 17, 301], 6)
  jax.block_until_ready(results[-1].data)
