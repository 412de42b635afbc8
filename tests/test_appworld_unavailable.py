"""AppWorld availability check: fails fast, with the setup steps, when servers or data are missing.

No AppWorld package is used: a tiny http.server on 127.0.0.1 answers like the AppWorld environment
server's `GET /` (appworld/serve/environment.py); the data layout is faked in a temporary folder.
"""

import http.server
import importlib.util
import json
import os
import socket
import threading
import time

import pytest

from envs.appworld.client import AppWorldUnavailable, check_available

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
SETUP_COMMANDS = (
  "pip install appworld==0.1.3.post1",
  "appworld install",
  "appworld download data",
  "appworld serve environment --port 8000",
  "APPWORLD_ROOT",
  "APPWORLD_SERVER_URLS",
  "pydantic<2",
  "SEPARATE virtual environment",
  "make appworld-setup",
)


def _load_config_module(name: str):
  spec = importlib.util.spec_from_file_location(f"_cfg_{name}", os.path.join(CONFIGS, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _config(server_urls, data_root=""):
  c = _load_config_module("appworld").get_config()
  c.appworld.server_urls = tuple(server_urls)
  c.appworld.data_root = str(data_root)
  return c


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class _Handler(http.server.BaseHTTPRequestHandler):
  status = 200
  payload = {
    "message": (
      "Welcome to AppWorld Server! "
      "Checkout /redoc or /docs for FastAPI documentation of this Server."
    )
  }

  def do_GET(self):  # noqa: N802 (http.server's name)
    body = json.dumps(self.payload).encode()
    self.send_response(self.status if self.path == "/" else 404)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)

  def log_message(self, *args):
    pass


class _NotAppWorldHandler(_Handler):
  payload = {"detail": "Not Found"}


@pytest.fixture
def fake_server(request):
  """URL of a local HTTP server; handler class from indirect parametrization (default: AppWorld)."""
  handler = getattr(request, "param", _Handler)
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield f"http://127.0.0.1:{server.server_address[1]}"
  server.shutdown()
  server.server_close()
  thread.join(timeout=5)


def _fake_data(root, splits=("train", "test_normal"), task_id="abc1234_1"):
  """Official layout (appworld/task.py): data/datasets/<split>.txt, data/tasks/<id>/specs.json."""
  os.makedirs(root / "data" / "datasets")
  os.makedirs(root / "data" / "tasks" / task_id)
  (root / "data" / "tasks" / task_id / "specs.json").write_text("{}")
  for split in splits:
    (root / "data" / "datasets" / f"{split}.txt").write_text(f"{task_id}\n")


def test_no_server_raises_fast_and_names_the_commands():
  url = f"http://127.0.0.1:{_free_port()}"
  start = time.monotonic()
  with pytest.raises(AppWorldUnavailable) as info:
    check_available(_config([url]))
  assert time.monotonic() - start < 3.0
  message = str(info.value)
  assert f"server {url}" in message
  for command in SETUP_COMMANDS:
    assert command in message, command
  assert message.count("\n") > 10  # multi-line, one step per line


def test_server_up_but_no_data_still_raises_naming_the_data_step(fake_server, tmp_path):
  for data_root in ("", tmp_path / "empty"):
    with pytest.raises(AppWorldUnavailable) as info:
      check_available(_config([fake_server], data_root))
    message = str(info.value)
    problems = message.split("How to set AppWorld up")[0]
    assert "server " not in problems  # the server itself passed the health check
    assert "appworld download data" in problems


def test_missing_split_file_is_named(fake_server, tmp_path):
  _fake_data(tmp_path, splits=("train",))
  with pytest.raises(AppWorldUnavailable) as info:
    check_available(_config([fake_server], tmp_path))
  problems = str(info.value).split("How to set AppWorld up")[0]
  assert os.path.join("datasets", "test_normal.txt") in problems
  assert "train.txt" not in problems


def test_server_and_data_present_passes(fake_server, tmp_path):
  _fake_data(tmp_path)
  check_available(_config([fake_server], tmp_path))
  check_available(_config([fake_server], tmp_path).appworld)  # the group alone also works


@pytest.mark.parametrize("fake_server", [_NotAppWorldHandler], indirect=True)
def test_server_that_is_not_appworld_is_rejected(fake_server, tmp_path):
  _fake_data(tmp_path)
  with pytest.raises(AppWorldUnavailable, match="not like an AppWorld environment server"):
    check_available(_config([fake_server], tmp_path))


def test_each_url_is_checked(fake_server, tmp_path):
  _fake_data(tmp_path)
  down = f"http://127.0.0.1:{_free_port()}"
  with pytest.raises(AppWorldUnavailable) as info:
    check_available(_config([fake_server, down], tmp_path))
  problems = str(info.value).split("How to set AppWorld up")[0]
  assert f"server {down}" in problems and f"server {fake_server}:" not in problems


def test_server_that_accepts_but_never_answers_times_out(tmp_path):
  _fake_data(tmp_path)
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # the kernel accepts connections; nobody ever reads or answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    c = _config([url], tmp_path)
    c.appworld.timeout_s = 0.3
    start = time.monotonic()
    with pytest.raises(AppWorldUnavailable, match="within 0.3 s|timed out"):
      check_available(c)
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize(
  "url", ["http://10.1.2.3:8000", "http://example.com:8000", "ftp://127.0.0.1:8000"]
)
def test_non_loopback_urls_are_refused_without_connecting(url, tmp_path):
  _fake_data(tmp_path)
  start = time.monotonic()
  with pytest.raises(AppWorldUnavailable, match="loopback|http"):
    check_available(_config([url], tmp_path))
  assert time.monotonic() - start < 0.5


def test_config_shares_the_base_groups_and_reads_env(monkeypatch):
  """AppWorld's config has every shared group of BFCL's (configs/base.py) and its own
  `appworld` group in place of BFCL's `bfcl`."""
  bfcl = _load_config_module("bfcl").get_config()
  monkeypatch.setenv("APPWORLD_SERVER_URLS", "http://127.0.0.1:8000, http://127.0.0.1:8001")
  monkeypatch.setenv("APPWORLD_ROOT", "/some/root")
  module = _load_config_module("appworld")
  for variant in ("", "cpu"):
    c = module.get_config(variant)
    assert c.env == "appworld"
    assert set(c.keys()) - {"appworld"} == set(bfcl.keys()) - {"bfcl"}
    for group, value in bfcl.items():
      if hasattr(value, "keys") and group != "bfcl":
        assert set(c[group].keys()) == set(value.keys()), group
    assert c.appworld.server_urls == ("http://127.0.0.1:8000", "http://127.0.0.1:8001")
    assert c.appworld.data_root == "/some/root"
    assert (c.appworld.split, c.appworld.eval_split) == ("train", "test_normal")
  with pytest.raises(ValueError):
    module.get_config("nope")
  monkeypatch.delenv("APPWORLD_SERVER_URLS")
  monkeypatch.delenv("APPWORLD_ROOT")
  c = module.get_config()
  assert c.appworld.server_urls == ("http://127.0.0.1:8000",) and c.appworld.data_root == ""
