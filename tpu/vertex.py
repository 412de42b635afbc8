"""Vertex AI custom-job launcher for TPU slices and GPU machines (google-cloud-aiplatform).

    python tpu/vertex.py --chip=v5e --topology=4x4 --image=IMAGE_URI --project=P --region=R \
        --staging-bucket=gs://BUCKET --dry-run -- --config=configs/bfcl.py --workdir=/gcs/BUCKET/run
    python tpu/vertex.py --chip=h100 --hosts=2 --image=IMAGE_URI ... -- --config=...

The job specification is built with the client library's own types
(`google.cloud.aiplatform_v1.types.CustomJob`); `--dry-run` prints it as JSON (the REST form) and
submits nothing. Without `--dry-run` it is submitted with `google.cloud.aiplatform.CustomJob`.

- TPU (`--chip=v4|v5e|v5p|v6e`): one worker pool with the chip's Vertex machine type and the
  slice shape in `tpu_topology`; every host gets `COEVOLVE_DISTRIBUTED=auto`, so JAX finds the
  other hosts of the slice from the TPU metadata.
- GPU (`--chip=h100|h200|a100`): pool 0 is the primary replica, pool 1 the other `--hosts - 1`
  machines; Vertex AI sets `CLUSTER_SPEC` on each and `coevolve_jax.distributed` reads it.
Machine types come from `coevolve_jax/accelerators.py` (the `vertex` entry of each chip), imported
from the installed package (`pip install -e '.[cloud]'`). The container is the image built from
`tpu/Dockerfile`; its entry point is `python -m coevolve_jax.main`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from google.cloud.aiplatform_v1 import types

from coevolve_jax import accelerators as prices
from coevolve_jax import launching as workers

HEARTBEAT_ENV = "COEVOLVE_HEARTBEAT_TIMEOUT_S"  # read by coevolve_jax.distributed
APPWORLD_IMAGE_NOTE = (
  "AppWorld job: the image must hold AppWorld's environment (docker build -f tpu/Dockerfile "
  "--build-arg APPWORLD=1); the primary replica runs its servers and episodes"
)
CHIP_OF_MACHINE = {facts["vertex"]["machine_type"]: name for name, facts in prices.CHIPS.items()}


def _accelerator(name: str) -> types.AcceleratorType:
  try:
    return types.AcceleratorType[name]
  except KeyError:
    known = [a.name for a in types.AcceleratorType if a.name.startswith("NVIDIA")]
    raise ValueError(
      f"accelerator type {name!r} is not known to this google-cloud-aiplatform "
      f"version (upgrade it); known: {known}"
    ) from None


def build_job(
  *,
  chip: str,
  image_uri: str,
  job_args: list[str],
  display_name: str = "coevolve",
  topology: str = "",
  hosts: int = 1,
  output_uri: str = "",
  heartbeat_timeout_s: int = 0,
  appworld_data: str = "",
) -> types.CustomJob:
  """The Vertex AI CustomJob for `chip` running `python -m coevolve_jax.main JOB_ARGS`.

  Args:
    chip: a chip name of coevolve_jax/accelerators.py (TPU: v4, v5e, v5p, v6e; GPU: h100, h200,
      a100).
    image_uri: the container image built from tpu/Dockerfile.
    job_args: arguments of coevolve_jax.main (--config=..., --workdir=...).
    topology: TPU slice shape, e.g. "2x2" (4 chips) or "4x4"; TPU only.
    hosts: GPU machines (each with the machine type's GPUs); GPU only.
    output_uri: optional gs:// prefix for Vertex AI's base output directory.
    heartbeat_timeout_s: COEVOLVE_HEARTBEAT_TIMEOUT_S on every replica (0: JAX's default).
    appworld_data: AppWorld's official data root as the replicas see it (a `/gcs/BUCKET/...`
      mount of a bucket holding `appworld download data`'s output), set as APPWORLD_ROOT; the
      primary replica, which runs AppWorld, reads it. An AppWorld job needs an image built with
      `--build-arg APPWORLD=1`.
  Raises:
    ValueError: unknown chip, a missing or malformed topology for a TPU, a topology for a GPU,
      hosts < 1, an accelerator type this library version does not know, a `gs://` workdir
      (use the /gcs/BUCKET mount), a bad `appworld_data` (`launching.check_appworld_data`),
      or a negative heartbeat timeout.
  """
  chips = prices.CHIPS
  if chip not in chips:
    raise ValueError(f"unknown chip {chip!r}; known: {sorted(chips)}")
  if not image_uri:
    raise ValueError("an image URI is required (build tpu/Dockerfile and push it)")
  if error := workers.check_workdir(job_args) or workers.check_appworld_data(appworld_data):
    raise ValueError(error)
  if heartbeat_timeout_s < 0:
    raise ValueError(f"the heartbeat timeout must be >= 0 seconds, got {heartbeat_timeout_s}")
  facts = chips[chip]
  vertex = facts["vertex"]
  command = ["python", "-m", "coevolve_jax.main"]
  beat = [types.EnvVar(name=HEARTBEAT_ENV, value=str(heartbeat_timeout_s))]
  beat = beat if heartbeat_timeout_s else []
  if appworld_data:
    beat.append(types.EnvVar(name=workers.APPWORLD_ENV_VAR, value=appworld_data))
  if facts["kind"] == "tpu":
    try:
      dims = [int(d) for d in topology.split("x")]
    except ValueError:
      dims = []
    if not dims or min(dims) < 1:
      raise ValueError(f"--topology must look like 2x2 or 4x4 for a TPU, got {topology!r}")
    if hosts != 1:
      raise ValueError("--hosts is for GPUs; a TPU slice's hosts follow from --topology")
    env = [types.EnvVar(name="COEVOLVE_DISTRIBUTED", value="auto"), *beat]
    machine = types.MachineSpec(machine_type=vertex["machine_type"], tpu_topology=topology)
    pools = [
      types.WorkerPoolSpec(
        machine_spec=machine,
        replica_count=1,
        container_spec=types.ContainerSpec(
          image_uri=image_uri, command=command, args=job_args, env=env
        ),
      )
    ]
    slice_chips = math.prod(dims)
    display_name += f"-{chip}-{slice_chips}chips"
  else:
    if topology:
      raise ValueError("--topology is for TPUs; use --hosts for GPU machines")
    if hosts < 1:
      raise ValueError(f"--hosts must be >= 1, got {hosts}")
    machine = types.MachineSpec(
      machine_type=vertex["machine_type"],
      accelerator_type=_accelerator(vertex["accelerator_type"]),
      accelerator_count=vertex["chips_per_host"],
    )
    container = types.ContainerSpec(image_uri=image_uri, command=command, args=job_args, env=beat)
    pools = [types.WorkerPoolSpec(machine_spec=machine, replica_count=1, container_spec=container)]
    if hosts > 1:
      pools.append(
        types.WorkerPoolSpec(
          machine_spec=machine, replica_count=hosts - 1, container_spec=container
        )
      )
    display_name += f"-{chip}-{hosts * vertex['chips_per_host']}gpus"
  spec = types.CustomJobSpec(worker_pool_specs=pools)
  if output_uri:
    spec.base_output_directory = types.GcsDestination(output_uri_prefix=output_uri)
  return types.CustomJob(display_name=display_name, job_spec=spec)


def replica_lines(job: types.CustomJob) -> list[str]:
  """`--dry-run`'s account of each replica: the environment it gets (the job's variables, and
  for GPU pools the `CLUSTER_SPEC` Vertex AI sets, read by `coevolve_jax.distributed` exactly as
  the job will), its JAX process and its duties."""
  from coevolve_jax import distributed  # noqa: PLC0415 (imports JAX: only for --dry-run)

  pools = list(job.job_spec.worker_pool_specs)
  envs, processes = [], []
  if pools[0].machine_spec.tpu_topology:  # one TPU pool: JAX numbers the slice's hosts itself
    dims = [int(d) for d in pools[0].machine_spec.tpu_topology.split("x")]
    per_host = prices.CHIPS[CHIP_OF_MACHINE[pools[0].machine_spec.machine_type]]["vertex"]
    hosts = max(1, math.ceil(math.prod(dims) / per_host["chips_per_host"]))
    env = {e.name: e.value for e in pools[0].container_spec.env}
    for i in range(hosts):
      envs.append(env)
      processes.append(f"JAX process {i} of {hosts} (TPU metadata)")
    return workers.worker_lines(envs, processes)
  cluster = {
    f"workerpool{p}": [f"workerpool{p}-{r}:2222" for r in range(pool.replica_count)]
    for p, pool in enumerate(pools)
  }
  for p, pool in enumerate(pools):
    for r in range(pool.replica_count):
      spec = json.dumps({"cluster": cluster, "task": {"type": f"workerpool{p}", "index": r}})
      env = {e.name: e.value for e in pool.container_spec.env}
      found = distributed.detect({**env, "CLUSTER_SPEC": spec})
      envs.append({**env, "CLUSTER_SPEC": f"<task workerpool{p}[{r}]>"})
      if found is None:
        processes.append("a single process (no jax.distributed)")
      else:
        processes.append(
          f"JAX process {found.process_id} of {found.num_processes}, coordinator "
          f"{found.coordinator_address}"
        )
  return workers.worker_lines(envs, processes)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--chip", required=True, help="v4, v5e, v5p, v6e, h100, h200 or a100.")
  p.add_argument("--topology", default="", help="TPU slice shape, e.g. 2x2 or 4x4.")
  p.add_argument("--hosts", type=int, default=1, help="GPU machines.")
  p.add_argument("--image", required=True, help="Container image URI (tpu/Dockerfile).")
  p.add_argument("--display-name", default="coevolve")
  p.add_argument("--output-uri", default="", help="gs:// base output directory.")
  p.add_argument("--project", default="", help="Project (default: from the environment).")
  p.add_argument("--region", default="", help="Vertex AI region.")
  p.add_argument("--staging-bucket", default="", help="gs:// staging bucket.")
  p.add_argument(
    "--heartbeat-timeout-s",
    type=int,
    default=0,
    help="COEVOLVE_HEARTBEAT_TIMEOUT_S on every replica: seconds before the others stop when "
    "one dies (default: JAX's 100).",
  )
  p.add_argument(
    "--appworld-data",
    default="",
    help="AppWorld's official data root as the replicas see it (e.g. /gcs/BUCKET/appworld), "
    "set as APPWORLD_ROOT. AppWorld jobs need an image built with --build-arg APPWORLD=1.",
  )
  p.add_argument(
    "--dry-run",
    action="store_true",
    help="Print the job as JSON, and each replica's environment and role on stderr; submit "
    "nothing.",
  )
  p.add_argument("job_args", nargs="*", help="Arguments of coevolve_jax.main after `--`.")
  return p


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(sys.argv[1:] if argv is None else argv)
  if not any(a.startswith("--config") for a in args.job_args):
    print(
      "error: give the job's arguments after `--`, at least --config and --workdir", file=sys.stderr
    )
    return 2
  try:
    job = build_job(
      chip=args.chip,
      image_uri=args.image,
      job_args=args.job_args,
      display_name=args.display_name,
      topology=args.topology,
      hosts=args.hosts,
      output_uri=args.output_uri,
      heartbeat_timeout_s=args.heartbeat_timeout_s,
      appworld_data=args.appworld_data,
    )
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.dry_run:
    print(
      types.CustomJob.to_json(
        job, use_integers_for_enums=False, always_print_fields_with_no_presence=False
      )
    )
    for line in replica_lines(job):  # stderr: stdout stays the job's JSON
      print(line, file=sys.stderr)
    if workers.needs_appworld(args.job_args):
      print(APPWORLD_IMAGE_NOTE, file=sys.stderr)
    return 0
  from google.auth import exceptions as auth_exceptions  # noqa: PLC0415
  from google.cloud import aiplatform  # noqa: PLC0415 (slow import; not needed for --dry-run)

  try:
    remote = aiplatform.CustomJob(
      display_name=job.display_name,
      worker_pool_specs=list(job.job_spec.worker_pool_specs),
      base_output_dir=args.output_uri or None,
      project=args.project or None,
      location=args.region or None,
      staging_bucket=args.staging_bucket or None,
    )
    remote.submit()
  except auth_exceptions.DefaultCredentialsError as e:
    print(
      f"error: no Google Cloud credentials ({e}); run `gcloud auth application-default "
      "login`, or use --dry-run",
      file=sys.stderr,
    )
    return 2
  print(remote.resource_name)
  return 0


if __name__ == "__main__":
  sys.exit(main())
