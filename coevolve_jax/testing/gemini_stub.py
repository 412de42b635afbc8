"""A loopback HTTP server that answers like the Gemini REST API (`models/*:generateContent`).

For tests and offline demos: point `GeminiSettings.base_url` at `server.url` and the real
google-genai client code runs end to end (request building, auth header, retries, timeouts,
response parsing). Binds 127.0.0.1 only.

Each request takes the next scripted `Reply` if any is queued, else the `responder` callable's
answer (default `feedback_responder`: plausible explorer, summary, abstraction and judge replies
worked out from the prompt text, so a whole feedback round can run against it).
"""

from __future__ import annotations

import collections
import dataclasses
import http.server
import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class Reply:
  """One scripted answer: HTTP `status`, raw `body` (sent as is), `delay_s` before answering."""

  status: int = 200
  body: str = ""
  delay_s: float = 0.0


def ok_body(text: str, prompt_tokens: int = 10, output_tokens: int = 5) -> str:
  """A generateContent success body whose candidate says `text`."""
  return json.dumps(
    {
      "candidates": [
        {
          "content": {"role": "model", "parts": [{"text": text}]},
          "finishReason": "STOP",
          "index": 0,
        }
      ],
      "usageMetadata": {
        "promptTokenCount": prompt_tokens,
        "candidatesTokenCount": output_tokens,
        "totalTokenCount": prompt_tokens + output_tokens,
      },
    }
  )


def error_body(code: int, status: str, message: str = "stub error") -> str:
  return json.dumps({"error": {"code": code, "message": message, "status": status}})


def _tool_lines(prompt: str) -> list[tuple[str, list[tuple[str, bool, str]]]]:
  """(name, [(param, required, type)]) of the "- name(p: t, q?: t) - ..." lines of a prompt."""
  out = []
  for m in re.finditer(r"^- (\w+)\(([^)]*)\)", prompt, re.M):
    params = []
    for p in filter(None, (x.strip() for x in m.group(2).split(","))):
      name, _, kind = p.partition(":")
      params.append((name.rstrip("?").strip(), not name.strip().endswith("?"), kind.strip()))
    out.append((m.group(1), params))
  return out


# The stub's AppWorld exploration (Simple Note, which every generated world has): log in, add a
# note, count the notes; then STOP.
APPWORLD_EXPLORATION = (
  'pw = {a["account_name"]: a["password"] for a in apis.supervisor.show_account_passwords()}\n'
  "me = apis.supervisor.show_profile()\n"
  'token = apis.simple_note.login(username=me["email"], password=pw["simple_note"])'
  '["access_token"]\nprint("logged in")',
  'apis.simple_note.create_note(access_token=token, title="Stub note", content="by the stub")\n'
  'print("created")',
  "print(len(apis.simple_note.search_notes(access_token=token, page_limit=20)))",
)


def appworld_responder(system: str, prompt: str) -> str | None:
  """Stand-in answers for the prompts of envs.appworld.llm_explorer (None: not one)."""
  if system.startswith("You explore the apps of an AppWorld"):
    step = int(m.group(1)) if (m := re.search(r"Step (\d+) of", prompt)) else 1
    if step > len(APPWORLD_EXPLORATION):
      return "STOP"
    return f"```python\n{APPWORLD_EXPLORATION[step - 1]}\n```"
  if system.startswith("You turn an exploration log of an AppWorld"):
    runs = collections.Counter(int(r) for r in re.findall(r"^run (\d+) step", prompt, re.M))
    if not runs:
      return json.dumps({"tasks": []})
    run_id, n = max(runs.items(), key=lambda kv: (kv[1], -kv[0]))
    at_most = int(m.group(1)) if (m := re.search(r"At most (\d+) steps", prompt)) else n
    if at_most >= n:  # log in, add the note, count
      steps, query = (
        list(range(n)),
        (
          'Add a Simple Note note titled "Stub note" saying "by the stub", then tell me how many '
          "notes I have."
        ),
      )
    else:  # log in, count
      steps, query = [0, n - 1], "How many notes do I have in Simple Note?"
    task = {
      "run_id": run_id,
      "steps": steps,
      "query": query,
      "answer_step": n - 1,
      "description": "count the notes (after adding one)",
      "completion": "the count is given",
    }
    return json.dumps({"tasks": [task]})
  if "Hints (a known solution):\n```python\n" in prompt:  # the attempting AppWorld agent
    hints = prompt.split("Hints (a known solution):\n```python\n", 1)[1].split("\n```", 1)[0]
    return f"```python\n{hints}\n```"
  return None


def feedback_responder(system: str, prompt: str) -> str:
  """Deterministic stand-in answers for the prompts of envs.bfcl.llm_explorer and
  envs.appworld.llm_explorer."""
  if (reply := appworld_responder(system, prompt)) is not None:
    return reply
  if system.startswith("You analyse"):
    return json.dumps(
      {
        "summary": "stub summary",
        "failure_cause": "",
        "instability_pattern": "",
        "focus_pattern": [],
        "exploration_objectives": ["stub"],
        "do_not_repeat": [],
      }
    )
  if system.startswith("You turn"):
    runs = collections.Counter(int(r) for r in re.findall(r"^run (\d+) step", prompt, re.M))
    if not runs:
      return json.dumps({"tasks": []})
    run_id, n = max(runs.items(), key=lambda kv: (kv[1], -kv[0]))
    at_most = int(m.group(1)) if (m := re.search(r"At most (\d+) steps", prompt)) else n
    steps = list(range(min(n, at_most)))
    return json.dumps(
      {
        "tasks": [
          {
            "run_id": run_id,
            "turns": [{"query": "Please do the stub task.", "steps": steps}],
            "description": "stub",
            "completion": "all calls done",
          }
        ]
      }
    )
  if system.startswith("You judge"):
    return json.dumps({"success": True, "reason": "stub judge"})
  # Explorer / attempting agent: call the tools that need no string input, in turn.
  step = int(m.group(1)) if (m := re.search(r"Step (\d+) of", prompt)) else 1
  done = prompt.count(" -> ")
  if "Hints (a known solution):" in prompt:
    hints = json.loads(prompt.split("Hints (a known solution): ", 1)[1].split("\n", 1)[0])
    if done >= len(hints):
      return json.dumps({"stop": True})
    call = hints[done]
    return json.dumps({"name": call.split("(", 1)[0], "arguments": _call_args(call)})
  usable = [name for name, params in _tool_lines(prompt) if not any(req for _, req, _ in params)]
  if not usable:
    return json.dumps({"stop": True})
  return json.dumps({"name": usable[(step - 1) % len(usable)], "arguments": {}})


def _call_args(call: str) -> dict[str | None, Any]:
  """Keyword arguments of a call string like "f(a='x', b=2)" (literals only, via ast); a `**{...}`
  argument would come back under the key None."""
  import ast  # pylint: disable=g-import-not-at-top

  node = ast.parse(call, mode="eval").body
  assert isinstance(node, ast.Call)
  return {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}


class GeminiStub:
  """Threaded loopback server; use as a context manager.

  Attributes:
    url: base URL to give the client ("http://127.0.0.1:<port>").
    requests: every request received, as {"path", "headers", "body"} (body parsed from JSON).
    script: deque of `Reply` consumed first-in first-out before `responder` is used.
  """

  def __init__(self, responder: Callable[[str, str], str] = feedback_responder):
    self.responder = responder
    self.script: collections.deque[Reply] = collections.deque()
    self.requests: list[dict[str, Any]] = []
    self._lock = threading.Lock()
    stub = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"

      def do_POST(self):  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        reply = stub._answer(self.path, dict(self.headers), body)
        if reply.delay_s:
          time.sleep(reply.delay_s)
        data = reply.body.encode("utf-8")
        try:
          self.send_response(reply.status)
          self.send_header("content-type", "application/json")
          self.send_header("content-length", str(len(data)))
          self.end_headers()
          self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
          pass

      def log_message(self, *args):
        pass

    self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self._server.daemon_threads = True
    self.url = f"http://127.0.0.1:{self._server.server_port}"
    self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
    self._thread.start()

  def _answer(self, path: str, headers: dict[str, str], raw: bytes) -> Reply:
    try:
      body = json.loads(raw or b"{}")
    except ValueError:
      body = {}
    with self._lock:
      self.requests.append({"path": path, "headers": headers, "body": body})
      if self.script:
        return self.script.popleft()
    return self._reply(path, body)

  def _reply(self, path: str, body: dict[str, Any]) -> Reply:
    """The responder's answer to an unscripted request, in the API's wire format (subclasses
    speaking another API override this)."""
    if not re.search(r"/models/[^/:]+:generateContent$", path):
      return Reply(404, error_body(404, "NOT_FOUND", f"no such method {path}"))
    parts = body.get("systemInstruction", {}).get("parts", [])
    system = " ".join(p.get("text", "") for p in parts)
    parts = [p for c in body.get("contents", []) for p in c.get("parts", [])]
    prompt = " ".join(p.get("text", "") for p in parts)
    return Reply(200, ok_body(self.responder(system, prompt)))

  def close(self) -> None:
    self._server.shutdown()
    self._server.server_close()

  def __enter__(self) -> "GeminiStub":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
