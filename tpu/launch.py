"""Cloud TPU VM launcher: create a TPU VM or pod slice, install, run on every worker, logs, delete.

    python tpu/launch.py up --name=coevolve --zone=us-east5-a --accelerator-type=v5p-16 \
        --version=v2-alpha-tpuv5 -- --config=configs/bfcl.py --workdir=/tmp/runs/bfcl
    python tpu/launch.py delete --name=coevolve --zone=us-east5-a

Subcommands: `create`, `setup` (copy this checkout as a `git archive` of HEAD to every worker and
install it in a Python 3.11 venv with the `tpu` extra), `run` (start the main job in the
background on all workers at once; JAX's distributed runtime finds the other workers from the
TPU metadata), `logs` (follow worker 0's log), `delete`, and `up` (create, setup, run, logs).
Every subcommand takes `--dry-run`, which prints the exact commands instead of running them;
for `run` and `up` it also lists, as shell comments, the environment each worker gets, its JAX
process and what it writes.
Everything runs through the `gcloud` CLI (`gcloud compute tpus tpu-vm ...`).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys

from coevolve_jax import launching as workers

BFCL_EVAL = "bfcl-eval==2026.3.23"  # same pin as setup.py; installed with --no-deps
ARCHIVE = "coevolve_jax.tar.gz"
REMOTE_DIR = "coevolve_jax"
LOG = "run.log"


def _base(args: argparse.Namespace) -> list[str]:
  flags = [f"--zone={args.zone}"]
  if args.project:
    flags.append(f"--project={args.project}")
  return flags


def _ssh(args: argparse.Namespace, command: str, worker: str = "all") -> list[str]:
  return [
    "gcloud",
    "compute",
    "tpus",
    "tpu-vm",
    "ssh",
    args.name,
    *_base(args),
    f"--worker={worker}",
    f"--command={command}",
  ]


def create_commands(args: argparse.Namespace) -> list[list[str]]:
  """`gcloud compute tpus tpu-vm create` for a single host or a pod slice."""
  cmd = [
    "gcloud",
    "compute",
    "tpus",
    "tpu-vm",
    "create",
    args.name,
    *_base(args),
    f"--accelerator-type={args.accelerator_type}",
    f"--version={args.version}",
  ]
  if args.spot:
    cmd.append("--spot")
  return [cmd]


def _appworld(args: argparse.Namespace) -> bool:
  """Whether `setup` installs AppWorld: asked for (--appworld, --appworld-data) or, for `up`,
  the job runs it."""
  wanted = getattr(args, "appworld", False) or bool(getattr(args, "appworld_data", ""))
  return wanted or workers.needs_appworld(getattr(args, "job_args", []))


def appworld_commands(args: argparse.Namespace) -> list[list[str]]:
  """On worker 0 only (the primary runs AppWorld's servers and episodes; the other workers
  receive their results): AppWorld's own environment (`make appworld-setup`) and, with
  --appworld-data, the official data downloaded there."""
  steps = [
    "set -e",
    "sudo apt-get install -y -qq make",
    f"cd {REMOTE_DIR}",
    "make appworld-setup PYTHON=python3.11",
  ]
  if args.appworld_data:
    steps.append(
      f".venv-appworld/bin/appworld download data --root {shlex.quote(args.appworld_data)}"
    )
  return [_ssh(args, " && ".join(steps), worker="0")]


def setup_commands(args: argparse.Namespace) -> list[list[str]]:
  """Archive HEAD, copy it to every worker, install Python 3.11, the package and bfcl-eval; for
  AppWorld, its environment (and data) on worker 0 (`appworld_commands`)."""
  archive = f"/tmp/{ARCHIVE}"
  install = " && ".join(
    [
      "set -e",
      "sudo apt-get update -qq",
      "sudo apt-get install -y -qq python3.11 python3.11-venv",
      f"rm -rf {REMOTE_DIR}",
      f"mkdir {REMOTE_DIR}",
      f"tar -xzf {ARCHIVE} -C {REMOTE_DIR}",
      f"cd {REMOTE_DIR}",
      "python3.11 -m venv .venv",
      ".venv/bin/pip install -q --upgrade pip",
      ".venv/bin/pip install -q -e '.[tpu]'",
      f".venv/bin/pip install -q --no-deps {BFCL_EVAL}",
      ".venv/bin/python -c 'import jax; print(jax.process_index(), jax.local_devices())'",
    ]
  )
  return [
    ["git", "archive", "--format=tar.gz", f"--output={archive}", "HEAD"],
    [
      "gcloud",
      "compute",
      "tpus",
      "tpu-vm",
      "scp",
      archive,
      f"{args.name}:~/",
      *_base(args),
      "--worker=all",
    ],
    _ssh(args, install),
    *(appworld_commands(args) if _appworld(args) else []),
  ]


def worker_env(args: argparse.Namespace) -> dict[str, str]:
  """The environment `run` gives every worker (the same on all: JAX numbers the processes from
  the TPU metadata)."""
  env = {"COEVOLVE_DISTRIBUTED": "auto"}
  if args.heartbeat_timeout_s:
    env["COEVOLVE_HEARTBEAT_TIMEOUT_S"] = str(args.heartbeat_timeout_s)
  if getattr(args, "appworld_data", ""):
    env[workers.APPWORLD_ENV_VAR] = args.appworld_data  # read by the primary's AppWorld
  return env


def run_commands(args: argparse.Namespace) -> list[list[str]]:
  """Starts the main job on all workers (in the background, surviving the ssh session)."""
  job = shlex.join([".venv/bin/python", "-m", "coevolve_jax.main", *args.job_args])
  env = " ".join(f"{k}={shlex.quote(v)}" for k, v in worker_env(args).items())
  command = f"cd {REMOTE_DIR} && {env} nohup {job} > {LOG} 2>&1 < /dev/null &"
  return [_ssh(args, command)]


def describe_workers(args: argparse.Namespace) -> list[str]:
  """`--dry-run`'s account of each worker: its environment, its JAX process and its duties
  (`coevolve_jax.launching`); one line for all when the slice's host count is unknown."""
  hosts = workers.tpu_vm_hosts(getattr(args, "accelerator_type", "") or "")
  env = worker_env(args)
  if hosts is None:
    return [
      f"every worker: {' '.join(f'{k}={v}' for k, v in env.items())}; JAX process = the TPU "
      "worker number (TPU metadata); worker 0 is the primary (pass --accelerator-type to list "
      "the workers)"
    ]
  process = [f"JAX process {i} of {hosts} (TPU metadata: worker {i})" for i in range(hosts)]
  return workers.worker_lines([env] * hosts, process)


def logs_commands(args: argparse.Namespace) -> list[list[str]]:
  return [_ssh(args, f"tail -n +1 -F {REMOTE_DIR}/{LOG}", worker=str(args.worker))]


def delete_commands(args: argparse.Namespace) -> list[list[str]]:
  return [["gcloud", "compute", "tpus", "tpu-vm", "delete", args.name, *_base(args), "--quiet"]]


def up_commands(args: argparse.Namespace) -> list[list[str]]:
  return create_commands(args) + setup_commands(args) + run_commands(args) + logs_commands(args)


COMMANDS = {
  "create": create_commands,
  "setup": setup_commands,
  "run": run_commands,
  "logs": logs_commands,
  "delete": delete_commands,
  "up": up_commands,
}


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="action", required=True)
  for name in COMMANDS:
    s = sub.add_parser(name)
    s.add_argument("--name", required=True, help="TPU VM name.")
    s.add_argument("--zone", required=True, help="Zone, e.g. us-east5-a.")
    s.add_argument("--project", default="", help="Project (default: gcloud's configured one).")
    s.add_argument("--dry-run", action="store_true", help="Print the commands; run nothing.")
    if name in ("create", "up"):
      s.add_argument(
        "--accelerator-type",
        required=True,
        help="e.g. v5litepod-16, v5p-16 (cores), v6e-8; more than one host "
        "makes a multi-host slice.",
      )
      s.add_argument(
        "--version",
        required=True,
        help="TPU software version, e.g. v2-alpha-tpuv5 (coevolve_jax/accelerators.py lists one "
        "per chip).",
      )
      s.add_argument("--spot", action="store_true", help="Spot (preemptible) capacity.")
    if name in ("setup", "up"):
      s.add_argument(
        "--appworld",
        action="store_true",
        help="Also install AppWorld (`make appworld-setup`) on worker 0, where its servers run; "
        "implied by `up` with an AppWorld config.",
      )
    if name in ("setup", "run", "up"):
      s.add_argument(
        "--appworld-data",
        default="",
        help="AppWorld's official data root on worker 0: `setup`/`up` download it there "
        "(`appworld download data --root DIR`) and the job reads it (APPWORLD_ROOT).",
      )
    if name in ("logs", "up"):
      s.add_argument("--worker", type=int, default=0, help="Worker whose log to follow.")
    if name == "run":
      s.add_argument(
        "--accelerator-type",
        default="",
        help="The slice's type (e.g. v5p-16): only lists each worker in --dry-run.",
      )
    if name in ("run", "up"):
      s.add_argument(
        "--heartbeat-timeout-s",
        type=int,
        default=0,
        help="COEVOLVE_HEARTBEAT_TIMEOUT_S on every worker: seconds before the others stop "
        "when one dies (default: JAX's 100).",
      )
      s.add_argument(
        "job_args",
        nargs="*",
        help="Arguments of coevolve_jax.main after `--`, e.g. --config=... --workdir=...",
      )
  return p


def build(argv: list[str]) -> tuple[argparse.Namespace, list[list[str]]]:
  """Parses `argv` and returns (args, the commands to run in order)."""
  args = parser().parse_args(argv)
  if args.action in ("run", "up"):
    if not any(a.startswith("--config") for a in args.job_args):
      parser().error("run/up need the job's arguments after `--`, at least --config and --workdir")
    if error := workers.check_workdir(args.job_args):
      parser().error(error)
  if error := workers.check_appworld_data(getattr(args, "appworld_data", "")):
    parser().error(error)
    if args.heartbeat_timeout_s < 0:
      parser().error(
        f"--heartbeat-timeout-s must be >= 0 (0: JAX's default), got {args.heartbeat_timeout_s}"
      )
  return args, COMMANDS[args.action](args)


def main(argv: list[str] | None = None) -> int:
  args, commands = build(sys.argv[1:] if argv is None else argv)
  if args.dry_run:
    for cmd in commands:
      print(shlex.join(cmd))
    if args.action in ("run", "up"):  # shell comments: the output stays a runnable script
      for line in describe_workers(args):
        print(f"# {line}")
    return 0
  if shutil.which("gcloud") is None:
    print(
      "error: the gcloud CLI is not on PATH (install the Google Cloud CLI and run "
      "`gcloud auth login`), or use --dry-run to see the commands",
      file=sys.stderr,
    )
    return 2
  for cmd in commands:
    print("+", shlex.join(cmd), file=sys.stderr)
    rc = subprocess.run(cmd, check=False).returncode
    if rc:
      print(f"error: command failed with exit status {rc}: {shlex.join(cmd)}", file=sys.stderr)
      return rc
  return 0


if __name__ == "__main__":
  sys.exit(main())
