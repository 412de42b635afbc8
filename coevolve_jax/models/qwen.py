"""Qwen2 / Qwen2.5 / Qwen3 dense, Qwen3-MoE and Llama-family decoders in Flax nnx, with a KV cache.

Dimension letters used in names and einsums:
  B batch, T query length, S key / cache length, D hidden (model) size, N query heads,
  K key/value heads, G = N // K query heads per kv head, H head dim, F MLP hidden size, V vocab,
  L layers, E experts, M tokens (B * T flattened), A token-expert assignments (M * top-k),
  k experts per token (top-k), L_moe sparse MoE layers (`QwenConfig.moe_layers`).

Parameters use the Hugging Face names (`embed_tokens`, `self_attn.q_proj`, ...) but store kernels as
[in, out] (HF stores [out, in]; the weight mapper transposes). The decoder layers are stacked for
training: `blocks[g]` is one `DecoderLayer` whose parameters carry a leading [L_g] layer axis
(logical axis "layers") for the consecutive layers of block g (`QwenConfig.layer_blocks`), and
the training forward runs each block under `jax.lax.scan`, so compile time does not grow with
the depth; the rollout engine decodes an unrolled copy (`Qwen(stacked=False)`, `unstack`).
Architecture reference: Hugging Face transformers `modeling_qwen2.py` / `modeling_qwen3.py` /
`modeling_qwen3_moe.py` (rotate-half RoPE, RMSNorm, SwiGLU MLP, GQA; Qwen2 q/k/v biases; Qwen3
per-head q/k RMSNorm; Qwen3-MoE softmax router with top-k experts, optionally renormalised).
Llama 3.x and SmolLM2 (`modeling_llama.py`) are the same decoder without q/k/v biases or q/k
norm, with Llama 3's RoPE frequency scaling (`RopeScaling`) where the checkpoint sets it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import PartitionSpec as P

from coevolve_jax.models.kernels import (
  ATTENTION_KERNELS,
  KEY_LAYOUTS,
  cudnn_supports,
  decode_kernel,
  fused_attention,
  key_layout,
  local_kv_heads,
  paged_decode_attention,
  paged_decode_blocks,
  paged_prefill_attention,
  paged_prefill_page,
  prefill_kernel,
  ragged_decode_attention,
  ragged_decode_splits,
  resolve_attention,
)
from coevolve_jax.models.sharding import active_mesh, constrain, param_spec, spec_axes


FAMILIES = ("qwen", "llama")
ROPE_TYPES = ("llama3",)


class RopeScaling(NamedTuple):
  """Llama 3's RoPE frequency scaling (HF `rope_scaling` / `rope_parameters` with
  `rope_type: "llama3"`; transformers `_compute_llama3_parameters`): frequencies whose wavelength
  exceeds `original_max_position_embeddings / low_freq_factor` are divided by `factor`, those
  below `original_max_position_embeddings / high_freq_factor` are kept, and the band between is
  interpolated. Llama 3.2: factor 32, low 1, high 4, original 8192."""

  rope_type: str
  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class QwenConfig:
  """Architecture hyper-parameters (names follow the Hugging Face config.json), plus the
  checkpoint's end-of-sequence ids, which generation reads.

  `family` "qwen" covers Qwen2 (q/k/v biases), Qwen3 (q/k norm) and Qwen3-MoE; "llama" covers
  Llama 3.x and SmolLM2 (neither biases nor q/k norm; `rope_scaling` for Llama 3.1+).
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  attention_bias: bool = False  # Qwen2: q/k/v biases (no o_proj bias)
  qk_norm: bool = True  # Qwen3: RMSNorm over head_dim on q and k
  max_position_embeddings: int = 40960
  # Qwen3-MoE; num_experts == 0 means a dense model.
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
  decoder_sparse_step: int = 1  # every n-th layer is sparse ...
  mlp_only_layers: tuple[int, ...] = ()  # ... except these, which keep a dense MLP
  # Not architecture: the ids a checkpoint names as `eos_token_id` in config.json and
  # generation_config.json (Qwen3 instruct: 151645 <|im_end|> and 151643 <|endoftext|>). A reply
  # ends at any of them as well as at the tokenizer's <|im_end|>; () for a random init.
  eos_token_ids: tuple[int, ...] = ()
  family: str = "qwen"
  rope_scaling: RopeScaling | None = None

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
    if self.family == "llama" and (self.attention_bias or self.qk_norm or self.num_experts):
      raise ValueError("a llama-family config has no q/k/v bias, q/k norm or experts")
    if self.rope_scaling is not None:
      rs = RopeScaling(*self.rope_scaling)
      if rs.rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rs.rope_type!r} is not one of {ROPE_TYPES}")
      if not (
        rs.factor > 0
        and 0 < rs.low_freq_factor < rs.high_freq_factor
        and rs.original_max_position_embeddings > 0
      ):
        raise ValueError(
          f"rope_scaling {rs} needs factor > 0, 0 < low < high freq factor and "
          "original_max_position_embeddings > 0"
        )
      object.__setattr__(self, "rope_scaling", rs)
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
        f"num_attention_heads {self.num_attention_heads} is not a multiple of "
        f"num_key_value_heads {self.num_key_value_heads}"
      )
    if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
      raise ValueError(
        f"num_experts_per_tok must be in [1, {self.num_experts}], got {self.num_experts_per_tok}"
      )
    if self.num_experts and self.moe_intermediate_size <= 0:
      raise ValueError("a MoE config needs moe_intermediate_size > 0")
    object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
    object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
    bad = [i for i in self.eos_token_ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"eos_token_ids {bad} are outside the vocabulary [0, {self.vocab_size})")

  @property
  def model_type(self) -> str:
    """The Hugging Face `model_type`: "qwen3_moe", "qwen3", "qwen2" or "llama"."""
    if self.family == "llama":
      return "llama"
    if self.num_experts:
      return "qwen3_moe"
    return "qwen3" if self.qk_norm else "qwen2"

  def is_moe_layer(self, layer: int) -> bool:
    """Whether decoder layer `layer` has a sparse MoE block (rule of HF `Qwen3MoeDecoderLayer`)."""
    return (
      self.num_experts > 0
      and layer not in self.mlp_only_layers
      and (layer + 1) % self.decoder_sparse_step == 0
    )

  @property
  def moe_layers(self) -> tuple[int, ...]:
    """Indices of the sparse MoE layers, in order (empty for a dense model). Routing records
    ([B, T, L_moe, k] expert indices, `Qwen.hidden_states`) hold one entry per layer listed here."""
    return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

  @property
  def layer_blocks(self) -> tuple[tuple[int, int], ...]:
    """(first layer, layer count) of each block of stacked, scanned layers, in order.

    Consecutive layers of one kind (dense or sparse MoE) share a block, except the last layer,
    which is always a block of its own: with `output_index_bp` it runs at P positions only, and
    keeping it apart avoids slicing it off a stacked parameter (a slice would copy the stack).
    A dense model has two blocks, (0, L-1) and (L-1, 1); Qwen3-MoE with `mlp_only_layers` or
    `decoder_sparse_step` > 1 has one block per run of same-kind layers (for an alternating stack
    that is one block per layer, and compile time grows with the depth again).
    """
    n = self.num_hidden_layers
    blocks: list[tuple[int, int]] = []
    for i in range(n - 1):
      if blocks and self.is_moe_layer(i) == self.is_moe_layer(blocks[-1][0]):
        blocks[-1] = (blocks[-1][0], blocks[-1][1] + 1)
      else:
        blocks.append((i, 1))
    if n:
      blocks.append((n - 1, 1))
    return tuple(blocks)

  @classmethod
  def tiny_cpu(cls, vocab_size: int = 151936) -> "QwenConfig":
    """Small Qwen3-architecture model for the CPU preset and tests (real vocabulary size)."""
    return cls(
      vocab_size=vocab_size,
      hidden_size=128,
      intermediate_size=384,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=32,
      tie_word_embeddings=True,
    )

  @classmethod
  def qwen3_0_6b(cls) -> "QwenConfig":
    return cls(
      vocab_size=151936,
      hidden_size=1024,
      intermediate_size=3072,
      num_hidden_layers=28,
      num_attention_heads=16,
      num_key_value_heads=8,
      head_dim=128,
      tie_word_embeddings=True,
    )

  @classmethod
  def qwen3_1_7b(cls) -> "QwenConfig":
    return cls(
      vocab_size=151936,
      hidden_size=2048,
      intermediate_size=6144,
      num_hidden_layers=28,
      num_attention_heads=16,
      num_key_value_heads=8,
      head_dim=128,
      tie_word_embeddings=True,
    )

  @classmethod
  def qwen3_4b(cls) -> "QwenConfig":
    return cls(
      vocab_size=151936,
      hidden_size=2560,
      intermediate_size=9728,
      num_hidden_layers=36,
      num_attention_heads=32,
      num_key_value_heads=8,
      head_dim=128,
      rope_theta=5_000_000.0,
      tie_word_embeddings=True,
      max_position_embeddings=262144,
    )

  @classmethod
  def qwen2_5_7b(cls) -> "QwenConfig":
    return cls(
      vocab_size=152064,
      hidden_size=3584,
      intermediate_size=18944,
      num_hidden_layers=28,
      num_attention_heads=28,
      num_key_value_heads=4,
      head_dim=128,
      rms_norm_eps=1e-6,
      attention_bias=True,
      qk_norm=False,
      max_position_embeddings=32768,
    )

  @classmethod
  def qwen3_30b_a3b(cls) -> "QwenConfig":
    """Qwen3-30B-A3B-Instruct-2507: 48 layers, 128 experts, 8 active per token."""
    return cls(
      vocab_size=151936,
      hidden_size=2048,
      intermediate_size=6144,
      num_hidden_layers=48,
      num_attention_heads=32,
      num_key_value_heads=4,
      head_dim=128,
      rope_theta=10_000_000.0,
      max_position_embeddings=262144,
      num_experts=128,
      num_experts_per_tok=8,
      moe_intermediate_size=768,
      norm_topk_prob=True,
    )

  @classmethod
  def llama3_2_1b(cls) -> "QwenConfig":
    """Llama-3.2-1B(-Instruct): 16 layers, tied head, Llama 3 RoPE scaling."""
    return cls._llama3_2(
      hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, head_dim=64
    )

  @classmethod
  def llama3_2_3b(cls) -> "QwenConfig":
    """Llama-3.2-3B(-Instruct): 28 layers, tied head, Llama 3 RoPE scaling."""
    return cls._llama3_2(
      hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, head_dim=128
    )

  @classmethod
  def _llama3_2(cls, **shape) -> "QwenConfig":
    return cls(
      vocab_size=128256,
      intermediate_size=8192,
      num_key_value_heads=8,
      rope_theta=500_000.0,
      rms_norm_eps=1e-5,
      tie_word_embeddings=True,
      qk_norm=False,
      max_position_embeddings=131072,
      family="llama",
      rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192),
      **shape,
    )

  @classmethod
  def smollm2_135m(cls) -> "QwenConfig":
    """SmolLM2-135M(-Instruct) (Llama architecture): 30 layers, hidden 576, 9 / 3 heads, tied."""
    return cls(
      vocab_size=49152,
      hidden_size=576,
      intermediate_size=1536,
      num_hidden_layers=30,
      num_attention_heads=9,
      num_key_value_heads=3,
      head_dim=64,
      rope_theta=100_000.0,
      rms_norm_eps=1e-5,
      tie_word_embeddings=True,
      qk_norm=False,
      max_position_embeddings=8192,
      family="llama",
    )

  @classmethod
  def preset(cls, name: str, **overrides) -> "QwenConfig":
    """A named preset (one of PRESETS, e.g. "qwen3_4b"); `overrides` replace fields.

    Raises:
      ValueError: an unknown name.
    """
    if name not in PRESETS:
      raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return dataclasses.replace(getattr(cls, name)(), **overrides)


# Named presets (QwenConfig classmethods). Published parameter counts: tests/test_model_presets.py.
PRESETS = (
  "tiny_cpu",
  "qwen3_0_6b",
  "qwen3_1_7b",
  "qwen3_4b",
  "qwen2_5_7b",
  "qwen3_30b_a3b",
  "llama3_2_1b",
  "llama3_2_3b",
  "smollm2_135m",
)


def routing_dtype(num_experts: int) -> jnp.dtype:
  """The integer dtype that stores routing records (expert indices and -1) for E experts: int16
  up to 32767 experts (every Qwen MoE), int32 beyond."""
  return jnp.dtype(jnp.int16 if num_experts <= jnp.iinfo(jnp.int16).max else jnp.int32)


# How a MoE block moves token copies to their experts' devices (`SparseMoE`, model.expert_dispatch).
EXPERT_DISPATCH = ("auto", "gather", "all_to_all")

CPU_LOGITS_ROWS = 256  # full-logits projection on XLA:CPU: rows per product (see Qwen.__call__)

# Logical axes (models/sharding.py) of each key and value array of a `KVCache`; a stacked array
# has "layers" first (`KVCache.axes`). Module constants: a NamedTuple's class body holds fields.
KV_KEY_AXES = ("batch", "act_kv_heads", None, "cache_length")
KV_VALUE_AXES = ("batch", "act_kv_heads", "cache_length", None)


class KVCache(NamedTuple):
  """Per-layer key caches [B, K, H, S] and value caches [B, K, S, H]. Cache index == position.

  Heads before positions, so a decode step's attention is a batched product over (B, K) that
  reads the cache as laid out (with [B, S, K, H], XLA:CPU transposed every layer's whole cache
  each step). Keys are stored transposed, position minor: the scores product q [G, H] x k [H, S]
  then runs in the standard layout (see `_attend`; docs/benchmarks/rollout.md). Values stay
  [S, H], the layout probs [G, S] x v [S, H] wants.

  That key layout is "hs" (`kernels.KEY_LAYOUTS`). Where the decode steps run a Pallas kernel
  (`model.attention` "cudnn", or "auto" on a GPU: the GPU decode kernel; "splash", or "auto" on a
  TPU, over a bfloat16 cache: the TPU paged-attention kernel; `kernels.key_layout`), keys are
  stored [B, K, S, H] like the values ("sh"), the layout those kernels read; `zeros` and `axes`
  take the layout, and the model and the engine read it from `model.attention` and the cache's
  dtype.

  Two layouts, as the model's layers have (`Qwen`):
  - unrolled (default): one array per layer, so a decode step of the unrolled model writes and
    reads each layer's cache in place;
  - stacked (`stacked=True`): one array per block of stacked layers (`QwenConfig.layer_blocks`),
    [L_g, B, K, H, S] and [L_g, B, K, S, H], which a stacked model's decode carries through its
    scan over the block (`Qwen.decode_routed`).
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]

  @classmethod
  def zeros(
    cls,
    cfg: QwenConfig,
    batch: int,
    length: int,
    dtype=jnp.float32,
    stacked: bool = False,
    keys: str = "hs",
  ) -> "KVCache":
    """A zero cache of `batch` slots x `length` entries, keys in layout `keys` ("hs" or "sh").

    Raises:
      ValueError: an unknown key layout.
    """
    _check_layout(keys)
    b, k, h = batch, cfg.num_key_value_heads, cfg.head_dim
    counts = [n for _, n in cfg.layer_blocks] if stacked else [None] * cfg.num_hidden_layers
    lead = lambda n: () if n is None else (n,)  # noqa: E731
    key_tail = (h, length) if keys == "hs" else (length, h)
    # Distinct buffers per layer: engines donate the cache, and a buffer donated twice is an error.
    return cls(
      k=tuple(jnp.zeros((*lead(n), b, k, *key_tail), dtype) for n in counts),
      v=tuple(jnp.zeros((*lead(n), b, k, length, h), dtype) for n in counts),
    )

  @property
  def length(self) -> int:
    """S, entries per slot."""
    return self.v[0].shape[-2]

  @property
  def stacked(self) -> bool:
    """Whether the arrays are per block of stacked layers ([L_g, B, ...]) rather than per layer."""
    return self.k[0].ndim == 5

  @classmethod
  def axes(cls, stacked: bool, keys: str = "hs") -> tuple[tuple, tuple]:
    """Logical axes of (each key array, each value array) in the given layout and key layout."""
    _check_layout(keys)
    lead = ("layers",) if stacked else ()
    return (*lead, *(KV_KEY_AXES if keys == "hs" else KV_VALUE_AXES)), (*lead, *KV_VALUE_AXES)


def _check_layout(keys: str) -> None:
  if keys not in KEY_LAYOUTS:
    raise ValueError(f"unknown key layout {keys!r}; known: {', '.join(KEY_LAYOUTS)}")


def _check_cache(k_cache, v_cache, keys: str) -> None:
  """Raises ValueError where a layer's key cache is not laid out as `keys` says (the values
  fix the other dimensions): a cache made for another `model.attention`."""
  want = (
    v_cache.shape if keys == "sh" else (*v_cache.shape[:-2], v_cache.shape[-1], v_cache.shape[-2])
  )
  if tuple(k_cache.shape) != tuple(want):
    raise ValueError(
      f"the KV cache's keys have shape {tuple(k_cache.shape)}, not {tuple(want)} (key layout "
      f"{keys!r}, which this model's attention needs: make the cache with "
      f"KVCache.zeros(..., keys=kernels.key_layout(model.attention, dtype=...)))"
    )


REMAT_POLICIES = ("none", "full", "save_dots")


def remat_layer(fn, policy: str, prevent_cse: bool = True):
  """`fn` (a decoder layer's forward) under the rematerialisation `policy`.

  "none": the backward pass keeps every intermediate of every layer; "full": only each layer's
  input is kept and the layer is recomputed in the backward pass (`jax.checkpoint`); "save_dots":
  the outputs of matrix products without batch dimensions (`jax.checkpoint_policies.
  dots_with_no_batch_dims_saveable`: the q/k/v/o projections and MLP or expert products) are kept
  and the rest (norms, RoPE, the attention scores and probabilities, which are batched products,
  activations) is recomputed.

  Raises:
    ValueError: a policy not in REMAT_POLICIES.
  """
  if policy == "none":
    return fn
  if policy == "full":
    return jax.checkpoint(fn, prevent_cse=prevent_cse)
  if policy == "save_dots":
    saveable = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return jax.checkpoint(fn, prevent_cse=prevent_cse, policy=saveable)
  raise ValueError(f"unknown remat policy {policy!r}; known: {', '.join(REMAT_POLICIES)}")


def next_params_key(rngs: nnx.Rngs) -> jax.Array:
  """The key `rngs.params()` returns, and the same advance of the stream's count.

  `rngs.params()` advances its count with an indexed update (`count[...] += 1`), which compares
  the new count's sharding with the old one's; on a tracer (a model built under `jit`, as
  `builder.init` does on a mesh, or `eval_shape`, as the memory planner does) the failed
  `.sharding` lookup builds JAX's error message by walking the whole trace recorded so far, once
  per parameter: quadratic in the parameter count. Setting the count whole skips that lookup;
  tracing `Qwen(qwen3_4b)` under `nnx.eval_shape` took 0.76 s with `rngs.params()` and 0.14 s
  without the lookup (2-core CPU, 2026-12-02). Same keys and final count
  (tests/test_model_presets.py).

  Returns:
    A typed PRNG key (`fold_in(stream key, count)`).
  """
  stream = rngs.params  # the "params" stream, or the default one when there is none
  count = stream.count.get_value()
  key = jax.random.fold_in(stream.key.get_value(), count)
  stream.count.set_value(count + 1)
  return key


def _init(rngs: nnx.Rngs, shape, axes, dtype, scale: float = 0.02) -> nnx.Param:
  value = scale * jax.random.normal(next_params_key(rngs), shape, dtype)
  return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


class RMSNorm(nnx.Module):
  """RMSNorm: x / sqrt(mean(x^2) + eps) * weight, computed in float32."""

  def __init__(self, size: int, eps: float, dtype):
    self.weight = nnx.Param(jnp.ones((size,), dtype), out_sharding=("norm",), eager_sharding=False)
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return (x32 * jax.lax.rsqrt(var + self.eps)).astype(x.dtype) * self.weight[...].astype(x.dtype)


def rope_inv_freq(h: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
  """The [H/2] float32 inverse frequencies of rotary embedding over head dim `h`.

  Without `scaling`: theta^(-2i/H) (RoFormer, Su et al. 2021, Eq. 15). With Llama 3 scaling
  (`RopeScaling`), long wavelengths are divided by `factor` and the band between the high- and
  low-frequency wavelengths is interpolated linearly in 1/wavelength, as transformers'
  `_compute_llama3_parameters` does.
  """
  inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # [H/2]
  if scaling is None:
    return inv_freq
  old = float(scaling.original_max_position_embeddings)
  low, high, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > old / low, inv_freq / factor, inv_freq)
  smooth = (old / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= old / high) & (wavelen <= old / low)
  return jnp.where(medium, smoothed, scaled)


def rope(
  x: jax.Array, positions: jax.Array, theta: float, scaling: RopeScaling | None = None
) -> jax.Array:
  """Rotate-half rotary embedding. x: [B, T, N, H]; positions: [B, T] int; `scaling`: Llama 3's
  frequency scaling, or None (`rope_inv_freq`)."""
  h = x.shape[-1]
  inv_freq = rope_inv_freq(h, theta, scaling)
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


# Query blocks of the cache-free (training / scoring) attention path. Causal block skipping over
# n blocks saves (n - 1) / (2n) of the attention work but unrolls n rematerialised blocks per
# layer (compile time): T is cut into 4 to 8 blocks of at least ATTN_MIN_BLOCK queries, or not
# at all (with 2 blocks, a T = 256 training step compiled 1.8 s longer and ran no faster).
ATTN_MIN_BLOCK = 128
ATTN_MIN_BLOCKS, ATTN_MAX_BLOCKS = 4, 8


def attention_block(t: int) -> int | None:
  """Query block size for a cache-free pass over T tokens, or None for one unblocked pass."""
  block = max(ATTN_MIN_BLOCK, t // ATTN_MAX_BLOCKS)
  return block if t % block == 0 and t // block >= ATTN_MIN_BLOCKS else None


def _attend(q_btnh, keys_bkhs, values_bksh, q_pos_bt, k_pos_bs, k_valid_bs) -> jax.Array:
  """Masked softmax attention with GQA. Returns [B, T, N, H]; a query sees keys whose position is
  <= its own and that are valid.

  Keys are [B, K, H, S] and values [B, K, S, H] (the KV cache's layout, see KVCache), and the
  queries are regrouped [B, K, G * T, H], so both products are plain [B, K] batches of
  row-major matrix products. XLA:CPU ran the [B, T, K, G, H] x [B, S, K, H] spelling 2.9x slower
  in a batch-64 decode step and 1.3-1.7x slower over whole sequences, backward included
  (docs/benchmarks/rollout.md).
  """
  b, t, n, h = q_btnh.shape
  kh, s = keys_bkhs.shape[1], keys_bkhs.shape[3]
  g = n // kh
  q = q_btnh.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, h)
  scores = jnp.einsum("BKQH,BKHS->BKQS", q, keys_bkhs.astype(q.dtype)).astype(jnp.float32)
  scores = scores.reshape(b, kh, g, t, s) * (h**-0.5)
  mask = (k_pos_bs[:, None, :] <= q_pos_bt[:, :, None]) & k_valid_bs[:, None, :]  # [B, T, S]
  scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(values_bksh.dtype).reshape(b, kh, g * t, s)
  out = jnp.einsum("BKQS,BKSH->BKQH", probs, values_bksh)
  return out.reshape(b, kh, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


ATTN_ONLINE_MIN_KEYS = 4096
ATTN_ONLINE_Q_BLOCK, ATTN_ONLINE_K_BLOCK = 512, 1024


def online_attention_blocks(t: int, s: int) -> tuple[int, int] | None:
  """(query block, key block) for `_attend_online` over T queries and S keys without a cache, or
  None where the blocked or plain `_attend` is used (fewer than ATTN_ONLINE_MIN_KEYS keys, or
  lengths the blocks do not divide; training lengths above 512 are multiples of 512)."""
  qb, kb = min(t, ATTN_ONLINE_Q_BLOCK), ATTN_ONLINE_K_BLOCK
  if s < ATTN_ONLINE_MIN_KEYS or t % qb or s % kb:
    return None
  return qb, kb


def _attend_online(
  q_btnh, keys_bkhs, values_bksh, q_pos_bt, k_pos_bs, k_valid_bs, q_block: int, k_block: int
) -> jax.Array:
  """`_attend` in O(q_block * k_block) memory per head: memory-efficient attention (Rabe and
  Staats 2021, "Self-attention does not need O(n^2) memory", Sec. 2-3).

  Queries run in blocks of `q_block` (`lax.map`), and for each block the keys in blocks of
  `k_block` (`lax.scan`) with the online softmax: a running maximum m, normaliser `total` and
  weighted sum of values `acc`, rescaled by exp(m_old - m_new) as each key block arrives. Both
  loops are rematerialised, so the backward pass keeps per query block only the scan's
  [B, K, G, q_block] carries, never a [.., T, S] score matrix. At T = S = 32,768 in Qwen3-4B a
  plain causal pass holds 128 GiB of float32 scores per layer, the 8-block `attention_block`
  path 16 GiB, this one 64 MiB per key block. A key block that no query of the block may see
  (all its keys after every query, or invalid) is skipped (`lax.cond`), so a causal pass costs
  about half the products of a full one.

  Same arguments and result as `_attend` ([B, T, N, H]); equal to it up to float rounding for
  every query that sees at least one valid key (a query that sees none gets zeros here, the
  mean of all values there). T must divide by q_block and S by k_block.
  """
  b, t, n, h = q_btnh.shape
  kh, s = keys_bkhs.shape[1], keys_bkhs.shape[3]
  g, nq, nk = n // kh, t // q_block, s // k_block
  low = jnp.finfo(jnp.float32).min
  # [nq, B, K, G, q_block, H] queries, [nk, ...] key and value blocks, positions alike.
  q = q_btnh.reshape(b, nq, q_block, kh, g, h).transpose(1, 0, 3, 4, 2, 5) * (h**-0.5)
  qp = q_pos_bt.reshape(b, nq, q_block).transpose(1, 0, 2)
  kb = keys_bkhs.reshape(b, kh, h, nk, k_block).transpose(3, 0, 1, 2, 4).astype(q.dtype)
  vb = values_bksh.reshape(b, kh, nk, k_block, h).transpose(2, 0, 1, 3, 4)
  kp = k_pos_bs.reshape(b, nk, k_block).transpose(1, 0, 2)
  kv = k_valid_bs.reshape(b, nk, k_block).transpose(1, 0, 2)

  def query_block(args):
    q_i, qp_i = args

    def key_block(carry, xs):
      k_j, v_j, kp_j, kv_j = xs

      def update(carry):
        m, total, acc = carry
        scores = jnp.einsum("BKGQH,BKHS->BKGQS", q_i, k_j).astype(jnp.float32)
        mask = (kp_j[:, None, :] <= qp_i[:, :, None]) & kv_j[:, None, :]  # [B, q_block, k_block]
        scores = jnp.where(mask[:, None, None], scores, low)
        m_new = jnp.maximum(m, scores.max(-1))
        p = jnp.where(mask[:, None, None], jnp.exp(scores - m_new[..., None]), 0.0)
        rescale = jnp.exp(m - m_new)
        pv = jnp.einsum("BKGQS,BKSH->BKGQH", p.astype(v_j.dtype), v_j)
        total = total * rescale + p.sum(-1)
        return m_new, total, acc * rescale[..., None] + pv.astype(jnp.float32)

      seen = jnp.any((kp_j[:, None, :] <= qp_i[:, :, None]) & kv_j[:, None, :])
      return jax.lax.cond(seen, update, lambda c: c, carry), None

    init = (
      jnp.full((b, kh, g, q_block), low, jnp.float32),
      jnp.zeros((b, kh, g, q_block), jnp.float32),
      jnp.zeros((b, kh, g, q_block, h), jnp.float32),
    )
    (_, total, acc), _ = jax.lax.scan(jax.checkpoint(key_block), init, (kb, vb, kp, kv))
    return (acc / jnp.where(total > 0, total, 1.0)[..., None]).astype(values_bksh.dtype)

  out = jax.lax.map(jax.checkpoint(query_block), (q, qp))  # [nq, B, K, G, q_block, H]
  return out.transpose(1, 0, 4, 2, 3, 5).reshape(b, t, n, h)


# Key block of a decode step's attention on the "blocked" path (`_attend_cached_blocks`), used
# from buckets of DECODE_MIN_BLOCKS blocks. On XLA:CPU a decode step of SmolLM2-135M (8 slots,
# 2,048-key bucket) spent 35% of its time copying the bucket out of the cache (a strided slice of
# the [B, K, H, S] keys) before its products; blocks read in place up to the last one a slot
# needs made the step 1.2x faster at a 2,048-key bucket and 1.5-1.7x at 4,096, and 0.86x at
# 1,024 (two blocks: the loop costs more than the copy it saves). 256 and 1,024 entries per
# block were no faster (benchmarks/decode_step.py, docs/benchmarks/rollout.md).
DECODE_KEY_BLOCK = 512
DECODE_MIN_BLOCKS = 4
DECODE_MAX_QUERIES = 1


class CacheView(NamedTuple):
  """A layer's KV cache as a cached pass reads it (`_attend_by_pass`): `read(start, size)` ->
  (keys, values) of entries [start, start + size) in the cache's layout: [B, K, H, size] keys
  (`keys` "hs") or [B, K, size, H] ("sh"), [B, K, size, H] values (`_read_kv_cache`,
  `_read_stacked_kv_cache`); `in_place`: the pass's key bucket is the whole of an unrolled
  cache, which a plain pass reads where it lies (no copy); `whole`: the entries `read(0, whole)`
  returns where they lie (an unrolled cache's length; 0 for a stacked cache, whose layer entry is
  read by a copy); `dtype`: the cache's (which decode kernel reads it, `kernels.decode_kernel`).
  A cached pass's keys are the cache's entries at index == position, every one valid
  (`Qwen.decode_routed`)."""

  read: Callable[..., tuple[jax.Array, jax.Array]]
  in_place: bool
  keys: str = "hs"
  whole: int = 0
  dtype: Any = jnp.float32


def decode_key_block(kernel: str, t: int, s: int, in_place: bool) -> int | None:
  """Key block of a cached pass of T queries over a key bucket of S entries with the attention
  `kernel`, or None where one plain pass over the bucket is used: only the "blocked" path
  ("auto" on CPU), decode steps (T <= DECODE_MAX_QUERIES), buckets of at least
  DECODE_MIN_BLOCKS blocks, and where the plain pass would copy the bucket out of the cache
  (`in_place` False: a stacked cache's layer entry, or fewer entries than the cache holds; a
  whole unrolled cache is read where it lies, and its plain pass was as fast on XLA:CPU)."""
  block = DECODE_KEY_BLOCK
  if in_place or t > DECODE_MAX_QUERIES or s < DECODE_MIN_BLOCKS * block or s % block:
    return None
  return block if resolve_attention(kernel) == "blocked" else None


def _attend_cached_blocks(q_btnh, read, q_pos_bt, k_pos_bs, k_valid_bs, block: int) -> jax.Array:
  """`_attend` of a cached pass over key blocks read in place, up to the last block any query
  sees: the online softmax of `_attend_online` (Rabe and Staats 2021, Sec. 2-3) in a
  `jax.lax.fori_loop` whose trip count is computed on the device. A decode step then reads the
  cache up to its longest slot's length (rounded up to `block`), not to the whole key bucket,
  and copies nothing out of it.

  Args:
    q_btnh: [B, T, N, H] queries; q_pos_bt: [B, T] their positions.
    read: `read(start, size)` -> ([B, K, H, size] keys, [B, K, size, H] values): cache entries
      [start, start + size) (`_read_kv_cache`, `_read_stacked_kv_cache`), start traced.
    k_pos_bs, k_valid_bs: [B, S] key positions and validity (None: all valid) of the bucket's S
      entries; S divides by `block`.
  Returns:
    [B, T, N, H] in the values' dtype; equal to `_attend` over the bucket up to float rounding
    for every query that sees a valid key (one that sees none gets zeros).
  """
  b, t, n, h = q_btnh.shape
  s = k_pos_bs.shape[1]
  if k_valid_bs is None:
    k_valid_bs = jnp.ones(k_pos_bs.shape, jnp.bool_)
  _, values0 = read(0, 1)  # shapes and dtype only
  kh = values0.shape[1]
  g = n // kh
  low = jnp.finfo(jnp.float32).min
  q = q_btnh.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
  # Blocks to read: up to the last entry some query of its row may see.
  seen_bs = k_valid_bs & (k_pos_bs <= jnp.max(q_pos_bt, axis=1, keepdims=True))
  last = jnp.max(jnp.where(seen_bs, jnp.arange(s, dtype=jnp.int32), -1))
  n_blocks = jnp.clip(last // block + 1, 1, s // block)

  def key_block(j, carry):
    m, total, acc = carry
    start = j * block
    k_j, v_j = read(start, block)
    kp_j = jax.lax.dynamic_slice_in_dim(k_pos_bs, start, block, axis=1)
    kv_j = jax.lax.dynamic_slice_in_dim(k_valid_bs, start, block, axis=1)
    scores = jnp.einsum("BKGTH,BKHS->BKGTS", q, k_j.astype(q.dtype)).astype(jnp.float32)
    scores = scores * (h**-0.5)  # scaled after the product, as `_attend` does
    mask = ((kp_j[:, None, :] <= q_pos_bt[:, :, None]) & kv_j[:, None, :])[:, None, None]
    scores = jnp.where(mask, scores, low)
    m_new = jnp.maximum(m, scores.max(-1))
    p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
    rescale = jnp.exp(m - m_new)
    pv = jnp.einsum("BKGTS,BKSH->BKGTH", p.astype(v_j.dtype), v_j)
    return m_new, total * rescale + p.sum(-1), acc * rescale[..., None] + pv.astype(jnp.float32)

  init = (
    jnp.full((b, kh, g, t), low, jnp.float32),
    jnp.zeros((b, kh, g, t), jnp.float32),
    jnp.zeros((b, kh, g, t, h), jnp.float32),
  )
  _, total, acc = jax.lax.fori_loop(0, n_blocks, key_block, init)
  out = (acc / jnp.where(total > 0, total, 1.0)[..., None]).astype(values0.dtype)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _start_indices(*indices) -> tuple[jax.Array, ...]:
  """Start indices for `jax.lax.dynamic_slice` / `dynamic_update_slice`, all int32: they must
  share one dtype, and a Python int becomes int64 under jax_enable_x64 (tests/test_engine.py
  decodes with it on)."""
  return tuple(jnp.asarray(i, jnp.int32) for i in indices)


def _write_kv_cache(keys_bkht, values_bkth, k_cache_bkhs, v_cache_bksh, write_b, keys="hs"):
  """Writes T new keys and values into a per-layer KV cache at each row's write index.

  Args:
    keys_bkht: [B, K, H, T] new keys ([B, K, T, H] with `keys` "sh"); values_bkth: [B, K, T, H]
      new values.
    k_cache_bkhs, v_cache_bksh: [B, K, H, S_max] ([B, K, S_max, H] with "sh") key and
      [B, K, S_max, H] value caches.
    write_b: [B] int cache index of the first new entry per row.
    keys: the key layout ("hs" or "sh", `KVCache`).
  Returns:
    (new k cache, new v cache).
  """
  at_s = lambda i: _start_indices(0, i, 0)  # noqa: E731  [K, S, H] arrays: values, keys "sh"
  key_at = (lambda i: _start_indices(0, 0, i)) if keys == "hs" else at_s
  write_k = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice(c, u, key_at(i)))
  write_v = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice(c, u, at_s(i)))
  k_cache_bkhs = write_k(k_cache_bkhs, keys_bkht.astype(k_cache_bkhs.dtype), write_b)
  v_cache_bksh = write_v(v_cache_bksh, values_bkth.astype(v_cache_bksh.dtype), write_b)
  return k_cache_bkhs, v_cache_bksh


def _read_kv_cache(k_cache_bkhs, v_cache_bksh, start, size: int, keys: str = "hs"):
  """Cache entries [start, start + size) of a per-layer KV cache: ([B, K, H, size] keys, or
  [B, K, size, H] with `keys` "sh"; [B, K, size, H] values). `start` is 0 (a static slice) or
  traced (`_attend_cached_blocks`)."""
  key_axis = 3 if keys == "hs" else 2
  if isinstance(start, int) and start == 0:
    cut = k_cache_bkhs[..., :size] if keys == "hs" else k_cache_bkhs[:, :, :size]
    return cut, v_cache_bksh[:, :, :size]
  cut = jax.lax.dynamic_slice_in_dim(k_cache_bkhs, start, size, axis=key_axis)
  return cut, jax.lax.dynamic_slice_in_dim(v_cache_bksh, start, size, axis=2)


def _write_stacked_kv_cache(
  k_btkh, v_btkh, k_cache_lbkhs, v_cache_lbksh, write_b, layer, keys: str = "hs"
):
  """Writes T new keys and values into one layer's entry of a block's stacked KV cache (a decode
  scan's carry), in place at [layer, b, ..., write_b[b]] (keys [L_g, B, K, S_max, H] with
  `keys` "sh").

  One scatter into the stack, indexed in place: a vmap over the slot axis (axis 1 here) would
  move it first and copy the whole stack twice per layer.

  Args:
    k_btkh, v_btkh: [B, T, K, H] new keys and values.
    k_cache_lbkhs, v_cache_lbksh: [L_g, B, K, H, S_max] key and [L_g, B, K, S_max, H] value
      caches of the block's layers (`KVCache(stacked=True)`).
    write_b: [B] int cache index of the first new entry per row.
    layer: the (traced) index of this layer's entry.
  Returns:
    (new k cache, new v cache).
  """
  li, t = layer, k_btkh.shape[1]
  rows = jnp.arange(k_btkh.shape[0])[:, None]  # [B, 1]
  cols = write_b[:, None] + jnp.arange(t, dtype=write_b.dtype)[None]  # [B, T]
  hints = dict(indices_are_sorted=True, unique_indices=True)
  key_at = (li, rows, slice(None), slice(None), cols)
  if keys == "sh":
    key_at = (li, rows, slice(None), cols, slice(None))
  k_cache_lbkhs = k_cache_lbkhs.at[key_at].set(
    k_btkh.astype(k_cache_lbkhs.dtype), **hints
  )  # updates [B, T, K, H]: the advanced indices' dims first
  v_cache_lbksh = v_cache_lbksh.at[li, rows, :, cols, :].set(
    v_btkh.astype(v_cache_lbksh.dtype), **hints
  )
  return k_cache_lbkhs, v_cache_lbksh


def _read_stacked_kv_cache(k_cache_lbkhs, v_cache_lbksh, layer, start, size: int, keys="hs"):
  """Entries [start, start + size) of layer `layer`'s part of a block's stacked KV cache, each one
  dynamic slice: ([B, K, H, size] keys, or [B, K, size, H] with `keys` "sh"; [B, K, size, H]
  values)."""
  _, b, kh, _, hd = v_cache_lbksh.shape
  at, shape = _start_indices(layer, 0, 0, start, 0), (1, b, kh, size, hd)
  values = jax.lax.dynamic_slice(v_cache_lbksh, at, shape)[0]
  if keys == "hs":
    at, shape = _start_indices(layer, 0, 0, 0, start), (1, b, kh, hd, size)
  return jax.lax.dynamic_slice(k_cache_lbkhs, at, shape)[0], values


def _attend_causal_blocks(
  q_btnh, keys_bkhs, values_bksh, q_pos_bt, k_pos_bs, k_valid_bs, block: int
) -> jax.Array:
  """`_attend` of a cache-free causal pass with block skipping: query block i only needs keys
  [0, (i+1)*block) (positions grow with the index for every real token), and each block is
  rematerialised in the backward pass instead of storing its [.., block, keys] scores.

  Same arguments and result as `_attend` ([B, T, N, H]); T must divide by `block` and the keys
  be the T inputs themselves (S = T).
  """
  t = q_btnh.shape[1]
  outs = []
  for i in range(t // block):
    lo, hi = i * block, (i + 1) * block
    outs.append(
      jax.checkpoint(_attend)(
        q_btnh[:, lo:hi],
        keys_bkhs[..., :hi],
        values_bksh[:, :, :hi],
        q_pos_bt[:, lo:hi],
        k_pos_bs[:, :hi],
        k_valid_bs[:, :hi],
      )
    )
  return jnp.concatenate(outs, axis=1)


def _attend_query_blocks(
  q_bpnh, keys_bkhs, values_bksh, q_pos_bp, k_pos_bs, k_valid_bs, block: int
) -> jax.Array:
  """`_attend` of queries at P chosen positions (the last layer of a scoring pass) in blocks of
  `block` queries: any query may see every key, so no block skipping, but each block of queries
  is rematerialised, so the backward pass keeps no [.., P, T] scores (at P = 2048 of T = 4096 in
  Qwen3-4B, 1 GiB of float32 per copy).

  Same arguments and result as `_attend` ([B, P, N, H]); P must divide by `block`.
  """
  p = q_bpnh.shape[1]
  outs = [
    jax.checkpoint(_attend)(
      q_bpnh[:, lo : lo + block],
      keys_bkhs,
      values_bksh,
      q_pos_bp[:, lo : lo + block],
      k_pos_bs,
      k_valid_bs,
    )
    for lo in range(0, p, block)
  ]
  return jnp.concatenate(outs, axis=1)


def _attend_by_pass(
  q_btnh,
  keys_bkhs,
  values_bksh,
  q_pos_bt,
  k_pos_bs,
  k_valid_bs,
  *,
  cached: bool,
  gathered: bool,
  kernel: str = "auto",
  cache: CacheView | None = None,
) -> jax.Array:
  """Attention by the kernel `model.attention` chose (`kernels.resolve_attention`) and the kind
  of pass: the one function every attention of the model calls.

  - "splash" / "cudnn" (the "auto" choice on TPU / GPU): a cache-free pass whose queries are its
    inputs (training, scoring) runs the fused kernel (`kernels.fused_attention`); cuDNN only for
    half-precision inputs it takes (`kernels.cudnn_supports`). Every other pass takes the
    "blocked" paths below.
  - "cudnn" on a decode step (one query per row) from a `cache` view with keys "sh" (the
    cache's key layout for this kernel, `kernels.key_layout`): JAX's Pallas GPU decode kernel
    (`kernels.ragged_decode_attention`), reading each row's entries up to its own position;
    "splash" likewise over a bfloat16 cache, by JAX's Pallas TPU paged-attention kernel
    (`kernels.paged_decode_attention`); on a TPU a prefill chunk from such a cache takes JAX's
    Pallas TPU ragged paged-attention kernel (`kernels.paged_prefill_attention`, where
    `kernels.paged_prefill_page` takes the shapes); other prefill chunks the plain pass below.
  - "blocked" ("auto" on CPU): with a KV cache (`cached`: prefill or decode) one plain pass,
    except a decode step from a `cache` view where `decode_key_block` says so, which reads the
    cache in blocks up to the longest row's (`_attend_cached_blocks`); without a cache, long
    passes key-blocked (`_attend_online`), others query-blocked where the lengths allow
    (`_attend_causal_blocks`, or `_attend_query_blocks` for queries at chosen positions,
    `gathered`), the rest one plain pass.
  - "xla": one plain masked softmax (`_attend`) for every pass: the reference.

  Same arguments and result as `_attend`: [B, T, N, H] queries ([B, P, N, H] when `gathered`),
  [B, K, H, S] keys, [B, K, S, H] values, [B, T] query and [B, S] key positions, [B, S] key
  validity (None: every key is real); returns [B, T, N, H]. A cached pass may give, instead of
  the keys and values (then None), a `cache` view of the layer's KV cache to read its first S
  entries from.

  Raises:
    ValueError: an unknown kernel, or "cudnn" off GPU.
  """
  if cache is not None:
    s, t = k_pos_bs.shape[1], q_btnh.shape[1]
    per_slot = decode_kernel(kernel, dtype=cache.dtype)
    if t > 1 and cache.keys == "sh" and prefill_kernel(kernel, dtype=cache.dtype) == "paged":
      # The bucket (the engine's prefill windows): the kernel's paged copy of it is taken anyway.
      keys, values = cache.read(0, s)
      if paged_prefill_page(s, local_kv_heads(keys.shape), q_btnh.shape[-1]):
        # The T queries are the entries written last, at positions == index: row b's at
        # [position of its last + 1 - T, position of its last + 1).
        lengths = jnp.clip(q_pos_bt[:, -1] + 1, t, s)
        return paged_prefill_attention(q_btnh, keys, values, lengths)
    if t == 1 and cache.keys == "sh" and per_slot in ("ragged", "paged"):
      # The whole unrolled cache as it lies (a stacked one's bucket, a copy either way): the
      # kernel stops at each slot's length, and a slice would be copied for the kernel call.
      size = cache.whole or s
      fits = ragged_decode_splits if per_slot == "ragged" else paged_decode_blocks
      if fits(size):
        keys, values = cache.read(0, size)
        # Keys at index == position, all valid: the query sees entries [0, position], in the
        # bucket (an idle slot's position may lie past it: it then sees the bucket, as below).
        lengths = jnp.clip(q_pos_bt[:, 0] + 1, 1, s)
        attend = ragged_decode_attention if per_slot == "ragged" else paged_decode_attention
        return attend(q_btnh[:, 0], keys, values, lengths)[:, None]
    block = None
    if cache.keys == "hs":
      block = decode_key_block(kernel, q_btnh.shape[1], s, cache.in_place)
    if block:
      return _attend_cached_blocks(q_btnh, cache.read, q_pos_bt, k_pos_bs, k_valid_bs, block)
    keys_bkhs, values_bksh = cache.read(0, s)
    if cache.keys == "sh":  # position-major keys, for the XLA paths: [B, K, H, S]
      keys_bkhs = keys_bkhs.swapaxes(-1, -2)
  kernel = resolve_attention(kernel)
  fused = kernel in ("splash", "cudnn") and not cached and not gathered
  if kernel == "cudnn":
    fused = fused and cudnn_supports(q_btnh.dtype, q_btnh.shape[-1])
  if fused:
    return fused_attention(kernel, q_btnh, keys_bkhs, values_bksh, k_valid_bs)
  if k_valid_bs is None:
    k_valid_bs = jnp.ones(k_pos_bs.shape, jnp.bool_)
  if kernel == "xla":
    return _attend(q_btnh, keys_bkhs, values_bksh, q_pos_bt, k_pos_bs, k_valid_bs)
  t = q_btnh.shape[1]
  block = attention_block(t) if not cached and not gathered else None
  online = online_attention_blocks(t, keys_bkhs.shape[-1]) if not cached else None
  if online:
    # Long cache-free passes (training at cache_len 32,768): key-blocked online softmax.
    return _attend_online(q_btnh, keys_bkhs, values_bksh, q_pos_bt, k_pos_bs, k_valid_bs, *online)
  if block:
    return _attend_causal_blocks(
      q_btnh, keys_bkhs, values_bksh, q_pos_bt, k_pos_bs, k_valid_bs, block
    )
  if not cached and gathered and (query_block := attention_block(t)):
    return _attend_query_blocks(
      q_btnh, keys_bkhs, values_bksh, q_pos_bt, k_pos_bs, k_valid_bs, query_block
    )
  return _attend(q_btnh, keys_bkhs, values_bksh, q_pos_bt, k_pos_bs, k_valid_bs)


class Attention(nnx.Module):
  """Grouped-query self-attention with optional q/k/v bias and q/k RMSNorm; `kernel` is the
  attention kernel (`kernels.ATTENTION_KERNELS`, `_attend_by_pass`)."""

  def __init__(self, cfg: QwenConfig, *, rngs: nnx.Rngs, dtype, kernel: str = "auto"):
    d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    self.cfg = cfg
    self.kernel = kernel
    self.q_proj = _init(rngs, (d, n, h), ("embed", "q_heads", "head_dim"), dtype)
    self.k_proj = _init(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype)
    self.v_proj = _init(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype)
    self.o_proj = _init(rngs, (n, h, d), ("q_heads", "head_dim", "embed"), dtype)
    if cfg.attention_bias:
      self.q_bias = nnx.Param(
        jnp.zeros((n, h), dtype), out_sharding=("q_heads", "head_dim"), eager_sharding=False
      )
      self.k_bias = nnx.Param(
        jnp.zeros((k, h), dtype), out_sharding=("kv_heads", "head_dim"), eager_sharding=False
      )
      self.v_bias = nnx.Param(
        jnp.zeros((k, h), dtype), out_sharding=("kv_heads", "head_dim"), eager_sharding=False
      )
    if cfg.qk_norm:
      self.q_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
      self.k_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)

  def __call__(
    self,
    x_btd,
    positions_bt,
    k_cache_bkhs,
    v_cache_bksh,
    write_b,
    key_pos_bs,
    key_valid_bs,
    query_index_bp=None,
    layer_index=None,
  ):
    """Attention over [cache ++ new keys].

    Args:
      x_btd: [B, T, D] inputs.
      positions_bt: [B, T] absolute positions of the inputs.
      k_cache_bkhs, v_cache_bksh: [B, K, H, S] key and [B, K, S, H] value caches (KVCache), or
        None (keys are the inputs themselves).
      write_b: [B] int cache index at which the T new keys are written (cache mode only).
      key_pos_bs: [B, S] absolute position of each key; key_valid_bs: [B, S] bool, or None
        when every key is real (cache-free passes without padding).
      query_index_bp: optional [B, P] int indices into T (cache-free mode only): queries, and so
        outputs, only at these inputs; keys and values still come from all T.
      layer_index: with a stacked cache ([L_g, B, K, H, S] and [L_g, B, K, S, H], a block's
        layers, `KVCache(stacked=True)`), the (traced) index of this layer's entry: the new keys
        are written there, in place, and this layer's keys are read from there.
    Returns:
      ([B, T, D] outputs, or [B, P, D] with query_index_bp; new k cache, new v cache).
    """
    with jax.named_scope("attention"):
      q, k, v, q_pos = self._project_qkv(x_btd, positions_bt, query_index_bp)
      # Keys [B, K, H, S] and values [B, K, S, H], the cache's layout, in both modes (`_attend`).
      keys, values = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
      view = None  # with a cache, what the attention reads its keys and values from
      layout = "hs"
      if k_cache_bkhs is not None:
        layout = key_layout(self.kernel, dtype=k_cache_bkhs.dtype)
        _check_cache(k_cache_bkhs, v_cache_bksh, layout)
      if k_cache_bkhs is not None and layer_index is not None:
        k_cache_bkhs, v_cache_bksh = _write_stacked_kv_cache(
          k, v, k_cache_bkhs, v_cache_bksh, write_b, layer_index, layout
        )
        read = functools.partial(
          _read_stacked_kv_cache, k_cache_bkhs, v_cache_bksh, layer_index, keys=layout
        )
        view = CacheView(read, in_place=False, keys=layout, dtype=k_cache_bkhs.dtype)
        keys, values = None, None
      elif k_cache_bkhs is not None:
        new_keys = keys if layout == "hs" else k.transpose(0, 2, 1, 3)  # [B, K, T, H]
        k_cache_bkhs, v_cache_bksh = _write_kv_cache(
          new_keys, values, k_cache_bkhs, v_cache_bksh, write_b, layout
        )
        read = functools.partial(_read_kv_cache, k_cache_bkhs, v_cache_bksh, keys=layout)
        length = v_cache_bksh.shape[-2]
        in_place = key_pos_bs.shape[1] == length
        view = CacheView(read, in_place, keys=layout, whole=length, dtype=k_cache_bkhs.dtype)
        keys, values = None, None
      out = _attend_by_pass(
        q,
        keys,
        values,
        q_pos,
        key_pos_bs,
        key_valid_bs,
        cached=k_cache_bkhs is not None,
        gathered=query_index_bp is not None,
        kernel=self.kernel,
        cache=view,
      )
      # "BTNH,NHD->BTD" with the contracted (N, H) in storage order: jnp.einsum lists them as
      # (H, N), and XLA:CPU then copied o_proj into [H, N, D] (and the activations into
      # [B, T, H, N]) on every call: 8 weight copies in each decode step of an 8-layer model.
      out = jax.lax.dot_general(out, self.o_proj[...], (((2, 3), (0, 1)), ((), ())))
      return out, k_cache_bkhs, v_cache_bksh

  def _project_qkv(self, x_btd, positions_bt, query_index_bp):
    """Query, key and value projections (bias, q/k norm, RoPE) of the inputs.

    Args:
      x_btd: [B, T, D] inputs. positions_bt: [B, T] their absolute positions.
      query_index_bp: None, or [B, P] indices into T: queries only at these inputs.
    Returns:
      ([B, T, N, H] queries ([B, P, N, H] with query_index_bp), sharded over heads; [B, T, K, H]
      keys; [B, T, K, H] values; [B, T] (or [B, P]) query positions).
    """
    cfg = self.cfg
    x_q, q_pos = x_btd, positions_bt
    if query_index_bp is not None:
      x_q = jnp.take_along_axis(x_btd, query_index_bp[..., None], axis=1)
      q_pos = jnp.take_along_axis(positions_bt, query_index_bp, axis=1)
    q = jnp.einsum("BTD,DNH->BTNH", x_q, self.q_proj[...])
    k = jnp.einsum("BTD,DKH->BTKH", x_btd, self.k_proj[...])
    v = jnp.einsum("BTD,DKH->BTKH", x_btd, self.v_proj[...])
    if cfg.attention_bias:
      q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = rope(q, q_pos, cfg.rope_theta, cfg.rope_scaling)
    k = rope(k, positions_bt, cfg.rope_theta, cfg.rope_scaling)
    q = constrain(q, ("batch", "length", "act_heads", None))
    return q, k, v, q_pos


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: QwenConfig, *, rngs: nnx.Rngs, dtype):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = _init(rngs, (d, f), ("embed", "mlp"), dtype)
    self.up_proj = _init(rngs, (d, f), ("embed", "mlp"), dtype)
    self.down_proj = _init(rngs, (f, d), ("mlp", "embed"), dtype)

  def __call__(self, x_btd):
    with jax.named_scope("mlp"):
      gate = jnp.einsum("BTD,DF->BTF", x_btd, self.gate_proj[...])
      up = jnp.einsum("BTD,DF->BTF", x_btd, self.up_proj[...])
      h = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
      return jnp.einsum("BTF,FD->BTD", h, self.down_proj[...])


class Experts(nnx.Module):
  """E SwiGLU experts with stacked kernels: gate/up [E, D, F], down [E, F, D]."""

  def __init__(self, cfg: QwenConfig, *, rngs: nnx.Rngs, dtype):
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    self.gate_proj = _init(rngs, (e, d, f), ("experts", "embed", "expert_mlp"), dtype)
    self.up_proj = _init(rngs, (e, d, f), ("experts", "embed", "expert_mlp"), dtype)
    self.down_proj = _init(rngs, (e, f, d), ("experts", "expert_mlp", "embed"), dtype)

  def __call__(self, x_ad: jax.Array, group_sizes_e: jax.Array) -> jax.Array:
    """x_ad: [A, D] token copies sorted by expert; group_sizes_e: [E] int32 copies per expert."""
    return self.apply(
      x_ad, group_sizes_e, self.gate_proj[...], self.up_proj[...], self.down_proj[...]
    )

  @staticmethod
  def apply(x_ad, group_sizes_g, gate_gdf, up_gdf, down_gfd) -> jax.Array:
    """SwiGLU of row groups under their own kernels: rows [sum(g[:i]), sum(g[:i+1])) of x_ad use
    kernel i. The kernels may be a slice of the experts (G of them, e.g. one device's experts
    under expert parallelism) and of the hidden size (F/n, a tensor shard: the output is then a
    partial sum over the shards).

    Args:
      x_ad: [A, D] rows sorted by group. group_sizes_g: [G] int32, summing to at most A.
      gate_gdf, up_gdf: [G, D, F] kernels; down_gfd: [G, F, D].
    Returns:
      [A, D] in x's dtype; rows past sum(group_sizes_g) belong to no group and are to be masked
      by the caller (XLA:CPU gives zeros there; other backends' ragged_dot need not).
    """
    with jax.named_scope("experts"):
      gate = jax.lax.ragged_dot(x_ad, gate_gdf, group_sizes_g)
      up = jax.lax.ragged_dot(x_ad, up_gdf, group_sizes_g)
      return jax.lax.ragged_dot(jax.nn.silu(gate) * up, down_gfd, group_sizes_g)


class SparseMoE(nnx.Module):
  """Qwen3-MoE block: softmax router over E experts, top-k, optional renormalisation.

  y_m = sum_{e in topk(p_m)} w_me * SwiGLU_e(x_m), p_m = softmax(x_m W_router) in float32, and
  w_me = p_me (or p_me / sum_topk p_m when `norm_topk_prob`), as in HF `Qwen3MoeSparseMoeBlock`.
  Dispatch is dropless: the M * k token copies are sorted by expert and multiplied with
  `jax.lax.ragged_dot`, so each token costs k expert MLPs (no capacity factor, nothing dropped).

  Routing replay: `forward` can be given the experts each token used before (recorded by the
  rollout engine); those replace topk(p_m), and the weights are still the router's p_me there
  (renormalised over them with `norm_topk_prob`), so the router keeps its gradient. Two router
  logits a rounding error apart otherwise pick different experts in the KV-cached decode and the
  cache-free training forward, and the trainer scores tokens under experts they were not sampled
  with.

  Expert parallelism: under an active mesh (`jax.set_mesh`) whose `expert` axis splits the
  experts (E divisible by its size), each device keeps E / n_ep experts and the dispatch runs in
  `jax.shard_map` (`_forward_expert_parallel`: each device computes its own experts' copies,
  partial outputs summed over `expert`). An `expert` axis that does not divide E leaves the
  experts replicated (`sharding.param_sharding`), and the block then takes the single-device
  dispatch, which the XLA partitioner spreads; no error is raised.

  `dispatch` (`EXPERT_DISPATCH`) says how token copies reach their experts' devices when the
  rules split the batch rows over `expert` (`sharding.LOGICAL_RULES`): "gather" (all rows of the
  expert group gathered on each device, partial outputs reduce-scattered back), "all_to_all"
  (each copy sent to its expert's device and back by `jax.lax.ragged_all_to_all`, as MaxText's
  `sparse_matmul`), or "auto": all-to-all where it moves fewer bytes (n_ep > k, the comparison
  in `_forward_expert_parallel`) on a backend that implements it, else gather. Both are dropless
  and give the same result up to float rounding. A training setting, not architecture.
  Raises (constructor): ValueError, an unknown `dispatch`.
  """

  def __init__(self, cfg: QwenConfig, *, rngs: nnx.Rngs, dtype, dispatch: str = "auto"):
    if dispatch not in EXPERT_DISPATCH:
      raise ValueError(f"unknown expert dispatch {dispatch!r}; known: {', '.join(EXPERT_DISPATCH)}")
    self.cfg = cfg
    self.dispatch = dispatch
    self.gate = _init(rngs, (cfg.hidden_size, cfg.num_experts), ("embed", "router"), dtype)
    self.experts = Experts(cfg, rngs=rngs, dtype=dtype)

  def __call__(self, x_btd: jax.Array) -> jax.Array:
    """[B, T, D] -> [B, T, D], each token through its own top-k experts."""
    return self.forward(x_btd)[0]

  def forward(
    self, x_btd: jax.Array, experts_btk: jax.Array | None = None
  ) -> tuple[jax.Array, jax.Array]:
    """The block, optionally replaying recorded expert choices.

    Args:
      x_btd: [B, T, D] inputs.
      experts_btk: optional [B, T, k] integer expert indices in [-1, E) to route by (routing
        replay). A token whose k entries are all >= 0 goes to these experts, weighted by the
        router's probabilities at them (renormalised over them with `norm_topk_prob`); a token
        with any entry -1 (not recorded) takes the router's own top-k. Indices are not checked
        here (callers validate them on the host); with None, or with every token at -1, the
        result equals the block without replay bit for bit.
    Returns:
      ([B, T, D] outputs in x's dtype, [B, T, k] int32 experts each token used, in the router's
      order for tokens it routed).
    """
    cfg = self.cfg
    with jax.named_scope("moe"):
      plan = self._expert_parallel_plan(active_mesh(), x_btd.shape)
      if plan is not None:
        return self._forward_expert_parallel(plan, x_btd, experts_btk)
      b, t, d = x_btd.shape
      k = cfg.num_experts_per_tok
      x_md = x_btd.reshape(b * t, d)
      weights_mk, experts_mk = self._route(x_md, self.gate[...], experts_btk)
      flat_experts = experts_mk.reshape(-1)  # [A]
      order = jnp.argsort(flat_experts, stable=True)  # assignments grouped by expert
      token_a = order // k
      group_sizes = jnp.bincount(flat_experts, length=cfg.num_experts).astype(jnp.int32)
      y_ad = self.experts(x_md[token_a], group_sizes)
      y_ad = y_ad * weights_mk.reshape(-1)[order][:, None]
      out_md = jnp.zeros_like(x_md).at[token_a].add(y_ad)
      return out_md.reshape(b, t, d), experts_mk.reshape(b, t, k)

  def _route(
    self, x_md: jax.Array, gate_de: jax.Array, experts_btk: jax.Array | None
  ) -> tuple[jax.Array, jax.Array]:
    """The router: top-k of softmax(x W_router) in float32, or the replayed experts.

    Args:
      x_md: [M, D] tokens. gate_de: [D, E] router kernel (whole: every expert scored).
      experts_btk: None, or [B, T, k] replayed experts with B T = M (`forward`).
    Returns:
      ([M, k] combine weights in x's dtype, [M, k] int32 experts).
    """
    k = self.cfg.num_experts_per_tok
    logits_me = jnp.einsum("MD,DE->ME", x_md, gate_de).astype(jnp.float32)
    probs_me = jax.nn.softmax(logits_me, axis=-1)
    weights_mk, experts_mk = jax.lax.top_k(probs_me, k)
    if experts_btk is not None:
      forced_mk = experts_btk.reshape(x_md.shape[0], k).astype(jnp.int32)
      recorded_m1 = jnp.all(forced_mk >= 0, axis=-1, keepdims=True)
      experts_mk = jnp.where(recorded_m1, forced_mk, experts_mk)
      # Gathered at the router's own choice this is the top-k value itself (same gradient).
      weights_mk = jnp.take_along_axis(probs_me, experts_mk, axis=-1)
    if self.cfg.norm_topk_prob:
      weights_mk = weights_mk / jnp.sum(weights_mk, axis=-1, keepdims=True)
    return weights_mk.astype(x_md.dtype), experts_mk

  # Logical axes of the expert kernels that the expert-parallel block gathers before its products
  # (FSDP: the kernels' model dimension is sharded at rest and whole in use).
  EP_GATHERED_AXES = ("embed",)

  def _expert_parallel_plan(self, mesh, x_shape: tuple[int, ...]) -> _EPPlan | None:
    """The shard_map specs of the expert-parallel dispatch on `mesh`, or None for the
    single-device dispatch (no mesh active, or the experts dimension not sharded on it: an
    `expert` axis of size 1, or one that does not divide E, which `param_sharding` then leaves
    replicated). Every spec comes from `sharding.LOGICAL_RULES` by `param_spec`, the rule that
    placed the parameters."""
    if mesh is None:
      return None
    kernels = []
    for var in (self.experts.gate_proj, self.experts.up_proj, self.experts.down_proj):
      axes = var.get_metadata()["out_sharding"]
      if len(axes) == var.ndim + 1 and axes[0] == "layers":
        axes = axes[1:]  # one layer's slice of a stacked block, inside the layer scan
      spec = param_spec(mesh.shape, axes, var.shape)
      kernels.append(P(*(None if a in self.EP_GATHERED_AXES else e for a, e in zip(axes, spec))))
    expert_axes = spec_axes(kernels[0][0])
    if not expert_axes:
      return None
    kernel_axes = {a for spec in kernels for entry in spec for a in spec_axes(entry)}
    tokens = param_spec(mesh.shape, ("batch", "length", "act_embed"), x_shape)
    # Inside the block a token's rows are whole: kernel axes that split length or the model
    # dimension are gathered on entry; kernel axes that split the batch are gathered in the block.
    inner = [tuple(a for a in spec_axes(e) if a not in kernel_axes) or None for e in tokens[1:]]
    tokens = P(tokens[0], *inner)
    batch_axes = spec_axes(tokens[0])
    order = [a for a in mesh.axis_names if a in kernel_axes]
    ep_size = math.prod(mesh.shape[a] for a in expert_axes)
    all_to_all = set(expert_axes) <= set(batch_axes) and (
      self.dispatch == "all_to_all"
      or (
        self.dispatch == "auto"
        and ep_size > self.cfg.num_experts_per_tok
        and native_ragged_all_to_all()
      )
    )
    moved = expert_axes if all_to_all else ()  # copies travel over these, rows are not gathered
    return _EPPlan(
      mesh=mesh,
      tokens=tokens,
      routes=P(tokens[0], tokens[1], None),
      kernels=(kernels[0], kernels[1], kernels[2]),
      expert_axes=expert_axes,
      gather_axes=tuple(a for a in order if a in batch_axes and a not in moved),
      sum_axes=tuple(a for a in order if a not in batch_axes),
      all_to_all=all_to_all,
    )

  def _forward_expert_parallel(
    self, plan: _EPPlan, x_btd: jax.Array, experts_btk: jax.Array | None
  ) -> tuple[jax.Array, jax.Array]:
    """`forward` expert-parallel: every device computes only its own experts' token copies.

    Inside `jax.shard_map` over the whole mesh, a device holds E / n_ep of the experts (n_ep:
    the size of the mesh axes that split the experts dimension, `expert`), a tensor shard
    F / n_tp of their hidden size, the whole router, and its own batch rows: the rules split
    "batch" over `expert` too (`sharding.LOGICAL_RULES`), so the devices of an expert group hold
    different rows (where the batch does not divide, the rows are whole over the group). It
    routes its own rows (`_route`; the router's gradient is summed over the batch axes by
    shard_map's transpose); then, by `plan.all_to_all`:
    - gather (`_ep_gather_rows`, `_ep_local_experts`): the group's rows are `all_gather`ed, the
      device sorts the M k token copies so that those routed to its own experts come first, runs
      `Experts.apply` on them (copies for other devices' experts fall past the groups and are
      masked to zero), scatter-adds the weighted results into an [M, D] partial output, and the
      partials are `psum_scatter`ed back to each device's rows (`psum`ed where the rows were
      whole over the group);
    - all-to-all (`_ep_all_to_all`): its own copies go to their experts' devices and come back.
    A tensor axis's partial sums over F are `psum`ed at the end. Dropless and exact either way:
    each copy is computed once, by the device holding its expert, and the result equals the
    single-device one up to float rounding.

    Communication per MoE layer and device, M the tokens of its expert group: the gather moves
    2 (n_ep - 1) / n_ep M D values (rows in, partial sums out), the all-to-all
    2 (n_ep - 1) / n_ep (M / n_ep) k D (each copy there and back), so the gather moves n_ep / k
    times as much: no more for Qwen3-30B-A3B (k = 8) up to n_ep = 8, which is the choice of
    `dispatch="auto"`. Backward: the transposes (a reduce-scatter and an all-gather, or the
    two exchanges reversed; the gather also reduce-scatters the [M, k] routing-weight gradients,
    which the all-to-all keeps on the sender), and the sum of the [D, E] router gradient over
    the batch axes; with `embed` split over `fsdp`, the FSDP
    all-gather of the router and of the device's own experts' kernels (and the reduce-scatter of
    their gradients). The experts are never gathered over `expert`. A fixed-capacity
    `jax.lax.all_to_all` would drop copies past its capacity, so the all-to-all is
    `jax.lax.ragged_all_to_all` into a buffer sized for the worst case, as MaxText's
    `sparse_matmul` (`layers/moe.py`) does; its `use_ring_of_experts` option is the gather.
    Compute per device: `ragged_dot` over a buffer of M k copies (dropless: any device may get
    all of them), about M k / n_ep of them in its groups; XLA:CPU's ragged_dot also works on the
    rows past the groups, grouped-matmul kernels on accelerators may skip them.

    Args:
      plan: `_expert_parallel_plan`'s specs.
      x_btd, experts_btk: as `forward`.
    Returns:
      As `forward`: [B, T, D] outputs in x's dtype, sharded as `plan.tokens`, and [B, T, k] int32
      experts, sharded as `plan.routes`.
    """
    args = [x_btd, self.gate[...]]
    args += [v[...] for v in (self.experts.gate_proj, self.experts.up_proj, self.experts.down_proj)]
    specs = [plan.tokens, P(), *plan.kernels]  # the router whole: every device scores every expert
    if experts_btk is not None:
      args.append(experts_btk)
      specs.append(plan.routes)
    with jax.named_scope("expert_parallel"):
      return jax.shard_map(
        functools.partial(self._expert_parallel_shard, plan),
        mesh=plan.mesh,
        in_specs=tuple(specs),
        out_specs=(plan.tokens, plan.routes),
      )(*args)

  def _expert_parallel_shard(
    self, plan: _EPPlan, x_btd, gate_de, gate_gdf, up_gdf, down_gfd, forced_btk=None
  ) -> tuple[jax.Array, jax.Array]:
    """One device's part of `_forward_expert_parallel` (the body of its `jax.shard_map`).

    Args:
      plan: `_expert_parallel_plan`'s specs.
      x_btd: [B, T, D] this device's token rows. gate_de: [D, E] the whole router kernel.
      gate_gdf, up_gdf: [G, D, F] and down_gfd: [G, F, D] this device's G = E / n_ep experts'
        kernels (F its tensor shard of the hidden size).
      forced_btk: None, or [B, T, k] replayed experts of these rows (`forward`).
    Returns:
      ([B, T, D] these rows' outputs, summed over the devices' experts; [B, T, k] int32 experts
      these rows used).
    """
    k = self.cfg.num_experts_per_tok
    b, t, d = x_btd.shape
    weights_mk, experts_mk = self._route(x_btd.reshape(b * t, d), gate_de, forced_btk)
    used_btk = experts_mk.reshape(b, t, k)
    x_btd, experts_btk, weights_btk = _ep_gather_rows(
      plan, x_btd, used_btk, weights_mk.reshape(b, t, k)
    )
    local = _ep_all_to_all if plan.all_to_all else _ep_local_experts
    out_btd = local(plan, x_btd, experts_btk, weights_btk, gate_gdf, up_gdf, down_gfd, k)
    return _ep_reduce(plan, out_btd), used_btk


def _ep_gather_rows(plan: _EPPlan, x_btd, experts_btk, weights_btk):
  """Inside the expert-parallel shard_map: the rows of the batch axes that also split the kernels
  (`plan.gather_axes`) gathered, and the rows typed as varying over `plan.sum_axes`.

  Args:
    x_btd: [B, T, D] tokens; experts_btk: [B, T, k] int experts; weights_btk: [B, T, k] weights.
  Returns:
    The three, [B', T, ...] with B' the rows of the device's whole expert group.
  """
  if plan.gather_axes:
    gather = functools.partial(jax.lax.all_gather, axis_name=plan.gather_axes, tiled=True)
    x_btd, experts_btk, weights_btk = gather(x_btd), gather(experts_btk), gather(weights_btk)
  if plan.sum_axes:
    # Typed as differing over the summed axes from here on, so that the backward sums the
    # inputs' gradients over them once, on [M, D] and [M, k], not on the [A, D] copies.
    x_btd, weights_btk = _pcast_varying((x_btd, weights_btk), plan.sum_axes)
  return x_btd, experts_btk, weights_btk


def _ep_local_order(experts_btk, expert_axes: tuple[str, ...], g: int, k: int):
  """Inside the expert-parallel shard_map: the order that groups the A = B T k token copies by
  this device's G = g experts, other devices' copies last.

  Args:
    experts_btk: [B, T, k] int experts of every row (or, with k = 1, the [R] experts of the
      copies an all-to-all received; -1 for none). expert_axes: the mesh axes splitting E.
  Returns:
    ([A] bool copies routed to this device's experts, [A] int32 sort order, [A] token index of
    each sorted copy, [g] int32 group sizes).
  """
  first = jax.lax.axis_index(expert_axes) * g  # this device's experts: [first, first + g)
  local_a = experts_btk.reshape(-1) - first
  mine_a = (local_a >= 0) & (local_a < g)
  key_a = jnp.where(mine_a, local_a, g)  # other devices' copies sort last, past the groups
  # Not jnp.argsort: in JAX 0.10 its result inside shard_map is typed as the same on every
  # device of the expert axis although it differs, and the backward then sums the gradients
  # of differently ordered rows over that axis (wrong dx; tests/test_moe_expert_parallel.py).
  iota_a = jnp.arange(key_a.shape[0], dtype=jnp.int32)
  _, order = jax.lax.sort((key_a, iota_a), num_keys=1, is_stable=True)
  token_a = order // k
  group_sizes = jnp.bincount(key_a, length=g + 1)[:g].astype(jnp.int32)
  return mine_a, order, token_a, group_sizes


def _ep_local_experts(
  plan: _EPPlan, x_btd, experts_btk, weights_btk, gate_gdf, up_gdf, down_gfd, k: int
) -> jax.Array:
  """Inside the expert-parallel shard_map: this device's experts applied to the copies routed to
  them, weighted and scatter-added into a partial output (other copies contribute zero).

  Args:
    x_btd: [B, T, D] tokens; experts_btk, weights_btk: [B, T, k] their experts and weights.
    gate_gdf, up_gdf: [G, D, F], down_gfd: [G, F, D] this device's experts' kernels.
  Returns:
    [B, T, D] this device's partial output.
  """
  b, t, d = x_btd.shape
  g = gate_gdf.shape[0]
  mine_a, order, token_a, group_sizes = _ep_local_order(experts_btk, plan.expert_axes, g, k)
  x_md = x_btd.reshape(b * t, d)
  y_ad = Experts.apply(x_md[token_a], group_sizes, gate_gdf, up_gdf, down_gfd)
  w_a = jnp.where(mine_a, weights_btk.reshape(-1), 0)[order]
  y_ad = jnp.where(mine_a[order][:, None], y_ad * w_a[:, None], 0)
  return jnp.zeros_like(x_md).at[token_a].add(y_ad).reshape(b, t, d)


def _ep_all_to_all(
  plan: _EPPlan, x_btd, experts_btk, weights_btk, gate_gdf, up_gdf, down_gfd, k: int
) -> jax.Array:
  """Inside the expert-parallel shard_map, with the batch rows split over the expert axes: this
  device's token copies sent to their experts' devices, computed there, sent back and combined.

  Each device sorts its A = B T k copies by expert, which groups them by destination device
  (device j holds experts [j G, (j + 1) G)); the [n, n] matrix of copy counts (sender x
  receiver, one all-gather of n int32 per device) gives every ragged chunk's offsets. One
  `ragged_all_to_all` moves the copies' rows and one their expert ids into a receive buffer of
  n A rows (the most that can arrive: dropless, as MaxText sizes it without a capacity factor);
  the receiver sorts them by its local expert, runs `Experts.apply`, and a third
  `ragged_all_to_all` returns each result to its sender's slot, where it is weighted and
  scatter-added into the sender's rows. The backward is the same exchange transposed
  (`ragged_all_to_all`'s transpose rule).

  Args:
    x_btd: [B, T, D] this device's rows (distinct rows on every device of the expert group).
    experts_btk, weights_btk: [B, T, k] their experts (int) and combine weights.
    gate_gdf, up_gdf: [G, D, F], down_gfd: [G, F, D] this device's experts' kernels.
  Returns:
    [B, T, D] these rows' outputs (partial over a tensor axis splitting F, summed by
    `_ep_reduce`).
  """
  b, t, d = x_btd.shape
  g = gate_gdf.shape[0]
  n = math.prod(plan.mesh.shape[a] for a in plan.expert_axes)
  a = b * t * k
  axes = plan.expert_axes
  me = jax.lax.axis_index(axes)
  flat_a = experts_btk.reshape(-1).astype(jnp.int32)
  iota_a = jnp.arange(a, dtype=jnp.int32)
  sent_e, order = jax.lax.sort((flat_a, iota_a), num_keys=1, is_stable=True)
  token_a = order // k
  send_sizes = jnp.bincount(sent_e // g, length=n).astype(jnp.int32)  # [n] copies per receiver
  counts_nn = jax.lax.all_gather(send_sizes, axes)  # [sender, receiver]
  before_nn = jnp.cumsum(counts_nn, axis=0) - counts_nn  # earlier senders' copies, per receiver
  sent_before = jnp.cumsum(counts_nn, axis=1) - counts_nn  # each sender's own input offsets
  recv_sizes = counts_nn[:, me]
  recv_offsets = before_nn[:, me]  # senders' chunks lie in sender order in the receive buffer
  exchange = functools.partial(
    ragged_all_to_all,
    input_offsets=sent_before[me],
    send_sizes=send_sizes,
    output_offsets=before_nn[me],
    recv_sizes=recv_sizes,
    axis_name=axes,
  )
  r = n * a
  x_rd = exchange(x_btd.reshape(b * t, d)[token_a], jnp.zeros((r, d), x_btd.dtype))
  # Rows past the received ones keep expert -1: not this device's, they sort past the groups.
  recv_e = exchange(sent_e, jnp.full((r,), -1, jnp.int32))
  mine_r, rorder, _, group_sizes = _ep_local_order(recv_e, axes, g, 1)
  y_rd = Experts.apply(x_rd[rorder], group_sizes, gate_gdf, up_gdf, down_gfd)
  y_rd = jnp.zeros_like(y_rd).at[rorder].set(jnp.where(mine_r[rorder][:, None], y_rd, 0))
  y_ad = ragged_all_to_all(
    y_rd,
    jnp.zeros((a, d), y_rd.dtype),
    input_offsets=recv_offsets,
    send_sizes=recv_sizes,
    output_offsets=sent_before[:, me],
    recv_sizes=send_sizes,
    axis_name=axes,
  )
  w_a = weights_btk.reshape(-1)[order]
  out_md = jnp.zeros((b * t, d), x_btd.dtype).at[token_a].add(y_ad * w_a[:, None])
  return out_md.reshape(b, t, d)


def native_ragged_all_to_all(backend: str | None = None) -> bool:
  """Whether JAX's backend (default: the default one) implements `jax.lax.ragged_all_to_all`:
  TPU and GPU do; XLA:CPU does not (UNIMPLEMENTED in JAX 0.10, jax-ml/jax issue 34755)."""
  return (backend or jax.default_backend()) != "cpu"


def ragged_all_to_all(
  operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
) -> jax.Array:
  """`jax.lax.ragged_all_to_all` with one chunk per device of `axis_name` (its semantics: chunk j
  of this device's `operand`, rows [input_offsets[j], + send_sizes[j]), is written on device j at
  rows [output_offsets[j], + the same count) of its `output`).

  Where the backend does not implement it (`native_ragged_all_to_all`: XLA:CPU), the same result
  by `jax.lax.all_to_all` of n chunks padded to operand's length, each received chunk scattered
  to its offsets: n times the bytes, for tests on host devices; its gradient is the transposed
  exchange, as the native op's.

  Args:
    operand: [N, ...] rows to send. output: [M, ...] the buffer received rows are written into.
    input_offsets, send_sizes, output_offsets, recv_sizes: [n] int32, n the axis size.
  Returns:
    [M, ...] `output` with the received rows written.
  """
  if native_ragged_all_to_all():
    return jax.lax.ragged_all_to_all(
      operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name
    )
  n, c = send_sizes.shape[0], operand.shape[0]
  rows = jnp.arange(c, dtype=jnp.int32)
  tail = (1,) * (operand.ndim - 1)
  take = jnp.clip(input_offsets[:, None] + rows, 0, c - 1)  # [n, c]
  keep = (rows < send_sizes[:, None]).reshape(n, c, *tail)
  chunks = jnp.where(keep, operand[take], jnp.zeros((), operand.dtype))  # [n, c, ...]
  got = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # [n, c, ...] by sender
  at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each sender writes
  pos = jnp.where(rows < recv_sizes[:, None], at[:, None] + rows, output.shape[0])
  return output.at[pos.reshape(-1)].set(got.reshape(n * c, *operand.shape[1:]), mode="drop")


def _ep_reduce(plan: _EPPlan, out_btd: jax.Array) -> jax.Array:
  """Inside the expert-parallel shard_map: the [B', T, D] partial outputs summed over the devices
  of the expert group (`psum`), and scattered back to each device's own [B, T, D] rows where the
  rows were gathered (`psum_scatter`)."""
  if plan.sum_axes:
    out_btd = jax.lax.psum(out_btd, plan.sum_axes)
  if plan.gather_axes:
    out_btd = jax.lax.psum_scatter(out_btd, plan.gather_axes, scatter_dimension=0, tiled=True)
  return out_btd


def _pcast_varying(xs, axes: tuple[str, ...]):
  """Inside shard_map: `xs` typed as varying over mesh `axes` (`jax.lax.pcast`, `pvary` before
  JAX 0.8); its transpose sums the gradient over them."""
  if hasattr(jax.lax, "pcast"):
    return jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), xs)
  # pvary is gone from JAX 0.8 on (the installed JAX's types lack it); this line runs before it.
  return jax.tree.map(lambda x: jax.lax.pvary(x, axes), xs)  # type: ignore[attr-defined]


class _EPPlan(NamedTuple):
  """How `SparseMoE` runs expert-parallel on a mesh (`SparseMoE._expert_parallel_plan`)."""

  mesh: jax.sharding.AbstractMesh  # the active mesh (`sharding.active_mesh`)
  tokens: P  # spec of x and of the output [B, T, D]
  routes: P  # spec of the experts and weights [B, T, k]
  kernels: tuple[P, P, P]  # specs of gate/up [E, D, F] and down [E, F, D] inside the block
  expert_axes: tuple[str, ...]  # mesh axes that split the experts dimension
  gather_axes: tuple[str, ...]  # kernel axes that also split the batch: all_gather, psum_scatter
  sum_axes: tuple[str, ...]  # kernel axes that do not: psum
  all_to_all: bool = False  # copies moved over expert_axes by ragged all-to-all (`_ep_all_to_all`)


class DecoderLayer(nnx.Module):
  def __init__(
    self,
    cfg: QwenConfig,
    *,
    rngs: nnx.Rngs,
    dtype,
    sparse: bool = False,
    attention: str = "auto",
    expert_dispatch: str = "auto",
  ):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    self.self_attn = Attention(cfg, rngs=rngs, dtype=dtype, kernel=attention)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    self.mlp: SparseMoE | MLP
    if sparse:
      self.mlp = SparseMoE(cfg, rngs=rngs, dtype=dtype, dispatch=expert_dispatch)
    else:
      self.mlp = MLP(cfg, rngs=rngs, dtype=dtype)

  def __call__(
    self,
    x,
    positions,
    kc,
    vc,
    write,
    key_pos,
    key_valid,
    query_index=None,
    experts=None,
    layer_index=None,
  ):
    """One pre-norm block; with `query_index` [B, P] the output is [B, P, D], only there.

    `layer_index`: the layer's entry in stacked caches (`Attention`).

    `experts` ([B, T, k] int, sparse layers only) replays recorded routing (`SparseMoE.forward`).
    Returns (x, k cache, v cache, [B, T, k] (or [B, P, k]) int32 experts used, or None for a
    dense layer).
    """
    # The blocks name their own scopes ("attention", "mlp" or "moe") for profiles.
    a, kc, vc = self.self_attn(
      self.input_layernorm(x),
      positions,
      kc,
      vc,
      write,
      key_pos,
      key_valid,
      query_index,
      layer_index,
    )
    if query_index is not None:
      x = jnp.take_along_axis(x, query_index[..., None], axis=1)
      if experts is not None:
        experts = jnp.take_along_axis(experts, query_index[..., None], axis=1)
    x = x + a
    h = self.post_attention_layernorm(x)
    if isinstance(self.mlp, SparseMoE):
      m, used = self.mlp.forward(h, experts)
    else:
      m, used = self.mlp(h), None
    x = x + m
    return constrain(x, ("batch", "length", "act_embed")), kc, vc, used


def stacked_layers(
  cfg: QwenConfig,
  first: int,
  count: int,
  *,
  rngs: nnx.Rngs,
  dtype,
  attention: str = "auto",
  expert_dispatch: str = "auto",
) -> DecoderLayer:
  """One `DecoderLayer` whose parameters hold `count` layers stacked on a leading axis.

  Layers `first` .. `first + count - 1` must be of one kind (all dense or all sparse MoE). Each
  layer is initialised in turn, as separate layers would be (so a seed gives the values it gave
  an unstacked model), then the values are stacked; every parameter's logical axes
  (`out_sharding`) gain a leading "layers" axis (models/sharding.py: not sharded).
  """
  sparse = cfg.is_moe_layer(first)
  if any(cfg.is_moe_layer(i) != sparse for i in range(first, first + count)):
    raise ValueError(f"layers {first}..{first + count - 1} mix dense and sparse MoE blocks")
  layers = [
    DecoderLayer(
      cfg,
      rngs=rngs,
      dtype=dtype,
      sparse=sparse,
      attention=attention,
      expert_dispatch=expert_dispatch,
    )
    for _ in range(count)
  ]
  flat = [nnx.to_flat_state(nnx.state(layer, nnx.Param)) for layer in layers]
  for (_, var), *rest in zip(*flat):
    var.set_value(jnp.stack([var.get_value()] + [v.get_value() for _, v in rest]))
    var.set_metadata(out_sharding=("layers", *var.get_metadata()["out_sharding"]))
  return layers[0]


class Qwen(nnx.Module):
  """Qwen decoder-only language model.

  `hidden_states` gives final-norm hidden states [B, T, D]; `logits` projects chosen positions to
  the vocabulary, so callers compute full-vocabulary logits only where they need them.

  Two layouts of the decoder layers, the same values:
  - stacked (`stacked=True`, what training uses): `blocks` (`QwenConfig.layer_blocks`: block g
    holds layers `block_spans[g]` = (first, count), parameters stacked [count, ...], logical
    axis "layers"); `hidden_states` runs each block under `jax.lax.scan`, so the train step's
    compile time does not grow with the depth.
  - unrolled (`stacked=False`; `unstack` converts): one `DecoderLayer` per layer in `layers`,
    run in a Python loop, each layer's KV cache read and written in place.
  `decode` works in both. A stacked model over a stacked cache (`KVCache(stacked=True)`, what
  the rollout engine uses with `scan_layers`, the job's default) scans each block with the
  block's cache in the loop's carry, written in place by one scatter per layer; its programs
  compile in about the same time at any depth and decode at the unrolled model's speed on CPU
  (docs/benchmarks/scan.md). Over an unrolled cache a stacked model slices each layer's
  parameters off its stack inside the step (a copy per step). `remat` (one of REMAT_POLICIES,
  default "full") is the rematerialisation of each layer in the backward pass of
  `hidden_states` (`remat_layer`); it is a training setting, not architecture, and is not written
  to config.json. So is `attention` (`kernels.ATTENTION_KERNELS`, default "auto"), the attention
  kernel of every layer (`_attend_by_pass`), and `expert_dispatch` (`EXPERT_DISPATCH`, default
  "auto"), how MoE blocks move token copies between devices (`SparseMoE`).

  Raises (constructor):
    ValueError: an unknown remat policy, attention kernel or expert dispatch.
  """

  def __init__(
    self,
    cfg: QwenConfig,
    *,
    rngs: nnx.Rngs,
    dtype=jnp.float32,
    remat: str = "full",
    stacked: bool = True,
    attention: str = "auto",
    expert_dispatch: str = "auto",
  ):
    if remat not in REMAT_POLICIES:
      raise ValueError(f"unknown remat policy {remat!r}; known: {', '.join(REMAT_POLICIES)}")
    if attention not in ATTENTION_KERNELS:
      raise ValueError(
        f"unknown attention kernel {attention!r}; known: {', '.join(ATTENTION_KERNELS)}"
      )
    self.config = cfg
    self.remat = remat
    self.attention = attention
    self.expert_dispatch = expert_dispatch
    self.stacked = stacked
    self.embed_tokens = _init(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
    self.block_spans = cfg.layer_blocks if stacked else ()
    if stacked:
      self.blocks = nnx.List(
        [
          stacked_layers(
            cfg, i, n, rngs=rngs, dtype=dtype, attention=attention, expert_dispatch=expert_dispatch
          )
          for i, n in self.block_spans
        ]
      )
    else:
      # Initialised in the order the stacked layout draws them: the same seed, the same values.
      self.layers = nnx.List(
        [
          DecoderLayer(
            cfg,
            rngs=rngs,
            dtype=dtype,
            sparse=cfg.is_moe_layer(i),
            attention=attention,
            expert_dispatch=expert_dispatch,
          )
          for i in range(cfg.num_hidden_layers)
        ]
      )
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = _init(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype)

  def hidden_states(
    self,
    input_ids_bt: jax.Array,
    positions_bt: jax.Array | None = None,
    attention_mask_bt: jax.Array | None = None,
    output_index_bp: jax.Array | None = None,
    routing_btlk: jax.Array | None = None,
  ) -> jax.Array:
    """Full forward without a cache. input_ids: [B, T] int; mask: [B, T] (1 = real token).

    Positions default to the running count of real tokens (handles left and right padding).
    `output_index_bp` ([B, P] int indices into T) asks for the hidden states at those inputs
    only: the last layer then computes queries, attention output and MLP just there (keys and
    values still at all T), which saves most of a layer when a loss scores a completion.
    `routing_btlk` ([B, T, L_moe, k] integer expert indices in [-1, E), any integer dtype)
    replays recorded routing: entry [b, t, j] gives the experts of token t in MoE layer
    `config.moe_layers[j]` (-1: not recorded, the router chooses; `SparseMoE.forward`). Dense
    models, and None, take the router's own choice everywhere.
    Stacked: each block of layers runs under `jax.lax.scan`; unrolled: layer by layer. Either
    way each layer is rematerialised in the backward pass as `self.remat` says.
    Returns [B, T, D] hidden states after the final norm (in the parameters' dtype), or
    [B, P, D] with output_index_bp.
    Raises:
      ValueError: routing_btlk not of shape [B, T, L_moe, k].
    """
    if attention_mask_bt is not None:  # None: every token is real (the fused kernels mask less)
      attention_mask_bt = attention_mask_bt.astype(jnp.bool_)
      if positions_bt is None:
        positions_bt = jnp.maximum(jnp.cumsum(attention_mask_bt, axis=-1) - 1, 0)
    elif positions_bt is None:
      positions_bt = jnp.broadcast_to(jnp.arange(input_ids_bt.shape[1]), input_ids_bt.shape)
    routing = self._split_routing(routing_btlk, input_ids_bt.shape)
    x = self._embed(input_ids_bt)

    def layer_fn(graphdef, x, params, experts, query_index):
      layer = nnx.merge(graphdef, params)
      x, _, _, used = layer(
        x, positions_bt, None, None, None, positions_bt, attention_mask_bt, query_index, experts
      )
      return x, used

    if not self.stacked:
      last = len(self.layers) - 1
      for i, layer in enumerate(self.layers):
        graphdef, params = nnx.split(layer)
        fn = remat_layer(functools.partial(layer_fn, graphdef), self.remat)
        x, _ = fn(x, params, routing[i], output_index_bp if i == last else None)
    else:
      last = len(self.blocks) - 1
    for g, block in enumerate(self.blocks if self.stacked else ()):
      graphdef, params = nnx.split(block)
      if g == last and output_index_bp is not None:
        # One layer (QwenConfig.layer_blocks), run outside the scan at the P positions only.
        one = jax.tree.map(lambda a: a[0], params)
        experts = None if routing[g] is None else routing[g][0]
        fn = remat_layer(functools.partial(layer_fn, graphdef), self.remat)
        x, _ = fn(x, one, experts, output_index_bp)
        continue

      def body(x, xs, graphdef=graphdef):
        params, experts = xs
        return layer_fn(graphdef, x, params, experts, None)

      body = remat_layer(body, self.remat, prevent_cse=False)
      x, _ = jax.lax.scan(body, x, (params, routing[g]))
    if output_index_bp is not None and last < 0:  # no layers: select from the embeddings
      x = jnp.take_along_axis(x, output_index_bp[..., None], axis=1)
    return self.norm(x)

  def layer(self, i: int) -> DecoderLayer:
    """A copy of decoder layer `i` as an unstacked `DecoderLayer` (parameters without the layer
    axis), for inspection and tests: changing it does not change the model.

    Raises:
      IndexError: i outside [0, num_hidden_layers).
    """
    if not self.stacked:
      if not 0 <= i < len(self.layers):
        raise IndexError(f"layer {i} outside [0, {self.config.num_hidden_layers})")
      return nnx.clone(self.layers[i])
    for block, (first, count) in zip(self.blocks, self.block_spans):
      if first <= i < first + count:
        graphdef, state = nnx.split(block)
        j = i - first
        out = nnx.merge(graphdef, jax.tree.map(lambda a, j=j: a[j], state))
        for _, var in nnx.to_flat_state(nnx.state(out, nnx.Param)):
          var.set_metadata(out_sharding=tuple(var.get_metadata()["out_sharding"][1:]))
        return out
    raise IndexError(f"layer {i} outside [0, {self.config.num_hidden_layers})")

  def _split_routing(self, routing_btlk: jax.Array | None, bt: tuple[int, ...]) -> list:
    """Stacked: per block, its [L_g, B, T, k] slice of a routing record; unrolled: per layer, its
    [B, T, k] slice; None for a dense block or layer, or without a record.

    A sparse block's layers are consecutive MoE layers, so its slice is a contiguous run of the
    record's L_moe axis, moved to the front (the scan's axis).
    """
    cfg = self.config
    moe = cfg.moe_layers
    out: list = [None] * (len(self.blocks) if self.stacked else len(self.layers))
    if routing_btlk is None:
      return out
    want = (*bt, len(moe), cfg.num_experts_per_tok)
    if tuple(routing_btlk.shape) != want:
      raise ValueError(
        f"routing of shape {tuple(routing_btlk.shape)}, want [B, T, L_moe, k] = {list(want)}"
      )
    if not self.stacked:
      for j, i in enumerate(moe):
        out[i] = routing_btlk[:, :, j]
      return out
    for g, (first, count) in enumerate(self.block_spans):
      if cfg.is_moe_layer(first):
        j = moe.index(first)
        out[g] = jnp.moveaxis(routing_btlk[:, :, j : j + count], 2, 0)
    return out

  def __call__(
    self,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    positions: jax.Array | None = None,
  ) -> jax.Array:
    """Float32 logits [B, T, V] for every position, as `model(input_ids, attention_mask=mask)`
    in transformers. input_ids: [B, T] int; attention_mask: [B, T] (1 = real token, left or right
    padding). Memory-heavy for long T: training code projects only the positions it needs."""
    hidden = self.hidden_states(input_ids, positions, attention_mask)
    if jax.default_backend() == "cpu" and active_mesh() is None:
      # XLA:CPU ran the [4096, 512] x [512, 151936] product at 0.92x of torch's rate whole and
      # 0.99x in 256-row pieces (docs/benchmarks/model.md); accelerators, or sharded, keep one.
      return self._logits_in_row_chunks(hidden, CPU_LOGITS_ROWS)
    return self.logits(hidden)

  def _logits_in_row_chunks(self, hidden_btd: jax.Array, rows: int) -> jax.Array:
    b, t, d = hidden_btd.shape
    if b * t <= rows or (b * t) % rows:
      return self.logits(hidden_btd)
    out = jax.lax.map(self.logits, hidden_btd.reshape(b * t // rows, rows, d))
    return out.reshape(b, t, -1)

  def decode(
    self,
    input_ids_bt: jax.Array,
    positions_bt: jax.Array,
    cache: KVCache,
    write_b: jax.Array,
    kv_len: int | None = None,
  ) -> tuple[jax.Array, KVCache]:
    """Runs T new tokens against a KV cache (prefill chunk when T > 1, decode step when T == 1).

    Args:
      input_ids_bt: [B, T] int32 new tokens.
      positions_bt: [B, T] int32 absolute positions; must equal write_b[:, None] + arange(T).
      cache: KVCache (per layer [B, K, H, S] keys, [B, K, S, H] values); entries at index <=
        position are attended.
      write_b: [B] int32 cache index where the new keys go. The caller guarantees
        write_b + T <= S (dynamic_update_slice would otherwise clamp the write).
      kv_len: static; attend only to cache entries [0, kv_len) (default S). The caller guarantees
        every position < kv_len, so attention costs T * kv_len rather than T * S.
    Returns:
      ([B, T, D] hidden states after the final norm, updated cache).
    """
    hidden, cache, _ = self.decode_routed(input_ids_bt, positions_bt, cache, write_b, kv_len)
    return hidden, cache

  def decode_routed(
    self,
    input_ids_bt: jax.Array,
    positions_bt: jax.Array,
    cache: KVCache,
    write_b: jax.Array,
    kv_len: int | None = None,
  ) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """`decode`, also returning the experts every new token was routed to.

    Arguments as `decode`. Two ways, by the cache's layout (`KVCache`):
    - unrolled cache: layer by layer in a Python loop, each layer's cache read and written in
      place (a stacked model slices each layer's parameters off its stack first, a copy per
      call: `unstack` the model once to serve it that way);
    - stacked cache (a stacked model only): each block of layers under `jax.lax.scan`, its
      cache in the loop's carry, written in place at the layer's entry; the program no longer
      grows with the depth (compile time), at the price of reading each layer's keys and values
      out of the carry (docs/benchmarks/scan.md).
    Returns:
      ([B, T, D] hidden states, updated cache, [B, T, L_moe, k] int32 expert indices of each
      token in each MoE layer (`config.moe_layers` order; what `hidden_states` replays), or None
      for a dense model).
    Raises:
      ValueError: a stacked cache with an unrolled model, or one whose blocks are not the
        model's.
    """
    s = cache.length if kv_len is None else kv_len
    key_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (input_ids_bt.shape[0], s))
    key_valid = jnp.ones_like(key_pos, jnp.bool_)
    x = self._embed(input_ids_bt)
    if cache.stacked:
      return self._decode_scanned(x, positions_bt, cache, write_b, key_pos, key_valid)
    layers = self.layers if not self.stacked else map(self.layer, range(len(cache.k)))
    ks, vs, routing = [], [], []
    for layer, kc, vc in zip(layers, cache.k, cache.v):
      x, kc, vc, used = layer(x, positions_bt, kc, vc, write_b, key_pos, key_valid)
      ks.append(kc)
      vs.append(vc)
      if used is not None:
        routing.append(used)
    routing_btlk = jnp.stack(routing, axis=2) if routing else None
    return self.norm(x), KVCache(tuple(ks), tuple(vs)), routing_btlk

  def _decode_scanned(self, x, positions_bt, cache: KVCache, write_b, key_pos, key_valid):
    """`decode_routed` over a stacked cache: one `jax.lax.scan` per block of layers."""
    counts = tuple(k.shape[0] for k in cache.k)
    if not self.stacked or counts != tuple(n for _, n in self.block_spans):
      raise ValueError(
        f"a stacked KV cache of blocks {counts} needs a stacked model with those blocks, got "
        + (f"{tuple(n for _, n in self.block_spans)}" if self.stacked else "an unrolled model")
      )
    ks, vs, routing = [], [], []
    for block, kc, vc in zip(self.blocks, cache.k, cache.v):
      graphdef, params = nnx.split(block)

      def body(carry, xs, graphdef=graphdef):
        x, kc, vc = carry
        params, i = xs
        layer = nnx.merge(graphdef, params)
        x, kc, vc, used = layer(x, positions_bt, kc, vc, write_b, key_pos, key_valid, layer_index=i)
        return (x, kc, vc), used

      index = jnp.arange(kc.shape[0], dtype=jnp.int32)
      (x, kc, vc), used = jax.lax.scan(body, (x, kc, vc), (params, index))
      ks.append(kc)
      vs.append(vc)
      if used is not None:  # [L_g, B, T, k]: the block's MoE layers, in order
        routing.append(jnp.moveaxis(used, 0, 2))
    routing_btlk = jnp.concatenate(routing, axis=2) if routing else None
    return self.norm(x), KVCache(tuple(ks), tuple(vs)), routing_btlk

  def logits(self, hidden: jax.Array) -> jax.Array:
    """Projects [..., D] hidden states to [..., V] float32 logits."""
    if self.config.tie_word_embeddings:
      w = self.embed_tokens[...]
      out = jnp.einsum("...D,VD->...V", hidden, w.astype(hidden.dtype))
    else:
      out = jnp.einsum("...D,DV->...V", hidden, self.lm_head[...].astype(hidden.dtype))
    return out.astype(jnp.float32)

  def _embed(self, ids):
    x = jnp.take(self.embed_tokens[...], ids, axis=0)
    return constrain(x, ("batch", "length", "act_embed"))


def unrolled_template(model: Qwen) -> tuple[nnx.GraphDef, nnx.State]:
  """The graph and abstract state (ShapeDtypeStructs, with their logical axes) of `model` in the
  unrolled layout (`Qwen(stacked=False)`), allocating nothing."""
  cfg = model.config
  dtype = model.embed_tokens.get_value().dtype
  abstract = nnx.eval_shape(
    lambda: Qwen(
      cfg,
      rngs=nnx.Rngs(0),
      dtype=dtype,
      remat=model.remat,
      stacked=False,
      attention=model.attention,
      expert_dispatch=model.expert_dispatch,
    )
  )
  return nnx.split(abstract)


def unstack_state(state: nnx.State, cfg: QwenConfig, template: nnx.State) -> nnx.State:
  """A stacked model's state (`Qwen(stacked=True)`: "blocks.{g}.rest" of [L_g, ...]) as the
  unrolled layout's ("layers.{i}.rest" of [...]), shaped like `template` (`unrolled_template`).

  Traceable (use it inside a jit: the per-layer slices are then one copy). A state already in
  the unrolled layout is returned as it is.

  Raises:
    KeyError: `state` lacks a parameter the template has (another config).
  """
  src = dict(nnx.to_flat_state(state))
  if not any(path[0] == "blocks" for path in src):
    return state
  owner = {}
  for g, (first, count) in enumerate(cfg.layer_blocks):
    owner.update({first + j: (g, j) for j in range(count)})
  out = []
  for path, var in nnx.to_flat_state(template):
    if path[0] == "layers":
      # flax types path entries as its Key protocol (hashable, ordered); here an int layer index.
      g, j = owner[int(path[1])]  # type: ignore[call-overload]
      value = src[("blocks", g, *path[2:])].get_value()[j]
    else:
      value = src[path].get_value()
    out.append((path, var.replace(value)))
  return nnx.from_flat_state(out)


def unstack(model: Qwen) -> Qwen:
  """`model` in the unrolled layout (the rollout engine's; `Qwen`), with the same values: new
  per-layer arrays sliced off the stacks (one copy of the decoder weights). An unrolled model is
  returned as it is."""
  if not model.stacked:
    return model
  graphdef, template = unrolled_template(model)
  return nnx.merge(graphdef, unstack_state(nnx.state(model), model.config, template))


def count_params(cfg: QwenConfig, model: Qwen | None = None) -> dict[str, int]:
  """Parameter counts of a config from `nnx.eval_shape` (nothing is allocated), or of `model`.

  Returns:
    {"total", "embedding" (input embedding plus an untied output head), "non_embedding",
     "active" (per token: every parameter except the experts a token does not use)}.
  """
  if model is None:
    model = nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0)))
  total = embedding = experts = 0
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    n = math.prod(var.get_value().shape)
    total += n
    if path[0] in ("embed_tokens", "lm_head"):
      embedding += n
    if "experts" in path:
      experts += n
  inactive = experts * (cfg.num_experts - cfg.num_experts_per_tok) // max(cfg.num_experts, 1)
  return {
    "total": total,
    "embedding": embedding,
    "non_embedding": total - embedding,
    "active": total - inactive,
  }
