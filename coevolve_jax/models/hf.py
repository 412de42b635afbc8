"""Hugging Face checkpoint folders: `from_pretrained` and `save_pretrained` for Qwen models.

A folder holds `config.json` and either one `model.safetensors` or shards listed in
`model.safetensors.index.json`, and may hold `generation_config.json`, whose `eos_token_id` ids
(with those of config.json) become the model's `config.eos_token_ids`: the ids that end a reply.
Loading reads one tensor at a time (safetensors) and places it straight into its target sharding,
so no host ever holds the whole model: the peak extra host memory is one tensor (or one layer's
stacked experts for MoE) plus the model's own shards. The model stacks its decoder layers
(`Qwen.blocks`); each layer's tensor is written into its slice of the stacked device array, and
saving reads one layer's slice at a time, so the checkpoint keeps HF's per-layer names.
`benchmarks/load_memory.py` measures it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from coevolve_jax.models.params import hf_to_path, layer_paths, path_to_hf, stacked_path
from coevolve_jax.models.qwen import Qwen, QwenConfig
from coevolve_jax.models.sharding import param_sharding

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe")
_ARCHITECTURES = {
  "qwen2": "Qwen2ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "qwen3_moe": "Qwen3MoeForCausalLM",
}
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"


class CheckpointFormatError(ValueError):
  """A Hugging Face folder that cannot be read as a supported Qwen checkpoint."""


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


def config_from_hf(hf: dict) -> QwenConfig:
  """QwenConfig from a parsed HF `config.json` (transformers 4 and 5 spellings alike).

  `eos_token_ids` comes from its `eos_token_id` (an id, a list of ids, or absent).

  Raises:
    CheckpointFormatError: an unsupported model type, a feature we do not implement (sliding
      window attention, RoPE scaling), or an `eos_token_id` that is not ids in the vocabulary.
  """
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise CheckpointFormatError(
      f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
    )
  if hf.get("use_sliding_window"):
    raise CheckpointFormatError(
      "sliding-window attention (use_sliding_window=true) is not implemented"
    )
  rope = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or rope
  if scaling.get("rope_type", scaling.get("type", "default")) != "default":
    raise CheckpointFormatError(f"RoPE scaling {scaling} is not implemented")
  heads = hf["num_attention_heads"]
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
    attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
    qk_norm=model_type != "qwen2",
    max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
    num_experts=num_experts,
    num_experts_per_tok=int(hf.get("num_experts_per_tok", 0)) if num_experts else 0,
    moe_intermediate_size=int(hf.get("moe_intermediate_size", 0)) if num_experts else 0,
    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    decoder_sparse_step=int(hf.get("decoder_sparse_step", 1) or 1),
    mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
    eos_token_ids=_eos_ids(hf.get("eos_token_id"), "config.json", hf["vocab_size"]),
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


def _iter_hf_tensors(files: list[Path]) -> Iterator[tuple[str, np.ndarray]]:
  for file in files:
    if not file.exists():
      raise CheckpointFormatError(f"shard {file} listed in the index is missing")
    try:
      with safetensors.safe_open(str(file), framework="np") as f:
        for name in f.keys():
          yield name, f.get_tensor(name)
    except safetensors.SafetensorError as e:
      raise CheckpointFormatError(f"{file}: unreadable safetensors file ({e})") from e


def _place(
  value: np.ndarray, var: nnx.Variable, mesh: Mesh | None, path: str, layer: int | None = None
) -> jax.Array:
  """`value` as a device array in `var`'s sharding; with `layer`, as the slice [layer] of the
  stacked `var` (in the stack's sharding without its unsharded leading axis).

  Raises:
    CheckpointFormatError: a shape that does not fit.
  """
  want = var.get_value()
  shape = tuple(want.shape) if layer is None else tuple(want.shape[1:])
  if tuple(value.shape) != shape:
    raise CheckpointFormatError(
      f"{path}: checkpoint shape {value.shape} does not fit the config's {shape}"
    )
  value = np.asarray(value, dtype=want.dtype)
  sharding = _sharding(var, mesh)
  if layer is not None and mesh is not None:
    sharding = NamedSharding(mesh, PartitionSpec(*sharding.spec[1:]))
  # Each device (and, on a multi-host mesh, each host) copies only its own slice.
  return jax.make_array_from_callback(shape, sharding, lambda index: value[index])


def _sharding(var: nnx.Variable, mesh: Mesh | None):
  if mesh is None:
    return SingleDeviceSharding(jax.devices()[0])
  return param_sharding(mesh, var.get_metadata()["out_sharding"], var.get_value().shape)


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
  path: str | os.PathLike, dtype=jnp.float32, mesh: Mesh | None = None, remat: str = "full"
) -> Qwen:
  """Loads a Hugging Face Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE checkpoint folder.

  Args:
    path: folder with `config.json` and `model.safetensors` or `model.safetensors.index.json`,
      and optionally `generation_config.json`.
    dtype: parameter dtype (float32 or bfloat16); tensors are cast one at a time.
    mesh: when given, every parameter is placed in its logical sharding on this mesh
      (`sharding.LOGICAL_RULES`); otherwise on the first device.
    remat: the model's rematerialisation policy (`qwen.REMAT_POLICIES`; not read from the folder).
  Returns:
    A `Qwen` model; `model(input_ids, attention_mask=mask)` gives [B, T, V] float32 logits.
    `model.config.eos_token_ids` holds every `eos_token_id` of config.json and
    generation_config.json (config.json's first), each once.
  Raises:
    ValueError: an unknown remat policy.
    FileNotFoundError: no `config.json`. CheckpointFormatError: an unsupported architecture, an
      unknown or missing tensor, a shape that does not fit the config, a damaged file, an
      `eos_token_id` that is not ids in the vocabulary.
  """
  folder = Path(path)
  cfg = read_config(folder)
  abstract = nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0), dtype=dtype, remat=remat))
  graphdef, state = nnx.split(abstract)
  variables = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(state)}
  done: set[str] = set()  # per-layer paths ("layers.3.mlp.up_proj") and unstacked ones
  stacks: dict[str, jax.Array] = {}  # stacked parameter -> its device array, being filled
  experts: dict[str, tuple[np.ndarray, set[int]]] = {}  # per-layer path -> (buffer, filled)
  for name, array in _iter_hf_tensors(_weight_files(folder)):
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
      continue  # some tied checkpoints also store the (identical) head
    try:
      path, expert, transform = hf_to_path(name)
      target, layer = stacked_path(path, cfg)
    except KeyError as e:
      raise CheckpointFormatError(str(e.args[0])) from None
    if target not in variables:
      raise CheckpointFormatError(
        f"tensor {name} has no place in a {cfg.model_type} model with this config.json"
      )
    value = transform(array, cfg)
    del array
    var = variables[target]
    if expert is not None:
      want = var.get_value().shape[1:]  # one layer's [E, ...]
      if expert >= want[0] or tuple(value.shape) != tuple(want[1:]):
        raise CheckpointFormatError(
          f"{name}: expert {expert} of shape {value.shape} does not fit {path} {tuple(want)}"
        )
      buf, filled = experts.setdefault(path, (np.empty(want, var.get_value().dtype), set()))
      buf[expert] = value
      filled.add(expert)
      if len(filled) < want[0]:
        continue
      value = experts.pop(path)[0]
    if layer is None:
      var.set_value(_place(value, var, mesh, target))
    else:
      if target not in stacks:
        spec = var.get_value()
        zeros = functools.partial(jnp.zeros, spec.shape, spec.dtype)
        stacks[target] = jax.jit(zeros, out_shardings=_sharding(var, mesh))()
      stacks[target] = _set_layer(stacks[target], _place(value, var, mesh, path, layer), layer)
    done.add(path)
  want = {p for t in variables for p, _ in layer_paths(t, cfg)}
  missing = sorted(want - done)
  if missing:
    raise CheckpointFormatError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")
  for target, stack in stacks.items():
    variables[target].set_value(stack)
  return nnx.merge(graphdef, state)


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
