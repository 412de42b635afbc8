"""A promotion gate over training branches (EvoTrainer, arXiv 2606.03108, Sec. 3.3).

EvoTrainer changes one factor of the training harness per policy version and keeps the version
only if the main score does not regress and the metric the change targets improves. It selects
on the split it reports; this gate does not. From each source run's newest checkpoint (one
source per seed: the pairing) it runs a *baseline* branch (the source's config) and one branch
per candidate intervention (config overrides) for `steps` GRPO steps each, then decides with

  - the selection score: success on the run's generated held-out set (`eval.generated_tasks`,
    tasks made by unguided exploration from the evaluation entries' states with another seed,
    frozen before training and kept out of the pool; `summary.eval_generated_after`), never
    the reported split (`eval_after`, which is recorded beside it and read by nothing here);
  - the candidate's targeted diagnostic (`diag/<target>` of `coevolve_jax.diagnostics`), its
    mean over the branch's steps;

both as paired differences against the baseline branch of the same source. A candidate passes
when the mean selection difference is >= -`tolerance` (no regression) and the target moved the
way the candidate says (`better`: "lower" or "higher") by a mean above its `min_gain` (0.01);
of those that pass, the one with the largest selection gain (then target gain) is promoted.
Every candidate's record (trigger, intervention, expected outcome, validation, decision,
reason) is written to a skills file (JSON lines) that a later run reads
(`diagnostics.skills`: an alert on a figure names the interventions promoted for it). Branches
are ordinary run folders under the gate's folder, so a rerun of the same command resumes: a
finished branch is read back, a killed one resumes from its last checkpoint. The gate runs on
one process, as scripts/ablations.py does.

    python -m coevolve_jax.cli.gate --source=runs/bfcl_cpu --steps=2 --out=runs/gate \\
        --candidate='{"name": "drop_dead", "overrides": {"train.drop_dead_groups": true},
                      "target": "dead_groups", "better": "lower"}'
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from coevolve_jax import backtest
from coevolve_jax.metrics import write_atomic

BASELINE = "baseline"
SKILLS = "skills.jsonl"
RECORD = "gate.json"
BRANCH = "branched_from.json"  # in each branch: its source, the source's step, its overrides
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclasses.dataclass(frozen=True)
class Candidate:
  """An intervention to try: `overrides` (dotted config field -> JSON value) that should move
  `diag/<target>` the `better` way ("lower" or "higher") by more than `min_gain` (in the
  figure's units; most diagnostics are shares in [0, 1]), so that float noise or two branches
  that happen to match promote nothing."""

  name: str
  overrides: dict[str, Any]
  target: str
  better: str = "lower"
  min_gain: float = 0.01

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Candidate":
    """Raises ValueError for a missing field, a name that is not a folder name (or is
    "baseline"), empty overrides or `better` not "lower"/"higher"."""
    try:
      if not isinstance(d["name"], str) or not isinstance(d["target"], str):
        raise TypeError("name and target must be strings")
      c = cls(
        d["name"],
        dict(d["overrides"]),
        d["target"],
        str(d.get("better", "lower")),
        float(d.get("min_gain", 0.01)),
      )
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(
        f"candidate {dict(d)!r}: want name, overrides (field -> value), target[, better, "
        f"min_gain] ({e})"
      ) from None
    if not _NAME.match(c.name) or c.name == BASELINE:
      raise ValueError(f"candidate name {c.name!r}: letters, digits, _ . - only, not {BASELINE!r}")
    if not c.overrides:
      raise ValueError(f"candidate {c.name}: no overrides (the baseline branch is run anyway)")
    if c.better not in ("lower", "higher"):
      raise ValueError(f"candidate {c.name}: better must be 'lower' or 'higher', got {c.better!r}")
    if not c.min_gain >= 0:
      raise ValueError(f"candidate {c.name}: min_gain must be >= 0, got {c.min_gain}")
    return c

  @property
  def key(self) -> str:
    return self.target if "/" in self.target else f"diag/{self.target}"


@dataclasses.dataclass
class Branch:
  """What one branch (a candidate or the baseline, from one source) gave.

  Attributes:
    selection: success (0-1) on the generated held-out set after the branch's steps.
    target: per candidate name, the mean of its target figure over the branch's steps (None
      where the rows lack it).
    reported: `eval_after` (the reported split): recorded, never decided on.
  """

  name: str
  source: str
  selection: float
  target: dict[str, float | None]
  reported: float | None = None


@dataclasses.dataclass
class Decision:
  candidate: str
  passed: bool
  promoted: bool
  reason: str
  selection_gain: float
  target_gain: float | None


def decide(
  candidates: Sequence[Candidate], branches: Sequence[Branch], tolerance: float = 0.0
) -> list[Decision]:
  """The gate's rule (module docstring) over finished branches: one `Decision` per candidate,
  at most one promoted. Reads `selection` and `target` only (never `reported`).

  Raises:
    ValueError: a candidate or source without its baseline branch.
  """
  base = {b.source: b for b in branches if b.name == BASELINE}
  out = []
  for c in candidates:
    mine = [b for b in branches if b.name == c.name]
    if not mine or any(b.source not in base for b in mine):
      raise ValueError(f"candidate {c.name}: every source needs its candidate and baseline branch")
    sel = [b.selection - base[b.source].selection for b in mine]
    sign = -1.0 if c.better == "lower" else 1.0
    tgt = [
      sign * (b.target[c.name] - base[b.source].target[c.name])  # type: ignore[operator]
      for b in mine
      if b.target.get(c.name) is not None and base[b.source].target.get(c.name) is not None
    ]
    sel_gain = float(np.mean(sel))
    tgt_gain = float(np.mean(tgt)) if len(tgt) == len(mine) else None
    if sel_gain < -tolerance:
      passed, reason = (
        False,
        f"selection score regressed by {-sel_gain:.4g} (tolerance {tolerance:g})",
      )
    elif tgt_gain is None:
      passed, reason = False, f"the branches did not report {c.key}"
    elif tgt_gain <= c.min_gain:
      passed = False
      reason = (
        f"{c.key} did not move {c.better} by more than {c.min_gain:g} (paired mean change "
        f"{sign * tgt_gain + 0.0:+.4g})"
      )
    else:
      passed = True
      reason = f"selection {sel_gain:+.4g}, {c.key} {sign * tgt_gain:+.4g} ({c.better} is better)"
    out.append(Decision(c.name, passed, False, reason, sel_gain, tgt_gain))
  passing = [d for d in out if d.passed]
  if passing:
    best = max(passing, key=lambda d: (d.selection_gain, d.target_gain))
    best.promoted = True
    best.reason = "promoted: " + best.reason
    for d in passing:
      if not d.promoted:
        d.reason = f"passed, not the best (the gate promotes {best.candidate}): " + d.reason
  return out


def branch_figures(workdir: str, after_step: int, candidates: Sequence[Candidate], name: str):
  """A finished branch's `Branch` from its summary.json and metrics.jsonl rows after
  `after_step` (the source's checkpoint).

  Raises:
    RuntimeError: the branch has no generated held-out set (the source ran without
      `eval.generated_tasks`).
  """
  path = os.path.join(workdir, "summary.json")
  with open(path, encoding="utf-8") as f:
    try:
      summary = json.load(f)
    except ValueError as e:
      raise RuntimeError(f"{path} is damaged ({e})") from None
  generated = summary.get("eval_generated_after")
  if not generated:
    raise RuntimeError(
      f"{workdir}: no generated held-out set to select on: the source run needs "
      "eval.generated_tasks > 0 (the gate never selects on the reported split)"
    )
  path = os.path.join(workdir, "metrics.jsonl")
  with open(path, encoding="utf-8") as f:
    try:
      rows = [json.loads(line) for line in f if line.strip()]
    except ValueError as e:
      raise RuntimeError(f"{path} is damaged ({e}): resume the branch to set it right") from None
  rows = [r for r in rows if r.get("step", 0) > after_step and "reward/mean" in r]
  target: dict[str, float | None] = {}
  for c in candidates:
    vals = [r[c.key] for r in rows if isinstance(r.get(c.key), (int, float))]
    target[c.name] = float(np.mean(vals)) if vals else None
  return Branch(name, "", float(generated["success"]), target, summary.get("eval_after"))


def newest_checkpoint(workdir: str) -> int:
  """The newest checkpoint step of a run folder.

  Raises:
    FileNotFoundError: none there.
  """
  folder = os.path.join(workdir, "checkpoints")
  steps = [int(x) for x in os.listdir(folder) if x.isdigit()] if os.path.isdir(folder) else []
  if not steps:
    raise FileNotFoundError(f"{workdir}: no checkpoint to branch from")
  return max(steps)


def _check_branch(workdir: str, want: dict[str, Any]) -> None:
  """Raises RuntimeError unless the branch folder was made as `want` says (source, its step,
  overrides, steps): a rerun after the source trained on, or with a candidate changed under
  its name, would otherwise compare branches from different starts."""
  path = os.path.join(workdir, BRANCH)
  try:
    with open(path, encoding="utf-8") as f:
      made = json.load(f)
  except (OSError, ValueError):
    made = None
  if made != json.loads(json.dumps(want, sort_keys=True)):
    raise RuntimeError(
      f"{workdir} was branched as {made}, not as this gate asks ({want}): give the gate "
      "another --out, or move the folder aside"
    )


def _source_trigger(workdir: str, c: Candidate) -> dict[str, Any]:
  """What the source showed when the gate ran: the target's last value and the alerts."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [r for r in map(json.loads, f) if "reward/mean" in r]
  last = rows[-1] if rows else {}
  return {"figure": c.key, "value": last.get(c.key), "alerts": last.get("alerts", [])}


def _skill_lines(path: str) -> list[tuple[str, dict[str, Any] | None]]:
  """A skills file's lines with their records (None for a torn line, which is kept as it is).

  Raises:
    ValueError: the path is a folder, or a whole line is not a skill record (a JSON object with
      "gate" and "candidate"): not a skills file, which the gate never rewrites.
  """
  if os.path.isdir(path):
    raise ValueError(f"--skills {path} is a folder, not a skills file")
  if not os.path.exists(path):
    return []
  out: list[tuple[str, dict[str, Any] | None]] = []
  with open(path, encoding="utf-8", errors="replace") as f:
    for n, line in enumerate(f.read().splitlines(), 1):
      if not line.strip():
        continue
      try:
        r = json.loads(line)
      except ValueError:
        out.append((line, None))
        continue
      if not (isinstance(r, dict) and "gate" in r and "candidate" in r):
        raise ValueError(f"{path}:{n} is not a skill record: not a skills file the gate writes")
      out.append((line, r))
  return out


def _plan(sources, candidates, steps, out, tolerance, skills, defaults) -> list[tuple]:
  """Every branch to run, (source, its step, name, folder, config, how it is made), checked
  before any trains: a gate that would fail on its third branch fails at once instead.

  Raises:
    ValueError: no source or candidate, a repeated name, steps < 1, a tolerance that is not a
      finite number >= 0, `out` inside a source (a copy would copy itself), a candidate whose
      config the run's checks refuse, a target the source never reported, a skills path that
      is not a skills file.
    FileNotFoundError, RuntimeError: a source without a checkpoint, config or generated set.
  """
  from coevolve_jax import config as run_config  # noqa: PLC0415

  if not sources:
    raise ValueError("give at least one source run folder")
  if not candidates or len({c.name for c in candidates}) < len(candidates):
    raise ValueError("give at least one candidate, each with its own name")
  if not isinstance(steps, int) or steps < 1:
    raise ValueError(f"steps must be an int >= 1, got {steps!r}")
  if not (isinstance(tolerance, (int, float)) and 0 <= tolerance < float("inf")):
    raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
  _skill_lines(skills or os.path.join(out, SKILLS))
  if skills and not os.path.isdir(os.path.dirname(os.path.abspath(skills))):
    raise ValueError(f"--skills {skills}: its folder does not exist")
  plan = []
  for i, src in enumerate(sources):
    a, b = os.path.realpath(src), os.path.realpath(out)
    if os.path.commonpath([a, b]) == a:
      raise ValueError(f"the gate's folder {out} is inside the source {src}: give another --out")
    step = newest_checkpoint(src)
    base = backtest.run_config_of(src, defaults)
    if not os.path.exists(os.path.join(src, "eval_generated.jsonl")):
      raise RuntimeError(
        f"{src}: no generated held-out set to select on (eval_generated.jsonl): the source run "
        "needs eval.generated_tasks > 0 (the gate never selects on the reported split)"
      )
    reported = _reported_figures(src)
    for c in candidates:
      if reported and c.key not in reported:
        raise ValueError(
          f"candidate {c.name}: the source {src} never reported {c.key} (it reports "
          f"{sorted(k for k in reported if k.startswith('diag/'))})"
        )
    for name, overrides in [(BASELINE, {}), *((c.name, c.overrides) for c in candidates)]:
      try:
        cfg = backtest.set_fields(base, {**overrides, "train.steps": step + steps})
        run_config.validate(cfg)
      except ValueError as e:
        raise ValueError(f"branch {name} from {src}: {e}") from None
      made = {"step": step, "overrides": overrides, "steps": steps}
      plan.append((src, step, name, os.path.join(out, f"{name}-{i}"), cfg, made))
  return plan


def _reported_figures(workdir: str) -> set[str]:
  """The diag/ keys of a run's GRPO rows (empty for a run from before the diagnostics)."""
  path = os.path.join(workdir, "metrics.jsonl")
  keys: set[str] = set()
  if os.path.exists(path):
    with open(path, encoding="utf-8", errors="replace") as f:
      for line in f:
        try:
          row = json.loads(line)
        except ValueError:
          continue
        if isinstance(row, dict):
          keys.update(k for k in row if k.startswith("diag/"))
  return keys


def run_gate(
  sources: Sequence[str],
  candidates: Sequence[Candidate],
  steps: int,
  out: str,
  *,
  tolerance: float = 0.0,
  skills: str = "",
  defaults: Any = None,
  fit: Callable[[Any, str], dict[str, Any]] | None = None,
) -> dict[str, Any]:
  """Runs the branches (resuming what a killed gate left), decides, writes `<out>/gate.json`
  and one skill record per candidate to `skills` (default `<out>/skills.jsonl`; a rerun of the
  same gate folder replaces its records, other gates' records stay).

  Args:
    sources: run folders, one per seed, each with a checkpoint, config.json and the generated
      held-out set.
    candidates: the interventions.
    steps: GRPO steps each branch trains after the source's newest checkpoint.
    out: the gate's folder (`<candidate>-<i>` per branch, i the source's index).
    tolerance: how far the mean selection score may fall and still count as no regression.
    defaults: the sources' config file as loaded now (a ConfigDict): their config.json is laid
      over it (`backtest.run_config_of`), so a run made before a config group existed branches
      with that group's defaults. None: config.json alone.
    fit: `(cfg, workdir) -> summary` that trains a branch (default `CoEvolveRun(cfg, workdir)
      .fit()`; tests pass their own).
  Returns:
    The gate's record (also in gate.json).
  Raises:
    ValueError, FileNotFoundError, RuntimeError: `_plan`'s, before any branch trains; a
      branch's training errors as raised.
  """
  plan = _plan(sources, candidates, steps, out, tolerance, skills, defaults)
  if fit is None:
    from coevolve_jax.loop import CoEvolveRun  # noqa: PLC0415 (JAX and the model: only to train)

    def fit(cfg, workdir):
      return CoEvolveRun(cfg, workdir).fit()

  from coevolve_jax.workdir import copy_run  # noqa: PLC0415

  os.makedirs(out, exist_ok=True)
  branches: list[Branch] = []
  at = {src: step for src, step, *_ in plan}
  for src, step, name, workdir, cfg, made in plan:
    if not os.path.exists(workdir):
      copy_run(src, workdir, marker=BRANCH, note=made)
    _check_branch(workdir, {"start": os.path.abspath(src), **made})
    print(f"=== gate branch {name} from {src} (step {step} + {steps}) -> {workdir}", flush=True)
    fit(cfg, workdir)
    b = branch_figures(workdir, step, candidates, name)
    b.source = src
    branches.append(b)
  decisions = decide(candidates, branches, tolerance)
  date = datetime.date.today().isoformat()
  record = {
    "date": date,
    "sources": {s: at[s] for s in sources},
    "steps": steps,
    "tolerance": tolerance,
    "selection": "eval_generated_after.success",
    "branches": [dataclasses.asdict(b) for b in branches],
    "decisions": [dataclasses.asdict(d) for d in decisions],
  }
  write_atomic(os.path.join(out, RECORD), json.dumps(record, indent=1, sort_keys=True))
  skills = skills or os.path.join(out, SKILLS)
  gate_id = os.path.abspath(out)
  # This run's candidates' records replace those an earlier run of the same gate wrote; every
  # other line of the file is kept as it is.
  mine_now = {(gate_id, c.name) for c in candidates}
  others = [
    line
    for line, r in _skill_lines(skills)
    if r is None or (r.get("gate"), r.get("candidate")) not in mine_now
  ]
  lines = []
  for c, d in zip(candidates, decisions):
    mine = [b for b in branches if b.name in (c.name, BASELINE)]
    lines.append(
      json.dumps(
        {
          "gate": gate_id,
          "candidate": c.name,
          "date": date,
          "trigger": _source_trigger(sources[0], c),
          "intervention": c.overrides,
          "expected": {"figure": c.key, "better": c.better},
          "validation": {
            "steps": steps,
            "sources": len(sources),
            "selection_gain": d.selection_gain,
            "target_gain": d.target_gain,
            "branches": [dataclasses.asdict(b) for b in mine],
          },
          "decision": "promoted" if d.promoted else ("passed" if d.passed else "refused"),
          "reason": d.reason,
        },
        sort_keys=True,
      )
    )
  write_atomic(skills, "".join(line + "\n" for line in others + lines))
  return record
