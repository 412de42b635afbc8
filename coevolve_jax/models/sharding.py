"""Logical axis names, the one table that maps them to mesh axes, and mesh construction.

Modules name every parameter and activation dimension with a logical axis (below); only this file
knows the mesh. Mesh axes: data, fsdp, tensor, expert.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
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
  "layers": None,  # the stacked decoder layers' leading axis: scanned over, never sharded
  # activations. Rows split over `expert` too: a MoE block's expert group then holds distinct
  # rows (attention, the dense layers and the KV cache are not repeated over it), and the block
  # moves token copies to their experts' devices (`qwen.SparseMoE`). On a dense model's mesh the
  # expert axis has size 1 and splits nothing.
  "batch": ("data", "fsdp", "expert"),
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
  out: list[str | tuple[str, ...] | None] = []
  for name in axes:
    if name is None:
      out.append(None)
      continue
    if name not in rules:
      raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
    out.append(rules[name])
  return PartitionSpec(*out)


def axis_devices(mesh_shape: Mapping[str, int], logical: str | None) -> int:
  """How many devices the logical axis `logical` is split over on a mesh of `mesh_shape` sizes
  (the product of its rule's mesh axes; 1 for None). `axis_devices(mesh.shape, "batch")` is the
  number of row shards: batches, decode slots and gradient-accumulation slices are multiples of it.

  Raises:
    KeyError: an unknown logical axis.
  """
  if logical is None:
    return 1
  if logical not in LOGICAL_RULES:
    raise KeyError(f"logical axis {logical!r} has no sharding rule; known: {sorted(LOGICAL_RULES)}")
  return math.prod(int(mesh_shape.get(n, 1)) for n in spec_axes(LOGICAL_RULES[logical]))


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
  return Mesh(device_grid(sizes, devices), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)


def expert_axis_warning(num_experts: int, mesh_shape: Mapping[str, int]) -> str | None:
  """What to tell the user when a MoE model (`num_experts` > 0) runs on a mesh of several
  devices without an expert axis, or None. Without one, `SparseMoE` leaves its experts to the
  SPMD partitioner's default path instead of its expert-parallel one (the experts split over
  `mesh.expert`, each token copy computed by its expert's device; issue 39 measured the default
  path at about 10x the per-row memory). The suggested size divides both the expert count and
  the devices (the largest such power of two up to 8, as in docs/running.md's 8-GPU example)."""
  devices = math.prod(int(s) for s in mesh_shape.values())
  if num_experts <= 0 or devices <= 1 or int(mesh_shape.get("expert", 1)) > 1:
    return None
  size = 1
  while size < 8 and num_experts % (size * 2) == 0 and devices % (size * 2) == 0:
    size *= 2
  head = (
    f"a MoE model ({num_experts} experts) on {devices} devices without an expert axis (mesh "
    f"{dict(mesh_shape)}): its experts take the partitioner's default path, not the "
    "expert-parallel one"
  )
  if size == 1:
    return head
  return (
    f"{head}; split them over the devices with --config.mesh.expert={size} "
    f"--config.mesh.fsdp={devices // size} (docs/running.md, 'Which mesh')"
  )


def device_grid(sizes: Sequence[int], devices: Sequence) -> np.ndarray:
  """`devices` arranged as an array of `sizes` (MESH_AXES order), by `jax.experimental.mesh_utils`.

  One slice: `create_device_mesh`, which on TPU orders the chips so that neighbouring mesh
  coordinates are neighbours on the ICI torus (elsewhere it keeps the device order). Several
  slices (TPU multislice: the devices carry distinct `slice_index` values):
  `create_hybrid_device_mesh` with the slices laid over the first of data, fsdp whose size
  divides by their count, so only that axis's collectives (data: the once-per-step gradient
  reduction) cross the slower data-centre network, as MaxText's dcn_data_parallelism does.

  Raises:
    ValueError: several slices and neither data nor fsdp divides by their count.
  """
  slices = len({getattr(d, "slice_index", 0) for d in devices})
  if slices <= 1:
    return mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
  for axis in ("data", "fsdp"):
    i = MESH_AXES.index(axis)
    if sizes[i] % slices == 0:
      ici, dcn = list(sizes), [1] * len(sizes)
      ici[i], dcn[i] = sizes[i] // slices, slices
      return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
  raise ValueError(
    f"the devices span {slices} slices: mesh.data or mesh.fsdp "
    f"({dict(zip(MESH_AXES, sizes))}) must divide by {slices}, so that one axis crosses the "
    "slices and the others stay inside each"
  )


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


def param_spec(
  mesh_shape: Mapping[str, int],
  axes: Sequence[str | None],
  shape: Sequence[int],
  rules: Mapping[str, str | tuple[str, ...] | None] = LOGICAL_RULES,
) -> PartitionSpec:
  """The PartitionSpec of an array of `shape` with logical `axes` on a mesh of `mesh_shape` sizes
  (`Mesh.shape`, or the `AbstractMesh` of `active_mesh()` inside a trace).

  A mesh axis that does not divide its dimension is dropped for that dimension, which then stays
  replicated over it: e.g. Qwen2.5-7B's 4 KV heads on a tensor axis of 8 devices. Mesh axes of
  size 1, or not in the mesh, are left out of the spec. Parameters, the KV cache, the
  expert-parallel shard_map specs (`SparseMoE`) and the memory planner
  (`cli.plan_device_memory`) all use this one rule, so the planner's figures are the job's.

  Raises:
    ValueError: `axes` and `shape` of different lengths. KeyError: an unknown logical axis.
  """
  if len(axes) != len(shape):
    raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
  spec = []
  for entry, dim in zip(logical_to_spec(axes, rules), shape):
    kept, size = [], 1
    for name in spec_axes(entry):
      n = mesh_shape.get(name, 1)
      if n > 1 and dim % (size * n) == 0:  # size-1 axes split nothing: leave them out
        kept.append(name)
        size *= n
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*spec)


def spec_axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry, as a tuple (() for a replicated dimension)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def shard_shape(mesh_shape: Mapping[str, int], spec: PartitionSpec, shape: Sequence[int]):
  """The per-device shape of an array of `shape` under `spec` (dimensions divide exactly, as
  `param_spec` keeps only dividing axes)."""
  out = list(shape)
  for i, entry in enumerate(spec):
    out[i] //= math.prod(mesh_shape.get(n, 1) for n in spec_axes(entry))
  return tuple(out)


def param_sharding(
  mesh: Mesh,
  axes: Sequence[str | None],
  shape: Sequence[int],
  rules: Mapping[str, str | tuple[str, ...] | None] = LOGICAL_RULES,
) -> NamedSharding:
  """The sharding of a parameter of `shape` with logical `axes` on `mesh` (`param_spec`).

  Raises:
    ValueError: `axes` and `shape` of different lengths. KeyError: an unknown logical axis.
  """
  return NamedSharding(mesh, param_spec(mesh.shape, axes, shape, rules))


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def tree_shardings(
  tree, mesh: Mesh, rules: Mapping[str, str | tuple[str, ...] | None] = LOGICAL_RULES
):
  """NamedShardings for a tree of nnx Params (parameters or an optax state that mirrors them).

  A Param is sharded by its `out_sharding` logical axes through `rules` (default
  `LOGICAL_RULES`); every other leaf (step counts, ...) is replicated. Returns a
  tree of the same structure.
  """
  leaves = jax.tree.leaves(tree, is_leaf=_is_variable)
  out = []
  for leaf in leaves:
    if _is_variable(leaf):
      axes = leaf.get_metadata().get("out_sharding")
      value = leaf.get_value()
      out.append(
        NamedSharding(mesh, PartitionSpec())
        if axes is None
        else param_sharding(mesh, axes, value.shape, rules)
      )
    else:
      out.append(NamedSharding(mesh, PartitionSpec()))
  return jax.tree.unflatten(jax.tree.structure(tree), out)
