"""Hugging Face <-> nnx weight mapping for Qwen models, in both directions.

Hugging Face stores linear kernels as [out, in] and one tensor per expert
(`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, the checkpoint format on the Hub and what
transformers' `save_pretrained` writes). We store kernels as [in, out], attention projections split
by head ([D, N, H]) and experts stacked ([E, D, F]). The rules below speak of one layer at a time
in dotted per-layer paths ("layers.3.self_attn.q_proj"); the model stacks the layers of each block
(`QwenConfig.layer_blocks`) on a leading axis, and `stacked_path` / `layer_paths` translate between
a per-layer path and (stacked nnx path "blocks.1.self_attn.q_proj", index in the stack).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np

from coevolve_jax.models.qwen import QwenConfig


def _heads_in(n_heads_attr: str) -> Callable:
  """[N*H, D] -> [D, N, H]."""

  def f(a, cfg):
    return a.reshape(getattr(cfg, n_heads_attr), cfg.head_dim, cfg.hidden_size).transpose(2, 0, 1)

  return f


def _bias_in(n_heads_attr: str) -> Callable:
  return lambda a, cfg: a.reshape(getattr(cfg, n_heads_attr), cfg.head_dim)


def _o_proj_in(a, cfg):  # [D, N*H] -> [N, H, D]
  return a.reshape(cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2, 0)


_T = lambda a, cfg: a.T  # noqa: E731
_ID = lambda a, cfg: a  # noqa: E731

_L = r"model\.layers\.(\d+)\."
# (HF name regex, our path template, HF -> ours transform). The expert rule's second group is the
# expert index: its tensors fill one slice of a stacked [E, ...] parameter.
RULES: list[tuple[str, str, Callable]] = [
  (r"model\.embed_tokens\.weight", "embed_tokens", _ID),
  (r"model\.norm\.weight", "norm.weight", _ID),
  (r"lm_head\.weight", "lm_head", _T),
  (_L + r"input_layernorm\.weight", "layers.{0}.input_layernorm.weight", _ID),
  (_L + r"post_attention_layernorm\.weight", "layers.{0}.post_attention_layernorm.weight", _ID),
  (
    _L + r"self_attn\.q_proj\.weight",
    "layers.{0}.self_attn.q_proj",
    _heads_in("num_attention_heads"),
  ),
  (
    _L + r"self_attn\.k_proj\.weight",
    "layers.{0}.self_attn.k_proj",
    _heads_in("num_key_value_heads"),
  ),
  (
    _L + r"self_attn\.v_proj\.weight",
    "layers.{0}.self_attn.v_proj",
    _heads_in("num_key_value_heads"),
  ),
  (_L + r"self_attn\.o_proj\.weight", "layers.{0}.self_attn.o_proj", _o_proj_in),
  (_L + r"self_attn\.q_proj\.bias", "layers.{0}.self_attn.q_bias", _bias_in("num_attention_heads")),
  (_L + r"self_attn\.k_proj\.bias", "layers.{0}.self_attn.k_bias", _bias_in("num_key_value_heads")),
  (_L + r"self_attn\.v_proj\.bias", "layers.{0}.self_attn.v_bias", _bias_in("num_key_value_heads")),
  (_L + r"self_attn\.q_norm\.weight", "layers.{0}.self_attn.q_norm.weight", _ID),
  (_L + r"self_attn\.k_norm\.weight", "layers.{0}.self_attn.k_norm.weight", _ID),
  (_L + r"mlp\.(gate|up|down)_proj\.weight", "layers.{0}.mlp.{1}_proj", _T),
  (_L + r"mlp\.gate\.weight", "layers.{0}.mlp.gate", _T),  # MoE router [E, D] -> [D, E]
  (_L + r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", "layers.{0}.mlp.experts.{2}_proj", _T),
]
_EXPERT_RULE = RULES[-1][0]


_LAYER_PATH = re.compile(r"layers\.(\d+)\.(.+)")
_BLOCK_PATH = re.compile(r"blocks\.(\d+)\.(.+)")


def stacked_path(path: str, cfg: QwenConfig) -> tuple[str, int | None]:
  """A per-layer path "layers.{i}.rest" as (the stacked parameter "blocks.{g}.rest" that holds
  layer i, i's index in that block); any other path as (path, None).

  Raises:
    KeyError: a layer index outside [0, num_hidden_layers).
  """
  m = _LAYER_PATH.fullmatch(path)
  if not m:
    return path, None
  i = int(m.group(1))
  for g, (first, count) in enumerate(cfg.layer_blocks):
    if first <= i < first + count:
      return f"blocks.{g}.{m.group(2)}", i - first
  raise KeyError(f"layer {i} is outside the model's {cfg.num_hidden_layers} layers")


def layer_paths(path: str, cfg: QwenConfig) -> list[tuple[str, int | None]]:
  """The inverse of `stacked_path`: a stacked parameter "blocks.{g}.rest" as its layers'
  [("layers.{i}.rest", index in the stack), ...]; any other path as [(path, None)].

  Raises:
    KeyError: a block index the config does not have.
  """
  m = _BLOCK_PATH.fullmatch(path)
  if not m:
    return [(path, None)]
  g = int(m.group(1))
  blocks = cfg.layer_blocks
  if g >= len(blocks):
    raise KeyError(f"block {g} is outside the model's {len(blocks)} blocks")
  first, count = blocks[g]
  return [(f"layers.{first + j}.{m.group(2)}", j) for j in range(count)]


def hf_to_path(name: str) -> tuple[str, int | None, Callable]:
  """Maps a HF tensor name to (our dotted path, expert index or None, HF -> ours transform).

  Raises:
    KeyError: a name no rule maps (for example a fused `mlp.experts.gate_up_proj`, which only
      exists inside transformers >= 5 at run time, never in a saved checkpoint).
  """
  for pattern, template, fn in RULES:
    m = re.fullmatch(pattern, name)
    if m:
      expert = int(m.group(2)) if pattern == _EXPERT_RULE else None
      return template.format(*m.groups()), expert, fn
  raise KeyError(f"no mapping for Hugging Face tensor {name!r}")


def path_to_hf(path: str, value: np.ndarray, cfg: QwenConfig) -> Iterator[tuple[str, np.ndarray]]:
  """The HF tensors (name, [out, in] array) that hold our parameter `path`; experts yield E.

  Raises:
    KeyError: a path that has no HF counterpart.
  """
  d = cfg.hidden_size
  if path == "embed_tokens":
    yield "model.embed_tokens.weight", value
    return
  if path == "norm.weight":
    yield "model.norm.weight", value
    return
  if path == "lm_head":
    yield "lm_head.weight", value.T
    return
  m = re.fullmatch(r"layers\.(\d+)\.(.+)", path)
  if not m:
    raise KeyError(f"no Hugging Face name for parameter {path!r}")
  prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
  if rest in (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
  ):
    yield prefix + rest, value
  elif rest in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):  # [D, X, H]
    yield prefix + rest + ".weight", value.reshape(d, -1).T
  elif rest == "self_attn.o_proj":  # [N, H, D]
    yield prefix + rest + ".weight", value.reshape(-1, d).T
  elif rest in ("self_attn.q_bias", "self_attn.k_bias", "self_attn.v_bias"):
    yield prefix + f"self_attn.{rest[-6]}_proj.bias", value.reshape(-1)
  elif rest in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.gate"):
    yield prefix + rest + ".weight", value.T
  elif rest in ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj"):
    kind = rest.rsplit(".", 1)[1]
    for e in range(value.shape[0]):
      yield prefix + f"mlp.experts.{e}.{kind}.weight", value[e].T
  else:
    raise KeyError(f"no Hugging Face name for parameter {path!r}")
