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


def _span(index: slice, size: int) -> tuple[int, int]:
  start, stop, step = index.indices(size)
  if step != 1:
    raise ValueError(f"strided slice {index} is not supported")
  return start, stop


class Layout:
  """How one Hugging Face tensor becomes one of our parameters: `__call__(hf, cfg)` transforms
  the whole tensor; `read(get, index, cfg)` gives only `ours[index]` and reads only the part of
  the HF tensor it needs through `get(hf_index) -> np.ndarray` (a safetensors slice), so a
  process loads just the shards its devices hold. `index` is a tuple of step-1 slices over our
  full shape (`jax.make_array_from_callback`'s)."""

  def __call__(self, a: np.ndarray, cfg: QwenConfig) -> np.ndarray:
    return self.read(lambda index: a[index], (slice(None),) * self.rank(a.ndim), cfg)

  def rank(self, hf_rank: int) -> int:
    return hf_rank

  def shape(self, hf_shape: tuple[int, ...], cfg: QwenConfig) -> tuple[int, ...] | None:
    """Our shape for an HF tensor of `hf_shape` (None when no shape of ours has that layout)."""
    return tuple(hf_shape)

  def read(self, get: Callable, index: tuple, cfg: QwenConfig) -> np.ndarray:
    raise NotImplementedError


class _Identity(Layout):
  def read(self, get, index, cfg):
    return get(tuple(index))


class _Transpose(Layout):
  """[out, in] -> [in, out]."""

  def shape(self, hf_shape, cfg):
    return tuple(hf_shape)[::-1]

  def read(self, get, index, cfg):
    return get(tuple(index)[::-1]).T


class _Heads(Layout):
  """q/k/v kernels [X*H, D] -> [D, X, H] (X heads of `n_heads_attr`)."""

  def __init__(self, n_heads_attr: str):
    self.attr = n_heads_attr

  def rank(self, hf_rank):
    return 3

  def shape(self, hf_shape, cfg):
    n, hd = getattr(cfg, self.attr), cfg.head_dim
    return (hf_shape[1], n, hd) if len(hf_shape) == 2 and hf_shape[0] == n * hd else None

  def read(self, get, index, cfg):
    d, n, h = index
    n0, n1 = _span(n, getattr(cfg, self.attr))
    hd = cfg.head_dim
    a = get((slice(n0 * hd, n1 * hd), d))  # [(n1 - n0) * H, D']
    return a.reshape(n1 - n0, hd, a.shape[1]).transpose(2, 0, 1)[:, :, h]


class _OProj(Layout):
  """o_proj [D, N*H] -> [N, H, D]."""

  def rank(self, hf_rank):
    return 3

  def shape(self, hf_shape, cfg):
    n, hd = cfg.num_attention_heads, cfg.head_dim
    return (n, hd, hf_shape[0]) if len(hf_shape) == 2 and hf_shape[1] == n * hd else None

  def read(self, get, index, cfg):
    n, h, d = index
    n0, n1 = _span(n, cfg.num_attention_heads)
    hd = cfg.head_dim
    a = get((d, slice(n0 * hd, n1 * hd)))  # [D', (n1 - n0) * H]
    return a.reshape(a.shape[0], n1 - n0, hd).transpose(1, 2, 0)[:, h, :]


class _Bias(Layout):
  """q/k/v biases [X*H] -> [X, H]."""

  def __init__(self, n_heads_attr: str):
    self.attr = n_heads_attr

  def rank(self, hf_rank):
    return 2

  def shape(self, hf_shape, cfg):
    n, hd = getattr(cfg, self.attr), cfg.head_dim
    return (n, hd) if tuple(hf_shape) == (n * hd,) else None

  def read(self, get, index, cfg):
    n, h = index
    n0, n1 = _span(n, getattr(cfg, self.attr))
    hd = cfg.head_dim
    return get((slice(n0 * hd, n1 * hd),)).reshape(n1 - n0, hd)[:, h]


def _heads_in(n_heads_attr: str) -> Layout:
  """[N*H, D] -> [D, N, H]."""
  return _Heads(n_heads_attr)


def _bias_in(n_heads_attr: str) -> Layout:
  return _Bias(n_heads_attr)


_o_proj_in = _OProj()  # [D, N*H] -> [N, H, D]
_T = _Transpose()
_ID = _Identity()

_L = r"model\.layers\.(\d+)\."
# (HF name regex, our path template, HF -> ours transform). The expert rule's second group is the
# expert index: its tensors fill one slice of a stacked [E, ...] parameter.
RULES: list[tuple[str, str, Layout]] = [
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


def hf_to_path(name: str) -> tuple[str, int | None, Layout]:
  """Maps a HF tensor name to (our dotted path, expert index or None, HF -> ours `Layout`).

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
