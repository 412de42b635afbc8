"""Cloud TPU VM and Vertex AI launchers: dry-run commands and job specifications (offline)."""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from google.cloud.aiplatform_v1 import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
  spec = importlib.util.spec_from_file_location(
    f"tpu_{name}", os.path.join(ROOT, "tpu", f"{name}.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


launch = _load("launch")
vertex = _load("vertex")
JOB = ["--config=configs/bfcl.py", "--workdir=/tmp/runs/a b", "--config.train.steps=3"]


def _run(script, *args, env=None):
  return subprocess.run(
    [sys.executable, os.path.join(ROOT, "tpu", script), *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    env=env,
  )


def test_tpu_up_dry_run_prints_every_step_in_order():
  out = _run(
    "launch.py",
    "up",
    "--name=cv",
    "--zone=us-east5-a",
    "--project=p1",
    "--accelerator-type=v5p-16",
    "--version=v2-alpha-tpuv5",
    "--spot",
    "--heartbeat-timeout-s=30",
    "--dry-run",
    "--",
    *JOB,
  )
  assert out.returncode == 0, out.stderr
  stdout = out.stdout.strip().splitlines()
  comments = [line for line in stdout if line.startswith("# ")]
  lines = [shlex.split(line) for line in stdout if not line.startswith("#")]
  tpu_vm = ["gcloud", "compute", "tpus", "tpu-vm"]
  assert [cmd[:5] if cmd[0] == "gcloud" else cmd[:2] for cmd in lines] == [
    tpu_vm + ["create"],
    ["git", "archive"],
    tpu_vm + ["scp"],
    tpu_vm + ["ssh"],
    tpu_vm + ["ssh"],
    tpu_vm + ["ssh"],
  ]
  create, _, scp, install, run, logs = lines
  assert {
    "cv",
    "--zone=us-east5-a",
    "--project=p1",
    "--accelerator-type=v5p-16",
    "--version=v2-alpha-tpuv5",
    "--spot",
  } <= set(create)
  assert "--worker=all" in scp and "--worker=all" in install and "--worker=all" in run
  assert "--worker=0" in logs
  assert "pip install -q -e '.[tpu]'" in install[-1]
  # The remote command, split as the worker's shell will, gives back the job's arguments intact.
  remote = shlex.split(run[-1].removeprefix("--command="))
  assert "COEVOLVE_DISTRIBUTED=auto" in remote and "COEVOLVE_HEARTBEAT_TIMEOUT_S=30" in remote
  start = remote.index("coevolve_jax.main") + 1
  assert remote[start : start + len(JOB)] == JOB
  # Issue 16 item 5: each worker's environment and role (v5p-16: 16 cores = 8 chips = 2 hosts).
  env = "COEVOLVE_DISTRIBUTED=auto COEVOLVE_HEARTBEAT_TIMEOUT_S=30"
  assert (
    comments[0].startswith(f"# worker 0 of 2: {env}; JAX process 0 of 2")
    and "primary" in (comments[0])
  )
  assert comments[1].startswith(f"# worker 1 of 2: {env}; JAX process 1 of 2")
  assert "primary:" not in comments[1] and "--workdir must be storage all workers" in comments[2]


@pytest.mark.parametrize(
  "accelerator_type,hosts",
  [
    ("v5p-8", 1),
    ("v5p-64", 8),
    ("v4-32", 4),
    ("v5litepod-8", 1),
    ("v5litepod-16", 4),
    ("v6e-256", 64),
    ("v7x-8", None),
  ],
)
def test_tpu_vm_hosts_from_the_accelerator_type(accelerator_type, hosts):
  from coevolve_jax import launching as workers  # noqa: PLC0415

  assert workers.tpu_vm_hosts(accelerator_type) == hosts


def test_launchers_refuse_a_gs_workdir_and_name_the_mount():
  job = ["--config=configs/bfcl.py", "--workdir=gs://bucket/run"]
  out = _run("launch.py", "run", "--name=cv", "--zone=z", "--dry-run", "--", *job)
  assert out.returncode == 2 and "Cloud Storage FUSE" in out.stderr
  with pytest.raises(ValueError, match="/gcs/BUCKET/run"):
    vertex.build_job(chip="h100", image_uri="img:1", job_args=job)


def test_vertex_dry_run_lists_each_replica_as_the_job_will_see_it():
  """The GPU replicas' CLUSTER_SPEC, as Vertex AI sets it, read by coevolve_jax.distributed."""
  out = _run(
    "vertex.py",
    "--chip=h200",
    "--hosts=3",
    "--image=img:1",
    "--heartbeat-timeout-s=45",
    "--dry-run",
    "--",
    *JOB,
  )
  assert out.returncode == 0, out.stderr
  job = json.loads(out.stdout)
  for pool in job["jobSpec"]["workerPoolSpecs"]:
    assert pool["containerSpec"]["env"] == [{"name": "COEVOLVE_HEARTBEAT_TIMEOUT_S", "value": "45"}]
  lines = out.stderr.strip().splitlines()
  for i in range(3):
    assert f"worker {i} of 3:" in lines[i] and f"JAX process {i} of 3" in lines[i]
    assert "coordinator workerpool0-0:2222" in lines[i] and ("primary:" in lines[i]) == (i == 0)
  assert "--workdir must be storage all workers mount" in lines[3]


def test_tpu_run_without_job_arguments_is_an_error():
  out = _run("launch.py", "run", "--name=cv", "--zone=z", "--dry-run")
  assert out.returncode == 2 and "--config" in out.stderr


def test_tpu_without_gcloud_fails_clearly():
  env = dict(os.environ, PATH=os.path.dirname(sys.executable))
  out = _run("launch.py", "delete", "--name=cv", "--zone=z", env=env)
  assert out.returncode == 2 and "gcloud CLI is not on PATH" in out.stderr


def test_tpu_delete_is_quiet_and_named():
  _, cmds = launch.build(["delete", "--name=cv", "--zone=z"])
  assert cmds == [["gcloud", "compute", "tpus", "tpu-vm", "delete", "cv", "--zone=z", "--quiet"]]


def test_vertex_tpu_job_uses_library_types_and_round_trips():
  job = vertex.build_job(
    chip="v5e", topology="4x4", image_uri="img:1", job_args=JOB, output_uri="gs://bucket/out"
  )
  assert isinstance(job, types.CustomJob)
  (pool,) = job.job_spec.worker_pool_specs
  assert pool.machine_spec.machine_type == "ct5lp-hightpu-4t"
  assert pool.machine_spec.tpu_topology == "4x4" and pool.replica_count == 1
  assert list(pool.container_spec.args) == JOB
  assert [(e.name, e.value) for e in pool.container_spec.env] == [("COEVOLVE_DISTRIBUTED", "auto")]
  assert job.job_spec.base_output_directory.output_uri_prefix == "gs://bucket/out"
  assert types.CustomJob.from_json(types.CustomJob.to_json(job)) == job
  assert job.display_name == "coevolve-v5e-16chips"


def test_vertex_gpu_job_has_primary_and_worker_pools():
  job = vertex.build_job(chip="h100", hosts=3, image_uri="img:1", job_args=JOB)
  primary, workers = job.job_spec.worker_pool_specs
  for pool in (primary, workers):
    assert pool.machine_spec.machine_type == "a3-highgpu-8g"
    assert pool.machine_spec.accelerator_type == types.AcceleratorType.NVIDIA_H100_80GB
    assert pool.machine_spec.accelerator_count == 8
  assert (primary.replica_count, workers.replica_count) == (1, 2)
  single = vertex.build_job(chip="h100", image_uri="img:1", job_args=JOB)
  assert len(single.job_spec.worker_pool_specs) == 1


@pytest.mark.parametrize(
  "kwargs,message",
  [
    (dict(chip="tpu9"), "unknown chip"),
    (dict(chip="v5p", topology="big"), "--topology must look like"),
    (dict(chip="v5p"), "--topology must look like"),
    (dict(chip="v5p", topology="2x2x1", hosts=2), "--hosts is for GPUs"),
    (dict(chip="h100", topology="2x2"), "--topology is for TPUs"),
    (dict(chip="h100", hosts=0), "--hosts must be >= 1"),
    (dict(chip="h100", image_uri=""), "image URI is required"),
  ],
)
def test_vertex_bad_input_is_a_clear_error(kwargs, message):
  kwargs = {"image_uri": "img:1", "job_args": JOB, **kwargs}
  with pytest.raises(ValueError, match=re.escape(message)):
    vertex.build_job(**kwargs)


def test_vertex_unknown_accelerator_enum_is_a_clear_error():
  with pytest.raises(ValueError, match="not known to this google-cloud-aiplatform"):
    vertex._accelerator("NVIDIA_NOT_A_GPU")


def test_vertex_dry_run_prints_the_job_json():
  out = _run("vertex.py", "--chip=v6e", "--topology=2x4", "--image=img:1", "--dry-run", "--", *JOB)
  assert out.returncode == 0, out.stderr
  spec = json.loads(out.stdout)
  pool = spec["jobSpec"]["workerPoolSpecs"][0]
  assert pool["machineSpec"] == {"machineType": "ct6e-standard-4t", "tpuTopology": "2x4"}
  assert pool["containerSpec"]["command"] == ["python", "-m", "coevolve_jax.main"]
  bad = _run("vertex.py", "--chip=v6e", "--image=img:1", "--dry-run", "--", *JOB)
  assert bad.returncode == 2 and "--topology" in bad.stderr


def test_dockerfile_copies_what_exists_and_pins_match_setup():
  text = open(os.path.join(ROOT, "tpu", "Dockerfile")).read()
  for line in text.splitlines():
    if line.startswith("COPY "):
      for src in line.split()[1:-1]:
        assert os.path.exists(os.path.join(ROOT, src)), src
  setup = open(os.path.join(ROOT, "setup.py")).read()
  bfcl = re.search(r'BFCL_EVAL = "([^"]+)"', setup).group(1)
  assert f"ARG BFCL_EVAL={bfcl}" in text and launch.BFCL_EVAL == bfcl
  for extra in ("tpu", "gpu"):
    assert f'"{extra}":' in setup


@pytest.mark.parametrize(
  "job_args,needs",
  [
    (["--config=configs/appworld.py", "--workdir=/w"], True),
    (["--config=configs/appworld.py:paper"], True),
    (["--config=/src/coevolve/configs/appworld.py:cpu"], True),
    (["--config=configs/bfcl.py", "--config.env=appworld"], True),
    (["--config", "configs/appworld.py:cpu", "--workdir=/w"], True),  # absl's other spelling
    (["--config=configs/bfcl.py", "--config.env", "appworld"], True),
    (["--config=configs/appworld.py", "--config.env=bfcl"], False),  # the override wins
    (["--config=configs/bfcl.py:cpu"], False),
    (["--config=configs/my_appworld.py.bak"], False),
  ],
)
def test_which_jobs_need_appworld(job_args, needs):
  from coevolve_jax import launching  # noqa: PLC0415

  assert launching.needs_appworld(job_args) is needs


def test_appworld_jobs_install_it_on_worker_0_and_pass_its_data_root():
  """Issue 39 item 2: AppWorld's servers and episodes run on the primary, so `up` with an
  AppWorld config installs its environment (and, with --appworld-data, downloads the data) on
  worker 0 only, and every worker's job gets APPWORLD_ROOT; a BFCL job installs nothing more.
  Vertex AI replicas get APPWORLD_ROOT from --appworld-data."""
  job = ["--config=configs/appworld.py", "--workdir=/mnt/b/run"]
  base = ["--name=cv", "--zone=z", "--accelerator-type=v5p-16", "--version=v"]
  _, commands = launch.build(["up", *base, "--appworld-data=/data/aw dir", "--", *job])
  (appworld,) = [c for c in commands if any("appworld-setup" in part for part in c)]
  assert "--worker=0" in appworld
  remote = appworld[-1].removeprefix("--command=")
  assert remote.index("make appworld-setup") < remote.index("appworld download data")
  assert shlex.split(remote)[-2:] == ["--root", "/data/aw dir"]
  run = shlex.split(commands[-2][-1].removeprefix("--command="))
  start = run.index("coevolve_jax.main") + 1
  assert "APPWORLD_ROOT=/data/aw dir" in run and run[start : start + len(job)] == job
  _, plain = launch.build(["up", *base, "--", *JOB])
  assert not any("appworld" in " ".join(c) for c in plain)
  _, asked = launch.build(["setup", "--name=cv", "--zone=z", "--appworld"])
  assert "download" not in asked[-1][-1] and "make appworld-setup" in asked[-1][-1]

  # Bad data folders are refused by both launchers: a line break would escape the dry run's
  # shell comments, a relative path is deleted by the next `setup`, a bucket URL is not files.
  for bad, said in [
    ("a\ntouch /tmp/x #", "line break"),
    ("aw", "absolute path"),
    ("~/aw", "absolute path"),
    ("--help", "absolute path"),
    ("gs://b/aw", "Cloud Storage FUSE"),
  ]:
    with pytest.raises(SystemExit):
      launch.build(["up", *base, f"--appworld-data={bad}", "--", *job])
    with pytest.raises(ValueError, match=said):
      vertex.build_job(chip="h100", image_uri="i", job_args=job, appworld_data=bad)
  with pytest.raises(SystemExit):  # a gs:// workdir, in absl's two-argument spelling too
    launch.build(["up", *base, "--", "--config=configs/bfcl.py", "--workdir", "gs://b/r"])

  aw_job = vertex.build_job(
    chip="h100", hosts=2, image_uri="img:1", job_args=job, appworld_data="/gcs/b/aw"
  )
  for pool in aw_job.job_spec.worker_pool_specs:
    env = {e.name: e.value for e in pool.container_spec.env}
    assert env == {"APPWORLD_ROOT": "/gcs/b/aw"}
