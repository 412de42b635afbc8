"""AppWorld: availability check for servers started by hand, and for the official data.

AppWorld (`appworld==0.1.3.post1`) pins pydantic < 2, which conflicts with this project's
environment, so it runs in its own virtual environment as HTTP servers and we talk to them over
loopback HTTP (docs/design.md §3). A CoEvolve run starts and stops its own servers
(envs/appworld/server.py, envs/appworld/suite.py); `check_available(cfg)` is for servers started
by hand (`cfg.appworld.server_urls`) and fails fast, with the exact setup steps, when a server does
not answer or the official data is missing. Its data checks are reused by
`envs.appworld.suite.check_setup`.

What the check relies on, from the appworld 0.1.3.post1 source:
- `appworld/serve/environment.py`: a FastAPI app whose `GET /` returns
  `{"message": "Welcome to AppWorld Server! ..."}`; `run(port)` calls
  `uvicorn.run(app, host="0.0.0.0", port=port)`. Other endpoints: POST /initialize, /execute,
  /evaluate, /task_completed, /close, ...; GET /tasks/{task_id}, /api_docs.
- `appworld/cli.py`: `appworld serve environment [--port 8000] [--root .] [--no-show-usage]`
  (default port 8000 for `environment`, 9000 for `apis`; it refuses to start without
  `<root>/data`); `appworld download data [--root .]`; `appworld install`.
- `appworld/common/path_store.py`: data lives in `$APPWORLD_ROOT/data` (APPWORLD_ROOT defaults to
  the current directory; the CLI's `--root` option, default ".", overrides it).
- `appworld/task.py` (`load_task_ids`, `Task.load`): split files `data/datasets/<split>.txt` (one
  task id per line, optionally `id:tag`), task folders `data/tasks/<task_id>/specs.json`.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from coevolve_jax.suite import SuiteUnavailable
from envs.appworld.splits import data_errors, split_names

__all__ = ["AppWorldUnavailable", "HEALTH_TIMEOUT_S", "SETUP_INSTRUCTIONS", "check_available"]

HEALTH_TIMEOUT_S = 2.0  # upper bound per server URL for the health check
APPWORLD_VERSION = "0.1.3.post1"
_HEALTH_MARKER = "AppWorld"  # GET / answers {"message": "Welcome to AppWorld Server! ..."}

SETUP_INSTRUCTIONS = f"""\
How to set AppWorld up, in a SEPARATE virtual environment (appworld pins pydantic<2, which
conflicts with this project's pydantic>=2 dependencies; never install it into this project's .venv):
  1. python3.11 -m venv ~/appworld-venv && source ~/appworld-venv/bin/activate
  2. pip install appworld=={APPWORLD_VERSION}
  3. appworld install    # unpacks the encrypted app code into the package (offline, seconds)
  4. export APPWORLD_ROOT=$HOME/appworld-root && mkdir -p "$APPWORLD_ROOT"
     appworld download data --root "$APPWORLD_ROOT"   # needs the internet; writes data/
  5. appworld serve environment --port 8000 --root "$APPWORLD_ROOT" --no-show-usage
     One world per server process: start one server per port (8000, 8001, ...) for parallel
     episodes. This command binds 0.0.0.0 (appworld/serve/environment.py); to bind loopback only:
       APPWORLD_ROOT="$APPWORLD_ROOT" python -m uvicorn appworld.serve.environment:app \\
         --host 127.0.0.1 --port 8000
  6. In this project's shell:
       export APPWORLD_ROOT=$HOME/appworld-root
       export APPWORLD_SERVER_URLS=http://127.0.0.1:8000   # comma-separated, loopback only
     (or --config.appworld.data_root=... and
      --config.appworld.server_urls="('http://127.0.0.1:8000', 'http://127.0.0.1:8001')")
A CoEvolve run does not need steps 5-6: it starts its own servers from .venv-appworld
(`make appworld-setup`; see docs/appworld.md)."""


class AppWorldUnavailable(SuiteUnavailable):
  """The AppWorld servers or data needed by an AppWorld run are not there."""


def _appworld_cfg(cfg: Any) -> Any:
  """The `appworld` group of a full config, or `cfg` itself when it already is that group."""
  return getattr(cfg, "appworld", cfg)


def _loopback_error(url: str) -> str | None:
  """None when `url` is an http(s) URL on a loopback host (no DNS lookup); else why not."""
  parsed = urllib.parse.urlsplit(url)
  if parsed.scheme not in ("http", "https"):
    return f"{url!r} is not an http(s) URL"
  host = parsed.hostname or ""
  if host == "localhost":
    return None
  try:
    if ipaddress.ip_address(host).is_loopback:
      return None
  except ValueError:
    pass
  return f"{url!r} is not a loopback URL (only 127.0.0.0/8, ::1 or localhost are allowed)"


def _server_error(url: str, timeout_s: float) -> str | None:
  """None when an AppWorld environment server answers `GET <url>/`; else what went wrong."""
  bad = _loopback_error(url)
  if bad:
    return bad
  root = url.rstrip("/") + "/"
  opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
  try:
    with opener.open(urllib.request.Request(root, method="GET"), timeout=timeout_s) as response:
      body = response.read(65536)
  except urllib.error.HTTPError as e:
    return f"{root} answered HTTP {e.code} instead of the AppWorld server's welcome message"
  except urllib.error.URLError as e:
    return f"no AppWorld environment server at {root} ({e.reason})"
  except (TimeoutError, OSError) as e:
    return f"no answer from {root} within {timeout_s:g} s ({type(e).__name__}: {e})"
  try:
    message = json.loads(body.decode("utf-8", "replace")).get("message", "")
  except (ValueError, AttributeError):
    message = ""
  if _HEALTH_MARKER not in str(message):
    expected = '{"message": "Welcome to AppWorld Server! ..."}'
    return (
      f"{root} answered, but not like an AppWorld environment server "
      f"(expected JSON {expected}, got {body[:120]!r})"
    )
  return None


def check_available(cfg: Any) -> None:
  """Raises AppWorldUnavailable unless every server answers and the official data is present.

  Args:
    cfg: the full config (with an `appworld` group, see configs/appworld.py) or that group
      itself. Reads `server_urls`, `data_root`, `split`, `eval_split` and `timeout_s`.

  Each server URL must be loopback and answer `GET /` with AppWorld's welcome message within
  min(timeout_s, 2) seconds (servers are probed concurrently). The data root must hold
  `data/tasks` and `data/datasets/<split>.txt` for both splits, whose first task id has
  `data/tasks/<id>/specs.json`. All problems are collected and reported with the setup steps.
  """
  aw = _appworld_cfg(cfg)
  urls = aw.server_urls or ()
  if isinstance(urls, str):  # one URL, or a comma-separated list as in APPWORLD_SERVER_URLS
    urls = urls.split(",")
  urls = [str(u).strip() for u in urls if str(u).strip()]
  timeout_s = min(float(aw.timeout_s), HEALTH_TIMEOUT_S)
  errors = []
  if not urls:
    errors.append(
      "no AppWorld server URLs: set APPWORLD_SERVER_URLS or "
      "--config.appworld.server_urls, and run step 5 (appworld serve environment)"
    )
  if urls:
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(urls), 16)) as pool:
      for url, error in zip(urls, pool.map(lambda u: _server_error(u, timeout_s), urls)):
        if error:
          hint = (
            ""
            if "loopback" in error or "http(s)" in error
            else ("; run step 5 (appworld serve environment) for this port")
          )
          errors.append(f"server {url}: {error}{hint}")
  errors += data_errors(str(aw.data_root or ""), [str(aw.split), *split_names(aw.eval_split)])
  if errors:
    problems = "\n".join(f"  - {e}" for e in errors)
    raise AppWorldUnavailable(f"AppWorld is not available:\n{problems}\n{SETUP_INSTRUCTIONS}")
