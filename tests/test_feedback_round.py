"""Feedback rounds: event selection and ablation switches, synthesis off the main thread (same
result, pool untouched until commit), provenance, per-round logs, token budget, LLM stages."""

import concurrent.futures
import dataclasses
import json
import os

import numpy as np
import pytest

from coevolve_jax.feedback.rounds import (
  RoundJournal,
  RoundResult,
  commit_round,
  events_digest,
  select_events,
  signal_shares,
)
from coevolve_jax.feedback.signals import SignalEvent
from coevolve_jax.testing.gemini_stub import GeminiStub, feedback_responder
from coevolve_jax.feedback import synthesis
from envs.bfcl import synthesis as controller
from envs.bfcl.explorer import ProgrammaticExplorer
from envs.bfcl.synthesis import BfclSynthesizer, SynthesisSettings
from coevolve_jax.feedback import llm as llm_lib
from coevolve_jax.feedback.llm import GeminiLLM, GeminiSettings
from envs.bfcl.llm_explorer import LLMExplorer
from coevolve_jax.feedback.pool import TaskPool
from envs.bfcl.validation import ValidationResult
from coevolve_jax.types import Task
from envs.bfcl.data import load_bfcl_tasks, split_tasks

SETTINGS = SynthesisSettings(min_calls=2, max_calls=4, max_turns=1, rounds=2, steps_per_round=6)


def synthesize_round(events, explorer, rng, round_idx, settings, llm=None, *, validate=True):
  """One round of the core's skeleton over BFCL's hooks with this explorer and settings."""
  synth = BfclSynthesizer(settings, llm, explorer)
  return synthesis.synthesize_round(synth, events, rng, round_idx, validate=validate)


@pytest.fixture(scope="module")
def data():
  train, held = split_tasks(load_bfcl_tasks("multi_turn_base"), 20, seed=0)
  d0, _ = synthesis.initial_tasks(
    BfclSynthesizer(SETTINGS, None), train, 3, np.random.default_rng(0)
  )
  assert len(d0) == 3
  return d0, held


def events_of(d0):
  return [
    SignalEvent(d0[0], "forgetting", [[]], 0.0),
    SignalEvent(
      d0[1],
      "boundary",
      d0[1].ground_truth,
      1.0,
      [[f"output of {c}" for c in turn] for turn in d0[1].ground_truth],
    ),
    SignalEvent(d0[2], "rare", d0[2].ground_truth, 1.0),
    SignalEvent(d0[0], "boundary", [[]], 0.0),
  ]


def test_select_events_kinds_mode_and_limit(data):
  d0, _ = data
  events = events_of(d0)
  rng = np.random.default_rng(0)
  assert len(select_events(events, rng, 10)) == 4
  assert len(select_events(events, rng, 2)) == 2
  no_forgetting = select_events(events, rng, 10, kinds=("boundary", "rare"))
  assert sorted(e.signal for e in no_forgetting) == ["boundary", "boundary", "rare"]
  no_boundary = select_events(events, rng, 10, kinds=("forgetting", "rare"))
  assert sorted(e.signal for e in no_boundary) == ["forgetting", "rare"]
  rand = select_events([], rng, 2, mode="random", pool_tasks=d0)
  assert len(rand) == 2 and all(e.signal is None for e in rand)
  assert {e.task.task_id for e in rand} <= {t.task_id for t in d0}
  with pytest.raises(ValueError, match="mode"):
    select_events(events, rng, 1, mode="bogus")
  with pytest.raises(ValueError, match="kinds"):
    select_events(events, rng, 1, kinds=("forgetting", "typo"))


def test_contexts_are_one_per_task_and_kind_balanced_across_kinds():
  """Paper Sec. 3.2: every annotated trajectory is a candidate; here deduplicated by (task, kind)
  and, under a budget, taken in turn from each kind. 5 boundary tasks (2 rollouts each), 1
  forgetting task (3 rollouts), 1 rare task (2 rollouts): 7 candidates."""
  tasks = [Task(f"t{i}", "bfcl", [f"q{i}"], [["a()"]]) for i in range(8)]
  events = [
    SignalEvent(tasks[i], "boundary", [[f"b{i}{j}()"]], float(j)) for i in range(5) for j in (0, 1)
  ]
  events += [SignalEvent(tasks[5], "forgetting", [[f"f{j}()"]], 0.0) for j in range(3)]
  events += [SignalEvent(tasks[7], "rare", [[f"r{j}()"]], 1.0) for j in range(2)]
  rng = np.random.default_rng(0)
  every = select_events(events, rng, 0)
  keys = [(e.task.task_id, e.signal) for e in every]
  assert len(keys) == len(set(keys)) == 7
  assert set(keys) == {(e.task.task_id, e.signal) for e in events}
  assert [e.signal for e in select_events(events, rng, 3)] == ["forgetting", "boundary", "rare"]
  five = [e.signal for e in select_events(events, rng, 5)]
  assert sorted(five) == ["boundary", "boundary", "boundary", "forgetting", "rare"]
  assert len(select_events(events, rng, 100)) == 7
  # The random ablation explores as many pool tasks as the signals would have given contexts.
  assert len(select_events(events, rng, 0, mode="random", pool_tasks=tasks)) == 7
  with pytest.raises(ValueError, match="max_contexts"):
    select_events(events, rng, -1)
  stats = signal_shares(events)
  assert stats["events"] == {"forgetting": 3, "boundary": 10, "rare": 2}
  assert stats["shares"]["boundary"] == pytest.approx(10 / 15)


def test_one_context_yields_every_task_its_exploration_supports(data, monkeypatch):
  """Paper Fig. 12: the abstraction returns several tasks for one context; each is validated
  on its own and joins the round under its own id."""
  d0, _ = data
  monkeypatch.setenv("GEMINI_API_KEY", "fake-key-for-the-stub")

  def two_tasks(system, prompt):
    reply = feedback_responder(system, prompt)
    if system.startswith("You turn"):
      task = json.loads(reply)["tasks"][0]
      steps = task["turns"][0]["steps"]
      part = {**task, "turns": [{"query": "Only the first call.", "steps": steps[:1]}]}
      return json.dumps({"tasks": [task, part] if len(steps) > 1 else [task]})
    return reply

  with GeminiStub(two_tasks) as stub:
    llm = GeminiLLM(GeminiSettings(model="m", base_url=stub.url, attempts=1))
    settings = dataclasses.replace(SETTINGS, min_calls=1)
    result = synthesize_round(
      events_of(d0)[1:2], LLMExplorer(llm), np.random.default_rng(0), 1, settings, llm
    )
  assert [t.task_id for t in result.tasks] == ["syn-r1-0000", "syn-r1-0000-1"]
  assert result.synthesized == 2 and result.per_signal["boundary"]["validated"] == 2
  full, part = result.tasks
  assert len(full.ground_truth[0]) > 1 and part.ground_truth == [full.ground_truth[0][:1]]
  assert part.turns == ["Only the first call."]


def test_lone_surrogates_in_gemini_text_never_reach_the_pool_or_the_logs(
  data, monkeypatch, tmp_path, caplog
):
  """A lone surrogate in the explorer LLM's text, as a JSON escape ("\\ud83d" without its pair)
  and as a raw code point of the response body, used to crash the round's commit with
  UnicodeEncodeError; now each is replaced with U+FFFD and counted in a warning."""
  d0, held = data
  monkeypatch.setenv("GEMINI_API_KEY", "fake-key-for-the-stub")

  def surrogates(system, prompt):
    reply = feedback_responder(system, prompt)
    if system.startswith("You turn"):
      tasks = json.loads(reply)["tasks"]
      for task in tasks:
        task["turns"][0]["query"] += " \ud83d"  # a raw code point of the response body
        task["description"] = task.get("description", "") + " ESCAPE"
      text = json.dumps({"tasks": tasks}, ensure_ascii=False)
      return text.replace("ESCAPE", "\\udc00")  # a JSON escape of a lone surrogate
    return reply

  before = llm_lib.sanitized_count()
  with GeminiStub(surrogates) as stub, caplog.at_level("WARNING"):
    llm = GeminiLLM(GeminiSettings(model="m", base_url=stub.url, attempts=1))
    result = synthesize_round(
      events_of(d0)[1:2],
      LLMExplorer(llm),
      np.random.default_rng(0),
      1,
      dataclasses.replace(SETTINGS, min_calls=1),
      llm,
    )
  assert result.tasks
  assert all(t.turns[0].endswith(" \ufffd") for t in result.tasks)
  pool = TaskPool(tmp_path / "pool.jsonl")
  report = commit_round(result, pool, held)  # UnicodeEncodeError here before
  assert report.accepted == len(result.tasks)
  journal = RoundJournal(str(tmp_path / "rounds"))
  journal.save(result, "digest")  # written as UTF-8 text: UnicodeEncodeError here before
  assert journal.load(1, "digest").tasks[0].turns == result.tasks[0].turns
  with open(tmp_path / "pool.jsonl", encoding="utf-8") as f:
    assert [Task.from_json(line).turns for line in f] == [t.turns for t in result.tasks]
  assert llm_lib.sanitized_count() >= before + 2 * len(result.tasks)
  warned = [r.getMessage() for r in caplog.records if "lone surrogate(s)" in r.getMessage()]
  assert any(w.startswith("Gemini text") for w in warned), warned  # the response body's
  assert any(w.startswith("explorer LLM text") for w in warned), warned  # the parsed JSON's


def test_synthesis_in_a_thread_matches_the_main_thread_and_spares_the_pool(data, tmp_path):
  d0, held = data
  events = events_of(d0)
  pool = TaskPool(tmp_path / "pool.jsonl")
  pool.add(d0)
  main = synthesize_round(events, ProgrammaticExplorer(), np.random.default_rng(5), 1, SETTINGS)
  with concurrent.futures.ThreadPoolExecutor(1) as ex:
    worker = ex.submit(
      synthesize_round, events, ProgrammaticExplorer(), np.random.default_rng(5), 1, SETTINGS
    ).result()
  assert [t.to_json() for t in worker.tasks] == [t.to_json() for t in main.tasks]
  assert main.tasks and len(pool) == 3  # synthesis never touches the pool
  report = commit_round(main, pool, held)
  assert len(pool) == 3 + report.accepted and report.accepted >= 1
  for task in pool.tasks[3:]:
    prov = task.provenance
    assert task.source == "synth" and prov["round"] == 1 and prov["explorer"] == "programmatic"
    assert prov["signal"] in ("forgetting", "boundary", "rare")
    assert prov["parent_task_id"] in {t.task_id for t in d0}
    assert prov["abstraction"] == "template" and prov["validation"] == "execution"
  assert set(report.eval_similarity) == {t.task_id for t in pool.tasks[3:]}
  # every exploration step is in the trace, tagged with its task and parent
  assert main.trace and all(
    {"task_id", "parent", "signal", "run", "action", "ok"} <= set(r) for r in main.trace
  )
  # committing the same round again adds nothing: every task is a duplicate of the pool
  again = commit_round(main, pool, held)
  assert again.accepted == 0 and len(again.dropped) == len(main.tasks)
  assert {d[1] for d in again.dropped} <= {"duplicate_id", "exact_pool", "near_pool"}


def test_eval_copies_are_dropped_at_commit(data, tmp_path):
  d0, _ = data
  result = synthesize_round(
    events_of(d0)[:2], ProgrammaticExplorer(), np.random.default_rng(1), 2, SETTINGS
  )
  assert result.tasks
  pool = TaskPool(tmp_path / "pool.jsonl")
  report = commit_round(result, pool, eval_tasks=result.tasks)  # as if they were eval tasks
  assert report.accepted == 0 and len(pool) == 0
  assert {d[1] for d in report.dropped} == {"exact_eval"}


def test_no_validation_switch_accepts_what_validation_rejects(data, monkeypatch):
  d0, _ = data
  monkeypatch.setattr(
    controller, "validate_task", lambda task, min_calls: ValidationResult(False, "forced")
  )
  events = events_of(d0)[:2]
  strict = synthesize_round(events, ProgrammaticExplorer(), np.random.default_rng(3), 1, SETTINGS)
  assert strict.tasks == [] and {r for _, r in strict.rejected} == {"forced"}
  loose = synthesize_round(
    events,
    ProgrammaticExplorer(),
    np.random.default_rng(3),
    1,
    SETTINGS,
    validate=False,
  )
  assert len(loose.tasks) == strict.synthesized > 0
  assert all(t.provenance["validation"] == "skipped" for t in loose.tasks)


def test_llm_round_summary_abstraction_judge_and_budget(data, monkeypatch, gemini_stub, tmp_path):
  d0, _ = data
  monkeypatch.setenv("GEMINI_API_KEY", "fake-key-for-the-stub")
  stub = gemini_stub
  llm = GeminiLLM(GeminiSettings(model="m", base_url=stub.url, attempts=1))
  events = events_of(d0)[1:3]
  result = synthesize_round(
    events,
    LLMExplorer(llm),
    np.random.default_rng(0),
    1,
    dataclasses.replace(SETTINGS, min_calls=1),
    llm,
  )
  assert result.llm_usage["requests"] == len(stub.requests) > 0
  systems = [r["body"]["systemInstruction"]["parts"][0]["text"] for r in stub.requests]
  assert any(s.startswith("You analyse") for s in systems)  # docs/design.md §1.2 context summary
  # The summary of the boundary event sees each call with the environment's output (Fig. 11).
  first = next(r for r, s in zip(stub.requests, systems) if s.startswith("You analyse"))
  shown = json.loads(first["body"]["contents"][0]["parts"][0]["text"])
  want = [[{"call": c, "observation": f"output of {c}"} for c in t] for t in d0[1].ground_truth]
  assert shown["signal"] == "boundary" and shown["agent_steps"] == want
  assert result.tasks  # the stub's explorer calls list_users() etc., which succeed
  for task in result.tasks:
    assert task.provenance["explorer"] == "gemini:m"
    assert task.provenance["abstraction"] == "llm"
    assert task.provenance["validation"]["checker_reward"] == 1.0

  n = len(stub.requests)
  small = GeminiLLM(
    GeminiSettings(model="m", base_url=stub.url, attempts=1, tokens_per_round=30)
  )  # two 15-token requests
  cut = synthesize_round(
    events,
    LLMExplorer(small),
    np.random.default_rng(0),
    2,
    dataclasses.replace(SETTINGS, min_calls=1),
    small,
  )
  # The budget runs out inside the first context, which is finished (its tasks are kept: they
  # used to be lost with it); the round stops before the second and records the skip.
  sent = len(stub.requests) - n
  assert sent > 2 and cut.llm_usage == {"tokens": 15 * sent, "requests": sent}
  assert cut.tasks and all(t.task_id.startswith("syn-r2-0000") for t in cut.tasks)
  assert list(cut.per_signal) == [events[0].signal]
  assert cut.stopped is not None and cut.stopped["reason"] == "token_budget"
  assert (cut.stopped["contexts_done"], cut.stopped["contexts_skipped"]) == (1, 1)
  # ... and it reaches feedback.jsonl's row through the report.
  assert commit_round(cut, TaskPool(tmp_path / "pool.jsonl"), []).stopped == cut.stopped


def test_llm_replies_that_break_the_json_rules_fall_back_and_the_round_goes_on(data, monkeypatch):
  """A summary that repeats a key and an abstraction that holds NaN used to be read (the last
  value of the key, a float nan); now each reply is an LLMError, counted: the summary falls back
  to the template, the abstraction to the template's task, and the round still makes tasks."""
  d0, _ = data
  monkeypatch.setenv("GEMINI_API_KEY", "fake-key-for-the-stub")

  def broken(system, prompt):
    reply = feedback_responder(system, prompt)
    if system.startswith("You analyse"):
      return reply[:-1] + ', "summary": "the second summary"}'
    if system.startswith("You turn"):
      return reply[:-1] + ', "confidence": NaN}'
    return reply

  before = llm_lib.refused_count()
  with GeminiStub(broken) as stub:
    llm = GeminiLLM(GeminiSettings(model="m", base_url=stub.url, attempts=1))
    result = synthesize_round(
      events_of(d0)[1:3],
      LLMExplorer(llm),
      np.random.default_rng(0),
      1,
      dataclasses.replace(SETTINGS, min_calls=1),
      llm,
    )
  systems = [r["body"]["systemInstruction"]["parts"][0]["text"] for r in stub.requests]
  prompts = [r["body"]["contents"][0]["parts"][0]["text"] for r in stub.requests]
  refusable = sum(s.startswith(("You analyse", "You turn")) for s in systems)
  assert sum(s.startswith("You analyse") for s in systems) == 2 and refusable > 2
  assert llm_lib.refused_count() - before == refusable
  explored = [p for p in prompts if p.startswith("Guidance:")]  # the explorer's, with the context
  assert explored and all('"by": "template"' in p for p in explored)
  assert not any("the second summary" in p for p in explored)
  assert result.tasks and result.per_signal["boundary"]["events"] == 1
  assert all(t.provenance["abstraction"] == "template" for t in result.tasks)


def test_round_journal_reuses_a_record_only_for_the_same_contexts(tmp_path):
  task = load_bfcl_tasks("multi_turn_base")[0]
  events = [SignalEvent(task, "rare", [["ls()"]], 0.0)]
  result = RoundResult(3, [task], 1, {"rare": {"events": 1}}, [("syn-r3-0001", "why")], [{"a": 1}])
  journal = RoundJournal(str(tmp_path / "rounds"))
  journal.save(result, events_digest(events))
  again = journal.load(3, events_digest(events))
  assert again == result and again.rejected == [("syn-r3-0001", "why")]
  other = [SignalEvent(task, "boundary", [["ls()"]], 1.0)]
  assert journal.load(3, events_digest(other)) is None  # other contexts: synthesize anew
  assert journal.load(4, events_digest(events)) is None
  (tmp_path / "rounds" / "round-00003.json").write_text('{"events_digest": "')  # torn write
  assert journal.load(3, events_digest(events)) is None
  journal.clear()
  assert not os.listdir(tmp_path / "rounds")
