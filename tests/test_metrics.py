"""PhaseTimer: phases accumulate, per-step figures pop, seconds move between phases."""

import pytest

from coevolve_jax.metrics import PhaseTimer


def test_move_reassigns_seconds_in_totals_and_the_current_step():
  timer = PhaseTimer({"rollout": 10.0})
  with timer("rollout"):
    pass
  timer.totals["rollout"] = 12.0  # fixed figures instead of measured ones
  timer.last["rollout"] = 2.0
  timer.move(0.5, src="rollout", dst="reward")
  assert timer.totals == {"rollout": 11.5, "reward": 0.5}
  assert timer.last == {"rollout": 1.5, "reward": 0.5}
  timer.move(0.25, src="rollout", dst="reward")  # onto a phase already there
  assert timer.totals["reward"] == 0.75 and timer.last["reward"] == 0.75
  assert sum(timer.totals.values()) == pytest.approx(12.0)
  assert timer.pop_last() == {"timing/rollout": 1.25, "timing/reward": 0.75}
  timer.move(1.0, src="train", dst="eval")  # phases not seen yet start from 0
  assert timer.totals["train"] == -1.0 and timer.totals["eval"] == 1.0
  assert timer.pop_last() == {"timing/train": -1.0, "timing/eval": 1.0}
  assert timer.pop_last() == {}
