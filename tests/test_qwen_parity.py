"""Logits of our Qwen against Hugging Face transformers on tiny random configs (float32)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from coevolve_jax.models import Qwen, QwenConfig, KVCache  # noqa: E402
from coevolve_jax.models.params import assign_hf_tensors  # noqa: E402


def _hf_model(family, tie, n_heads, n_kv):
  common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=16,
                rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie)
  torch.manual_seed(0)
  if family == "qwen3":
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
  else:
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
  with torch.no_grad():  # random biases/norm weights, so that every parameter is exercised
    for name, p in hf.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  cfg = QwenConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=16,
                   rope_theta=10000.0, tie_word_embeddings=tie,
                   attention_bias=family == "qwen2", qk_norm=family == "qwen3")
  ours = Qwen(cfg, rngs=nnx.Rngs(1))
  assign_hf_tensors(ours, ((k, v.detach().numpy()) for k, v in hf.state_dict().items()))
  return hf.eval(), ours


@pytest.mark.parametrize("family,tie,n_heads,n_kv", [
    ("qwen3", True, 4, 2), ("qwen3", False, 4, 4), ("qwen2", False, 4, 1), ("qwen2", True, 4, 2)])
def test_logits_match_transformers(family, tie, n_heads, n_kv):
  hf, ours = _hf_model(family, tie, n_heads, n_kv)
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 320, size=(3, 11))
  mask = np.ones_like(ids)
  mask[1, :4] = 0  # left padding
  mask[2, 8:] = 0  # right padding
  with torch.no_grad():
    ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
  got = np.asarray(ours(jnp.asarray(ids), attention_mask_bt=jnp.asarray(mask)))
  valid = mask.astype(bool)
  np.testing.assert_allclose(got[valid], ref[valid], atol=1e-4, rtol=0)


def test_kv_cache_decode_equals_full_forward():
  _, ours = _hf_model("qwen3", True, 4, 2)
  ids = jnp.asarray(np.random.default_rng(1).integers(0, 320, size=(2, 9)))
  full = ours(ids)
  cache = KVCache.zeros(ours.config, 2, 16)
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  h, cache = ours.decode(ids[:, :5], pos, cache, jnp.zeros((2,), jnp.int32))
  outs = [ours.logits(h)]
  for t in range(5, 9):
    h, cache = ours.decode(ids[:, t:t + 1], jnp.full((2, 1), t), cache, jnp.full((2,), t))
    outs.append(ours.logits(h))
  np.testing.assert_allclose(np.concatenate(outs, axis=1), full, atol=1e-4, rtol=0)
