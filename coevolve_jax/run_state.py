"""The resumable host-side state of a CoEvolve run, and the feedback round in flight.

A checkpoint holds two things: the train-state pytree (`trainer.TrainState`: parameters, optimizer
state, reference policy) and this state as JSON (`RunState.to_json`). Everything the loop needs to
continue exactly after a kill lives in one of them: the step, the numpy and JAX random states, the
signal tracker's histories, the signal events since the last round, the round in flight, the
feedback counters, the phase timings and the evaluation before training.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coevolve_jax.feedback.rounds import RoundResult
from coevolve_jax.feedback.signals import SignalEvent


@dataclasses.dataclass
class RoundInFlight:
  """A feedback round between its start (after step `start_step`) and its commit.

  Attributes:
    round_idx: 1-based round number; with the run's seed it fixes the round's random streams.
    start_step: the GRPO step after which the round's contexts were selected.
    commit_at: the step after which its tasks join the pool (start_step + feedback.lag, or the
      last step): fixed in advance so the pool does not depend on timing.
    events: the selected contexts (signal events), in order.
    signals: the round's candidate events per kind and their shares (`rounds.signal_shares`,
      counted before selection), for feedback.jsonl.
    future: the synthesis running in the feedback worker (not saved: a resumed run resubmits);
      it holds None on the processes other than the primary, which synthesizes the round.
  """

  round_idx: int
  start_step: int
  commit_at: int
  events: list[SignalEvent]
  signals: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
  future: concurrent.futures.Future[RoundResult | None] | None = dataclasses.field(
    default=None, compare=False, repr=False
  )

  def to_json(self) -> dict[str, Any]:
    return {
      "round": self.round_idx,
      "start_step": self.start_step,
      "commit_at": self.commit_at,
      "events": [e.to_dict() for e in self.events],
      "signals": self.signals,
    }

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> RoundInFlight:
    return cls(
      round_idx=int(d["round"]),
      start_step=int(d["start_step"]),
      commit_at=int(d["commit_at"]),
      events=[SignalEvent.from_dict(e) for e in d["events"]],
      signals=d.get("signals", {}),
    )


@dataclasses.dataclass
class RunState:
  """Everything outside the train state that a resumed run needs (see the module docstring).

  Attributes:
    step: GRPO steps done (0 after the bootstrap: D0, warm-start, eval before).
    np_rng: host randomness (task sampling, D0 exploration, warm-start batches).
    key: JAX PRNG key for sampling rollouts; split once per rollout call.
    events: signal events since the last round started (the next round's candidates).
    round: feedback rounds started so far.
    pending: the round in flight, if any.
    signals: `SignalTracker.state_dict()` as of the last checkpoint.
    tasks_synthesized / tasks_accepted / tasks_dropped: totals over committed rounds.
    validation: per committed round, the validation pass rate (None when nothing was synthesized).
    feedback_synth_s: seconds the feedback worker spent synthesizing, over all rounds.
    phase_s: wall seconds per phase of the loop, over the whole run (all sessions).
    wall_s: wall seconds of the whole run as of the last checkpoint (all sessions).
    eval_before: greedy success rate on the held-out split before GRPO.
    eval_generated_before: greedy figures on the generated held-out set before GRPO
      (`evaluation.Evaluator.evaluate_generated`), None without one.
    eval_generated_init: the same figures before the warm-start (`eval.generated_before_warmstart`),
      None when not measured.
    d0: how D0 was made (the suite's counts plus pool added / dropped).
    pool_size: tasks in the pool at the last checkpoint (a resume rolls the pool back to it).
    suite_eval: per evaluation tag ("before", "after"), the suite's own figures (e.g. TGC/SGC).
    sampler: the task sampler's state (`feedback.sampler.TaskSampler.state_dict`).
    hooks: per training hook's name, its state (`hooks.TrainingHook.state_dict`).
  """

  step: int
  np_rng: np.random.Generator
  key: jax.Array
  events: list[SignalEvent] = dataclasses.field(default_factory=list)
  round: int = 0
  pending: RoundInFlight | None = None
  signals: dict[str, Any] | None = None
  tasks_synthesized: int = 0
  tasks_accepted: int = 0
  tasks_dropped: int = 0
  validation: list[float | None] = dataclasses.field(default_factory=list)
  feedback_synth_s: float = 0.0
  phase_s: dict[str, float] = dataclasses.field(default_factory=dict)
  wall_s: float = 0.0
  eval_before: float | None = None
  eval_generated_before: dict[str, float] | None = None
  eval_generated_init: dict[str, float] | None = None
  d0: dict[str, int] = dataclasses.field(default_factory=dict)
  pool_size: int = 0
  suite_eval: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
  sampler: dict[str, Any] = dataclasses.field(default_factory=dict)
  hooks: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

  @classmethod
  def fresh(cls, seed: int) -> RunState:
    """The state of a run that has done nothing yet: both random streams seeded by `seed`."""
    return cls(step=0, np_rng=np.random.default_rng(seed), key=jax.random.key(seed))

  def to_json(self) -> dict[str, Any]:
    """A JSON-serialisable dict (the checkpoint's `meta` item; `from_json` reads it back)."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    out.update(
      np_rng=self.np_rng.bit_generator.state,
      key=jax.random.key_data(self.key).tolist(),
      events=[e.to_dict() for e in self.events],
      pending_round=None if self.pending is None else self.pending.to_json(),
      validation=list(self.validation),
      phase_s=dict(self.phase_s),
      d0=dict(self.d0),
      suite_eval=dict(self.suite_eval),
      sampler=dict(self.sampler),
      hooks=dict(self.hooks),
    )
    del out["pending"]
    return out

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> RunState:
    """Reads `to_json`'s dict; keys it does not know (e.g. the saved config) are ignored.

    Raises:
      KeyError: `step`, `np_rng` or `key` is missing (not a run state).
    """
    np_rng = np.random.default_rng()
    np_rng.bit_generator.state = d["np_rng"]
    known = {f.name for f in dataclasses.fields(cls)} - {"np_rng", "key", "events", "pending"}
    pending = d.get("pending_round")
    return cls(
      np_rng=np_rng,
      key=jax.random.wrap_key_data(jnp.asarray(d["key"], jnp.uint32)),
      events=[SignalEvent.from_dict(e) for e in d.get("events", [])],
      pending=None if not pending else RoundInFlight.from_json(pending),
      **{k: v for k, v in d.items() if k in known},
    )
