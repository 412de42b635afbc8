"""The OpenAI-compatible explorer LLM against a loopback chat-completions stub: the real `openai`
client builds, sends, retries, times out and parses; every failure is an LLMError."""

from __future__ import annotations

import importlib.util
import json
import os
import socket

import pytest

from coevolve_jax.feedback import factory
from coevolve_jax.feedback.llm import (
  UNREACHABLE_AFTER,
  BudgetExhausted,
  EndpointUnreachable,
  LLMError,
)
from coevolve_jax.feedback.openai_llm import NO_KEY, OpenAILLM, OpenAISettings
from coevolve_jax.testing.gemini_stub import Reply
from coevolve_jax.testing.openai_stub import OpenAIStub, chat_body, openai_error_body

KEY = "sk-test-0123456789"


@pytest.fixture
def stub():
  with OpenAIStub(lambda system, prompt: f"echo {system[:3]}|{prompt}") as server:
    yield server


def _llm(stub, monkeypatch, **kw) -> OpenAILLM:
  monkeypatch.setenv("COEVOLVE_TEST_KEY", KEY)
  settings = {"base_url": stub.api_url, "api_key_env": "COEVOLVE_TEST_KEY", "model": "m1", **kw}
  return OpenAILLM(OpenAISettings(**settings))


def test_a_request_carries_system_prompt_settings_and_the_key_from_the_environment(
  stub, monkeypatch
):
  llm = _llm(stub, monkeypatch, temperature=0.3, max_output_tokens=77)
  assert llm.complete("You analyse", "hello") == "echo You|hello"
  (req,) = stub.requests
  assert req["path"] == "/v1/chat/completions"
  body = req["body"]
  assert body["model"] == "m1" and body["max_tokens"] == 77 and body["temperature"] == 0.3
  assert body["messages"] == [
    {"role": "system", "content": "You analyse"},
    {"role": "user", "content": "hello"},
  ]
  assert "response_format" not in body
  assert {k.lower(): v for k, v in req["headers"].items()}["authorization"] == f"Bearer {KEY}"
  assert llm.budget.used == 15 and llm.budget.requests == 1  # the stub's usage.total_tokens
  assert KEY not in repr(llm) and llm.name == "openai:m1"


def test_json_output_asks_for_a_json_object_unless_json_mode_is_off(stub, monkeypatch):
  _llm(stub, monkeypatch).complete("s", "p", json_output=True)
  _llm(stub, monkeypatch, json_mode=False).complete("s", "p", json_output=True)
  formats = [r["body"].get("response_format") for r in stub.requests]
  assert formats == [{"type": "json_object"}, None]


def test_server_errors_are_retried_then_succeed(stub, monkeypatch):
  stub.script.extend([Reply(503, openai_error_body()), Reply(429, openai_error_body())])
  assert _llm(stub, monkeypatch, attempts=3).complete("s", "p") == "echo s|p"
  assert len(stub.requests) == 3


@pytest.mark.parametrize(
  ("reply", "match", "sent"),
  [
    (Reply(401, openai_error_body("bad key", "invalid_request_error")), "HTTP 401", 1),
    (Reply(500, openai_error_body()), "HTTP 500", 2),  # attempts=2: retried once, then fails
    (Reply(200, "{not json"), "malformed", 1),
    (Reply(200, chat_body(None)), "empty response", 1),
    (Reply(200, json.dumps({"id": "x", "choices": []})), "empty response", 1),
  ],
)
def test_failures_are_llm_errors_without_the_key(stub, monkeypatch, reply, match, sent):
  stub.script.extend([reply] * 2)
  with pytest.raises(LLMError, match=match) as e:
    _llm(stub, monkeypatch, attempts=2).complete("s", "p")
  assert KEY not in str(e.value)
  assert len(stub.requests) == sent


def test_a_hanging_server_is_a_timeout(stub, monkeypatch):
  stub.script.append(Reply(200, chat_body("late"), delay_s=2.0))
  with pytest.raises(LLMError, match="timeout"):
    _llm(stub, monkeypatch, timeout_s=0.3, attempts=1).complete("s", "p")


def test_a_refused_connection_is_an_llm_error(monkeypatch):
  with socket.socket() as s:  # a port nothing listens on once closed
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  monkeypatch.setenv("COEVOLVE_TEST_KEY", KEY)
  llm = OpenAILLM(
    OpenAISettings(
      base_url=f"http://127.0.0.1:{port}/v1", api_key_env="COEVOLVE_TEST_KEY", attempts=1
    )
  )
  with pytest.raises(LLMError, match="connection error"):
    llm.complete("s", "p")


def test_an_unreachable_endpoint_stops_the_round_after_a_few_requests(stub, monkeypatch):
  """A dead or misnamed endpoint: after UNREACHABLE_AFTER requests in a row that could not
  connect, the next is refused before it is sent (EndpointUnreachable, a RoundStopped) instead
  of every remaining context waiting out its retries; a new round tries again; an answer of any
  kind, an HTTP error too, restarts the count."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  monkeypatch.setenv("COEVOLVE_TEST_KEY", KEY)
  settings = dict(base_url=f"http://127.0.0.1:{port}/v1", api_key_env="COEVOLVE_TEST_KEY")
  dead = OpenAILLM(OpenAISettings(**settings, attempts=1))
  for _ in range(UNREACHABLE_AFTER):
    with pytest.raises(LLMError, match="connection error") as e:
      dead.complete("s", "p")
    assert not isinstance(e.value, EndpointUnreachable)
  with pytest.raises(EndpointUnreachable, match=f"127.0.0.1:{port}"):
    dead.complete("s", "p")
  dead.budget.reset()  # the next round
  with pytest.raises(LLMError, match="connection error") as e:
    dead.complete("s", "p")
  assert not isinstance(e.value, EndpointUnreachable)
  # A live endpoint that fails with HTTP errors is reachable: its errors never stop the round.
  live = _llm(stub, monkeypatch, attempts=1)
  stub.script.extend([Reply(500, openai_error_body())] * (UNREACHABLE_AFTER + 1))
  for _ in range(UNREACHABLE_AFTER + 1):
    with pytest.raises(LLMError, match="HTTP 500") as e:
      live.complete("s", "p")
    assert not isinstance(e.value, EndpointUnreachable)


def test_the_token_budget_stops_requests_before_they_are_sent(stub, monkeypatch):
  llm = _llm(stub, monkeypatch, tokens_per_round=15)
  llm.complete("s", "p")  # 15 tokens: the budget is now spent
  with pytest.raises(BudgetExhausted):
    llm.complete("s", "p")
  assert len(stub.requests) == 1
  assert llm.budget.reset() == {"tokens": 15, "requests": 1}
  llm.complete("s", "p")  # a new round


def test_keys_come_from_the_environment_only(stub, monkeypatch):
  monkeypatch.delenv("COEVOLVE_ABSENT_KEY", raising=False)
  with pytest.raises(LLMError, match="COEVOLVE_ABSENT_KEY") as e:
    OpenAILLM(OpenAISettings(api_key_env="COEVOLVE_ABSENT_KEY"))
  assert "explore.openai.base_url" in str(e.value)
  # A keyless local server (vLLM, SGLang) is reached with a placeholder key.
  llm = OpenAILLM(OpenAISettings(base_url=stub.api_url, api_key_env="COEVOLVE_ABSENT_KEY"))
  llm.complete("s", "p")
  headers = {k.lower(): v for k, v in stub.requests[-1]["headers"].items()}
  assert headers["authorization"] == f"Bearer {NO_KEY}"


def test_the_factory_builds_it_from_the_explore_config(stub, monkeypatch):
  path = os.path.join(os.path.dirname(__file__), "..", "configs", "bfcl.py")
  spec = importlib.util.spec_from_file_location("_openai_test_bfcl_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config()
  monkeypatch.setenv("OPENAI_API_KEY", KEY)
  cfg.explore.openai.base_url = stub.api_url
  cfg.explore.openai.model = "qwen3-max"
  llm = factory.make_llm("openai", cfg.explore)
  assert isinstance(llm, OpenAILLM) and llm.settings.model == "qwen3-max"
  assert "openai" in factory.EXPLORERS


def test_a_run_without_the_key_stops_with_a_one_line_run_error(tmp_path, monkeypatch):
  """Missing credentials are a RunError (main prints one line and exits 2), not a traceback."""
  from coevolve_jax.errors import RunError  # noqa: PLC0415
  from coevolve_jax.loop import CoEvolveRun  # noqa: PLC0415

  path = os.path.join(os.path.dirname(__file__), "..", "configs", "bfcl.py")
  spec = importlib.util.spec_from_file_location("_openai_run_bfcl_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config("cpu")
  cfg.explore.explorer = "openai"
  cfg.explore.openai.api_key_env = "COEVOLVE_ABSENT_KEY"
  monkeypatch.delenv("COEVOLVE_ABSENT_KEY", raising=False)
  with pytest.raises(RunError, match="COEVOLVE_ABSENT_KEY"):
    CoEvolveRun(cfg, str(tmp_path / "run")).fit()
