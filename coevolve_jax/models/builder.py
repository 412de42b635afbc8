"""The policy model of a run's `model` config group: a random-init preset or a checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from coevolve_jax.models.hf import from_pretrained
from coevolve_jax.models.qwen import Qwen, QwenConfig
from coevolve_jax.models.sharding import tree_shardings


MATMUL_PRECISIONS = ("default", "high", "highest")


def apply_matmul_precision(model_cfg: Mapping[str, Any]) -> None:
  """Sets the process's default precision of float32 matrix products (JAX's
  `jax_default_matmul_precision`) from `model_cfg.matmul_precision` (absent = "default").

  "default": the backend's fastest (on NVIDIA GPUs float32 products run as TF32-class products,
  about 1e-3 relative; on TPU as bfloat16 passes); "high": about 3 bfloat16 passes on TPU;
  "highest": full float32 everywhere (parity with transformers at 1e-4 needs it on GPU).
  bfloat16 products are not affected. Applies to every function traced afterwards in the
  process (a jit cache key), so a run sets it once at start-up.

  Raises:
    ValueError: a name not in MATMUL_PRECISIONS.
  """
  name = model_cfg.get("matmul_precision", "default")
  if name not in MATMUL_PRECISIONS:
    raise ValueError(f"model.matmul_precision must be one of {MATMUL_PRECISIONS}, got {name!r}")
  jax.config.update("jax_default_matmul_precision", None if name == "default" else name)


def build(model_cfg: Mapping[str, Any], *, seed: int, mesh: Mesh | None = None, dtype=None) -> Qwen:
  """The model a run trains, from its `model` config group (configs/bfcl.py `c.model`).

  With `model_cfg.checkpoint` set, the Hugging Face folder is loaded (`from_pretrained`; its
  config.json replaces the preset, which is then not read, and the `eos_token_id` ids of its
  config.json and generation_config.json are `model.config.eos_token_ids`, the ids that end a
  reply besides the tokenizer's `<|im_end|>`); otherwise `QwenConfig.preset(
  model_cfg.preset)` is initialised at random with `nnx.Rngs(seed)`. Parameters are in `dtype`
  (default `model_cfg.dtype`; a training run passes `model_cfg.param_dtype`, its master copy);
  `model_cfg.remat` ("full" when absent) is each decoder layer's rematerialisation in the
  training backward pass (`qwen.remat_layer`); `model_cfg.attention` ("auto" when absent) the
  attention kernel (`kernels.ATTENTION_KERNELS`); `model_cfg.expert_dispatch` ("auto" when
  absent) how MoE blocks move token copies between devices (`qwen.EXPERT_DISPATCH`).

  Args:
    model_cfg: has `preset` (a `models.PRESETS` name), `checkpoint` (a folder, "" for random
      init), `dtype` (a float dtype name: "float32", "bfloat16") and optionally `remat`
      ("none", "full" or "save_dots"), `attention` and `expert_dispatch`.
    seed: the random initialisation's seed (a run passes its `seed`).
    mesh: when given, every parameter is placed in its logical sharding on this mesh
      (`sharding.tree_shardings`), with the values it has without a mesh; otherwise parameters
      stay where JAX puts them (the first device).
    dtype: the parameters' float dtype (a name or dtype), overriding `model_cfg.dtype`.
  Returns:
    The `Qwen` model.
  Raises:
    ValueError: an unknown preset (random init), remat policy, attention kernel or expert
      dispatch.
    TypeError: an unknown dtype name.
    FileNotFoundError, CheckpointFormatError: an unusable checkpoint folder (`from_pretrained`).
  """
  dtype = jnp.dtype(model_cfg["dtype"] if dtype is None else dtype)
  kinds = {
    "remat": model_cfg.get("remat", "full"),
    "attention": model_cfg.get("attention", "auto"),
    "expert_dispatch": model_cfg.get("expert_dispatch", "auto"),
  }
  if model_cfg["checkpoint"]:
    return from_pretrained(model_cfg["checkpoint"], dtype=dtype, mesh=mesh, **kinds)
  cfg = QwenConfig.preset(model_cfg["preset"])
  return init(cfg, seed=seed, dtype=dtype, mesh=mesh, **kinds)


def init(
  cfg: QwenConfig,
  *,
  seed: int,
  dtype=jnp.float32,
  mesh: Mesh | None = None,
  remat: str = "full",
  attention: str = "auto",
  expert_dispatch: str = "auto",
) -> Qwen:
  """A randomly initialised `Qwen(cfg)` (`nnx.Rngs(seed)`, parameters in `dtype`, `remat`,
  `attention` and `expert_dispatch` as `Qwen`'s).

  The draw runs inside one jit; with a `mesh`, its outputs carry the parameters' logical
  shardings (`sharding.tree_shardings`): each device draws only its own shard, with the values
  it has without a mesh (bit for bit), and no device ever holds the whole model.
  """

  def make():
    return Qwen(
      cfg,
      rngs=nnx.Rngs(seed),
      dtype=dtype,
      remat=remat,
      attention=attention,
      expert_dispatch=expert_dispatch,
    )

  graphdef, shapes = nnx.split(nnx.eval_shape(make))
  # Jitted with or without a mesh: the same compiled draw, so the values are bit-identical on
  # any mesh (an eager draw rounds differently in the last place).
  out = None if mesh is None else tree_shardings(shapes, mesh)
  state = jax.jit(lambda: nnx.split(make())[1], out_shardings=out)()
  return nnx.merge(graphdef, state)
