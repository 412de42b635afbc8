"""AppWorld environment servers on loopback, started and stopped by us, and their HTTP client.

AppWorld (`appworld==0.1.3.post1`) pins pydantic < 2, so it lives in its own virtual environment
(`.venv-appworld`, made by `make appworld-setup`) and runs as server processes: each is
`uvicorn appworld.serve.environment:app --host 127.0.0.1 --port P` with `APPWORLD_ROOT` pointing at
a data root. One server holds one world at a time (AppWorld keeps process-wide state and freezes the
process clock), so a pool runs one server per concurrent episode.

Endpoints used (appworld/serve/environment.py): GET / (health), POST /initialize {task_id,
experiment_name, timeout_seconds, ...}, /execute {task_id, code}, /task_completed {task_id},
/evaluate {task_id, suppress_errors}, /close {task_id}. Every request has a timeout; a server that
does not answer in time, refuses the connection or has exited is a `ServerError`, and
`ServerPool.release(server, failed=True)` kills and restarts it, so only its episode fails.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

__all__ = [
  "DEFAULT_VENV",
  "AppWorldServer",
  "ServerError",
  "ServerPool",
  "add_worlds",
  "build_worlds",
  "derive_worlds",
  "venv_python",
]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
DEFAULT_VENV = os.path.join(REPO, ".venv-appworld")
WORLD_BUILDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "world.py")  # a script
_WELCOME = "Welcome to AppWorld Server"


class ServerError(RuntimeError):
  """An AppWorld server is down, hung, or answered with an error."""


def venv_python(venv: str = "") -> str:
  """The AppWorld environment's interpreter; raises FileNotFoundError with the set-up command."""
  python = os.path.join(os.path.abspath(venv or DEFAULT_VENV), "bin", "python")
  if not os.access(python, os.X_OK):
    raise FileNotFoundError(
      f"no AppWorld environment at {os.path.dirname(os.path.dirname(python))}"
      ": run `make appworld-setup` (creates .venv-appworld, installs "
      "appworld==0.1.3.post1, runs `appworld install`)"
    )
  return python


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# The server command: a small launcher asks the kernel to SIGTERM the server when the thread that
# started it dies, even by SIGKILL (Linux PR_SET_PDEATHSIG = 1), limits the server's address
# space to argv[2] MiB (RLIMIT_AS, 0 = none; kept across exec, so a runaway world or model-written
# code gets MemoryError instead of taking the machine's memory, as BFCL's workers do) with no
# core dumps, then execs uvicorn. Done in the child itself, not by subprocess's preexec_fn:
# forking a multithreaded (JAX) process to run Python code before exec can deadlock.
_LAUNCHER = """\
import ctypes, os, resource, signal, sys
parent, mib = int(sys.argv[1]), int(sys.argv[2])
try:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)
except OSError:
    pass
if os.getppid() != parent:  # the parent died before prctl
    sys.exit(0)
if mib > 0:
    resource.setrlimit(resource.RLIMIT_AS, (mib << 20, mib << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.execv(sys.executable, [sys.executable, "-m", "uvicorn", *sys.argv[3:]])
"""
DEFAULT_MEMORY_MIB = 4096  # an idle server maps ~300 MiB; worlds and executed code add to it


def _env(root: str) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
  env.update(
    APPWORLD_ROOT=os.path.abspath(root),
    APPWORLD_CACHE=os.path.join(os.path.abspath(root), "cache"),
    NO_PROXY="127.0.0.1,localhost",
    no_proxy="127.0.0.1,localhost",
  )
  return env


class AppWorldServer:
  """One `appworld serve environment` process on 127.0.0.1.

  Args:
    root: AppWorld root (holds data/); world outputs go to <root>/experiments/outputs.
    python: interpreter of the AppWorld environment (see `venv_python`).
    timeout_s: per-request timeout in seconds (initialize, execute, evaluate, ...).
    startup_timeout_s: seconds to wait for the first successful health check.
    log_path: file for the server's stdout and stderr ('' = discard).
    memory_mib: the server process's address-space limit in MiB (RLIMIT_AS; 0 = none).
  """

  def __init__(
    self,
    root: str,
    python: str,
    timeout_s: float = 60.0,
    startup_timeout_s: float = 60.0,
    log_path: str = "",
    memory_mib: int = DEFAULT_MEMORY_MIB,
  ):
    self.root, self.python, self.timeout_s = os.path.abspath(root), python, float(timeout_s)
    self.startup_timeout_s, self.log_path = float(startup_timeout_s), log_path
    self.memory_mib = int(memory_mib)
    self.port = 0
    self.proc: subprocess.Popen | None = None
    self.restarts = 0

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.port}"

  def start(self) -> None:
    """Starts the process and waits until GET / answers; raises ServerError otherwise."""
    self.stop()
    self.port = _free_port()
    out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
      self.proc = subprocess.Popen(
        [
          self.python,
          "-c",
          _LAUNCHER,
          str(os.getpid()),
          str(self.memory_mib),
          "appworld.serve.environment:app",
          "--host",
          "127.0.0.1",
          "--port",
          str(self.port),
          "--log-level",
          "warning",
        ],
        cwd=self.root,
        env=_env(self.root),
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
      )
    finally:
      if not isinstance(out, int):  # an opened log file, not subprocess.DEVNULL (an int)
        out.close()
    deadline = time.monotonic() + self.startup_timeout_s
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        raise ServerError(
          f"AppWorld server on port {self.port} exited with code "
          f"{self.proc.returncode} while starting (log: {self.log_path or 'off'})"
        )
      if self.healthy(timeout_s=1.0):
        return
      time.sleep(0.2)
    self.stop()
    raise ServerError(
      f"AppWorld server on port {self.port} did not answer within {self.startup_timeout_s:g} s"
    )

  def alive(self) -> bool:
    return self.proc is not None and self.proc.poll() is None

  def healthy(self, timeout_s: float = 2.0) -> bool:
    """True when the process runs and GET / answers with AppWorld's welcome message in time."""
    if not self.alive():
      return False
    try:
      body = self._open(urllib.request.Request(self.url + "/"), timeout_s)
    except ServerError:
      return False
    return _WELCOME in str(body.get("message", ""))

  def call(self, method: str, timeout_s: float | None = None, **payload: Any) -> Any:
    """POST /<method> with a JSON body; returns the `output` field.

    Raises:
      ServerError: the process is gone, the connection failed, no answer within the timeout, or
        the server answered with a non-200 status (its message is included).
    """
    if not self.alive():
      raise ServerError(f"AppWorld server on port {self.port} is not running")
    data = json.dumps(payload).encode()
    request = urllib.request.Request(
      f"{self.url}/{method}", data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    return self._open(request, self.timeout_s if timeout_s is None else timeout_s)["output"]

  def _open(self, request: urllib.request.Request, timeout_s: float) -> dict:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never proxied
    try:
      with opener.open(request, timeout=timeout_s) as response:
        return json.loads(response.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as e:
      detail = e.read(2000).decode("utf-8", "replace")
      raise ServerError(f"{request.full_url} answered HTTP {e.code}: {detail}") from e
    except (urllib.error.URLError, OSError, ValueError) as e:  # refused, reset, timeout, bad JSON
      raise ServerError(
        f"{request.full_url}: no usable answer within {timeout_s:g} s ({type(e).__name__}: {e})"
      ) from e

  def stop(self) -> None:
    """Terminates the server's process group (SIGTERM, then SIGKILL after 5 s); idempotent."""
    proc, self.proc = self.proc, None
    if proc is None or proc.poll() is not None:
      return
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
      try:
        os.killpg(proc.pid, sig)
        os.killpg(proc.pid, signal.SIGCONT)  # a stopped (hung) process must run to handle SIGTERM
      except ProcessLookupError:
        return
      try:
        proc.wait(timeout=wait)
        return
      except subprocess.TimeoutExpired:
        continue

  def restart(self) -> None:
    self.restarts += 1
    self.start()


class ServerPool:
  """Up to `size` servers, one per concurrent episode; started lazily, restarted when they fail.

  `acquire()` hands out a healthy idle server (starting one if none is idle and fewer than `size`
  exist); `release(server, failed)` returns it, killing and restarting it first when `failed` (its
  episode timed out or lost the connection). `close()` stops every server; the pool is also a
  context manager. Raises ServerError from `acquire` when all `size` servers are busy.
  """

  def __init__(
    self,
    root: str,
    size: int,
    python: str = "",
    timeout_s: float = 60.0,
    startup_timeout_s: float = 60.0,
    log_dir: str = "",
    memory_mib: int = DEFAULT_MEMORY_MIB,
  ):
    if size < 1:
      raise ValueError(f"pool size must be >= 1, got {size}")
    self.root, self.size, self.python = root, int(size), python or venv_python()
    self.timeout_s, self.startup_timeout_s, self.log_dir = timeout_s, startup_timeout_s, log_dir
    self.memory_mib = int(memory_mib)
    self.idle: list[AppWorldServer] = []
    self.busy: list[AppWorldServer] = []
    self.restarts = 0
    self._lock = threading.Lock()
    atexit.register(self.close)  # no server outlives the run (SIGKILL: see _LAUNCHER)

  def _new(self) -> AppWorldServer:
    index = len(self.idle) + len(self.busy)
    log = os.path.join(self.log_dir, f"appworld-server-{index}.log") if self.log_dir else ""
    server = AppWorldServer(
      self.root, self.python, self.timeout_s, self.startup_timeout_s, log, self.memory_mib
    )
    server.start()
    return server

  def acquire(self) -> AppWorldServer:
    with self._lock:
      if self.idle:
        server = self.idle.pop()
        if not server.healthy():  # died or hung while idle
          self.restarts += 1
          try:
            server.restart()
          except ServerError:
            server.stop()
            raise
        self.busy.append(server)
        return server
      if len(self.busy) >= self.size:
        raise ServerError(f"all {self.size} AppWorld servers are busy")
      server = self._new()
      self.busy.append(server)
      return server

  def release(self, server: AppWorldServer, failed: bool = False) -> None:
    with self._lock:
      if server in self.busy:
        self.busy.remove(server)
      if failed or not server.alive():
        self.restarts += 1
        try:
          server.restart()
        except ServerError as e:  # leave it out; acquire() starts a fresh one when needed
          print(f"warning: AppWorld server restart failed: {e}", file=sys.stderr)
          server.stop()
          return
      self.idle.append(server)

  def close(self) -> None:
    with self._lock:
      for server in self.idle + self.busy:
        server.stop()
      self.idle, self.busy = [], []

  def __enter__(self) -> "ServerPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def build_worlds(
  root: str,
  python: str = "",
  num_scenarios: int = 5,
  tasks_per_scenario: int = 3,
  eval_scenarios: int = 1,
  seed: int = 0,
  templates: tuple[str, ...] = (),
  num_people: int = 3,
  num_notes: int = 5,
  timeout_s: float = 900.0,
) -> list[dict]:
  """Builds generated worlds and tasks under `root` with envs/appworld/world.py in the AppWorld env.

  Returns the rows of <root>/coevolve_tasks.jsonl (task_id, scenario, split, instruction, answer,
  solution, ...). Reuses a finished build with the same arguments (a stamp file records them).
  Raises FileNotFoundError without the AppWorld environment, RuntimeError when the builder fails.
  """
  python = python or venv_python()
  args = [
    "--root",
    os.path.abspath(root),
    "--num-scenarios",
    str(num_scenarios),
    "--tasks-per-scenario",
    str(tasks_per_scenario),
    "--eval-scenarios",
    str(eval_scenarios),
    "--seed",
    str(seed),
    "--num-people",
    str(num_people),
    "--num-notes",
    str(num_notes),
  ]
  if templates:
    args += ["--templates", ",".join(templates)]
  index = os.path.join(root, "coevolve_tasks.jsonl")
  stamp = os.path.join(root, "coevolve_build.json")
  if os.path.exists(stamp) and os.path.exists(index):
    with open(stamp, encoding="utf-8") as f:
      if json.load(f) == args:
        return _read_rows(index)
  shutil.rmtree(os.path.join(root, "data"), ignore_errors=True)
  os.makedirs(root, exist_ok=True)
  script = WORLD_BUILDER
  try:
    done = subprocess.run(
      [python, script, *args],
      env=_env(root),
      capture_output=True,
      text=True,
      timeout=timeout_s,
      check=False,
    )
  except subprocess.TimeoutExpired as e:
    raise RuntimeError(f"the AppWorld world builder took over {timeout_s:g} s") from e
  if done.returncode != 0:
    raise RuntimeError(
      f"the AppWorld world builder failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
    )
  with open(stamp, "w", encoding="utf-8") as f:
    json.dump(args, f)
  return _read_rows(index)


def _read_rows(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _run_builder(
  root: str, python: str, flag: str, specs: list[dict], args: list[str], timeout_s: float
) -> str:
  """Runs envs/appworld/world.py `flag` SPEC_FILE on `root` in the AppWorld environment; its
  stdout. Raises RuntimeError when it fails or times out."""
  spec_path = os.path.join(root, f"coevolve_spec_{os.getpid()}_{time.monotonic_ns()}.json")
  with open(spec_path, "w", encoding="utf-8") as f:
    json.dump(specs, f)
  try:
    done = subprocess.run(
      [python or venv_python(), WORLD_BUILDER, "--root", os.path.abspath(root), flag, spec_path]
      + args,
      env=_env(root),
      capture_output=True,
      text=True,
      timeout=timeout_s,
      check=False,
    )
  except subprocess.TimeoutExpired as e:
    raise RuntimeError(f"the AppWorld world builder took over {timeout_s:g} s") from e
  finally:
    os.remove(spec_path)
  if done.returncode != 0:
    raise RuntimeError(
      f"the AppWorld world builder failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
    )
  return done.stdout


def add_worlds(
  root: str,
  specs: list[dict],
  python: str = "",
  num_people: int = 3,
  num_notes: int = 5,
  timeout_s: float = 900.0,
) -> list[dict]:
  """Builds more tasks ({task_id, template, seed} each) into the built root `root`.

  Running servers see them at once (AppWorld loads a task from disk when it is initialized).
  Returns their index rows (split "synth"). Raises RuntimeError when the builder fails.
  """
  if not specs:
    return []
  args = ["--num-people", str(num_people), "--num-notes", str(num_notes)]
  _run_builder(root, python, "--add", specs, args, timeout_s)
  wanted = {s["task_id"] for s in specs}
  return [
    r for r in _read_rows(os.path.join(root, "coevolve_tasks.jsonl")) if r["task_id"] in wanted
  ]


def derive_worlds(
  root: str, specs: list[dict], python: str = "", timeout_s: float = 900.0
) -> list[dict]:
  """Derives tasks ({task_id, base_task_id, instruction, steps, answer_step} each) from the
  worlds of existing tasks under `root` (envs/appworld/world.py `derive_task`: the code steps
  run once, and the answer step's printed output and the database changes become the task's
  evaluation).

  Returns one row per spec, in order; a row whose "error" is not None names why no task was made.
  Raises RuntimeError when the builder itself fails.
  """
  if not specs:
    return []
  out = _run_builder(root, python, "--derive", specs, [], timeout_s)
  lines = [line for line in out.splitlines() if line.startswith('{"rows"')]
  if not lines:
    raise RuntimeError(f"the AppWorld world builder printed no rows:\n{out[-2000:]}")
  return json.loads(lines[-1])["rows"]
