"""A trained policy as a Qwen model, from a run's orbax checkpoint or a Hugging Face folder.

`model_config_for_checkpoint(cfg, path)` gives the model group the checkpoint was made with: a
Hugging Face folder (`config.json` + safetensors) is its own; a run's checkpoint
(`coevolve_jax.checkpoint.RunCheckpointer`, in `<workdir>/checkpoints`, or the workdir itself) has
the `model` group of the run's `<workdir>/config.json` (`workdir.check_config` writes it), which
replaces the caller's, so a run started from a Hugging Face folder (`model.checkpoint`) is rebuilt
with that folder's architecture and end-of-sequence ids whatever the caller's config says.

`load_model(cfg, path)` then builds the model: a Hugging Face folder is loaded by `models.build`
(its config.json gives the shape, its config.json and generation_config.json the end-of-sequence
ids); a run's checkpoint stores the parameters as their own item, `params`, restored alone into
the shape of `cfg.model` (the recorded folder's config.json, or `cfg.model.preset`), without a
random initialisation or a read of the folder's safetensors. Used by evaluation tools
(`python -m envs.bfcl.evaluate`).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

RUN_CONFIG = "config.json"  # <workdir>/config.json, the run's whole config (workdir.check_config)


def _checkpoint_dir(path: str) -> str:
  """The orbax folder of `path`: `<path>/checkpoints` when there is one (a workdir), else `path`."""
  sub = os.path.join(path, "checkpoints")
  return sub if os.path.isdir(sub) else path


def _read_run_config(file: str) -> tuple[dict[str, Any] | None, str]:
  """(the run config in `file`, "") or (None, why it is not one: missing, not JSON, no `model`
  group). A Hugging Face config.json is not a run config (it has no `model` group)."""
  if not os.path.exists(file):
    return None, f"{file} does not exist"
  try:
    with open(file, encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, ValueError) as e:
    return None, f"{file} is unreadable ({e})"
  if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
    return None, f"{file} has no model group"
  return config, ""


def _is_hf_folder(path: str) -> bool:
  """A Hugging Face folder: a config.json that is not a run's config.json, and no
  `checkpoints/` folder (a workdir's, even with a damaged config.json)."""
  file = os.path.join(path, "config.json")
  return (
    os.path.exists(file)
    and _read_run_config(file)[0] is None
    and not os.path.isdir(os.path.join(path, "checkpoints"))
  )


def _eos_note(folder: str) -> str:
  """The "eos ids [...]" of a Hugging Face folder (its config.json and generation_config.json).

  Raises:
    FileNotFoundError: no config.json. CheckpointFormatError: what `hf.read_config` refuses.
  """
  from coevolve_jax.models.hf import read_config  # noqa: PLC0415

  return f"eos ids {list(read_config(folder).eos_token_ids)}"


def model_config_for_checkpoint(cfg, checkpoint: str) -> tuple[Any, str]:
  """`cfg` with the model group that `checkpoint` was made with, and one line saying where it
  came from.

  - A Hugging Face folder (a config.json that is not a run's): `model.checkpoint` is the folder;
    its config.json gives the shape, it and generation_config.json the end-of-sequence ids.
  - A run's orbax checkpoint (a workdir, or its `checkpoints/` folder): the `model` group of the
    run's config.json (in the workdir: the checkpoint folder's parent) replaces `cfg.model`
    field by field, the run's values winning (fields the run does not record keep `cfg`'s); the
    line names the fields `cfg` had otherwise. With the run's `model.checkpoint` set (a run
    started from a Hugging Face folder), that folder's config.json and generation_config.json
    give the shape and the end-of-sequence ids (its tensors are not read).
  - A run's checkpoint without that config.json (an old or copied checkpoint): `cfg` as given,
    and the line is a warning.

  Args:
    cfg: the caller's run config (ConfigDict, e.g. `--config`); not modified.
    checkpoint: the folder given (`--checkpoint`).
  Returns:
    (a resolved copy of `cfg` with that model group, the line).
  Raises:
    FileNotFoundError: `checkpoint` is not a folder; the Hugging Face folder the run recorded
      (its config.json) no longer exists.
    CheckpointFormatError: that folder's config.json or generation_config.json is unreadable or
      not a supported Qwen model.
  """
  import ml_collections  # noqa: PLC0415

  from flax.traverse_util import flatten_dict  # noqa: PLC0415

  path = os.path.abspath(checkpoint)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"--checkpoint={checkpoint}: no such folder")
  out = cfg.copy_and_resolve_references()
  if _is_hf_folder(path):
    with out.unlocked():
      out.model.checkpoint = path
    return out, (
      f"model config: the Hugging Face folder {path} (shape from its config.json, "
      f"{_eos_note(path)} from its config.json and generation_config.json)"
    )
  file = os.path.join(os.path.dirname(_checkpoint_dir(path)), RUN_CONFIG)
  run, why = _read_run_config(file)
  if run is None:
    return out, (
      f"warning: {why}, so the model is built from --config's model group (model.preset="
      f"{out.model.preset!r}, model.checkpoint={out.model.checkpoint!r}); a checkpoint of "
      f"another model does not restore"
    )
  recorded, given = run["model"], out.model.to_dict()
  hf_folder = recorded.get("checkpoint") or ""
  if hf_folder and not os.path.exists(os.path.join(hf_folder, "config.json")):
    raise FileNotFoundError(
      f"{file} records model.checkpoint={hf_folder!r}, a Hugging Face folder that no longer "
      f"exists (a relative path is read from the current directory); the parameters are in the "
      f"orbax checkpoint, but the model's shape and end-of-sequence ids are that folder's: put "
      f"its config.json and generation_config.json back there, or set model.checkpoint in "
      f"{file} to where the folder is now"
    )
  with out.unlocked():
    out.model = ml_collections.ConfigDict({**given, **recorded})
  model = (
    f"model.checkpoint={hf_folder!r}: shape from its config.json, {_eos_note(hf_folder)} from "
    f"its config.json and generation_config.json"
    if hf_folder
    else f"model.preset={recorded.get('preset')!r}"
  )
  before = flatten_dict({"model": given}, sep=".")
  now = flatten_dict({"model": recorded}, sep=".")
  changed = [
    f"{k} ({before[k]!r} there)" if k in before else f"{k} (absent there)"
    for k in sorted(now)
    if k not in before or before[k] != now[k]
  ]
  kept = sorted(set(before) - set(now))
  line = f"model config: the run's {file} ({model})"
  line += (
    f"; --config's model group differs in {', '.join(changed)}: the run's is used"
    if changed
    else "; --config's model group is the same"
  )
  if kept:
    line += f"; not recorded by the run, kept from --config: {', '.join(kept)}"
  return out, line


def load_model(cfg, checkpoint: str):
  """The policy of `checkpoint` (orbax run checkpoint or Hugging Face folder) as a Qwen model.

  A run's checkpoint is restored into the shape of `cfg.model`: pass the config of
  `model_config_for_checkpoint(cfg, checkpoint)`, which holds the run's own model group.

  Raises:
    FileNotFoundError: the path does not exist or holds neither kind of checkpoint; the
      Hugging Face folder of `cfg.model.checkpoint` has no config.json.
    CheckpointFormatError: a Hugging Face folder that is not a readable Qwen checkpoint.
    CheckpointMismatchError: the orbax checkpoint's parameters have other shapes or paths than
      `cfg.model`'s (nothing is restored; the error names the differing arrays).
    CorruptFileError: the newest step's files cannot be read (a damaged checkpoint).
  """
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import orbax.checkpoint as ocp  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from coevolve_jax import models  # noqa: PLC0415
  from coevolve_jax.models.hf import read_config  # noqa: PLC0415

  path = os.path.abspath(checkpoint)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"--checkpoint={checkpoint}: no such folder")
  if _is_hf_folder(path):
    model_cfg = {"preset": cfg.model.preset, "dtype": cfg.model.dtype, "checkpoint": path}
    return models.build(model_cfg, seed=0)
  ckpt_dir = _checkpoint_dir(path)
  mgr = ocp.CheckpointManager(ckpt_dir, item_names=("params",))
  try:
    step = mgr.latest_step()
    if step is None:
      raise FileNotFoundError(
        f"{path}: neither a Hugging Face folder (config.json) nor an orbax checkpoint folder"
      )
    shape = (
      read_config(cfg.model.checkpoint)
      if cfg.model.checkpoint
      else models.QwenConfig.preset(cfg.model.preset)
    )
    dtype = jnp.dtype(cfg.model.dtype)
    abstract = nnx.eval_shape(lambda: models.Qwen(shape, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, params = nnx.split(abstract)  # the structure to restore into; no values drawn
    _check_shapes(os.path.join(ckpt_dir, str(step)), step, ckpt_dir, params)
    like = jax.tree.map(ocp.utils.to_shape_dtype_struct, params)
    try:
      restored = mgr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(like)))
    except Exception as e:  # noqa: BLE001  (orbax and TensorStore raise many types when damaged)
      from coevolve_jax.errors import CorruptFileError, describe  # noqa: PLC0415

      raise CorruptFileError(
        f"checkpoint step {step} in {ckpt_dir} cannot be read ({describe(e)}); resuming that "
        "run moves it aside to <step>.damaged-<n> and goes on from the step before, which this "
        "command then evaluates"
      ) from None
  finally:
    mgr.close()
  print(f"loaded step {step} from {ckpt_dir}", file=sys.stderr)
  return nnx.merge(graphdef, restored.params)


def _check_shapes(step_folder: str, step: int, ckpt_dir: str, params) -> None:
  """Raises CheckpointMismatchError when the stored `params` item's array paths or shapes differ
  from `params`' (orbax would fail mid-restore); returns when they agree or the metadata is
  unreadable (the restore then reports the damage). The run's own resume check does the same
  (`RunCheckpointer._check_matches`)."""
  from coevolve_jax.checkpoint import CheckpointMismatchError, shape_differences  # noqa: PLC0415

  lines = shape_differences(step_folder, {"params": params})
  if lines:
    raise CheckpointMismatchError(step, ckpt_dir, lines[:3], len(lines), None)
