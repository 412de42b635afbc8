"""A trained policy as a Qwen model, from a run's orbax checkpoint or a Hugging Face folder.

`load_model(cfg, path)`: a run's checkpoint (`coevolve_jax.checkpoint.RunCheckpointer`, found in
`<workdir>/checkpoints` or the folder itself) stores the parameters as their own item, `params`,
restored alone into the structure of `cfg.model.preset`; a Hugging Face folder (`config.json` +
safetensors) is loaded by `models.build` (its config.json gives the shape, its config.json and
generation_config.json the end-of-sequence ids). Used by evaluation tools
(`python -m envs.bfcl.evaluate`).
"""

from __future__ import annotations

import os
import sys


def load_model(cfg, checkpoint: str):
  """The policy of `checkpoint` (orbax run checkpoint or Hugging Face folder) as a Qwen model.

  Raises:
    FileNotFoundError: the path does not exist or holds neither kind of checkpoint.
  """
  import jax  # noqa: PLC0415
  import orbax.checkpoint as ocp  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from coevolve_jax import models  # noqa: PLC0415

  path = os.path.abspath(checkpoint)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"--checkpoint={checkpoint}: no such folder")
  model_cfg = {"preset": cfg.model.preset, "dtype": cfg.model.dtype, "checkpoint": ""}
  if os.path.exists(os.path.join(path, "config.json")):  # a Hugging Face folder
    return models.build({**model_cfg, "checkpoint": path}, seed=0)
  ckpt_dir = (
    os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
  )
  mgr = ocp.CheckpointManager(ckpt_dir, item_names=("params",))
  step = mgr.latest_step()
  if step is None:
    raise FileNotFoundError(
      f"{path}: neither a Hugging Face folder (config.json) nor an orbax checkpoint folder"
    )
  graphdef, params = nnx.split(models.build(model_cfg, seed=0))  # the structure to restore into
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, params)
  restored = mgr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
  mgr.close()
  print(f"loaded step {step} from {ckpt_dir}", file=sys.stderr)
  return nnx.merge(graphdef, restored.params)
