"""Feedback rounds on the GRPO clock (paper Algorithm 1: a round every F steps).

After every F-th step a round starts: its contexts are selected from the signal events since the
last round (`rounds.select_events`), and its synthesis (`feedback.synthesis.synthesize_round` over
the suite's hooks: explore -> abstract -> validate) runs in a worker thread while the next
`feedback.lag` GRPO steps go on (`feedback.concurrent`). Its tasks join the pool after step
start + lag, a step fixed in advance, so a run's pool does not depend on timing. The primary
process synthesizes (LLM calls and environment writes happen once) and every process commits
its result; each committed round's result is journaled (`rounds.RoundJournal`) before the pool
sees it, so a resumed run commits the same tasks again instead of synthesizing anew.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from typing import Any

import jax
import numpy as np

from coevolve_jax import distributed
from coevolve_jax.feedback import rounds, synthesis
from coevolve_jax.feedback.llm import TextLLM
from coevolve_jax.feedback.pool import TaskPool
from coevolve_jax.metrics import append_lines
from coevolve_jax.run_state import RoundInFlight, RunState
from coevolve_jax.suite import Suite
from coevolve_jax.types import Task


class RoundScheduler:
  """Starts, runs and commits the run's feedback rounds (see the module docstring).

  Args:
    cfg: the run config (reads `seed`, `feedback`, `train.steps`).
    workdir: feedback.jsonl and exploration.jsonl go here.
    suite: the benchmark whose `synthesizer(llm)` gives the round's hooks.
    llm: the rounds' explorer LLM (None: programmatic).
    pool: the task pool the rounds commit to.
    journal: the committed rounds' records.
  """

  def __init__(
    self,
    cfg: Any,
    workdir: str,
    suite: Suite,
    llm: TextLLM | None,
    pool: TaskPool,
    journal: rounds.RoundJournal,
  ):
    self.cfg, self.workdir, self.suite, self.llm = cfg, workdir, suite, llm
    self.pool, self.journal = pool, journal
    self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="feedback")

  def shutdown(self) -> None:
    self._executor.shutdown()

  def abandon(self) -> None:
    """Stops without waiting (the run was interrupted): a round not yet started is cancelled;
    one being synthesized runs on in its worker thread, whose result no one commits (the
    checkpoint holds the round as in flight, so a resumed run redoes it)."""
    self._executor.shutdown(wait=False, cancel_futures=True)

  def tick(self, state: RunState, step: int, held_out: list[Task]) -> dict[str, Any]:
    """After GRPO step `step`: starts a round after every F-th step; commits the round in
    flight once its step is due. Returns the commit's metrics ({} without one)."""
    info: dict[str, Any] = {}
    if step % self.cfg.feedback.every == 0:
      if state.pending is not None:  # never with lag < every (validated); a guard
        info.update(self.commit(state, held_out))
      self._start(state, step)
    if state.pending is not None and step >= state.pending.commit_at:
      info.update(self.commit(state, held_out))
    return info

  def rngs(self, round_idx: int) -> tuple[np.random.Generator, np.random.Generator]:
    """Selection and synthesis RNGs of a round: fixed by (seed, round), so a resumed run redoes
    a round in flight exactly."""
    return (
      np.random.default_rng([self.cfg.seed, round_idx, 0]),
      np.random.default_rng([self.cfg.seed, round_idx, 1]),
    )

  def _start(self, state: RunState, step: int) -> None:
    fb = self.cfg.feedback
    state.round += 1
    chosen = rounds.select_events(
      state.events,
      self.rngs(state.round)[0],
      fb.max_contexts,
      kinds=tuple(fb.kinds),
      mode=fb.mode,
      pool_tasks=self.pool.tasks,
    )
    shares = rounds.signal_shares(state.events)
    state.events = []
    # the last step's round is joined at once, before the final checkpoint
    commit_at = min(step + fb.lag, self.cfg.train.steps) if fb.concurrent else step
    self.submit(state, RoundInFlight(state.round, step, commit_at, chosen, shares))

  def _synthesize(self, round_: RoundInFlight) -> rounds.RoundResult:
    return synthesis.synthesize_round(
      self.suite.synthesizer(self.llm),
      round_.events,
      self.rngs(round_.round_idx)[1],
      round_.round_idx,
      validate=self.cfg.feedback.validate,
    )

  def submit(self, state: RunState, round_: RoundInFlight) -> None:
    """Hands the round to the synthesis: in the worker thread, or here when not
    `feedback.concurrent`. A round this run committed before a kill is not synthesized again:
    its recorded result is reused, so its tasks keep their ids and content."""
    recorded = self.journal.load(round_.round_idx, rounds.events_digest(round_.events))
    round_.future = concurrent.futures.Future()
    state.pending = round_
    if recorded is not None:
      round_.future.set_result(recorded)
    elif not distributed.is_primary():  # the primary synthesizes; `commit` shares it
      round_.future.set_result(None)
    else:
      if self.llm is not None:
        self.llm.refresh()  # the local explorer serves the policy as of this step
      if self.cfg.feedback.concurrent:
        round_.future = self._executor.submit(self._synthesize, round_)
      else:
        round_.future.set_result(self._synthesize(round_))

  def commit(self, state: RunState, held_out: list[Task]) -> dict[str, Any]:
    """Waits for the round in flight, adds its tasks to the pool, logs the round (feedback.jsonl,
    exploration.jsonl) and returns its metrics."""
    pending, state.pending = state.pending, None
    assert pending is not None and pending.future is not None
    start = time.perf_counter()
    if jax.process_count() > 1:  # the primary's round (or its failure) on every process
      future = pending.future
      result = rounds.RoundResult.from_json(
        distributed.on_primary(lambda: _primary_round(future).to_json())
      )
    else:
      result = _primary_round(pending.future)
    wait_s = time.perf_counter() - start
    self.journal.save(result, rounds.events_digest(pending.events))  # before the pool sees it
    report = rounds.commit_round(result, self.pool, held_out)
    state.tasks_synthesized += report.synthesized
    state.tasks_accepted += report.accepted
    state.tasks_dropped += len(report.dropped)
    state.validation.append(report.pass_rate if report.synthesized else None)
    state.feedback_synth_s += result.wall_s
    self._log(state, pending, result, report, wait_s)
    return _metrics(pending, result, report, wait_s)

  def _log(self, state, pending, result, report, wait_s: float) -> None:
    row = {
      "stage": "round",
      "round": pending.round_idx,
      "step": state.step,
      "start_step": pending.start_step,
      "synthesized": report.synthesized,
      "accepted": report.accepted,
      "pass_rate": report.pass_rate,
      "per_signal": report.per_signal,
      "signal_events": pending.signals.get("events", {}),
      "signal_shares": pending.signals.get("shares", {}),
      "dropped": report.dropped,
      "rejected": report.rejected,
      "llm_usage": report.llm_usage,
      "synth_s": round(result.wall_s, 3),
      "wait_s": round(wait_s, 3),
      "eval_similarity": report.eval_similarity,
      "pool_size": len(self.pool),
      "stopped": report.stopped,
    }
    if report.stopped is not None:
      print(f"feedback round {pending.round_idx} stopped early: {report.stopped}")
    append_lines(os.path.join(self.workdir, "feedback.jsonl"), [json.dumps(row)])
    append_lines(
      os.path.join(self.workdir, "exploration.jsonl"),
      (
        json.dumps({"round": pending.round_idx, "step": state.step, **t}, ensure_ascii=False)
        for t in result.trace
      ),
    )


def _primary_round(
  future: concurrent.futures.Future[rounds.RoundResult | None],
) -> rounds.RoundResult:
  """The round a future holds on the primary process (the others' hold None: `submit`)."""
  result = future.result()
  assert result is not None, "only the primary process holds the round's result"
  return result


def _metrics(pending, result, report, wait_s: float) -> dict[str, Any]:
  """A committed round's metrics.jsonl entries (`feedback/*`)."""
  out = {
    "feedback/synthesized": report.synthesized,
    "feedback/accepted": report.accepted,
    "feedback/pass_rate": report.pass_rate,
    "feedback/dropped": len(report.dropped),
    "feedback/synth_s": result.wall_s,
    "feedback/wait_s": wait_s,
  }
  if report.llm_usage:
    out["feedback/llm_tokens"] = report.llm_usage["tokens"]
  for kind, share in pending.signals.get("shares", {}).items():
    out[f"feedback/share_{kind}"] = share  # the round's events per kind (paper Fig. 4)
  return out
