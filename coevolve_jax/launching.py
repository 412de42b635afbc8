"""What each worker of a multi-host launch gets and does: shared by the TPU VM and Vertex AI
launchers' `--dry-run` (tpu/launch.py, tpu/vertex.py). No JAX import: the launchers run on a
workstation.

One logical controller (docs/running.md, "Several processes"): every process runs the same job
over the global mesh; process 0, the primary, is the only one with effects outside the job.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

PRIMARY_DUTIES = (
  "primary: writes metrics.jsonl, pool.jsonl, feedback.jsonl, TensorBoard and summary.json, "
  "calls the explorer and judge LLMs, runs AppWorld's servers and episodes (AppWorld jobs), "
  "and writes its checkpoint shards"
)
# Where the TPU VM launcher and the container image put AppWorld's own environment
# (`make appworld-setup`; envs/appworld/server.py DEFAULT_VENV of a checkout).
APPWORLD_ENV_VAR = "APPWORLD_ROOT"  # the official data's root (configs/appworld.py reads it)
OTHER_DUTIES = "writes its checkpoint shards; logs and LLM calls are process 0's"


def tpu_vm_hosts(accelerator_type: str) -> int | None:
  """Hosts (TPU VM workers) of a gcloud `--accelerator-type`, or None when it is not one of the
  forms below. v4-N and v5p-N count TensorCores (2 per chip, 4 chips per host); v5litepod-N and
  v6e-N count chips (up to 8 on one host, else 4 per host)."""
  m = re.fullmatch(r"(v4|v5p|v5litepod|v6e)-(\d+)", accelerator_type.strip())
  if not m:
    return None
  family, n = m.group(1), int(m.group(2))
  if family in ("v4", "v5p"):
    return max(1, n // 8)
  return 1 if n <= 8 else n // 4


def flag_values(job_args: Sequence[str], name: str) -> list[str]:
  """The values the job's arguments give flag `name` (e.g. "--workdir"), in order, in both of
  absl's spellings: `--name=value` and `--name value`."""
  values = []
  for i, arg in enumerate(job_args):
    if arg.startswith(name + "="):
      values.append(arg[len(name) + 1 :])
    elif arg == name and i + 1 < len(job_args):
      values.append(job_args[i + 1])
  return values


def check_workdir(job_args: Sequence[str]) -> str | None:
  """An error message when the job's `--workdir` is a `gs://` URL, else None: the job writes its
  logs with local file operations, so a bucket is used through a Cloud Storage FUSE mount
  (`/gcs/BUCKET/...` on Vertex AI; `gcsfuse` on TPU VMs)."""
  for value in flag_values(job_args, "--workdir"):
    if value.startswith("gs://"):
      return (
        f"--workdir={value}: the job writes its workdir with local file operations; mount the "
        "bucket with Cloud Storage FUSE and pass the mount path (on Vertex AI: "
        "--workdir=/gcs/BUCKET/run; on TPU VMs: gcsfuse BUCKET /mnt/BUCKET on every worker)"
      )
  return None


def check_appworld_data(path: str) -> str | None:
  """An error message for a bad `--appworld-data` (the official data's folder on the primary
  host), else None. It must be an absolute path ("" = not given): the TPU VM launcher's set-up
  replaces the checkout, so a relative one would be deleted on every re-setup, and a `~` is
  never expanded; no `gs://` URL (AppWorld reads files; use a FUSE mount); no line break (it
  is printed into the dry run's shell comments) and no leading "-" (it is a command's argument)."""
  if not path:
    return None
  if "\n" in path or "\r" in path:
    return "--appworld-data must not contain a line break"
  if path.startswith("gs://"):
    return (
      f"--appworld-data={path}: AppWorld reads its data as files; mount the bucket with Cloud "
      "Storage FUSE and pass the mount path (on Vertex AI: /gcs/BUCKET/appworld)"
    )
  if not path.startswith("/"):
    return f"--appworld-data={path!r} must be an absolute path on the primary host"
  return None


def needs_appworld(job_args: Sequence[str]) -> bool:
  """Whether the job's arguments run AppWorld: the last `--config.env` says so, or without one
  the config file is configs/appworld.py (`--config=.../appworld.py[:variant]`, or the same as
  two arguments). Its environment (and, for the official data, the data) must then be on worker
  0, where AppWorld's servers run (the primary)."""
  env = flag_values(job_args, "--config.env")
  if env:
    return env[-1] == "appworld"
  return any(
    re.fullmatch(r"(\S*/)?appworld\.py(:\w+)?", c) for c in flag_values(job_args, "--config")
  )


def worker_lines(env_of: Sequence[Mapping[str, str]], process_of: Sequence[str]) -> list[str]:
  """One line per worker: the environment the launcher gives it, how it becomes a JAX process,
  and what it does. `env_of[i]` and `process_of[i]` describe worker i."""
  n = len(env_of)
  lines = []
  for i, (env, process) in enumerate(zip(env_of, process_of)):
    variables = " ".join(f"{k}={v}" for k, v in env.items()) or "(nothing set)"
    duties = PRIMARY_DUTIES if i == 0 else OTHER_DUTIES
    lines.append(f"worker {i} of {n}: {variables}; {process}; {duties}")
  if n > 1:
    lines.append(
      "every worker: --workdir must be storage all workers mount (a Cloud Storage FUSE mount or "
      "NFS): orbax writes every process's shards there and a restarted job reads the primary's "
      "logs; the job checks this at start-up"
    )
  return lines
