"""The KV-cached rollout engine against full (uncached) forwards of a tiny random Qwen."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coevolve_jax.models.qwen import rope
from coevolve_jax.rollout import Completion, generate
from coevolve_jax.rollout.engine import MAX_PREFILL_CHUNK, Engine, _chunks, prefill_schedule
from coevolve_jax.rollout.sampling import (
  SamplingParams,
  _two_level_argmax,
  argmax_last,
  processed_logprobs,
  sample,
)
from coevolve_jax.trainer import token_logprobs

import kit

CACHE = 64  # every engine below uses this cache length and 3 slots, so compilations are shared
SLOTS = 3
GREEDY = SamplingParams(temperature=0.0)
KEY = jax.random.key(0)


@pytest.fixture(scope="module")
def model(tiny_model):
  return tiny_model  # the kit's default tiny Qwen (conftest.py)


@pytest.fixture(scope="module")
def full_logprobs(model):
  """ids -> [len(ids), V] log_softmax(logits / T) of the full uncached forward `model(ids)`."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def fwd(state, ids):
    return nnx.merge(graphdef, state)(ids)[0]

  def f(ids, temperature=1.0):
    padded = np.zeros((1, CACHE), np.int32)  # right padding cannot reach earlier positions
    padded[0, : len(ids)] = ids
    logits = np.asarray(fwd(state, jnp.asarray(padded)), np.float64)[: len(ids)] / temperature
    logits -= logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))

  return f


def _prompt(seed, n):
  return [int(x) for x in np.random.default_rng(seed).integers(1, 512, n)]


def _greedy_reference(full_logprobs, ids, steps):
  """Greedy argmax over the full forward, recomputed from scratch at each step."""
  ids, toks, lps = list(ids), [], []
  for _ in range(steps):
    lp = full_logprobs(ids)[-1]
    tok = int(np.argmax(lp))
    toks.append(tok)
    lps.append(lp[tok])
    ids.append(tok)
  return toks, np.array(lps)


def _decode_alone(model, slot, ids, steps):
  engine = Engine(model, SLOTS, CACHE)
  tok, lp = engine.prefill(slot, ids, jax.random.key(0), GREEDY)
  toks, lps = [tok], [lp]
  active = np.zeros(SLOTS, bool)
  active[slot] = True
  for i in range(steps - 1):
    t, lp_b = engine.generate(active, jax.random.key(i), GREEDY)
    toks.append(int(t[slot]))
    lps.append(float(lp_b[slot]))
  return toks, np.array(lps)


def _layer0_kv(model, ids):
  """Layer-0 keys and values depend only on (token, position): [K, T, H] each (the value
  cache's layout; compare keys through `_keys`), computed by hand."""
  padded = np.zeros((CACHE,), np.int32)
  padded[: len(ids)] = ids
  k, v = _layer0_kv_jit(model, jnp.asarray(padded))
  return (
    np.asarray(k[: len(ids)]).transpose(1, 0, 2),
    np.asarray(v[: len(ids)]).transpose(1, 0, 2),
  )


def _keys(cache_k):
  """A key cache [B, K, H, S] as [B, K, S, H], the layout `_layer0_kv` returns."""
  return np.asarray(cache_k).swapaxes(-1, -2)


@nnx.jit
def _layer0_kv_jit(model, ids):
  layer = model.layer(0)
  attn = layer.self_attn
  x = layer.input_layernorm(jnp.take(model.embed_tokens[...], jnp.asarray(ids)[None], axis=0))
  k = attn.k_norm(jnp.einsum("BTD,DKH->BTKH", x, attn.k_proj[...]))
  k = rope(k, jnp.arange(len(ids))[None], model.config.rope_theta)
  v = jnp.einsum("BTD,DKH->BTKH", x, attn.v_proj[...])
  return k[0], v[0]


# (a) -----------------------------------------------------------------------------------------


def test_greedy_matches_full_forward(model, full_logprobs):
  prompt = _prompt(1, 7)
  toks, lps = _decode_alone(model, 1, prompt, 12)
  want_toks, want_lps = _greedy_reference(full_logprobs, prompt, 12)
  assert toks == want_toks
  np.testing.assert_allclose(lps, want_lps, atol=1e-5)


# (b) -----------------------------------------------------------------------------------------


def test_slots_decode_independently(model):
  prompts = [_prompt(10, 3), _prompt(11, 11), _prompt(12, 20)]  # chunk sizes 16, 16 and 32
  steps = 8
  alone = [_decode_alone(model, 0, p, steps) for p in prompts]

  engine = Engine(model, SLOTS, CACHE)
  got = [[], [], []]
  got_lp = [[], [], []]
  for slot in (2, 0, 1):  # prefill order differs from slot order
    tok, lp = engine.prefill(slot, prompts[slot], jax.random.key(slot), GREEDY)
    got[slot].append(tok)
    got_lp[slot].append(lp)
  # Slot 0 pauses for two steps in the middle (inactive), then resumes.
  schedule = [[1, 1, 1]] * 3 + [[0, 1, 1]] * 2 + [[1, 1, 1]] * 4 + [[1, 0, 0]] * 2
  for i, act in enumerate(schedule):
    active = np.array(act, bool)
    pos_before = [engine.position(s) for s in range(SLOTS)]
    t, lp_b = engine.generate(active, jax.random.key(100 + i), GREEDY)
    for s in range(SLOTS):
      assert engine.position(s) == pos_before[s] + int(active[s])
      if active[s] and len(got[s]) < steps:
        got[s].append(int(t[s]))
        got_lp[s].append(float(lp_b[s]))
  for s in range(SLOTS):
    assert got[s] == alone[s][0], s
    np.testing.assert_allclose(got_lp[s], alone[s][1], atol=1e-5, err_msg=str(s))
    assert engine.position(s) == len(prompts[s]) + sum(act[s] for act in schedule)


# (c) -----------------------------------------------------------------------------------------


def test_multi_turn_continuation_equals_single_forward(model, full_logprobs):
  a, b = _prompt(20, 7), _prompt(21, 9)
  engine = Engine(model, SLOTS, CACHE)
  active = np.array([False, True, False])
  tok, _ = engine.prefill(1, a, jax.random.key(0), GREEDY)
  gen = [tok]
  for i in range(3):
    gen.append(int(engine.generate(active, jax.random.key(i), GREEDY)[0][1]))
  # Cache: a + gen[:-1]; gen[-1] is pending, so the continuation starts with it.
  tok, lp = engine.prefill(1, [gen[-1]] + b, jax.random.key(5), GREEDY)
  conv = a + gen + b
  assert engine.position(1) == len(conv)
  after = [tok]
  after_lp = [lp]
  for i in range(4):
    t, lp_b = engine.generate(active, jax.random.key(10 + i), GREEDY)
    after.append(int(t[1]))
    after_lp.append(float(lp_b[1]))

  want_gen, _ = _greedy_reference(full_logprobs, a, 4)
  assert gen == want_gen
  want, want_lp = _greedy_reference(full_logprobs, conv, 5)
  assert after == want
  np.testing.assert_allclose(after_lp, want_lp, atol=1e-5)

  # The cache equals that of one prefill over the whole concatenation.
  single = Engine(model, SLOTS, CACHE)
  tok1, lp1 = single.prefill(1, conv, jax.random.key(0), GREEDY)
  assert tok1 == after[0] and lp1 == pytest.approx(after_lp[0], abs=1e-5)
  n = len(conv)
  for layer in range(model.config.num_hidden_layers):
    for multi_c, single_c, cut in (
      (engine.state.cache.k, single.state.cache.k, lambda c: c[1, ..., :n]),  # [K, H, S]
      (engine.state.cache.v, single.state.cache.v, lambda c: c[1, :, :n]),
    ):  # [K, S, H]
      np.testing.assert_allclose(
        np.asarray(cut(single_c[layer])), np.asarray(cut(multi_c[layer])), atol=1e-5
      )


# (d) -----------------------------------------------------------------------------------------


def test_prefill_near_end_of_cache(model, full_logprobs):
  engine = Engine(model, SLOTS, CACHE)
  other = _prompt(30, 5)
  engine.prefill(2, other, jax.random.key(0), GREEDY)
  k_other, v_other = _layer0_kv(model, other)

  active = np.array([True, False, False])
  a = _prompt(31, 30)
  tok, _ = engine.prefill(0, a, jax.random.key(1), GREEDY)
  gen = [tok]
  for i in range(10):
    gen.append(int(engine.generate(active, jax.random.key(i), GREEDY)[0][0]))
  b = _prompt(32, 15)
  t1, _ = engine.prefill(0, [gen[-1]] + b, jax.random.key(2), GREEDY)  # 16 tokens at 40
  conv = a + gen + b
  assert engine.position(0) == len(conv) == 56 and engine.room(0) == 8
  # 7 tokens at index 56: a 16-chunk would pass the end, so it must shrink to 8 (one padded
  # entry, at index 63, still inside the cache).
  c = _prompt(33, 6)
  t2, lp2 = engine.prefill(0, [t1] + c, jax.random.key(3), GREEDY)
  conv += [t1] + c
  assert engine.position(0) == len(conv) == 63 and engine.room(0) == 1
  want = full_logprobs(conv)[-1]
  assert t2 == int(np.argmax(want)) and lp2 == pytest.approx(want[t2], abs=1e-5)
  # The last free entry takes the pending token.
  t3, lp3 = engine.generate(active, jax.random.key(4), GREEDY)
  conv.append(t2)
  assert engine.position(0) == CACHE and engine.room(0) == 0
  want = full_logprobs(conv)[-1]
  assert int(t3[0]) == int(np.argmax(want)) and lp3[0] == pytest.approx(want[t3[0]], abs=1e-5)
  # Every cache entry sits at its own index (a write clamped at the end would shift entries).
  k_want, v_want = _layer0_kv(model, conv)
  np.testing.assert_allclose(_keys(engine.state.cache.k[0])[0], k_want, atol=1e-5)
  np.testing.assert_allclose(np.asarray(engine.state.cache.v[0][0]), v_want, atol=1e-5)
  assert engine.state.cache.k[0].shape == (SLOTS, 2, 16, CACHE)  # [B, K, H, S]
  assert engine.state.cache.v[0].shape == (SLOTS, 2, CACHE, 16)  # [B, K, S, H]
  # The other slot is untouched.
  n = len(other)
  np.testing.assert_allclose(_keys(engine.state.cache.k[0])[2, :, :n], k_other, atol=1e-5)
  np.testing.assert_allclose(np.asarray(engine.state.cache.v[0][2, :, :n]), v_other, atol=1e-5)

  # A full slot takes nothing more; a prefill that does not fit is refused and changes nothing.
  before = jax.tree.map(np.asarray, engine.state)
  with pytest.raises(ValueError):
    engine.prefill(0, [1], jax.random.key(5), GREEDY)
  with pytest.raises(ValueError):
    engine.prefill(2, [], jax.random.key(5), GREEDY)
  assert engine.room(2) == CACHE - n
  with pytest.raises(ValueError):
    engine.prefill(2, _prompt(34, CACHE - n + 1), jax.random.key(5), GREEDY)
  after = jax.tree.map(np.asarray, engine.state)
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("max_prefill_tokens", [1024, 32])
def test_prefill_many_equals_each_request_alone(model, full_logprobs, max_prefill_tokens):
  """Three slots prefilled in one call: a fresh long prompt, a fresh short one, and a
  continuation so near the end of its cache that it runs alone, in two chunks. Each gets the
  full forward's greedy token and log-prob and its own keys in the cache, and with a sampler
  the same token as `prefill` alone with the same key. With max_prefill_tokens = 32 a round's
  chunks run as several forwards (one row each at chunk length 64)."""
  engine = Engine(model, SLOTS, CACHE, max_prefill_tokens=max_prefill_tokens)
  first = _prompt(40, 50)
  engine.prefill(0, first, jax.random.key(0), GREEDY)
  convs = [first + _prompt(41, 9), _prompt(42, 40), _prompt(43, 3)]
  new = [convs[0][50:], convs[1], convs[2]]
  results = engine.prefill_many([(s, ids, jax.random.key(s)) for s, ids in enumerate(new)], GREEDY)
  for slot, (conv, (tok, lp)) in enumerate(zip(convs, results)):
    want = full_logprobs(conv)[-1]
    assert tok == int(np.argmax(want)) and lp == pytest.approx(want[tok], abs=1e-5)
    assert engine.position(slot) == len(conv)
    k_want, v_want = _layer0_kv(model, conv)
    np.testing.assert_allclose(
      _keys(engine.state.cache.k[0])[slot, :, : len(conv)], k_want, atol=1e-5
    )
    np.testing.assert_allclose(
      np.asarray(engine.state.cache.v[0][slot, :, : len(conv)]), v_want, atol=1e-5
    )
  with pytest.raises(ValueError, match="distinct"):
    engine.prefill_many([(1, [1], jax.random.key(0)), (1, [2], jax.random.key(1))], GREEDY)

  sampling = SamplingParams(temperature=0.9)
  prompts = [_prompt(44 + i, n) for i, n in enumerate((17, 5, 30))]
  keys = [jax.random.key(100 + i) for i in range(3)]
  together = Engine(model, SLOTS, CACHE, max_prefill_tokens=max_prefill_tokens).prefill_many(
    [(s, p, k) for s, (p, k) in enumerate(zip(prompts, keys))], sampling
  )
  for slot, (p, k) in enumerate(zip(prompts, keys)):
    tok, lp = Engine(model, SLOTS, CACHE).prefill(slot, p, k, sampling)
    assert together[slot][0] == tok and together[slot][1] == pytest.approx(lp, abs=1e-5)


# (e) -----------------------------------------------------------------------------------------


def _nucleus_logprobs(lp_tv, top_p):
  """Independent float64 reference: tempered log-probs renormalised over each row's nucleus."""
  out = np.full_like(lp_tv, -np.inf)
  for i, row in enumerate(lp_tv):
    order = np.argsort(-row, kind="stable")
    probs = np.exp(row[order])
    keep = order[(np.cumsum(probs) - probs) < top_p]
    out[i, keep] = row[keep] - np.log(np.exp(row[keep]).sum())
  return out


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_logprobs_match_trainer(model, full_logprobs, top_p):
  sampling = SamplingParams(temperature=0.9, top_p=top_p)
  engine = Engine(model, SLOTS, CACHE)
  prompts = {0: _prompt(40, 6), 2: _prompt(41, 13)}
  seqs, lps = {}, {}
  for slot, p in prompts.items():
    tok, lp = engine.prefill(slot, p, jax.random.key(slot), sampling)
    seqs[slot], lps[slot] = [tok], [lp]
  steps = {0: 39, 2: 30}  # 40 and 31 sampled tokens: not multiples of the trainer's chunk
  for i in range(max(steps.values())):
    active = np.array([i < steps[0], False, i < steps[2]])
    t, lp_b = engine.generate(active, jax.random.key(50 + i), sampling)
    for slot in prompts:
      if active[slot]:
        seqs[slot].append(int(t[slot]))
        lps[slot].append(float(lp_b[slot]))
  p_max = max(len(s) for s in seqs.values())
  t_max = max(len(prompts[s]) + len(seqs[s]) for s in prompts)
  tokens = np.zeros((2, t_max), np.int32)
  pos = np.ones((2, p_max), np.int32)
  want = np.zeros((2, p_max))
  for r, slot in enumerate(prompts):
    full = prompts[slot] + seqs[slot]
    tokens[r, : len(full)] = full
    pos[r, : len(seqs[slot])] = np.arange(len(prompts[slot]), len(full))
    want[r, : len(seqs[slot])] = lps[slot]
    # Engine log-probs are those of the distribution sampled from, computed here independently
    # (float64, numpy) from the full uncached forward.
    ref = full_logprobs(full, 0.9)[np.arange(len(prompts[slot]) - 1, len(full) - 1)]
    if top_p < 1.0:
      ref = _nucleus_logprobs(ref, top_p)
    np.testing.assert_allclose(lps[slot], ref[np.arange(len(seqs[slot])), seqs[slot]], atol=1e-5)
  if top_p < 1.0:  # the nucleus really is smaller than the vocabulary at these positions
    assert np.isfinite(ref).sum(-1).max() < model.config.vocab_size
  scorer = nnx.jit(token_logprobs, static_argnames=("temperature", "sampling"))
  if top_p == 1.0:  # the trainer's default: the full tempered softmax
    got = np.asarray(scorer(model, jnp.asarray(tokens), jnp.asarray(pos), temperature=0.9))
  else:  # the trainer scoring under the sampler's nucleus
    got = np.asarray(scorer(model, jnp.asarray(tokens), jnp.asarray(pos), sampling=sampling))
  assert got.shape == (2, p_max)
  for r, slot in enumerate(prompts):
    n = len(seqs[slot])
    np.testing.assert_allclose(got[r, :n], want[r, :n], atol=1e-5)


# (f) -----------------------------------------------------------------------------------------


def _chi2(counts, probs):
  expected = probs * counts.sum()
  keep = expected > 0
  assert np.all(counts[~keep] == 0), "sampled a token of probability 0"
  return float(np.sum((counts[keep] - expected[keep]) ** 2 / expected[keep]))


# Chi-square quantiles at 1 - 1e-4, by degrees of freedom.
CHI2_CRIT = {1: 15.14, 2: 18.42, 4: 23.51, 5: 25.74, 7: 29.88}


def _softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


def test_top_k_one_equals_greedy():
  logits = jax.random.normal(jax.random.key(0), (64, 100)) * 3.0
  greedy_tok, greedy_lp = sample(logits, jax.random.key(1), GREEDY)
  np.testing.assert_array_equal(np.asarray(greedy_tok), np.argmax(np.asarray(logits), -1))
  np.testing.assert_allclose(
    np.asarray(greedy_lp),
    np.asarray(jax.nn.log_softmax(logits))[np.arange(64), np.asarray(greedy_tok)],
    atol=1e-6,
  )
  for seed in range(2):
    for temp in (0.5, 2.0):
      tok, lp = sample(logits, jax.random.key(seed), SamplingParams(temperature=temp, top_k=1))
      np.testing.assert_array_equal(np.asarray(tok), np.asarray(greedy_tok))
      # The distribution sampled from holds one token: log-prob 0.
      np.testing.assert_array_equal(np.asarray(lp), np.zeros(64, np.float32))


def _argmax_cases(v: int) -> np.ndarray:
  """[14, v] float32 rows for the greedy argmax: normal rows, ties, -inf, NaN and +inf rows."""
  x = np.array(jax.random.normal(jax.random.key(v), (14, v)), np.float32)
  x[1, [3, v - 1]] = 9.0  # a tie in the first and last blocks
  x[2, [v // 2, v // 2 + 1]] = 9.0  # a tie at neighbouring entries
  x[3, -1] = 9.0  # the last entry (past the padding edge)
  x[4] = -np.inf
  x[5, [7, v - 2]] = np.nan
  x[6] = 1.0  # all equal
  x[7, :] = -np.inf
  x[7, v - 3] = -1.0
  x[8, [v - 5, v - 4]] = np.inf  # +inf, twice
  x[9, 2] = np.inf  # +inf first, a NaN in a later block: the NaN
  x[9, v - 6] = np.nan
  x[10, 0] = 50.0  # a larger value first, a NaN later
  x[10, v - 7] = np.nan
  return x


@pytest.mark.parametrize("v", [100, 4 * 1024 + 37, 5 * 1187])
def test_two_level_argmax_is_argmax(v):
  """`argmax_last` (the greedy sampler's on CPU) gives `argmax`'s index in every row: one
  vocabulary block, padded blocks (4133) and exact ones (5 x 1187); ties take the first index,
  in one block and across blocks; +inf; rows of -inf give 0; a NaN is taken as the max (its
  first index, also when a larger value or +inf comes earlier), as numpy does; bfloat16 too."""
  x = _argmax_cases(v)
  want = np.argmax(x, axis=-1)
  assert want[1] == 3 and want[4] == 0 and want[5] == 7 and want[6] == 0
  assert want[8] == v - 5 and want[9] == v - 6 and want[10] == v - 7
  for fn in (argmax_last, jax.jit(argmax_last)):
    got = np.asarray(fn(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
  half = jnp.asarray(x, jnp.bfloat16)  # rounding makes new ties: compare with jnp's argmax
  np.testing.assert_array_equal(np.asarray(argmax_last(half)), np.asarray(jnp.argmax(half, -1)))


@pytest.mark.parametrize("v", [1000, 4133, 5 * 1187])
def test_greedy_draw_is_argmax_and_its_logprob(v):
  """`sample` at T = 0 gives `argmax`'s token and -log(sum(exp(z - z[token]))) in every row: a
  batch of finite rows (on CPU the draw without the NaN pass) and one with NaN, +inf and -inf
  rows (the draw taken again with it), with NaN log-probs where the formula gives NaN."""
  x = _argmax_cases(v)
  greedy = jax.jit(lambda z: sample(z, jax.random.key(0), SamplingParams(temperature=0.0)))
  for rows in ([0, 1, 2, 3, 6, 7], list(range(len(x)))):  # finite maxima only; every case
    z = x[rows]
    want_tok = np.argmax(z, axis=-1)
    with np.errstate(invalid="ignore"):
      top = np.take_along_axis(z, want_tok[:, None], axis=-1)
      want_lp = -np.log(np.sum(np.exp((z - top).astype(np.float64)), axis=-1))
    tok, lp = greedy(jnp.asarray(z))
    np.testing.assert_array_equal(np.asarray(tok), want_tok)
    if len(rows) < len(x):  # finite rows: the draw without the NaN pass is already exact
      fast = _two_level_argmax(jnp.asarray(z), nan_pass=False)
      np.testing.assert_array_equal(np.asarray(fast), want_tok)
    np.testing.assert_allclose(np.asarray(lp), want_lp, rtol=1e-5, atol=1e-6)  # NaN == NaN


def test_tiny_temperatures_keep_exact_logprobs():
  """At T -> 0 the draw is the argmax and its log-prob tends to 0 from below; dividing the raw
  logits by T = 1e-8 first left no float32 digits for the gaps (log-probs of +1.26 were seen)."""
  logits = jax.random.normal(jax.random.key(0), (16, 512)) * 3.0 + 10.0
  want_tok = np.argmax(np.asarray(logits), -1)
  for temp in (1e-3, 1e-6, 1e-8, 1e-30):
    params = SamplingParams(temperature=temp)
    tok, lp = jax.jit(lambda x, k, p=params: sample(x, k, p))(logits, jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(tok), want_tok)
    lp = np.asarray(lp)
    assert np.all(lp <= 0.0) and np.all(lp > -1e-6), (temp, lp)
    np.testing.assert_allclose(np.asarray(processed_logprobs(logits, tok, params)), lp, atol=1e-6)
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams(temperature=float("nan"))
  with pytest.raises(ValueError, match="top_k"):
    SamplingParams(top_k=2.5)


@pytest.mark.parametrize("temp", [1.0, 0.7])
def test_sampling_frequencies_match_softmax(temp):
  logits = np.array([1.0, 0.5, -0.3, 2.0, 0.0, -1.5, 1.2, 0.1], np.float32)
  n = 40_000
  tok, lp = sample(
    jnp.broadcast_to(jnp.asarray(logits), (n, 8)),
    jax.random.key(7),
    SamplingParams(temperature=temp),
  )
  tok = np.asarray(tok)
  probs = _softmax(logits.astype(np.float64) / temp)
  counts = np.bincount(tok, minlength=8)
  assert _chi2(counts, probs) < CHI2_CRIT[7], (counts / n, probs)
  np.testing.assert_allclose(np.asarray(lp), np.log(probs)[tok], atol=1e-5)
  # The test has power: the untempered distribution is rejected at T = 0.7.
  if temp != 1.0:
    assert _chi2(counts, _softmax(logits.astype(np.float64))) > CHI2_CRIT[7]


@pytest.mark.parametrize("v", [4 * 1024 + 37, 5 * 1187])
def test_sampling_across_vocabulary_blocks(v):
  """A vocabulary of several sampler blocks (padded: 4133 has no divisor near 1024; exact: 5 x
  1187, as 151,936 = 128 x 1187): mass at block edges and in the last block is drawn at its
  softmax frequency, and nothing outside top-k is."""
  from coevolve_jax.rollout.sampling import _sample_block  # noqa: PLC0415

  block = _sample_block(v)
  assert block == (1024 if v == 4133 else 1187)
  heavy = np.array([0, block - 1, block, 3 * block + 5, v - 1])
  logits = np.full((v,), -4.0, np.float32)  # light tail: about a fifth of the mass in all
  logits[heavy] = [2.0, 3.0, 1.0, 2.5, 3.0]
  # 16,000 draws: every bin expects 300 or more (the rarest, token `block`, p = 0.02), so a
  # block edge or a last block drawn wrong (mass moved or lost) is far past the critical value;
  # 40,000 took 2.5x the time (a [n, V] float32 batch) for power this check does not need.
  n = 16_000
  batch = jnp.broadcast_to(jnp.asarray(logits), (n, v))
  tok, lp = sample(batch, jax.random.key(11), SamplingParams(temperature=1.0))
  tok = np.asarray(tok)
  probs = _softmax(logits.astype(np.float64))
  bins = np.searchsorted(heavy, tok)  # 5 heavy tokens, and everything else as one bin
  bins = np.where(np.isin(tok, heavy), bins, len(heavy))
  binned = np.append(probs[heavy], 1.0 - probs[heavy].sum())
  assert _chi2(np.bincount(bins, minlength=6), binned) < CHI2_CRIT[5], np.bincount(bins)
  np.testing.assert_allclose(np.asarray(lp), np.log(probs)[tok], atol=1e-5)
  tok, lp = sample(batch, jax.random.key(12), SamplingParams(temperature=1.0, top_k=5))
  counts = np.bincount(np.searchsorted(heavy, np.asarray(tok)), minlength=5)
  assert np.all(np.isin(np.asarray(tok), heavy))
  assert _chi2(counts, _softmax(logits[heavy].astype(np.float64))) < CHI2_CRIT[4], counts


def test_top_p_keeps_only_the_nucleus():
  probs = np.array([0.05, 0.4, 0.1, 0.15, 0.3])  # sorted: 0.4, 0.3, 0.15, 0.1, 0.05
  logits = np.log(probs).astype(np.float32)
  n = 40_000
  batch = jnp.broadcast_to(jnp.asarray(logits), (n, 5))
  # top_p = 0.75: mass before 0.15 is 0.7 < 0.75, before 0.1 is 0.85 -> nucleus {1, 4, 3}.
  tok, lp = sample(batch, jax.random.key(3), SamplingParams(temperature=1.0, top_p=0.75))
  counts = np.bincount(np.asarray(tok), minlength=5)
  nucleus = np.array([0.0, 0.4, 0.0, 0.15, 0.3])
  assert counts[0] == 0 and counts[2] == 0
  assert _chi2(counts, nucleus / nucleus.sum()) < CHI2_CRIT[2], counts
  # Log-probs are under the distribution sampled from: the nucleus, renormalised.
  kept = nucleus[[1, 3, 4]] / nucleus.sum()
  want = np.zeros(5)
  want[[1, 3, 4]] = np.log(kept)
  np.testing.assert_allclose(np.asarray(lp), want[np.asarray(tok)], atol=1e-5)
  np.testing.assert_allclose(
    np.asarray(
      processed_logprobs(
        batch[:3], jnp.array([1, 4, 0]), SamplingParams(temperature=1.0, top_p=0.75)
      )
    ),
    [np.log(0.4 / 0.85), np.log(0.3 / 0.85), -np.inf],
    atol=1e-6,
  )
  # top_p = 0.35, or even 0: only the top token.
  for top_p in (0.35, 0.0):
    tok, _ = sample(batch, jax.random.key(4), SamplingParams(temperature=1.0, top_p=top_p))
    assert np.all(np.asarray(tok) == 1), top_p
  # top_k and top_p together: k = 2 keeps {1, 4}; p = 0.95 then keeps both.
  tok, _ = sample(batch, jax.random.key(5), SamplingParams(temperature=1.0, top_k=2, top_p=0.95))
  counts = np.bincount(np.asarray(tok), minlength=5)
  assert counts[[0, 2, 3]].sum() == 0
  k2 = np.array([0.0, 0.4, 0.0, 0.0, 0.3])
  assert _chi2(counts, k2 / k2.sum()) < CHI2_CRIT[1]


# (g) generate() -----------------------------------------------------------------------------


def test_generate_batches_requests_like_decoding_each_alone(model, full_logprobs):
  prompts = [_prompt(60 + i, n) for i, n in enumerate((5, 9, 3, 14, 7))]
  want = [_greedy_reference(full_logprobs, p, 6) for p in prompts]
  stop = want[1][0][2]  # request 1 stops at its third token (and so may others that sample it)
  engine = Engine(model, SLOTS, CACHE)  # 5 requests over 3 slots: slots are reused
  got = generate(engine, prompts, GREEDY, max_new_tokens=6, stop_ids=[stop])
  assert all(isinstance(c, Completion) for c in got)
  for p_toks, c in zip(want, got):
    toks, lps = p_toks
    n = toks.index(stop) + 1 if stop in toks else 6
    assert c.token_ids == toks[:n]
    np.testing.assert_allclose(c.logprobs, lps[:n], atol=1e-5)
    assert c.finish_reason == ("stop" if stop in toks else "length")
  assert got[1].finish_reason == "stop" and len(got[1].token_ids) == 3


def test_generate_ends_with_length_at_the_end_of_the_cache(model, full_logprobs):
  engine = Engine(model, SLOTS, CACHE)
  other = _prompt(70, 5)
  engine.prefill(2, other, jax.random.key(0), GREEDY)  # a neighbour that must stay untouched
  k_other, _ = _layer0_kv(model, other)
  prompt = _prompt(71, CACHE - 4)
  (c,) = generate(engine, [prompt], GREEDY, max_new_tokens=100)
  # 60 prompt tokens fill indices 0..59; four decode steps fill 60..63; the fifth sampled token
  # has nowhere to go, so the request ends there, with "length".
  assert c.finish_reason == "length" and len(c.token_ids) == 5
  want_toks, want_lps = _greedy_reference(full_logprobs, prompt, 5)
  assert c.token_ids == want_toks
  np.testing.assert_allclose(c.logprobs, want_lps, atol=1e-5)
  slot = next(s for s in range(SLOTS) if engine.position(s) == CACHE)
  # Every entry holds its own token (a write clamped at the end would overwrite index 63).
  k_want, _ = _layer0_kv(model, prompt + c.token_ids[:-1])
  np.testing.assert_allclose(_keys(engine.state.cache.k[0])[slot], k_want, atol=1e-5)
  np.testing.assert_allclose(_keys(engine.state.cache.k[0])[2, :, :5], k_other, atol=1e-5)
  # The engine refuses to advance a full slot rather than write past the cache.
  active = np.zeros(SLOTS, bool)
  active[slot] = True
  with pytest.raises(ValueError, match="full"):
    engine.generate(active, jax.random.key(1), GREEDY)


def test_generate_rejects_bad_requests_before_any_work(model):
  engine = Engine(model, SLOTS, CACHE)
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    generate(engine, [[1, 2], []], GREEDY)
  with pytest.raises(ValueError, match="prompt 0 has 64 tokens"):
    generate(engine, [_prompt(80, CACHE), [1]], GREEDY)
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(engine, [[1]], GREEDY, max_new_tokens=0)
  assert all(engine.position(s) == 0 for s in range(SLOTS))
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=1.5)
  for bad in (dict(num_slots=0), dict(cache_len=0), dict(max_prefill_tokens=0)):
    with pytest.raises(ValueError, match="must be >= 1"):
      Engine(model, **{"num_slots": SLOTS, "cache_len": CACHE, **bad})
  # Ids outside the vocabulary (512) would embed as NaN and poison the slot's cache; a
  # negative slot would alias the last one on the device. All refused before any work.
  with pytest.raises(ValueError, match=r"prompt 1: token ids must lie in \[0, 512\)"):
    generate(engine, [[1, 2], [3, 512]], GREEDY)
  with pytest.raises(ValueError, match="must be integers"):
    generate(engine, [[1.5, 2.0]], GREEDY)
  before = jax.tree.map(np.asarray, engine.state)
  for requests, match in (
    ([(0, [1, 2], KEY), (1, [-1], KEY)], "slot 1: token ids"),
    ([(SLOTS - 1, [1], KEY), (-1, [2], KEY)], "outside"),
    ([(SLOTS, [1], KEY)], "outside"),
  ):
    with pytest.raises(ValueError, match=match):
      engine.prefill_many(requests, GREEDY)
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(jax.tree.map(np.asarray, engine.state))):
    np.testing.assert_array_equal(x, y)
  assert all(engine.position(s) == 0 for s in range(SLOTS))
  assert engine.prefill_many([], GREEDY) == []


@pytest.mark.parametrize(
  "n,start,cache", [(2100, 0, 4096), (700, 3300, 4096), (4, 60, 64), (1, 0, 64), (513, 0, 1024)]
)
def test_prefill_chunks_cover_the_input_and_stay_inside_the_cache(n, start, cache):
  sizes = _chunks(n, start, cache)
  taken = 0
  for size in sizes:
    assert size & (size - 1) == 0 and size <= 512  # powers of two, at most one max chunk
    assert start + taken + size <= cache  # the padded chunk fits
    taken += min(size, n - taken)
  assert taken == n and sizes[-1] >= 1
  assert sum(sizes) - n < max(sizes)  # padding is less than one chunk


@pytest.mark.parametrize("seed", range(6))
def test_prefill_schedule_covers_every_request_within_the_limits(seed):
  """The schedule `prefill_many` runs: each request's tokens consumed once and in order, one
  chunk length per forward, forwards within max_prefill_tokens (or a single row), nothing past a
  slot's cache, and requests that share a round share forwards."""
  rng = np.random.default_rng(seed)
  cache = int(rng.choice([64, 600, 4096]))
  mpt = int(rng.choice([8, 256, 1024]))
  n = int(rng.integers(1, 7))
  starts = [int(rng.integers(0, cache)) for _ in range(n)]
  lengths = [int(rng.integers(1, cache - s + 1)) for s in starts]
  left, pos = list(lengths), list(starts)
  for rows, t in prefill_schedule(lengths, starts, cache, mpt):
    assert rows and len(set(rows)) == len(rows) and all(left[i] > 0 for i in rows)
    assert t & (t - 1) == 0 and t <= MAX_PREFILL_CHUNK
    assert len(rows) == 1 or len(rows) * t <= mpt
    for i in rows:
      assert pos[i] + t <= cache  # the padded chunk fits the slot
      step = min(t, left[i])
      left[i] -= step
      pos[i] += step
  assert left == [0] * n and pos == [s + x for s, x in zip(starts, lengths)]
  # 64 fresh 128-token prompts with 1024 tokens per forward: 8 forwards of 8 rows.
  assert prefill_schedule([128] * 64, [0] * 64, 4096, 1024) == [
    (list(range(k, k + 8)), 128) for k in range(0, 64, 8)
  ]


def test_generate_samples_do_not_depend_on_batching(model):
  prompts = [_prompt(90 + i, n) for i, n in enumerate((5, 9, 3, 14))]
  sampling = SamplingParams(temperature=0.9, top_p=0.9)
  rng = jax.random.key(11)
  three = generate(Engine(model, SLOTS, CACHE), prompts, sampling, max_new_tokens=7, rng=rng)
  one = generate(Engine(model, 1, CACHE), prompts, sampling, max_new_tokens=7, rng=rng)
  for a, b in zip(three, one):
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
  other = generate(
    Engine(model, SLOTS, CACHE), prompts, sampling, max_new_tokens=7, rng=jax.random.key(12)
  )
  assert [c.token_ids for c in other] != [c.token_ids for c in three]  # the key matters


def test_donated_weights_are_a_clear_error_and_a_trainer_fed_engine_follows_updates(model):
  """An engine left on weights a training step donated raises StaleWeightsError (not a crash);
  one built with weights=trainer.inference_params decodes each update's weights unasked."""
  import optax

  from coevolve_jax import grpo
  from coevolve_jax.rollout.engine import StaleWeightsError
  from coevolve_jax.trainer import PolicyTrainer, make_batch
  from coevolve_jax.types import Trajectory

  graphdef, state = nnx.split(model)  # the trainer donates what it is given: not the fixture
  copy = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
  trainer = PolicyTrainer(copy, optax.sgd(1.0), grpo.GRPOConfig(), 1.0)
  stale = Engine(copy, num_slots=2, cache_len=32)  # holds the trainer's first buffers
  live = Engine(copy, num_slots=2, cache_len=32, weights=trainer.inference_params)
  greedy, key, ids = SamplingParams(temperature=0.0), jax.random.key(0), _prompt(3, 6)
  before = live.prefill(0, ids, key, SamplingParams(temperature=1.0))

  ids_t = _prompt(4, 12)
  traj = Trajectory("t", 0, ids_t, [0] * 6 + [1] * 6, [0.0] * 12, reward=1.0)
  trainer.sft_update(make_batch([traj], min_len=16, min_targets=8))
  with pytest.raises(StaleWeightsError, match="donated"):
    stale.prefill(0, ids, key, greedy)
  with pytest.raises(StaleWeightsError):
    stale.generate(np.ones(2, bool), key, greedy)

  live.reset_slot(0)
  after = live.prefill(0, ids, key, SamplingParams(temperature=1.0))
  assert after[1] != before[1]  # the update moved the log-prob of the sampled token
  reference = Engine(nnx.merge(trainer.graphdef, jax.tree.map(jnp.copy, trainer.params)), 2, 32)
  assert reference.prefill(0, ids, key, SamplingParams(temperature=1.0)) == after
  stale.load_params(trainer.model())  # re-pointed by hand, it works again
  assert stale.prefill(1, ids, key, SamplingParams(temperature=1.0)) == after


def _generate_all(engine, prompts, sampling, decode_steps, **kw):
  return generate(
    engine, prompts, sampling, rng=jax.random.key(11), decode_steps=decode_steps, **kw
  )


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_steps_equal_single_steps_bit_for_bit(model, temperature):
  """K decode steps per device call (`Engine.generate_steps`) give the single-step completions
  exactly: tokens, log-probs (bitwise) and finish reasons. Seven requests over three slots (slots
  are reused while others decode), a stop id that ends some requests early, token limits, and a
  request that ends at the end of its cache (room) with K larger than what is left."""
  sampling = SamplingParams(temperature=temperature)
  prompts = [_prompt(80 + i, n) for i, n in enumerate((5, 9, 3, 14, 7, CACHE - 6, 11))]
  want = _generate_all(Engine(model, SLOTS, CACHE), prompts, sampling, 1, max_new_tokens=12)
  stop = want[0].token_ids[3]  # ends request 0 at its 4th token (and others that sample it)
  want = _generate_all(
    Engine(model, SLOTS, CACHE), prompts, sampling, 1, max_new_tokens=12, stop_ids=[stop]
  )
  assert {c.finish_reason for c in want} == {"stop", "length"}
  assert len(want[5].token_ids) == 7  # 58 prompt tokens + 6 writes fill the cache
  for k in (2, 5, 16):
    got = _generate_all(
      Engine(model, SLOTS, CACHE), prompts, sampling, k, max_new_tokens=12, stop_ids=[stop]
    )
    for w, g in zip(want, got, strict=True):
      assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason, k
      assert np.array_equal(np.float32(g.logprobs), np.float32(w.logprobs)), k


def test_decode_steps_equal_single_steps_bit_for_bit_at_batch_16_hidden_256():
  """The same at batch 16, hidden 256 and a 4,096-token vocabulary, where XLA:CPU fuses the
  single-step program (`_generate`) so that its log-probs differ from the K-step loop's in the
  last bit (every row did while K = 1 decoded through it; at the rollout benchmark's shape such
  differences flipped sampled tokens): every K runs the one compiled step of `generate_steps`."""
  model = kit.tiny_model(1, vocab_size=4096, hidden_size=256, intermediate_size=768, head_dim=64)
  prompts = [[int(x) for x in np.random.default_rng(i).integers(1, 4096, 32)] for i in range(16)]
  sampling = SamplingParams(temperature=0.9)
  want, got = (
    _generate_all(Engine(model, 16, 128), prompts, sampling, k, max_new_tokens=16) for k in (1, 8)
  )
  for w, g in zip(want, got, strict=True):
    assert g.token_ids == w.token_ids
    assert np.array_equal(np.float32(g.logprobs), np.float32(w.logprobs))


def test_decode_steps_stop_at_the_key_length_bucket_and_match_single_steps(model):
  """Calls never pass the key-length bucket of their first step (the next call takes the next
  bucket, as single steps would): a request decoding across 256 cached tokens gives the
  single-step tokens and log-probs bit for bit."""
  prompts = [_prompt(90, 250), _prompt(91, 40)]
  want = _generate_all(Engine(model, 2, 512), prompts, GREEDY, 1, max_new_tokens=20)
  engine = Engine(model, 2, 512)
  calls = []
  real = engine.generate_steps

  def logged(active, *args):
    calls.append(int(engine._pos[active].max()))
    return real(active, *args)

  engine.generate_steps = logged
  got = _generate_all(engine, prompts, GREEDY, 8, max_new_tokens=20)
  for w, g in zip(want, got, strict=True):
    assert g.token_ids == w.token_ids
    assert np.array_equal(np.float32(g.logprobs), np.float32(w.logprobs))
  # Prompt 0 sits at 250: 6 steps reach index 255, then the next call starts in the 512 bucket.
  assert calls == [250, 256, 264], calls
  # What the engine reports of its work (`pop_work`): the prompts' tokens, the decode calls and
  # the tokens they sampled (each request's first token comes from its prefill), then nothing.
  work = engine.pop_work()
  assert work["engine/prefill_tokens"] == 290 <= work["engine/prefill_padded_tokens"]
  assert work["engine/decode_calls"] == 3
  assert work["engine/decode_tokens"] == sum(len(g.token_ids) - 1 for g in got)
  assert work["engine/decode_key_entries"] == 2 * (6 * 256 + (8 + 5) * 512)  # steps x slots x keys
  assert work["engine/prefill_seconds"] > 0 and work["engine/decode_seconds"] > 0
  assert engine.pop_work() == {}


def test_decode_steps_copy_to_the_host_once_per_call_at_batch_64(model, monkeypatch):
  """64 requests, 33 tokens each (the first from the prefill), K = 8: four device calls of up to
  eight steps (no single-step call) and four copies of their outputs to the host. (On CPU the
  device is host memory, so JAX's transfer guard cannot count; the engine fetches its outputs
  with one `jax.device_get` per call, counted here.)"""
  import coevolve_jax.rollout.engine as engine_lib  # noqa: PLC0415

  counts = {"steps": 0, "single": 0, "device_get": 0}

  def counting(name, fn):
    def wrapped(*args, **kwargs):
      counts[name] += 1
      return fn(*args, **kwargs)

    return wrapped

  monkeypatch.setattr(engine_lib, "_generate_steps", counting("steps", engine_lib._generate_steps))
  monkeypatch.setattr(engine_lib, "_generate", counting("single", engine_lib._generate))
  monkeypatch.setattr(jax, "device_get", counting("device_get", jax.device_get))
  prompts = [_prompt(100 + i, 4 + i % 9) for i in range(64)]
  got = generate(Engine(model, 64, CACHE), prompts, GREEDY, max_new_tokens=33, decode_steps=8)
  assert all(len(c.token_ids) == 33 and c.finish_reason == "length" for c in got)
  assert counts == {"steps": 4, "single": 0, "device_get": 4}


def test_decode_steps_reject_bad_calls(model):
  engine = Engine(model, SLOTS, CACHE)
  engine.prefill(0, [1, 2, 3], KEY, GREEDY)
  active, keys = np.array([True, False, False]), jax.random.split(KEY, SLOTS)
  zeros = np.zeros(SLOTS, np.int32)
  with pytest.raises(ValueError, match="limits >= 1"):
    engine.generate_steps(active, keys, zeros, zeros, (), GREEDY, 4)
  with pytest.raises(ValueError, match="max_steps >= 1"):
    engine.generate_steps(active, keys, zeros, zeros + 1, (), GREEDY, 0)
  with pytest.raises(ValueError, match="an active slot"):
    engine.generate_steps(~np.ones(SLOTS, bool), keys, zeros, zeros + 1, (), GREEDY, 4)
  with pytest.raises(ValueError, match="must have shape"):
    engine.generate_steps(active[:2], keys, zeros, zeros + 1, (), GREEDY, 4)
  with pytest.raises(ValueError, match="decode_steps must be >= 1"):
    generate(engine, [[1, 2]], GREEDY, decode_steps=0)


@pytest.mark.parametrize("rows_mode", ["fit", "full"])
def test_prefill_shapes_hold_every_forward_the_engine_runs(model, monkeypatch, rows_mode):
  """`prefill_shapes` is a superset of the (rows, chunk, key bucket) shapes `prefill_many` runs,
  and every forward's chunk fits in its key bucket (the window `_prefill_rows` copies): random
  requests from random positions, near the end of the cache too."""
  import coevolve_jax.rollout.engine as engine_lib  # noqa: PLC0415

  engine = Engine(model, 4, 256, max_prefill_tokens=64, prefill_rows=rows_mode, prefill_min_chunk=8)
  allowed, seen = set(engine.prefill_shapes()), set()
  real = engine_lib._prefill_rows

  def logged(graphdef, params, state, slots_r, chunk_rt, true_len_r, keys_r, sampling, kv_len, sh):
    seen.add((chunk_rt.shape[0], chunk_rt.shape[1], kv_len))
    # _prefill_rows copies only each row's cache entries [0, kv_len): the chunk must fit in them.
    assert (
      int(np.max(np.asarray(state.next_pos)[np.asarray(slots_r)])) + chunk_rt.shape[1] <= kv_len
    )
    return real(
      graphdef, params, state, slots_r, chunk_rt, true_len_r, keys_r, sampling, kv_len, sh
    )

  monkeypatch.setattr(engine_lib, "_prefill_rows", logged)
  rng = np.random.default_rng(0)
  for _ in range(12):
    slots = sorted(rng.choice(4, int(rng.integers(1, 5)), replace=False).tolist())
    requests = []
    for slot in slots:
      if engine.room(slot) < 2 or rng.random() < 0.2:
        engine.reset_slot(slot)
      n = int(rng.integers(1, min(engine.room(slot), 120) + 1))
      requests.append((slot, _prompt(int(rng.integers(1 << 20)), n), KEY))
    engine.prefill_many(requests, GREEDY)
  assert seen and seen <= allowed, seen - allowed
  if rows_mode == "full":  # one row count per chunk length
    assert len({(t, r) for r, t, _ in allowed}) == len({t for _, t, _ in allowed})
  assert any(t < 8 for _, t, _ in seen)  # a chunk near the end of a cache was run


def test_compile_ahead_leaves_nothing_to_compile(model):
  """After `Engine.compile_ahead`, prefills and decodes of every kind (batched prompts,
  continuations, K-step and single-step decode) compile none of the engine's
  programs: the ahead compiles fill the cache the calls use. The first pass may compile the
  batcher's own small eager ops (key updates, once per shape); a second pass compiles nothing.
  A fresh engine of another size, so nothing was compiled for it before."""
  from coevolve_jax.metrics import CompileCounter  # noqa: PLC0415

  sampled = SamplingParams(temperature=0.7)
  engine = Engine(model, 2, 128, max_prefill_tokens=64, prefill_rows="full", prefill_min_kv=32)
  programs = ("_prefill_rows", "_generate", "_generate_steps")
  counter = CompileCounter()
  try:
    n = engine.compile_ahead([sampled], stop_ids=[3], decode_steps=(1, 4), threads=2)
    assert n == len(engine.prefill_shapes()) + 2 * len(engine.decode_buckets())  # K 1 and 4
    ahead = counter.pop()
    assert sum(ahead.get(f"compile/program/{p}", 0) for p in programs) == n
    for rounds in range(2):
      for k in (1, 4):
        engine.reset_slot(0), engine.reset_slot(1)
        prompts = [_prompt(7, 40), _prompt(8, 5)]
        generate(engine, prompts, sampled, max_new_tokens=6, stop_ids=[3], rng=KEY, decode_steps=k)
        engine.prefill_many([(0, _prompt(9, 30), KEY), (1, _prompt(10, 3), KEY)], sampled)
      left = counter.pop()
      assert not any(left.get(f"compile/program/{p}") for p in programs), left
      assert rounds == 0 or left["compile/count"] == 0, left
  finally:
    counter.close()


def test_decoding_under_jax_enable_x64_gives_the_same_tokens(model):
  """With 64-bit types on (`jax.enable_x64`, a user's setting), the engine's cache writes take
  start indices of one dtype (a Python 0 became int64 beside int32 positions, a TypeError), and
  sampled decoding gives the 32-bit run's tokens and log-probs."""
  prompts, sampling = [_prompt(90, 3), _prompt(91, 9)], SamplingParams(temperature=0.8)
  want = generate(Engine(model, SLOTS, CACHE), prompts, sampling, rng=KEY, max_new_tokens=5)
  with jax.enable_x64(True):
    got = generate(Engine(model, SLOTS, CACHE), prompts, sampling, rng=KEY, max_new_tokens=5)
  for w, g in zip(want, got, strict=True):
    assert g.token_ids == w.token_ids
    assert np.array_equal(np.float32(g.logprobs), np.float32(w.logprobs))
