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

Anything else is a single-process run and nothing is initialised.

Failure: `COEVOLVE_HEARTBEAT_TIMEOUT_S` (default 100, JAX's own) bounds how long the others wait
for a process that died: JAX's coordination service then aborts every process with "heartbeat
timeout" (exit status 134) instead of leaving it in a collective forever; rerunning the same
command on every host resumes from the last checkpoint. An exception inside `on_primary` (an
explorer, judge or file error on the primary) reaches every process at once as
`PrimaryFailed`, with the primary's message. Placing parameters and batches
on the global mesh is the trainer's job (`PolicyTrainer(..., mesh=...)`): host values that are
identical on every process go onto the mesh with `jax.device_put`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from coevolve_jax.errors import RunError


DEFAULT_HEARTBEAT_TIMEOUT_S = 100  # jax.distributed.initialize's own default
HEARTBEAT_ENV = "COEVOLVE_HEARTBEAT_TIMEOUT_S"


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
  """How to initialise this process. None fields are left to JAX's cluster detection."""

  source: str  # "env", "vertex" or "auto"
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S


class PrimaryFailed(RuntimeError):
  """Raised on every process other than the primary when the primary's `on_primary` function
  raised: the job stops on all processes with the primary's error, not in a hung collective."""


def _int(env: Mapping[str, str], name: str, when: str = " with JAX_COORDINATOR_ADDRESS") -> int:
  try:
    return int(env[name])
  except (KeyError, ValueError):
    raise ValueError(f"{name} must be set to an integer{when}, got {env.get(name)!r}") from None


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
      process id outside [0, num_processes), a malformed CLUSTER_SPEC, or a
      COEVOLVE_HEARTBEAT_TIMEOUT_S that is not an integer >= 1.
  """
  env = os.environ if env is None else env
  spec = _detect(env)
  if spec is None or HEARTBEAT_ENV not in env:
    return spec
  beat = _int(env, HEARTBEAT_ENV, "")
  if beat < 1:
    raise ValueError(f"{HEARTBEAT_ENV} must be a number of seconds >= 1, got {beat}")
  return dataclasses.replace(spec, heartbeat_timeout_s=beat)


def _detect(env: Mapping[str, str]) -> ProcessSpec | None:
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
    heartbeat_timeout_seconds=spec.heartbeat_timeout_s,
  )
  return spec


def is_primary() -> bool:
  """Whether this process writes the run's files and calls external services.

  One logical controller (docs/running.md, "Several processes"): every process runs the same
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
  return _broadcast_text(json.dumps(value) if is_primary() else "")


def _broadcast_text(text: str) -> Any:
  """The primary's JSON `text`, decoded, on every process (a collective)."""
  from jax.experimental import multihost_utils  # noqa: PLC0415

  data = text.encode("utf-8") if is_primary() else b""
  size = int(multihost_utils.broadcast_one_to_all(np.int64(len(data))))
  buf = np.frombuffer(data, np.uint8) if is_primary() else np.zeros((size,), np.uint8)
  buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
  return json.loads(bytes(buf).decode("utf-8"))


def on_primary(fn: Callable[[], Any]) -> Any:
  """`fn()` run by the primary process only, its JSON-serialisable result given to every
  process (`broadcast_json`): how host-side work with effects outside the job (LLM calls,
  environment writes) happens once however many processes run. A collective.

  Raises:
    whatever `fn` raised (or the TypeError of a result that is not JSON), on the primary;
    `PrimaryFailed` with its message on the others (the failure is broadcast too, so no
    process waits for a result that will not come).
  """
  if jax.process_count() == 1:
    return fn()
  failure, text = None, ""
  if is_primary():
    try:
      text = json.dumps({"result": fn()})
    except BaseException as e:  # every process must leave the collective, then all stop
      failure, text = e, json.dumps({"error": f"{type(e).__name__}: {e}"})
  outcome = _broadcast_text(text)
  if failure is not None:
    raise failure
  if "error" in outcome:
    raise PrimaryFailed(f"process 0 failed: {outcome['error']}")
  return outcome["result"]


class ProcessesDiverged(RunError):
  """Processes that run the same deterministic controller computed different host-side results
  (an environment step, a reward): the job cannot go on, since each would train on its own."""


def check_agreement(digests: Sequence[bytes], names: Sequence[str], what: str) -> None:
  """Stops the job where the processes computed different results for the same items.

  Every process steps its own copy of the environments (one logical controller, `is_primary`),
  so the job is only right while they agree; a host whose environment answers differently (a
  clock, a file, a service) would otherwise train on other data or hang in a later collective.
  Each process gives one 8-byte digest per item; they are gathered from every process
  (`process_allgather`, as two uint32 per item) and compared with the primary's. A collective:
  every process calls it at the same point. Nothing to check with one process.

  Args:
    digests: per item, an 8-byte digest of this process's result (e.g. `Trajectory.digest`).
    names: per item, how the error names it (e.g. "episode 3 (task t, group 1)").
    what: the batch, for the message (e.g. "rollouts of step 4").
  Raises:
    ProcessesDiverged: on every process, naming the first item that differs, the processes
      that differ on it and how many items differ; or the item counts, where they differ.
    ValueError: a digest that is not 8 bytes long.
  """
  if jax.process_count() == 1:
    return
  if any(len(d) != 8 for d in digests):
    raise ValueError("check_agreement needs 8-byte digests")
  from jax.experimental import multihost_utils  # noqa: PLC0415

  counts = np.asarray(multihost_utils.process_allgather(np.int32(len(digests)))).reshape(-1)
  if len(set(counts.tolist())) > 1:
    raise ProcessesDiverged(
      f"{what}: the processes hold different numbers of results ({counts.tolist()} by process)"
    )
  if not len(digests):
    return
  mine = np.frombuffer(b"".join(digests), np.uint32)  # two per digest
  every = np.asarray(multihost_utils.process_allgather(mine.reshape(-1, 2)))  # [P, N, 2]
  every = every.reshape(len(counts), len(digests), 2)
  differ = (every != every[:1]).any(axis=2)  # [P, N]: differs from the primary's
  items = np.flatnonzero(differ.any(axis=0))
  if items.size:
    first = int(items[0])
    processes = np.flatnonzero(differ[:, first]).tolist()
    raise ProcessesDiverged(
      f"{what}: process(es) {processes} computed {names[first]} differently from process 0 "
      f"({items.size} of {len(digests)} items differ). Every process steps its own copy of the "
      "environments and must get the same results: check what an environment reads that "
      "differs between hosts (files, clocks, services, installed versions)"
    )


def check_shared_dir(path: str) -> None:
  """Checks that every process sees the same directory at `path` (the workdir): the primary
  writes a file with a fresh token there and every process reads it back. Orbax writes each
  process's shards of a checkpoint under one path and a restarted job reads the primary's logs,
  so with several processes the workdir must be storage all hosts share (a mounted bucket or
  NFS), not each host's own disk. A collective; nothing to check with one process.

  Raises:
    RuntimeError: on every process, naming the processes that did not see the primary's file.
  """
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils  # noqa: PLC0415

  marker = os.path.join(path, ".shared-workdir-check")
  token = broadcast_json(os.urandom(8).hex() if is_primary() else None)
  if is_primary():
    try:
      with open(marker, "w") as f:
        f.write(token)
    except OSError:  # unwritable: no process sees the file, which the check then reports
      pass
  multihost_utils.sync_global_devices("check_shared_dir: written")
  try:
    with open(marker) as f:
      seen = f.read() == token
  except OSError:
    seen = False
  flags = np.asarray(multihost_utils.process_allgather(np.int32(seen)))
  if is_primary():
    with contextlib.suppress(OSError):
      os.remove(marker)
  missing = [i for i, ok in enumerate(flags.reshape(-1)) if not ok]
  if missing:
    raise RuntimeError(
      f"--workdir={path} is not shared between the processes: process(es) {missing} do not see "
      "what process 0 wrote there. Checkpoints are written by every process and the logs by "
      "process 0, so the workdir must be storage every host mounts (a Cloud Storage bucket "
      "mounted with Cloud Storage FUSE, as Vertex AI does under /gcs/BUCKET, or NFS)"
    )


def fetch(x: Any) -> np.ndarray:
  """`x` as a numpy array on this process, whole: directly when this process holds all of it,
  else gathered from every process (`process_allgather`; a collective: every process must call
  it at the same point). Non-JAX values pass through `np.asarray`."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  from jax.experimental import multihost_utils  # noqa: PLC0415

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
