"""Hugging Face <-> nnx weight mapping for Qwen models.

Each rule maps a Hugging Face tensor name (regex) to our parameter path and a transform from the HF
array (stored [out, in]) to our layout. `assign_hf_tensors` fills a model in place, tensor by
tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from coevolve_jax.models.qwen import Qwen


def _heads_in(n_heads_attr: str) -> Callable:
  """[N*H, D] -> [D, N, H]."""
  def f(a, cfg):
    n = getattr(cfg, n_heads_attr)
    return a.reshape(n, cfg.head_dim, cfg.hidden_size).transpose(2, 0, 1)
  return f


def _bias(n_heads_attr: str) -> Callable:
  return lambda a, cfg: a.reshape(getattr(cfg, n_heads_attr), cfg.head_dim)


def _o_proj(a, cfg):  # [D, N*H] -> [N, H, D]
  return a.reshape(cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2, 0)


_T = lambda a, cfg: a.T  # noqa: E731
_ID = lambda a, cfg: a  # noqa: E731

# (HF regex, our path template, transform)
RULES: list[tuple[str, str, Callable]] = [
    (r"model\.embed_tokens\.weight", "embed_tokens", _ID),
    (r"model\.norm\.weight", "norm.weight", _ID),
    (r"lm_head\.weight", "lm_head", _T),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.{0}.input_layernorm.weight", _ID),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight",
     "layers.{0}.post_attention_layernorm.weight", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", "layers.{0}.self_attn.q_proj",
     _heads_in("num_attention_heads")),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", "layers.{0}.self_attn.k_proj",
     _heads_in("num_key_value_heads")),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", "layers.{0}.self_attn.v_proj",
     _heads_in("num_key_value_heads")),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "layers.{0}.self_attn.o_proj", _o_proj),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.bias", "layers.{0}.self_attn.q_bias",
     _bias("num_attention_heads")),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.bias", "layers.{0}.self_attn.k_bias",
     _bias("num_key_value_heads")),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.bias", "layers.{0}.self_attn.v_bias",
     _bias("num_key_value_heads")),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", "layers.{0}.self_attn.q_norm.weight", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", "layers.{0}.self_attn.k_norm.weight", _ID),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "layers.{0}.mlp.gate_proj", _T),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "layers.{0}.mlp.up_proj", _T),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "layers.{0}.mlp.down_proj", _T),
]


def hf_to_path(name: str) -> tuple[str, Callable]:
  """Our dotted parameter path and transform for a HF tensor name. Raises KeyError if unmapped."""
  for pattern, template, fn in RULES:
    m = re.fullmatch(pattern, name)
    if m:
      return template.format(*m.groups()), fn
  raise KeyError(f"no mapping for Hugging Face tensor {name!r}")


def _get(model: nnx.Module, path: str) -> nnx.Variable:
  obj = model
  for part in path.split("."):
    obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
  return obj


def assign_hf_tensors(model: Qwen, tensors: Iterable[tuple[str, np.ndarray]]) -> set[str]:
  """Copies HF tensors into `model` one at a time. Returns the set of our paths assigned.

  Raises:
    KeyError: an unknown tensor name. ValueError: a shape mismatch.
  """
  done = set()
  for name, arr in tensors:
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
      continue
    path, fn = hf_to_path(name)
    var = _get(model, path)
    value = fn(np.asarray(arr, dtype=np.float32), model.config)
    if value.shape != var[...].shape:
      raise ValueError(f"{name}: shape {value.shape} does not fit {path} {var[...].shape}")
    var[...] = jnp.asarray(value, var[...].dtype)
    done.add(path)
  return done
