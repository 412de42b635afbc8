"""Logical axis names, the one table that maps them to mesh axes, and mesh construction.

Modules name every parameter and activation dimension with a logical axis (below); only this file
knows the mesh. Mesh axes: data, fsdp, tensor, expert.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# Logical axis -> mesh axis (or tuple of mesh axes, or None for replicated).
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
  # parameters
  "vocab": "tensor",
  "embed": "fsdp",
  "q_heads": "tensor",
  "kv_heads": "tensor",
  "head_dim": None,
  "mlp": "tensor",
  "experts": "expert",
  "expert_mlp": "tensor",
  "router": None,  # the router's expert dimension: every device scores every expert
  "norm": None,
  "layers": None,  # the stacked decoder layers' leading axis (and the KV cache's): scanned over
  # activations
  "batch": ("data", "fsdp"),
  "length": None,
  "act_embed": None,
  "act_heads": "tensor",
  "act_kv_heads": "tensor",
  "act_vocab": "tensor",
  "cache_length": None,
}


def logical_to_spec(
  axes: Sequence[str | None],
  rules: Mapping[str, str | tuple[str, ...] | None] = LOGICAL_RULES,
) -> PartitionSpec:
  """Maps logical axis names to a PartitionSpec.

  Raises:
    KeyError: an axis name that the rules table does not know (a typo must not silently replicate).
  """
  out = []
  for name in axes:
    if name is None:
      out.append(None)
      continue
    if name not in rules:
      raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
    out.append(rules[name])
  return PartitionSpec(*out)


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds a mesh with axes (data, fsdp, tensor, expert); one size may be -1 for "the rest".

  Raises:
    ValueError: sizes that do not multiply to the device count, or more than one -1.
  """
  devices = list(devices if devices is not None else jax.devices())
  sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f"{len(devices)} devices do not divide by {known}")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(
      f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, have {len(devices)}"
    )
  arr = np.asarray(devices).reshape(sizes)
  return Mesh(arr, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def active_mesh():
  """The mesh set for tracing (`jax.set_mesh`), or None when none is active."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or mesh.empty else mesh


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """`with_sharding_constraint` by logical axes; a no-op when no mesh is active."""
  mesh = active_mesh()
  if mesh is None:
    return x
  spec = logical_to_spec(axes)
  spec = PartitionSpec(*(_drop_missing(s, mesh.axis_names) for s in spec))
  return jax.lax.with_sharding_constraint(x, spec)


def _drop_missing(entry, names):
  if entry is None:
    return None
  if isinstance(entry, tuple):
    kept = tuple(e for e in entry if e in names)
    return kept or None
  return entry if entry in names else None


def named_sharding(mesh: Mesh, axes: Sequence[str | None]) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(axes))


def param_sharding(
  mesh: Mesh,
  axes: Sequence[str | None],
  shape: Sequence[int],
  rules: Mapping[str, str | tuple[str, ...] | None] = LOGICAL_RULES,
) -> NamedSharding:
  """The sharding of a parameter of `shape` with logical `axes` on `mesh`.

  A mesh axis that does not divide its dimension is dropped for that dimension, which then stays
  replicated over it: e.g. Qwen2.5-7B's 4 KV heads on a tensor axis of 8 devices. Mesh axes of
  size 1 are left out of the spec.

  Raises:
    ValueError: `axes` and `shape` of different lengths. KeyError: an unknown logical axis.
  """
  if len(axes) != len(shape):
    raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
  spec = []
  for entry, dim in zip(logical_to_spec(axes, rules), shape):
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    kept, size = [], 1
    for name in names:
      n = mesh.shape.get(name, 1)
      if n > 1 and dim % (size * n) == 0:  # size-1 axes split nothing: leave them out
        kept.append(name)
        size *= n
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return NamedSharding(mesh, PartitionSpec(*spec))
