"""The policy model of a run's `model` config group: a random-init preset or a checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from coevolve_jax.models.hf import from_pretrained
from coevolve_jax.models.qwen import Qwen, QwenConfig
from coevolve_jax.models.sharding import param_sharding


def build(model_cfg: Mapping[str, Any], *, seed: int, mesh: Mesh | None = None) -> Qwen:
  """The model a run trains, from its `model` config group (configs/bfcl.py `c.model`).

  With `model_cfg.checkpoint` set, the Hugging Face folder is loaded (`from_pretrained`; its
  config.json replaces the preset, which is then not read, and the `eos_token_id` ids of its
  config.json and generation_config.json are `model.config.eos_token_ids`, the ids that end a
  reply besides the tokenizer's `<|im_end|>`); otherwise `QwenConfig.preset(
  model_cfg.preset)` is initialised at random with `nnx.Rngs(seed)`. Parameters are in
  `model_cfg.dtype`; `model_cfg.remat` ("full" when absent) is each decoder layer's
  rematerialisation in the training backward pass (`qwen.remat_layer`).

  Args:
    model_cfg: has `preset` (a `models.PRESETS` name), `checkpoint` (a folder, "" for random
      init), `dtype` (a float dtype name: "float32", "bfloat16") and optionally `remat`
      ("none", "full" or "save_dots").
    seed: the random initialisation's seed (a run passes its `seed`).
    mesh: when given, every parameter is placed in its logical sharding on this mesh
      (`sharding.param_sharding`), with the values it has without a mesh; otherwise parameters
      stay where JAX puts them (the first device).
  Returns:
    The `Qwen` model.
  Raises:
    ValueError: an unknown preset (random init) or remat policy. TypeError: an unknown dtype name.
    FileNotFoundError, CheckpointFormatError: an unusable checkpoint folder (`from_pretrained`).
  """
  dtype = jnp.dtype(model_cfg["dtype"])
  remat = model_cfg.get("remat", "full")
  if model_cfg["checkpoint"]:
    return from_pretrained(model_cfg["checkpoint"], dtype=dtype, mesh=mesh, remat=remat)
  cfg = QwenConfig.preset(model_cfg["preset"])
  model = Qwen(cfg, rngs=nnx.Rngs(seed), dtype=dtype, remat=remat)
  if mesh is not None:
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
      value = np.asarray(var.get_value())
      sharding = param_sharding(mesh, var.get_metadata()["out_sharding"], value.shape)
      # Each device (and, on several hosts, each host) copies only its own slice.
      var.set_value(
        jax.make_array_from_callback(value.shape, sharding, lambda index, v=value: v[index])
      )
  return model
