"""Hugging Face checkpoint folders: `from_pretrained` and `save_pretrained` for Qwen and
Llama-family models (Llama 3.x, SmolLM2).

A folder holds `config.json` and either one `model.safetensors` or shards listed in
`model.safetensors.index.json`, and may hold `generation_config.json`, whose `eos_token_id` ids
(with those of config.json) become the model's `config.eos_token_ids`: the ids that end a reply.
Loading builds each parameter with `jax.make_array_from_callback` in its target sharding: each
device's shard is read from the safetensors files as a slice (`safe_open(...).get_slice`, through
the HF -> ours `params.Layout`), so a process reads only the bytes its own devices hold (one
process of a multi-host mesh reads its share of the checkpoint, and an expert-parallel device
only its experts); the peak extra host memory is one device shard. The model stacks its decoder
layers (`Qwen.blocks`); each layer's slice is written into the stacked device array, and saving
reads one layer's slice at a time, so the checkpoint keeps HF's per-layer names.
`benchmarks/load_memory.py` measures it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import tempfile
from typing import Any
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from coevolve_jax.models.params import hf_to_path, layer_paths, path_to_hf, stacked_path
from coevolve_jax.models.qwen import ROPE_TYPES, Qwen, QwenConfig, RopeScaling
from coevolve_jax.models.sharding import param_sharding

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe", "llama")
_ARCHITECTURES = {
  "qwen2": "Qwen2ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "qwen3_moe": "Qwen3MoeForCausalLM",
  "llama": "LlamaForCausalLM",
}
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"


class CheckpointFormatError(ValueError):
  """A Hugging Face folder that cannot be read as a supported Qwen or Llama checkpoint."""


def _eos_ids(value, where: str, vocab_size: int) -> tuple[int, ...]:
  """An `eos_token_id` value (null, an id, or a list of ids) as a tuple of ids.

  Raises:
    CheckpointFormatError: anything else, or an id outside [0, vocab_size).
  """
  if value is None:
    return ()
  ids = value if isinstance(value, list) else [value]
  if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
    raise CheckpointFormatError(
      f"{where}: eos_token_id must be an id or a list of ids, got {value!r}"
    )
  bad = [i for i in ids if not 0 <= i < vocab_size]
  if bad:
    raise CheckpointFormatError(
      f"{where}: eos_token_id {bad} outside the vocabulary [0, {vocab_size})"
    )
  return tuple(dict.fromkeys(ids))


def generation_eos_ids(path: str | os.PathLike, vocab_size: int) -> tuple[int, ...]:
  """The `eos_token_id` ids of a folder's `generation_config.json`, in order; () without one.

  transformers' `generate` stops at every one of them (Qwen3 instruct checkpoints list 151645
  `<|im_end|>` and 151643 `<|endoftext|>`).

  Args:
    path: a Hugging Face model folder.
    vocab_size: the model's vocabulary size; every id must be below it.
  Raises:
    CheckpointFormatError: the file is not JSON, or its eos_token_id is not null, an id or a list
      of ids in [0, vocab_size).
  """
  file = Path(path) / GENERATION_CONFIG
  if not file.exists():
    return ()
  try:
    gen = json.loads(file.read_text())
  except ValueError as e:
    raise CheckpointFormatError(f"{file}: not JSON ({e})") from e
  if not isinstance(gen, dict):
    raise CheckpointFormatError(f"{file}: not a JSON object")
  return _eos_ids(gen.get("eos_token_id"), str(file), vocab_size)


def _rope_scaling(hf: dict) -> RopeScaling | None:
  """The RoPE scaling of a config.json (transformers 4's `rope_scaling`, 5's `rope_parameters`):
  None for the default rotary embedding, a `RopeScaling` for Llama 3's.

  Raises:
    CheckpointFormatError: another scaling type (linear, dynamic, yarn, ...), or a llama3 entry
      without its four numbers.
  """
  rope = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or rope
  if not isinstance(scaling, dict):
    raise CheckpointFormatError(f"rope_scaling must be an object, got {scaling!r}")
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return None
  if kind not in ROPE_TYPES:
    raise CheckpointFormatError(
      f"RoPE scaling {scaling} is not implemented (supported types: default, {ROPE_TYPES})"
    )
  try:
    return RopeScaling(
      kind,
      float(scaling["factor"]),
      float(scaling["low_freq_factor"]),
      float(scaling["high_freq_factor"]),
      int(scaling["original_max_position_embeddings"]),
    )
  except (KeyError, TypeError, ValueError) as e:
    raise CheckpointFormatError(f"RoPE scaling {scaling}: missing or bad field ({e})") from None


def config_from_hf(hf: dict) -> QwenConfig:
  """QwenConfig from a parsed HF `config.json` (transformers 4 and 5 spellings alike).

  `eos_token_ids` comes from its `eos_token_id` (an id, a list of ids, or absent).

  Raises:
    CheckpointFormatError: an unsupported model type, a feature we do not implement (sliding
      window attention, RoPE scaling other than Llama 3's, Llama's attention or MLP biases, an
      activation other than SiLU), an `eos_token_id` that is not ids in the vocabulary, or a
      missing or malformed field.
  """
  if not isinstance(hf, dict):
    raise CheckpointFormatError(f"config.json must be a JSON object, got {type(hf).__name__}")
  try:
    return _config_from_hf(hf)
  except (KeyError, TypeError, ValueError, AttributeError) as e:
    if isinstance(e, CheckpointFormatError):
      raise
    what = f"missing field {e.args[0]!r}" if isinstance(e, KeyError) else str(e)
    raise CheckpointFormatError(f"config.json: {what}") from None


def _int_field(hf: dict, key: str) -> int:
  """`hf[key]` when it is an integer >= 1 (KeyError when absent: `config_from_hf` names it)."""
  value = hf[key]
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise CheckpointFormatError(f"config.json: {key} must be an integer >= 1, got {value!r}")
  return value


def _config_from_hf(hf: dict) -> QwenConfig:
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise CheckpointFormatError(
      f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
    )
  if hf.get("use_sliding_window"):
    raise CheckpointFormatError(
      "sliding-window attention (use_sliding_window=true) is not implemented"
    )
  llama = model_type == "llama"
  if llama and (hf.get("attention_bias") or hf.get("mlp_bias")):
    raise CheckpointFormatError(
      "a Llama checkpoint with attention_bias or mlp_bias (o_proj / MLP biases) is not implemented"
    )
  act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
  if act != "silu":
    raise CheckpointFormatError(f"hidden_act {act!r} is not implemented (the MLP is SwiGLU: silu)")
  if llama and int(hf.get("pretraining_tp", 1) or 1) != 1:
    log.info(
      "config.json pretraining_tp=%s ignored (transformers ignores it too)", hf["pretraining_tp"]
    )
  rope = hf.get("rope_parameters") or {}
  scaling = _rope_scaling(hf)
  if scaling is not None and not llama:
    raise CheckpointFormatError(f"RoPE scaling {scaling} is implemented for Llama models only")
  heads = _int_field(hf, "num_attention_heads")
  for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
    _int_field(hf, key)
  if hf.get("num_key_value_heads") is not None:
    _int_field(hf, "num_key_value_heads")
  if hf.get("head_dim") is not None:
    _int_field(hf, "head_dim")
  num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
  if model_type != "qwen3_moe":
    num_experts = 0
  return QwenConfig(
    vocab_size=hf["vocab_size"],
    hidden_size=hf["hidden_size"],
    intermediate_size=hf["intermediate_size"],
    num_hidden_layers=hf["num_hidden_layers"],
    num_attention_heads=heads,
    num_key_value_heads=hf.get("num_key_value_heads") or heads,
    head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
    rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
    rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    # Qwen2 always has q/k/v biases; Qwen3 has them only when attention_bias is set.
    attention_bias=model_type == "qwen2" or (not llama and bool(hf.get("attention_bias", False))),
    qk_norm=model_type in ("qwen3", "qwen3_moe"),
    max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
    num_experts=num_experts,
    num_experts_per_tok=int(hf.get("num_experts_per_tok", 0)) if num_experts else 0,
    moe_intermediate_size=int(hf.get("moe_intermediate_size", 0)) if num_experts else 0,
    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    decoder_sparse_step=int(hf.get("decoder_sparse_step", 1) or 1),
    mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
    eos_token_ids=_eos_ids(hf.get("eos_token_id"), "config.json", hf["vocab_size"]),
    family="llama" if llama else "qwen",
    rope_scaling=scaling,
  )


def hf_config(cfg: QwenConfig, dtype=jnp.float32) -> dict:
  """The HF `config.json` dict for `cfg` (keys that transformers 4 and 5 both read).

  Raises:
    CheckpointFormatError: a config HF cannot express (q/k/v biases without Qwen2 layout, etc.).
  """
  model_type = cfg.model_type
  if model_type == "qwen2" and not cfg.attention_bias:
    raise CheckpointFormatError("a Qwen2 model always has q/k/v biases; this config has none")
  out = {
    "architectures": [_ARCHITECTURES[model_type]],
    "model_type": model_type,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.hidden_size,
    "intermediate_size": cfg.intermediate_size,
    "num_hidden_layers": cfg.num_hidden_layers,
    "num_attention_heads": cfg.num_attention_heads,
    "num_key_value_heads": cfg.num_key_value_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "rope_theta": cfg.rope_theta,
    "rms_norm_eps": cfg.rms_norm_eps,
    "tie_word_embeddings": cfg.tie_word_embeddings,
    "max_position_embeddings": cfg.max_position_embeddings,
    "use_sliding_window": False,
    "torch_dtype": jnp.dtype(dtype).name,
  }
  if model_type != "qwen2":
    out["attention_bias"] = cfg.attention_bias
  if model_type == "llama":
    out.update(mlp_bias=False, pretraining_tp=1)
    del out["use_sliding_window"]
  if cfg.rope_scaling is not None:
    out["rope_scaling"] = cfg.rope_scaling._asdict()
  if cfg.eos_token_ids:
    ids = list(cfg.eos_token_ids)
    out["eos_token_id"] = ids[0] if len(ids) == 1 else ids
  if cfg.num_experts:
    out.update(
      num_experts=cfg.num_experts,
      num_experts_per_tok=cfg.num_experts_per_tok,
      moe_intermediate_size=cfg.moe_intermediate_size,
      norm_topk_prob=cfg.norm_topk_prob,
      decoder_sparse_step=cfg.decoder_sparse_step,
      mlp_only_layers=list(cfg.mlp_only_layers),
    )
  return out


def _weight_files(folder: Path) -> list[Path]:
  index = folder / SAFE_INDEX
  if index.exists():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError) as e:
      raise CheckpointFormatError(f"{index}: not a safetensors index ({e})") from e
    return [folder / f for f in sorted(set(weight_map.values()))]
  if (folder / SAFE_WEIGHTS).exists():
    return [folder / SAFE_WEIGHTS]
  raise CheckpointFormatError(
    f"{folder} has neither {SAFE_WEIGHTS} nor {SAFE_INDEX} (PyTorch "
    ".bin checkpoints are not read: convert them to safetensors)"
  )


class _Tensors:
  """The tensors of a checkpoint's safetensors files, read lazily by slice.

  `bytes_read` counts the bytes of every slice read (what `from_pretrained(stats=...)` reports).

  Raises (constructor, `read`):
    CheckpointFormatError: a listed shard is missing, a file is not safetensors or is cut short,
      or a tensor name appears in two files.
  """

  def __init__(self, files: list[Path]):
    self._stack = contextlib.ExitStack()
    self.where: dict[str, Any] = {}
    self.bytes_read = 0
    for file in files:
      if not file.exists():
        self.close()
        raise CheckpointFormatError(f"shard {file} listed in the index is missing")
      try:
        handle = self._stack.enter_context(safetensors.safe_open(str(file), framework="np"))
      except safetensors.SafetensorError as e:
        self.close()
        raise CheckpointFormatError(f"{file}: unreadable safetensors file ({e})") from e
      for name in handle.keys():
        if name in self.where:
          self.close()
          raise CheckpointFormatError(f"tensor {name} is stored in two files ({file})")
        self.where[name] = (file, handle)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.where[name][1].get_slice(name).get_shape())

  def read(self, name: str, index: tuple) -> np.ndarray:
    file, handle = self.where[name]
    try:
      out = handle.get_slice(name)[index]
    except safetensors.SafetensorError as e:
      raise CheckpointFormatError(f"{file}: unreadable safetensors file ({e})") from e
    self.bytes_read += out.nbytes
    return out

  def close(self) -> None:
    self._stack.close()


def _normalize(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
  """`index` (make_array_from_callback's, possibly slice(None)) as explicit step-1 slices."""
  return tuple(slice(*s.indices(n)) for s, n in zip(index, shape, strict=True))


def _load(shape: tuple[int, ...], sharding, read_shard, dtype) -> jax.Array:
  """A global array of `shape` in `sharding`; each addressable shard is `read_shard(index)`
  (host numpy), cast to `dtype`. Each device (and each host) reads only its own shard."""

  def callback(index):
    return np.asarray(read_shard(_normalize(index, shape)), dtype=dtype)

  return jax.make_array_from_callback(shape, sharding, callback)


def _sharding(var: nnx.Variable, mesh: Mesh | None, layer: bool = False):
  """`var`'s sharding on `mesh` (the first device without one); with `layer`, that of one
  layer's slice of the stacked `var` (the stack's spec without its unsharded leading axis)."""
  if mesh is None:
    return SingleDeviceSharding(jax.devices()[0])
  sharding = param_sharding(mesh, var.get_metadata()["out_sharding"], var.get_value().shape)
  return NamedSharding(mesh, PartitionSpec(*sharding.spec[1:])) if layer else sharding


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stack: jax.Array, value: jax.Array, layer) -> jax.Array:
  """stack [L, ...] with slice [layer] replaced by value [...], in place (stack is donated)."""
  return jax.lax.dynamic_update_index_in_dim(stack, value.astype(stack.dtype), layer, 0)


def read_config(path: str | os.PathLike) -> QwenConfig:
  """The QwenConfig of a Hugging Face folder (`config_from_hf` of its config.json), with
  `eos_token_ids` from config.json and generation_config.json, config.json's first, each once;
  no tensor is read (the memory planner sizes a checkpoint run from it).

  Raises:
    FileNotFoundError: no `config.json`. CheckpointFormatError: not JSON, or what
      `config_from_hf` refuses.
  """
  folder = Path(path)
  config_file = folder / "config.json"
  if not config_file.exists():
    raise FileNotFoundError(f"{config_file} not found (is {folder} a Hugging Face model folder?)")
  try:
    hf = json.loads(config_file.read_text())
  except ValueError as e:
    raise CheckpointFormatError(f"{config_file}: not JSON ({e})") from e
  cfg = config_from_hf(hf)
  generation = generation_eos_ids(folder, cfg.vocab_size)
  return dataclasses.replace(
    cfg, eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + generation))
  )


def from_pretrained(
  path: str | os.PathLike,
  dtype=jnp.float32,
  mesh: Mesh | None = None,
  remat: str = "full",
  stats: dict[str, int] | None = None,
  attention: str = "auto",
  expert_dispatch: str = "auto",
) -> Qwen:
  """Loads a Hugging Face Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE / Llama 3.x / SmolLM2 checkpoint
  folder.

  Args:
    path: folder with `config.json` and `model.safetensors` or `model.safetensors.index.json`,
      and optionally `generation_config.json`.
    dtype: parameter dtype (float32 or bfloat16); tensors are cast one at a time.
    mesh: when given, every parameter is placed in its logical sharding on this mesh
      (`sharding.LOGICAL_RULES`); otherwise on the first device.
    remat: the model's rematerialisation policy (`qwen.REMAT_POLICIES`; not read from the folder).
    attention: the attention kernel (`kernels.ATTENTION_KERNELS`; not read from the folder).
    expert_dispatch: how MoE blocks move token copies (`qwen.EXPERT_DISPATCH`; not read either).
    stats: if given, filled with "bytes_read": the checkpoint bytes this process read (its
      devices' shards only; the whole checkpoint on one device).
  Returns:
    A `Qwen` model; `model(input_ids, attention_mask=mask)` gives [B, T, V] float32 logits.
    `model.config.eos_token_ids` holds every `eos_token_id` of config.json and
    generation_config.json (config.json's first), each once.
  Raises:
    ValueError: an unknown remat policy, attention kernel or expert dispatch.
    FileNotFoundError: no `config.json`. CheckpointFormatError: an unsupported architecture, an
      unknown or missing tensor, a shape that does not fit the config, a damaged file, an
      `eos_token_id` that is not ids in the vocabulary.
  """
  folder = Path(path)
  cfg = read_config(folder)
  abstract = nnx.eval_shape(
    lambda: Qwen(
      cfg,
      rngs=nnx.Rngs(0),
      dtype=dtype,
      remat=remat,
      attention=attention,
      expert_dispatch=expert_dispatch,
    )
  )
  graphdef, state = nnx.split(abstract)
  variables = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(state)}
  tensors = _Tensors(_weight_files(folder))
  try:
    sources = _sources(tensors, cfg, variables)
    for target, var in variables.items():
      want = var.get_value()
      stacked = layer_paths(target, cfg)
      if stacked[0][1] is None:
        sharding = _sharding(var, mesh)
        var.set_value(_load_param(tensors, sources, target, want.shape, sharding, cfg, want.dtype))
        continue
      zeros = functools.partial(jnp.zeros, want.shape, want.dtype)
      stack = jax.jit(zeros, out_shardings=_sharding(var, mesh))()
      layer_sharding = _sharding(var, mesh, layer=True)
      for layer_path, layer in stacked:
        value = _load_param(
          tensors, sources, layer_path, want.shape[1:], layer_sharding, cfg, want.dtype
        )
        stack = _set_layer(stack, value, layer)
      var.set_value(stack)
  finally:
    tensors.close()
  if stats is not None:
    stats["bytes_read"] = tensors.bytes_read
  return nnx.merge(graphdef, state)


def _sources(tensors: _Tensors, cfg: QwenConfig, variables: dict) -> dict[str, Any]:
  """Per-layer parameter path -> (HF name, Layout), or for stacked experts {expert: HF name},
  for every tensor of the checkpoint, after checking names, shapes and completeness (no data
  is read: shapes come from the files' headers).

  Raises:
    CheckpointFormatError: an unknown tensor, a shape that does not fit the config, an expert
      outside the config, a missing tensor.
  """
  sources: dict[str, Any] = {}
  for name in tensors.where:
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
      continue  # some tied checkpoints also store the (identical) head
    try:
      path, expert, layout = hf_to_path(name)
      target, layer = stacked_path(path, cfg)
    except KeyError as e:
      raise CheckpointFormatError(str(e.args[0])) from None
    if target not in variables:
      raise CheckpointFormatError(
        f"tensor {name} has no place in a {cfg.model_type} model with this config.json"
      )
    want = tuple(variables[target].get_value().shape[0 if layer is None else 1 :])
    hf_shape = tensors.shape(name)
    if expert is not None:
      if expert >= want[0] or hf_shape[::-1] != want[1:]:
        raise CheckpointFormatError(
          f"{name}: expert {expert} of shape {hf_shape} does not fit {path} {want}"
        )
      sources.setdefault(path, {})[expert] = name
      continue
    if layout.shape(hf_shape, cfg) != want:
      raise CheckpointFormatError(
        f"{path}: checkpoint shape {hf_shape} does not fit the config's {want}"
      )
    sources[path] = (name, layout)
  expected = {p for t in variables for p, _ in layer_paths(t, cfg)}
  done = {
    p
    for p, src in sources.items()
    if not isinstance(src, dict)
    or len(src) == variables[stacked_path(p, cfg)[0]].get_value().shape[1]
  }
  missing = sorted(expected - done)
  if missing:
    raise CheckpointFormatError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")
  return sources


def _load_param(tensors, sources, path, shape, sharding, cfg, dtype) -> jax.Array:
  """One per-layer parameter as a global array in `sharding`, each shard read as a slice."""
  src = sources[path]
  if isinstance(src, dict):  # stacked experts [E, ...]: shard [e0:e1] reads experts e0..e1-1
    transpose = hf_to_path(src[0])[2]

    def read_shard(index):
      e, rest = index[0], index[1:]
      return np.stack(
        [
          transpose.read(lambda i, name=src[k]: tensors.read(name, i), rest, cfg)
          for k in range(e.start, e.stop)
        ]
      )

  else:
    name, layout = src

    def read_shard(index):
      return layout.read(lambda i: tensors.read(name, i), index, cfg)

  return _load(tuple(shape), sharding, read_shard, dtype)


def save_pretrained(
  model: Qwen, path: str | os.PathLike, max_shard_bytes: int = 5 * 1024**3
) -> Path:
  """Writes `model` as a Hugging Face folder that transformers' `from_pretrained` loads.

  Tensors are gathered to the host one at a time and each shard of at most `max_shard_bytes` is
  written as soon as it is full, so the host holds at most one shard. Files are written under
  temporary names and renamed into place at the end, so an interrupted save (a full disk) never
  leaves a half-written file under a final name. Tied models do not write `lm_head.weight`.
  On a multi-host mesh, call it where every parameter is fully addressable (or gather first).

  Returns:
    The folder. Raises OSError from the file system (for example a full disk).
  """
  folder = Path(path)
  folder.mkdir(parents=True, exist_ok=True)
  cfg: QwenConfig = model.config
  state = nnx.state(model, nnx.Param)
  dtype = jax.tree.leaves(state)[0].dtype
  written: list[tuple[str, list[str]]] = []  # (temporary file, tensor names)
  shard: dict[str, np.ndarray] = {}
  shard_bytes = total = 0

  def flush():
    fd, tmp = tempfile.mkstemp(prefix=".shard.", suffix=".tmp", dir=folder)
    os.close(fd)
    written.append((tmp, list(shard)))
    safetensors.numpy.save_file(shard, tmp, {"format": "pt"})
    shard.clear()

  try:
    for p, var in nnx.to_flat_state(state):
      for path, layer in layer_paths(".".join(map(str, p)), cfg):
        value = var.get_value() if layer is None else var.get_value()[layer]  # one layer's slice
        host = np.asarray(jax.device_get(value))
        for name, array in path_to_hf(path, host, cfg):
          if shard and shard_bytes + array.nbytes > max_shard_bytes:
            flush()
            shard_bytes = 0
          shard[name] = np.ascontiguousarray(array)
          shard_bytes += array.nbytes
          total += array.nbytes
    flush()
    n = len(written)
    names = (
      [SAFE_WEIGHTS] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    for file, (tmp, _) in zip(names, written):
      os.replace(tmp, folder / file)
    if n > 1:
      weight_map = {k: file for file, (_, keys) in zip(names, written) for k in keys}
      index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
      _atomic_write(
        folder / SAFE_INDEX, lambda tmp: Path(tmp).write_text(json.dumps(index, indent=2))
      )
  finally:
    for tmp, _ in written:
      Path(tmp).unlink(missing_ok=True)
  config = json.dumps(hf_config(cfg, dtype), indent=2)
  _atomic_write(folder / "config.json", lambda tmp: Path(tmp).write_text(config))
  return folder


def _atomic_write(dest: Path, write) -> None:
  fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
  os.close(fd)
  try:
    write(tmp)
    os.replace(tmp, dest)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise
