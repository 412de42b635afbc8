"""The CPU preset as shipped compiles nothing after GRPO step 2 (issue 17, bounded compiles).

Slow (about 10 minutes on 2 cores: the preset's D0, warm-start, evaluations and four GRPO steps),
so it runs in `make test-slow`, not in `make test`; the fast suite checks the parts: the engine's
and the trainer's `compile_ahead` leave nothing to compile (tests/test_engine.py,
tests/test_trainer.py) and the end-to-end run compiles none of those programs in its steps
(tests/test_main_e2e.py).
"""

import json
import os

import pytest
from test_main_e2e import _load_config_module

from coevolve_jax.loop import CoEvolveRun


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_cpu_preset_compiles_nothing_after_grpo_step_2(tmp_path):
  cfg = _load_config_module().get_config("cpu")
  cfg.train.steps = 4  # a feedback round joins the pool after step 3 (feedback.every = 3)
  workdir = str(tmp_path / "run")
  CoEvolveRun(cfg, workdir).fit()
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  counts = {r["step"]: r for r in rows if "compile/count" in r}
  assert sorted(counts) == [0, 1, 2, 3, 4]
  ahead = ("_prefill_rows", "_generate_steps", "_generate", "_grpo_step_fn", "_logp_fn")
  for step in (1, 2):  # compiled ahead: none of the engine's or the train step's programs
    assert not any(f"compile/program/{p}" in counts[step] for p in ahead), counts[step]
  for step in (3, 4):  # step 4's row also holds the evaluations after training
    assert counts[step]["compile/count"] == 0, counts[step]
