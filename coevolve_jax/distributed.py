"""Multi-process (multi-host) JAX set-up from the environment.

`initialize_from_env()` is called by the entry point before any JAX computation. It decides from
the environment whether this process is one of several and, if so, calls
`jax.distributed.initialize` (JAX's multi-controller runtime: every process runs the same program
over the global device mesh). Sources, first match wins:

1. `COEVOLVE_DISTRIBUTED=0`: never initialise (a single-process run on a multi-host machine).
2. Explicit: `JAX_COORDINATOR_ADDRESS` (host:port of process 0), `JAX_NUM_PROCESSES`,
   `JAX_PROCESS_ID`. Use this on GPU clusters without a scheduler JAX knows.
3. Vertex AI custom jobs with more than one replica: `CLUSTER_SPEC` (JSON set by Vertex AI on
   every replica: `cluster.workerpool0..3` host:port lists and `task.type` / `task.index`). The
   coordinator is the first replica of the first pool; process ids follow pool order.
4. `COEVOLVE_DISTRIBUTED=auto` (set by `tpu/launch.py` on every worker of a TPU VM slice), or a
   Slurm job with more than one task: JAX's own cluster detection (Cloud TPU metadata, Slurm,
   Open MPI) with `jax.distributed.initialize()` and no arguments.

Anything else is a single-process run and nothing is initialised. Placing parameters and batches
on the global mesh is the trainer's job (`PolicyTrainer(..., mesh=...)`): host values that are
identical on every process go onto the mesh with `jax.device_put`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
  """How to initialise this process. None fields are left to JAX's cluster detection."""

  source: str  # "env", "vertex" or "auto"
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None


def _int(env: Mapping[str, str], name: str) -> int:
  try:
    return int(env[name])
  except (KeyError, ValueError):
    raise ValueError(
      f"{name} must be set to an integer with JAX_COORDINATOR_ADDRESS, got {env.get(name)!r}"
    ) from None


def _from_vertex(text: str) -> ProcessSpec | None:
  try:
    spec = json.loads(text)
    cluster, task = spec["cluster"], spec["task"]
    pools = [cluster[k] for k in sorted(cluster) if k.startswith("workerpool")]
    offsets = {
      k: sum(len(cluster[j]) for j in sorted(cluster) if j.startswith("workerpool") and j < k)
      for k in cluster
    }
    total = sum(len(p) for p in pools)
    process_id = offsets[task["type"]] + int(task["index"])
    coordinator = pools[0][0]
  except (ValueError, KeyError, IndexError, TypeError) as e:
    raise ValueError(
      f"CLUSTER_SPEC is not a Vertex AI cluster spec ({e!r}): {text[:200]}"
    ) from None
  if total <= 1:
    return None
  return ProcessSpec("vertex", coordinator, total, process_id)


def detect(env: Mapping[str, str] | None = None) -> ProcessSpec | None:
  """The multi-process set-up the environment describes, or None for a single process.

  Raises:
    ValueError: an explicit coordinator without integer JAX_NUM_PROCESSES / JAX_PROCESS_ID, a
      process id outside [0, num_processes), or a malformed CLUSTER_SPEC.
  """
  env = os.environ if env is None else env
  mode = env.get("COEVOLVE_DISTRIBUTED", "").strip().lower()
  if mode in ("0", "off", "false"):
    return None
  if env.get("JAX_COORDINATOR_ADDRESS"):
    n, i = _int(env, "JAX_NUM_PROCESSES"), _int(env, "JAX_PROCESS_ID")
    if not 0 <= i < n:
      raise ValueError(f"JAX_PROCESS_ID={i} is outside [0, JAX_NUM_PROCESSES={n})")
    return ProcessSpec("env", env["JAX_COORDINATOR_ADDRESS"], n, i)
  if env.get("CLUSTER_SPEC"):
    spec = _from_vertex(env["CLUSTER_SPEC"])
    if spec is not None:
      return spec
  if mode == "auto" or int(env.get("SLURM_NTASKS", "1") or 1) > 1:
    return ProcessSpec("auto")
  return None


def initialize_from_env(env: Mapping[str, str] | None = None) -> ProcessSpec | None:
  """Calls `jax.distributed.initialize` when the environment describes several processes.

  Must run before any JAX computation. Idempotent: returns None without acting when JAX's
  distributed runtime is already up. On CPU, cross-process collectives use gloo (JAX's default
  CPU collectives implementation).

  Returns:
    The `ProcessSpec` used, or None for a single-process run.
  Raises:
    ValueError: see `detect`.
  """
  spec = detect(env)
  if spec is None or jax.distributed.is_initialized():
    return None
  jax.distributed.initialize(
    coordinator_address=spec.coordinator_address,
    num_processes=spec.num_processes,
    process_id=spec.process_id,
  )
  return spec


def is_primary() -> bool:
  """Whether this process writes the run's files and calls external services.

  One logical controller (README "Several processes"): every process runs the same
  deterministic controller over the same inputs and issues the same device calls in the same
  order; only the first process (`jax.process_index() == 0`) writes logs, the task pool, round
  journals and the summary, so each is written once however many processes run. True in a
  single-process run.
  """
  return jax.process_index() == 0


def broadcast_json(value: Any) -> Any:
  """`value` (JSON-serialisable) as the primary process has it, on every process.

  A collective: every process must call it at the same point (the others' `value` is ignored).
  Returns `value` unchanged in a single-process run.
  """
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils  # noqa: PLC0415

  data = json.dumps(value).encode("utf-8") if is_primary() else b""
  size = int(multihost_utils.broadcast_one_to_all(np.int64(len(data))))
  buf = np.frombuffer(data, np.uint8) if is_primary() else np.zeros((size,), np.uint8)
  buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
  return json.loads(bytes(buf).decode("utf-8"))


def on_primary(fn: Callable[[], Any]) -> Any:
  """`fn()` run by the primary process only, its JSON-serialisable result given to every
  process (`broadcast_json`): how host-side work with effects outside the job (LLM calls,
  environment writes) happens once however many processes run. A collective."""
  return broadcast_json(fn() if is_primary() else None)


def fetch(x: Any) -> np.ndarray:
  """`x` as a numpy array on this process, whole: directly when this process holds all of it,
  else gathered from every process (`process_allgather`; a collective: every process must call
  it at the same point). Non-JAX values pass through `np.asarray`."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  from jax.experimental import multihost_utils  # noqa: PLC0415

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
