"""CoEvolve ablation grid: paired runs over seeds, a table with confidence intervals, per-signal
accounting and plots.

    .venv/bin/python scripts/ablations.py --seeds 0,1,2                  # the CPU grid (~3 h)
    .venv/bin/python scripts/ablations.py --config configs/bfcl.py --preset qwen3_4b \
        --steps 120 --set model.checkpoint='"/ckpt/Qwen3-4B"'            # accelerator scale

Variants (paper Sec. 4 ablations; docs/design.md §1.1-1.3): the full loop, GRPO only (no feedback
rounds: the reference), random re-exploration (no signals), and the single-signal drops and no
validation when asked for (`--variants`). Every variant is `--config` (default the CPU preset,
`configs/bfcl.py:cpu`) with one switch changed, run for every seed in `--seeds`. Runs of one seed
share one start: step 0 (D0, the warm-start, the evaluation sets and the figures before training)
runs once per seed in `start-s<seed>` (`CoEvolveRun.bootstrap`, with the full loop's config) and
every variant of the seed whose switch step 0 does not read (`STEP0_UNREAD`: all but
`no_validation`, which makes its own) resumes from a copy of it, so a seed pays for one
warm-start (`--no-shared-start`: every run makes its own, as the same seed makes the same one).
The script checks that they started alike (D0 counts, warm-start losses and the figures
before training equal) and says so in the record.

Each run has its own workdir under `--workdir` (`<variant>-s<seed>`); all share one persistent
compilation cache there (`GRID_CACHE`, unless the config, `--set compile.cache_dir=...` or
JAX_COMPILATION_CACHE_DIR names a folder other than the default "auto"). A rerun of the same
command resumes the grid: finished runs are read back, a killed run resumes from its last
checkpoint (a killed start from scratch). What the record needs from each finished run is also
saved beside the plots (`<out>/runs/<variant>-s<seed>.json`, small enough to commit), so a grid
spans sessions whose workdirs are gone: a saved run made with the same settings (but how programs
are compiled) is read back instead of run again. Each workdir lists the code versions (commits)
and CPUs that ran it (`CODE_FILE`), saved with the run, and the record says whether all runs ran
the same code on the same CPU: a pair whose runs ran different code, or on another CPU
(sessions apart), differs by more than its switch.
`--report` only rebuilds the record and plots from the workdirs.

Figures per run (`FIGURES`): the held-out BFCL success before and after, the generated held-out
set's success and mean reward before and after (`eval.generated_tasks`: an in-distribution proxy a
small model can move), mean rollout reward, and greedy success after training on the D0 tasks.
For every variant against the reference (and the full loop against every other variant) the
record gives, per figure, the per-seed differences' mean and a 95% t confidence interval; a
variant is called better (worse) only when the interval lies above (below) zero.

Per-signal accounting (paper Sec. 5 analysis): per round, which signals the accepted tasks came
from (feedback.jsonl); after training (`eval.pool_after`), greedy success on each signal's
synthesized tasks, and on the pool tasks that fired each signal during training (did boundary
tasks move from mixed to solved? did forgotten tasks recover?), from groups.jsonl and
eval_pool_after.jsonl.

Outputs: the record (date, machine, exact command, tables, plot links) written into the ablations
document (`--doc`, default `--out` plus `.md`: docs/ablations.md) between its `ablations:record`
markers, keeping the rest of the document (`write_record`); PNG plots under `--out`. matplotlib
is needed for the plots (`pip install -e '.[plots]'`).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, ROOT)

VARIANTS: dict[str, dict[str, Any]] = {
  "coevolve": {},
  "no_forgetting": {"feedback.kinds": ("boundary", "rare")},
  "no_boundary": {"feedback.kinds": ("forgetting", "rare")},
  "no_rare": {"feedback.kinds": ("forgetting", "boundary")},
  "random_reexplore": {"feedback.mode": "random"},
  "no_validation": {"feedback.validate": False},
  "grpo_only": {"feedback.enabled": False},
  # Role-Agent (issue 43; docs/design.md §8.1-8.2): AIW beside synthesis, AIW instead of it, and
  # WIA. A prediction of the next observation does not fit the CPU presets' 64-token replies, so
  # WIA's variant predicts at most 200 characters in replies of up to 128 tokens (its cost).
  "aiw": {"role_agent.aiw.enabled": True},
  "aiw_only": {"role_agent.aiw.enabled": True, "feedback.enabled": False},
  "wia": {
    "role_agent.wia.enabled": True,
    "role_agent.wia.char_cap": 200,
    "episode.max_new_tokens": 128,
    "eval.max_new_tokens": 128,
    "train.target_buckets": (256, 384, 768),
  },
  # Q-Evolve's critic advantages in the GRPO step (issue 44; docs/design.md §8.3), in the
  # paper's order (Alg. 1: fit the critic on the step's episodes, then read their advantages),
  # the order that reached the credit benchmark's target sooner (docs/benchmarks/qevolve.md).
  "qevolve": {"qevolve.enabled": True, "qevolve.order": "fit_first"},
}
REFERENCE = "grpo_only"
DEFAULT_VARIANTS = ("coevolve", "grpo_only", "random_reexplore")
DEFAULT_CONFIG = "configs/bfcl.py:cpu"
SIGNALS = ("forgetting", "boundary", "rare")


@functools.cache
def _bench_common():
  """benchmarks/common.py (`cpu_name`), loaded once."""
  return _load_module("bench_common", os.path.join("benchmarks", "common.py"))


def _load_module(name: str, path: str):
  """The Python file at `path` (relative to the repository root) loaded as module `name`."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_config(variant: str, seed: int, overrides: dict[str, Any], config: str = DEFAULT_CONFIG):
  """`config` ("path/to/config.py[:variant]", relative to the repository) with `variant`'s switch,
  `seed` and `overrides` (dotted keys) applied.

  Raises:
    KeyError: an override names a field the config does not have.
  """
  path, _, name = config.partition(":")
  cfg = _load_module("run_config", path).get_config(name)
  cfg.seed = seed
  for key, value in {**VARIANTS[variant], **overrides}.items():
    node = cfg
    *parents, leaf = key.split(".")
    for part in parents:
      node = node[part]
    if leaf not in node:
      raise KeyError(f"--set {key}: the config has no field {leaf!r} there")
    node[leaf] = value
  return cfg


# The workdir (`<START>-s<seed>`) where a seed's step 0 runs once (`CoEvolveRun.bootstrap`: D0,
# warm-start, the evaluations before training, checkpoint 0), with the full loop's config.
START = "start"
START_VARIANT = "coevolve"
# The fields step 0 does not read (the loop reads them in GRPO steps and feedback rounds only).
# A variant whose switch is among them resumes from a copy of the seed's start; any other makes its
# own step 0: `no_validation`, since AppWorld's D0 validation follows `feedback.validate`.
STEP0_UNREAD = frozenset(
  {"feedback.enabled", "feedback.mode", "feedback.kinds", "role_agent.aiw.enabled"}
)
# Written into the start once its step 0 is done, and into each copy (what the record reports).
START_DONE, COPIED_FROM = "start_done.json", "copied_from_start.json"
# The code versions (`code_version`, and the CPU) that worked on a workdir, in order, each once: a
# run resumed across sessions, or a variant resumed from its seed's start, lists every one.
CODE_FILE = "code_versions.json"
# What a copy of the start leaves out: a run's own files (`workdir.RUN_OWN_FILES`: config,
# summary, lock; written out here, since this module imports the package only where it runs one)
# and the start's mark.
START_OWN_FILES = ("config.json", "summary.json", "run.lock", "run.lock.owner", START_DONE)


# Fields a finished start may have been made with other values of: GRPO steps, and how programs
# are compiled (ahead or lazily, threads, the cache they are kept in).
COMPILE_ONLY = frozenset({"compile.ahead", "compile.threads", "compile.cache_dir"})
# The feedback clock (when rounds run and join the pool) and the synthesized share of a draw are
# read in GRPO steps only, like the number of steps.
SCHEDULE = frozenset(
  {"feedback.every", "feedback.lag", "feedback.concurrent", "pool.synth_fraction"}
)
START_MAY_DIFFER = STEP0_UNREAD | COMPILE_ONLY | SCHEDULE | {"train.steps"}
# What a run without feedback rounds and without AIW (GRPO only) never reads: its rounds' clock,
# contexts and signals, and the synthesized share of a draw (no synthesized task joins its pool,
# and `TaskPool.sample` then makes the same random calls as a proportional draw). Two such runs
# that differ only here ran the same thing.
UNREAD_WITHOUT_ROUNDS = SCHEDULE | {"feedback.max_contexts", "feedback.kinds", "feedback.mode"}
# JAX's persistent compilation cache shared by every run of the grid (`compile.cache_dir`, unless
# the config, --set or JAX_COMPILATION_CACHE_DIR gives one): its runs compile the same programs
# (the switches change no shape), so each run after the first loads them instead of compiling.
GRID_CACHE = "xla_cache"


def shares_start(variant: str) -> bool:
  """Whether `variant` can resume from the seed's shared step 0 (its switch is not read there)."""
  return set(VARIANTS[variant]) <= STEP0_UNREAD


def ensure_start(
  start: str, cfg, overrides: dict[str, Any] | None = None, code: str | None = None
) -> None:
  """Runs step 0 in `start` unless it is done (`START_DONE` there, written after it).

  Raises:
    RuntimeError: `start` holds a run past step 0 (a variant would resume from that step), or a
      finished start was made with other settings than `cfg`'s (but `START_MAY_DIFFER`, and
      fields added to the project since, unless `overrides` names them: `changed_settings`).
  """
  from coevolve_jax.loop import CoEvolveRun  # pylint: disable=g-import-not-at-top

  if os.path.exists(os.path.join(start, START_DONE)):
    with open(os.path.join(start, "config.json"), encoding="utf-8") as f:
      made = json.load(f)
    changed = changed_settings(made, cfg, overrides, START_MAY_DIFFER)
    if changed:
      raise RuntimeError(
        f"{start} was made with other settings ({', '.join(changed)}); its variants would not "
        f"run the config asked for: use another --workdir, or move {start} aside"
      )
    return
  print(f"=== start of seed {cfg.seed} (D0, warm-start, eval before) -> {start}", flush=True)
  run = CoEvolveRun(cfg, start)  # makes the folder
  if code:
    note_code(start, code)
  step = run.bootstrap()
  if step != 0:
    raise RuntimeError(
      f"{start} holds a checkpoint at step {step}, not a step-0 start: move it aside"
    )
  with open(os.path.join(start, START_DONE), "w", encoding="utf-8") as f:
    json.dump({"step": 0, "seed": cfg.seed}, f)


def code_version() -> str:
  """The commit this checkout runs (12 hex digits), "+dirty" where tracked files differ from it
  (the run's code is then not that commit's), or "unknown" where git cannot say."""
  try:
    git = functools.partial(subprocess.run, cwd=ROOT, capture_output=True, text=True, check=True)
    commit = git(["git", "rev-parse", "--short=12", "HEAD"]).stdout.strip()
    dirty = git(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return commit + ("+dirty" if dirty else "")


def note_code(workdir: str, version: str) -> list[str]:
  """Adds `version` to the code versions that worked on `workdir` (`CODE_FILE`, replaced by
  `metrics.write_atomic`) unless it is the last one there; returns the list."""
  from coevolve_jax.metrics import write_atomic  # pylint: disable=g-import-not-at-top

  path = os.path.join(workdir, CODE_FILE)
  versions = read_json_list(path)
  if versions[-1:] != [version]:
    versions.append(version)
    write_atomic(path, json.dumps(versions))
  return versions


def code_sentence(results: dict[str, list[dict[str, Any]]]) -> str:
  """Which code (and CPU) the runs ran: one for all, or each run's (a seed's pair that ran
  different code, or on another CPU, differs by more than its variant's switch). Runs saved
  before the grid noted them count as unknown."""
  each = {
    f"{v}-s{r['seed']}": ", ".join(r.get("code") or ["unknown"])
    for v, rs in results.items()
    for r in rs
  }
  if len(set(each.values())) == 1:
    return f"Code: every run at {next(iter(each.values()))}."
  listed = "; ".join(f"{name}: {versions}" for name, versions in each.items())
  return f"Code: **the runs ran different code or CPUs** (in the order they ran): {listed}."


def copy_start(start: str, workdir: str) -> None:
  """Makes `workdir` a copy of the seed's step-0 workdir `start` (checkpoint 0, D0 pool, frozen
  generated held-out set, step 0's logs), so `CoEvolveRun(...).fit()` there resumes from
  checkpoint 0, and marks it (`COPIED_FROM`); `workdir.copy_run`, which a killed copy leaves
  no trace of.

  Raises:
    FileExistsError: `workdir` exists (a run of its own is there).
  """
  from coevolve_jax.workdir import copy_run  # pylint: disable=g-import-not-at-top

  copy_run(start, workdir, leave_out=START_OWN_FILES, marker=COPIED_FROM)


def saved_path(out: str, variant: str, seed: int) -> str:
  """Where the grid saves what the record needs from run `variant`-s`seed` (`save_run`)."""
  return os.path.join(out, "runs", f"{variant}-s{seed}.json")


def changed_settings(
  made: dict[str, Any], cfg, overrides: dict[str, Any] | None, ignore: frozenset[str] = COMPILE_ONLY
) -> list[str]:
  """The settings (dotted names) in which `cfg` differs from `made` (a run's config.json), but
  `ignore`, and `UNREAD_WITHOUT_ROUNDS` where both are GRPO only. A field `made` lacks was added
  to the project after it was written, with a default that keeps earlier behaviour (the project's
  rule for new options), so it differs only where `overrides` (the command's --set) names it."""
  made, now = _settings(made), _settings(json.loads(cfg.to_json_best_effort()))
  if all(
    c.get("feedback.enabled") is False and not c.get("role_agent.aiw.enabled") for c in (made, now)
  ):
    ignore = ignore | UNREAD_WITHOUT_ROUNDS
  named = tuple(overrides or ())
  added = {k for k in set(now) - set(made) if not any(k.startswith(n) for n in named)}
  return sorted(k for k in (set(made) | set(now)) - added - ignore if made.get(k) != now.get(k))


def _settings(cfg: dict[str, Any]) -> dict[str, Any]:
  """A config (as config.json holds it) flattened, without the fields that only say how programs
  are compiled (`COMPILE_ONLY`)."""
  from flax.traverse_util import flatten_dict  # pylint: disable=g-import-not-at-top

  return {k: v for k, v in flatten_dict(cfg, sep=".").items() if k not in COMPILE_ONLY}


def save_run(path: str, run: dict[str, Any], workdir: str) -> None:
  """Saves `run` (`collect`'s output plus the seed) with the config it ran (its config.json), by
  a rename (`metrics.write_atomic`), so a killed save leaves the previous file or none."""
  config_path = os.path.join(workdir, "config.json")
  config = None
  if os.path.exists(config_path):
    with open(config_path, encoding="utf-8") as f:
      config = json.load(f)
  from coevolve_jax.metrics import write_atomic  # pylint: disable=g-import-not-at-top

  os.makedirs(os.path.dirname(path), exist_ok=True)
  write_atomic(path, json.dumps({"config": config, "run": run}))


def load_saved(path: str, cfg, overrides: dict[str, Any] | None = None) -> dict[str, Any] | None:
  """The run saved at `path` if it ran `cfg`'s settings (`changed_settings`: but `COMPILE_ONLY`
  and fields added since that `overrides` does not name), else None (a note says which settings
  differ; the grid runs it again)."""
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    saved = json.load(f)
  if saved.get("config") is None:
    print(f"--- {path} does not say which config it ran: running it again")
    return None
  changed = changed_settings(saved["config"], cfg, overrides)
  if changed:
    print(f"--- {path} ran other settings ({', '.join(changed)}): running it again")
    return None
  return saved["run"]


def read_jsonl(path: str) -> list[dict[str, Any]]:
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def is_complete(workdir: str) -> bool:
  """Whether the run in `workdir` wrote its final summary (a rerun of the grid only reads it)."""
  path = os.path.join(workdir, "summary.json")
  if not os.path.exists(path):
    return False
  with open(path, encoding="utf-8") as f:
    return bool(json.load(f).get("complete"))


def check_workdir(workdir: str, cfg, overrides: dict[str, Any] | None = None) -> None:
  """Refuses a run in `workdir`, finished or not, made with other settings than `cfg`'s
  (`changed_settings`), so a grid whose config changed neither resumes, reports nor pairs it.

  Raises:
    RuntimeError: its config.json differs (a workdir without one, written by hand, passes).
  """
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    changed = changed_settings(json.load(f), cfg, overrides)
  if changed:
    raise RuntimeError(
      f"{workdir} ran other settings ({', '.join(changed)}) than the command's: move "
      "it aside (and its saved run under --out) or use another --workdir"
    )


def collect(workdir: str) -> dict[str, Any]:
  """What the tables and plots need from one finished run's workdir."""
  with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
    summary = json.load(f)
  rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  # feedback.jsonl: D0's row ("stage": "d0") and one per round (older runs: rounds only).
  rows_fb = read_jsonl(os.path.join(workdir, "feedback.jsonl"))
  rounds = [r for r in rows_fb if r.get("stage", "round") == "round"]
  config_path = os.path.join(workdir, "config.json")
  threshold = 0.5  # configs/bfcl.py's signals.success_threshold, for workdirs without config.json
  if os.path.exists(config_path):
    with open(config_path, encoding="utf-8") as f:
      threshold = float(json.load(f)["signals"]["success_threshold"])
  return {
    "summary": summary,
    "threshold": threshold,
    "gen_recall": _generated_recall(workdir),
    "rewards": [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r],
    "groups_mixed": [
      (r["rollout/mixed_groups"], r["rollout/groups"]) for r in rows if "rollout/groups" in r
    ],
    "warmstart": [r["warmstart/loss"] for r in rows if "warmstart/loss" in r],
    "rounds": rounds,
    "groups": read_jsonl(os.path.join(workdir, "groups.jsonl")),
    "pool_eval": read_jsonl(os.path.join(workdir, "eval_pool_after.jsonl")),
    "similarity": [v for r in rounds for v in (r.get("eval_similarity") or {}).values()],
    "shared_start": os.path.exists(os.path.join(workdir, COPIED_FROM)),
    "code": read_json_list(os.path.join(workdir, CODE_FILE)),
  }


def read_json_list(path: str) -> list[Any]:
  """The JSON list in `path`, or [] where there is none."""
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _generated_recall(workdir: str) -> dict[str, float]:
  """ "before" / "after": mean exact-call recall on the generated held-out set
  (`metrics.call_recall`), computed from the run's files, so runs whose summary does not carry
  it get it too; {} without the set."""
  from coevolve_jax.metrics import call_recall  # pylint: disable=g-import-not-at-top

  truth = {
    t["task_id"]: t["ground_truth"]
    for t in read_jsonl(os.path.join(workdir, "eval_generated.jsonl"))
  }
  out = {}
  for tag in ("before", "after"):
    rows = read_jsonl(os.path.join(workdir, f"eval_generated_{tag}.jsonl"))
    if rows and truth:
      out[tag] = statistics.fmean(call_recall(truth[r["task_id"]], r["calls"])[0] for r in rows)
  return out


def mean(xs: list[float]) -> float | None:
  return statistics.fmean(xs) if xs else None


def fmt(x: Any, digits: int = 3) -> str:
  if x is None:
    return "-"
  return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _generated(run: dict[str, Any], tag: str, key: str) -> float | None:
  figures = run["summary"].get(f"eval_generated_{tag}") or {}
  return None if figures.get(key) is None else float(figures[key])


def _mixed_share(run: dict[str, Any]) -> float | None:
  """Share of the GRPO steps' groups whose rewards were not all equal (a group of equal rewards
  gives GRPO no signal); None for runs whose metrics do not count groups."""
  mixed = [(m, n) for m, n in run["groups_mixed"] if n]
  return sum(m for m, _ in mixed) / sum(n for _, n in mixed) if mixed else None


def _mean_reward(run: dict[str, Any]) -> float | None:
  return mean([r for _, r in run["rewards"]])


def _pool_success(run: dict[str, Any], origin: str) -> float | None:
  figures = (run["summary"].get("eval_pool_after") or {}).get(origin)
  return None if figures is None else float(figures["success"])


# (name, what it is, from one run's `collect`); None where the run does not have it.
FIGURES: list[tuple[str, str, Callable[[dict[str, Any]], float | None]]] = [
  ("eval_before", "held-out BFCL success before", lambda r: r["summary"]["eval_before"]),
  ("eval_after", "held-out BFCL success after", lambda r: r["summary"]["eval_after"]),
  ("gen_before", "generated held-out success before", lambda r: _generated(r, "before", "success")),
  ("gen_after", "generated held-out success after", lambda r: _generated(r, "after", "success")),
  (
    "gen_gain",
    "generated held-out success, after - before",
    lambda r: (
      None
      if _generated(r, "after", "success") is None
      else _generated(r, "after", "success") - _generated(r, "before", "success")
    ),
  ),
  (
    "gen_recall_before",
    "generated held-out: share of ground-truth calls made (metrics.call_recall), before",
    lambda r: r["gen_recall"].get("before"),
  ),
  (
    "gen_recall_after",
    "generated held-out: share of ground-truth calls made, after",
    lambda r: r["gen_recall"].get("after"),
  ),
  (
    "gen_calls_init",
    "generated held-out: share of replies with a well-formed tool call, before the warm-start",
    lambda r: _generated(r, "init", "tool_call_rate"),
  ),
  (
    "gen_calls_before",
    "generated held-out: share of replies with a well-formed tool call, before GRPO",
    lambda r: _generated(r, "before", "tool_call_rate"),
  ),
  (
    "gen_calls_after",
    "generated held-out: share of replies with a well-formed tool call, after",
    lambda r: _generated(r, "after", "tool_call_rate"),
  ),
  ("rollout_reward", "mean rollout reward over the GRPO steps", _mean_reward),
  ("mixed_groups", "share of GRPO groups with mixed rewards", _mixed_share),
  ("d0_after", "greedy success on the D0 tasks after", lambda r: _pool_success(r, "d0")),
]


def t_interval(diffs: list[float], level: float = 0.95) -> tuple[float, float] | None:
  """The `level` Student-t confidence interval of the mean of `diffs` (paired differences, one
  per seed); None with fewer than two. Identical differences give a zero-width interval."""
  if len(diffs) < 2:
    return None
  from scipy import stats  # pylint: disable=g-import-not-at-top (installed with jax)

  m, sd = statistics.fmean(diffs), statistics.stdev(diffs)
  half = stats.t.ppf(0.5 + level / 2, len(diffs) - 1) * sd / math.sqrt(len(diffs))
  return m - half, m + half


def verdict(ci: tuple[float, float] | None) -> str:
  if ci is None:
    return "- (one seed)"
  if ci[0] > 0:
    return "**better**"
  if ci[1] < 0:
    return "**worse**"
  return "no difference shown"


def by_seed(runs: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
  return {int(run["seed"]): run for run in runs}


def pairs(variants: list[str]) -> list[tuple[str, str]]:
  """(variant, baseline) comparisons: every variant against the reference, and the full loop
  against every other variant."""
  out = [(v, REFERENCE) for v in variants if v != REFERENCE and REFERENCE in variants]
  if "coevolve" in variants:
    out += [("coevolve", v) for v in variants if v not in ("coevolve", REFERENCE)]
  return out


def summary_table(results: dict[str, list[dict[str, Any]]]) -> list[str]:
  """Mean ± sample standard deviation over seeds of every figure, per variant."""
  head = "| variant | seeds | " + " | ".join(name for name, _, _ in FIGURES) + " | tasks accepted |"
  lines = [head, "|" + " --- |" * (head.count("|") - 1)]
  for variant, runs in results.items():
    cells = [variant, ",".join(str(r["seed"]) for r in runs)]
    for _, _, get in [*FIGURES, ("", "", lambda r: float(r["summary"]["tasks_accepted"]))]:
      xs = [x for x in (get(r) for r in runs) if x is not None]
      if not xs:
        cells.append("-")
      elif len(xs) == 1:
        cells.append(fmt(float(xs[0])))
      else:
        cells.append(f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}")
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def paired(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
  """Per (variant, baseline) pair and figure: the per-seed differences, their mean and CI."""
  out = []
  for variant, base in pairs(list(results)):
    a, b = by_seed(results[variant]), by_seed(results[base])
    seeds = sorted(set(a) & set(b))
    for name, what, get in FIGURES:
      diffs = [
        get(a[s]) - get(b[s]) for s in seeds if get(a[s]) is not None and get(b[s]) is not None
      ]
      if not diffs:
        continue
      ci = t_interval(diffs)
      out.append(
        {
          "variant": variant,
          "baseline": base,
          "figure": name,
          "what": what,
          "diffs": diffs,
          "mean": statistics.fmean(diffs),
          "ci": ci,
          "verdict": verdict(ci),
        }
      )
  return out


def paired_table(rows: list[dict[str, Any]]) -> list[str]:
  head = "| variant - baseline | figure | per-seed differences | mean | 95% CI | verdict |"
  lines = [head, "|" + " --- |" * 6]
  for r in rows:
    ci = "-" if r["ci"] is None else f"[{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}]"
    lines.append(
      f"| {r['variant']} - {r['baseline']} | {r['figure']} | "
      + ", ".join(f"{d:+.3f}" for d in r["diffs"])
      + f" | {r['mean']:+.3f} | {ci} | {r['verdict']} |"
    )
  return lines


def signal_accounting(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """Per signal kind, for one run:

  - fired: tasks on which the signal fired during training (groups.jsonl), and of those, the share
    solved greedily after training (eval_pool_after.jsonl) as `fired_solved_after`;
  - revisited_solved: of the fired tasks sampled again after firing, the share whose later group
    solved the task in every rollout (boundary: mixed -> solved; forgetting: recovered);
  - accepted: tasks accepted from the signal's contexts over all rounds (feedback.jsonl), and
    `synth_solved_after`, greedy success after training on them.
  """
  thr = run["threshold"]  # the run's signals.success_threshold, as its summary's success
  solved_after = {r["task_id"]: r["reward"] >= thr for r in run["pool_eval"]}
  out = {}
  for kind in SIGNALS:
    first_fired: dict[str, int] = {}
    for g in run["groups"]:
      if kind in g["fired"]:
        first_fired.setdefault(g["task_id"], g["step"])
    later = {}
    for g in run["groups"]:
      if g["task_id"] in first_fired and g["step"] > first_fired[g["task_id"]]:
        later[g["task_id"]] = all(x >= thr for x in g["rewards"])  # the last revisit counts
    fired_after = [solved_after[t] for t in first_fired if t in solved_after]
    synth = [r["reward"] >= thr for r in run["pool_eval"] if r.get("origin") == f"synth:{kind}"]
    out[kind] = {
      "fired": len(first_fired),
      "fired_solved_after": mean([float(x) for x in fired_after]),
      "revisited": len(later),
      "revisited_solved": mean([float(x) for x in later.values()]),
      "accepted": sum(
        int((r.get("per_signal") or {}).get(kind, {}).get("accepted", 0)) for r in run["rounds"]
      ),
      "synth_solved_after": mean([float(x) for x in synth]),
    }
  return out


def signal_table(results: dict[str, list[dict[str, Any]]]) -> list[str]:
  """Per variant and signal, means over seeds of `signal_accounting`."""
  head = (
    "| variant | signal | tasks fired on | fired: solved after | fired, revisited | "
    "revisited: solved | tasks accepted | synthesized: solved after |"
  )
  lines = [head, "|" + " --- |" * 8]
  for variant, runs in results.items():
    acc = [signal_accounting(r) for r in runs]
    for kind in SIGNALS:
      cell = []
      for key, digits in (
        ("fired", 1),
        ("fired_solved_after", 2),
        ("revisited", 1),
        ("revisited_solved", 2),
        ("accepted", 1),
        ("synth_solved_after", 2),
      ):
        xs = [float(a[kind][key]) for a in acc if a[kind][key] is not None]
        cell.append(fmt(mean(xs), digits))
      lines.append(f"| {variant} | {kind} | " + " | ".join(cell) + " |")
  return lines


GEN_START = ("success", "reward", "tasks")


def same_start(results: dict[str, list[dict[str, Any]]]) -> list[str]:
  """Seeds whose variants did not start alike: D0 counts, warm-start losses, figures before."""

  def start(run):
    s = run["summary"]
    # The figures every version of the job reports (later ones add recall keys to the dict).
    gen = {k: v for k, v in (s.get("eval_generated_before") or {}).items() if k in GEN_START}
    return (s.get("d0"), run["warmstart"], s["eval_before"], gen)

  seeds: dict[int, list[tuple[str, Any]]] = {}
  for variant, runs in results.items():
    for run in runs:
      seeds.setdefault(int(run["seed"]), []).append((variant, start(run)))
  return [
    f"seed {seed}: {', '.join(v for v, _ in starts)} differ"
    for seed, starts in sorted(seeds.items())
    if any(x != starts[0][1] for _, x in starts)
  ]


def start_sentence(results: dict[str, list[dict[str, Any]]]) -> str:
  """Which runs resumed from their seed's shared step 0 (a copy of `start-s<seed>`)."""
  runs = [(v, r["seed"]) for v, rs in results.items() for r in rs]
  own = [f"{v}-s{r['seed']}" for v, rs in results.items() for r in rs if not r["shared_start"]]
  if not own:
    return (
      f"Step 0 (D0, warm-start, figures before training) ran once per seed in "
      f"`{START}-s<seed>`; every run resumed from a copy of it."
    )
  if len(own) == len(runs):
    return "Every run made its own step 0."
  return (
    f"Step 0 ran once per seed in `{START}-s<seed>` and {len(runs) - len(own)} of {len(runs)} "
    f"runs resumed from a copy of it; these made their own: {', '.join(own)}."
  )


def plots(results: dict[str, list[dict[str, Any]]], rows: list[dict[str, Any]], out: str):
  """Writes the PNGs; returns their file names."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  names = []

  def save(fig, name):
    fig.tight_layout()
    fig.savefig(os.path.join(out, name), dpi=110)
    plt.close(fig)
    names.append(name)

  fig, ax = plt.subplots(figsize=(7, 4))
  for variant, runs in results.items():
    steps = sorted({s for run in runs for s, _ in run["rewards"]})
    per = [[dict(run["rewards"]).get(s) for run in runs] for s in steps]
    m = [mean([x for x in xs if x is not None]) for xs in per]
    sd = [statistics.pstdev([x for x in xs if x is not None]) for xs in per]
    ax.plot(steps, m, marker="o", label=f"{variant} (n={len(runs)})")
    ax.fill_between(steps, np.subtract(m, sd), np.add(m, sd), alpha=0.15)
  ax.set(xlabel="GRPO step", ylabel="mean rollout reward (± sd over seeds)", title="Reward curves")
  ax.legend(fontsize=7)
  save(fig, "reward_curves.png")

  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  labels = list(results)
  xs = np.arange(len(labels))
  for ax, (title, before, after) in zip(
    axes,
    (
      (
        "Held-out BFCL entries",
        lambda r: r["summary"]["eval_before"],
        lambda r: r["summary"]["eval_after"],
      ),
      (
        "Generated held-out set (proxy)",
        lambda r: _generated(r, "before", "success"),
        lambda r: _generated(r, "after", "success"),
      ),
    ),
    strict=True,
  ):
    for shift, tag, get in ((-0.2, "before", before), (0.2, "after", after)):
      vals = [[x for x in (get(r) for r in results[v]) if x is not None] for v in labels]
      ax.bar(
        xs + shift,
        [mean(v) or 0.0 for v in vals],
        0.4,
        yerr=[statistics.pstdev(v) if v else 0.0 for v in vals],
        label=tag,
        capsize=3,
      )
    ax.set_xticks(xs, labels, rotation=30, fontsize=7)
    ax.set(ylabel="greedy success rate (± sd)", title=title)
    ax.legend()
  save(fig, "eval_success.png")

  if rows:
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    for i, r in enumerate(rows):
      lo, hi = r["ci"] if r["ci"] is not None else (r["mean"], r["mean"])
      ax.plot([lo, hi], [i, i], color="tab:blue")
      ax.plot([r["mean"]], [i], "o", color="tab:blue")
    ax.axvline(0.0, color="grey", lw=0.8)
    ax.set_yticks(
      range(len(rows)), [f"{r['variant']}-{r['baseline']}: {r['figure']}" for r in rows], fontsize=7
    )
    ax.invert_yaxis()
    ax.set(xlabel="paired difference (mean, 95% CI over seeds)", title="Paired differences")
    save(fig, "paired_differences.png")

  fig, axes = plt.subplots(1, 3, figsize=(13, 4))
  runs = results.get("coevolve", [])
  if any(r["rounds"] for r in runs):
    n_rounds = max(len(r["rounds"]) for r in runs)
    bottom = np.zeros(n_rounds)
    for kind in (*SIGNALS, "unguided"):
      acc = np.zeros(n_rounds)
      for run in runs:
        for i, rnd in enumerate(run["rounds"]):
          acc[i] += (rnd.get("per_signal") or {}).get(kind, {}).get("accepted", 0) / len(runs)
      if acc.any():
        axes[0].bar(np.arange(1, n_rounds + 1), acc, bottom=bottom, label=kind)
        bottom += acc
  axes[0].set(
    xlabel="feedback round",
    ylabel="accepted tasks (mean over seeds)",
    title="coevolve: accepted tasks by signal",
  )
  if axes[0].get_legend_handles_labels()[0]:
    axes[0].legend(fontsize=7)
  width = 0.8 / max(1, len(results))
  for j, (variant, runs) in enumerate(results.items()):
    acc = [signal_accounting(r) for r in runs]
    for ax, key in ((axes[1], "fired_solved_after"), (axes[2], "synth_solved_after")):
      vals = [mean([a[k][key] for a in acc if a[k][key] is not None]) for k in SIGNALS]
      ax.bar(np.arange(len(SIGNALS)) + j * width, [v or 0.0 for v in vals], width, label=variant)
  for ax, title in (
    (axes[1], "Tasks that fired the signal: solved after"),
    (axes[2], "Tasks synthesized from the signal: solved after"),
  ):
    ax.set_xticks(np.arange(len(SIGNALS)) + width * (len(results) - 1) / 2, SIGNALS)
    ax.set(ylabel="greedy success after training", title=title)
    ax.legend(fontsize=7)
  save(fig, "per_signal.png")
  return names


RECORD_BEGIN = (
  "<!-- ablations:record:begin (written by scripts/ablations.py; a rerun replaces this block) -->"
)
RECORD_END = "<!-- ablations:record:end -->"


def write_record(doc: str, record: list[str]) -> None:
  """Puts `record` (markdown lines) into the document at `doc` between the record markers.

  The block between `RECORD_BEGIN` and `RECORD_END` is replaced and the rest of the document is
  kept. A document without the markers gets the block appended; a missing one is created.

  Raises:
    ValueError: the document has a begin marker without an end marker after it (or the reverse).
  """
  block = "\n".join([RECORD_BEGIN, *record, RECORD_END]) + "\n"
  text = ""
  if os.path.exists(doc):
    with open(doc, encoding="utf-8") as f:
      text = f.read()
  begin, end = text.find(RECORD_BEGIN), text.find(RECORD_END)
  if begin == -1 and end == -1:
    text = (text.rstrip("\n") + "\n\n" if text else "") + block
  elif begin == -1 or end < begin:
    raise ValueError(f"{doc}: unbalanced {RECORD_BEGIN!r} / {RECORD_END!r} markers")
  else:
    rest = text[end + len(RECORD_END) :].lstrip("\n")
    text = text[:begin] + block + ("\n" + rest if rest else "")
  os.makedirs(os.path.dirname(os.path.abspath(doc)), exist_ok=True)
  with open(doc, "w", encoding="utf-8") as f:
    f.write(text)


def machine() -> str:
  import jax  # pylint: disable=g-import-not-at-top

  common = _bench_common()
  load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
  return (
    f"{platform.node()}: {common.cpu_name()}, "
    f"{os.cpu_count()} CPU cores, Python {platform.python_version()}, JAX {jax.__version__} "
    f"on {jax.default_backend()}, load average at the end {load[0]:.1f}"
  )


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default=DEFAULT_CONFIG, help="config file[:variant] of every run")
  p.add_argument("--preset", default="", help="model.preset of every run ('' = the config's)")
  p.add_argument("--steps", type=int, default=0, help="train.steps of every run (0 = the config's)")
  p.add_argument("--out", default=os.path.join(ROOT, "docs", "ablations"), help="plots folder")
  p.add_argument("--doc", default="", help="ablations document (default: --out plus .md)")
  p.add_argument("--workdir", default=os.path.join(ROOT, "runs", "ablations"))
  p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
  p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated subset")
  p.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="KEY=JSON",
    help="extra config override for every run, e.g. feedback.every=3",
  )
  p.add_argument("--report", action="store_true", help="only rebuild the record from the workdirs")
  p.add_argument(
    "--no-shared-start",
    dest="shared_start",
    action="store_false",
    help="every run makes its own D0 and warm-start (by default the variants of a seed resume "
    "from one copy of step 0)",
  )
  args = p.parse_args(argv)
  variants = args.variants.split(",")
  if unknown := set(variants) - set(VARIANTS):
    p.error(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
  overrides = {}
  for item in args.set:
    key, _, value = item.partition("=")
    overrides[key] = json.loads(value)
  if args.preset:
    overrides["model.preset"] = args.preset
  if args.steps:
    overrides["train.steps"] = args.steps
  seeds = [int(s) for s in args.seeds.split(",")]
  setting = load_config(START_VARIANT, seeds[0], overrides, args.config).compile.cache_dir
  jax_own = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
  if setting not in ("auto", ""):  # the config names a folder
    cache, where = {}, setting
  elif jax_own:  # JAX's own setting, left to JAX
    cache, where = {"compile.cache_dir": ""}, jax_own
  else:  # the default: one cache of the grid's own, beside its runs
    where = os.path.join(os.path.abspath(args.workdir), GRID_CACHE)
    cache = {"compile.cache_dir": where}
  print(f"compilation cache of every run: {where}")
  run_overrides = {**cache, **overrides}  # the record lists what the command set

  os.makedirs(args.out, exist_ok=True)
  # What this process imports (whatever the checkout becomes meanwhile), and where: XLA:CPU's
  # code differs by CPU, and so do a run's last bits (seed 0's warm-start loss, the same commit's
  # training path: 0.0303740 on an AMD EPYC VM, 0.0303735 on an Intel Xeon one).
  code = f"{code_version()} on {_bench_common().cpu_name()}"
  results: dict[str, list[dict[str, Any]]] = {}
  for seed in seeds:  # seed-major: a partly finished grid already holds whole pairs
    for variant in variants:
      workdir = os.path.join(args.workdir, f"{variant}-s{seed}")
      saved = saved_path(args.out, variant, seed)
      cfg = load_config(variant, seed, run_overrides, args.config)
      check_workdir(workdir, cfg, run_overrides)
      if not is_complete(workdir) and (run := load_saved(saved, cfg, run_overrides)):
        print(f"--- {variant} seed {seed}: read back from {saved}")
        results.setdefault(variant, []).append(run)
        continue
      if not is_complete(workdir):
        if args.report:
          print(f"--- {variant} seed {seed}: not finished in {workdir}; left out")
          continue
        from coevolve_jax.loop import CoEvolveRun  # pylint: disable=g-import-not-at-top

        if args.shared_start and shares_start(variant) and not os.path.exists(workdir):
          start = os.path.join(args.workdir, f"{START}-s{seed}")
          start_cfg = load_config(START_VARIANT, seed, run_overrides, args.config)
          ensure_start(start, start_cfg, run_overrides, code)
          copy_start(start, workdir)
        print(f"=== {variant} seed {seed} -> {workdir} (code {code})", flush=True)
        loop_run = CoEvolveRun(cfg, workdir)  # makes the folder
        note_code(workdir, code)
        loop_run.fit()
      run = {**collect(workdir), "seed": seed}
      save_run(saved, run, workdir)
      results.setdefault(variant, []).append(run)
  results = {v: results[v] for v in variants if v in results}
  lines = summary_table(results)
  rows = paired(results)
  differ = same_start(results)
  try:
    pngs = plots(results, rows, args.out)
  except ImportError:
    pngs = []
    print("matplotlib is not installed: no plots (pip install -e '.[plots]')")
  command = " ".join(
    shlex.quote(a)
    for a in [
      ".venv/bin/python",
      "scripts/ablations.py",
      *(argv if argv is not None else sys.argv[1:]),
    ]
  )
  doc = args.doc or os.path.normpath(args.out) + ".md"
  plots_dir = os.path.relpath(os.path.abspath(args.out), os.path.dirname(os.path.abspath(doc)))
  record = [
    f"## Recorded run ({datetime.date.today().isoformat()})",
    "",
    f"Command: `{command}`",
    "",
    f"Machine: {machine()}",
    "",
    f"Each run is `{args.config}` with its variant's switch"
    + (f" and {', '.join(f'{k}={v!r}' for k, v in overrides.items())}" if overrides else "")
    + ". "
    + start_sentence(results)
    + " Same start per seed (D0 counts, warm-start losses, figures before training): "
    + ("yes, in every seed." if not differ else "**no**: " + "; ".join(differ))
    + " "
    + code_sentence(results),
    "",
    "Figures, mean ± standard deviation over seeds:",
    "",
    *lines,
    "",
    "Paired differences (same seed), 95% Student-t interval over seeds; better or worse only "
    "when the interval excludes zero:",
    "",
    *paired_table(rows),
    "",
    "Per-signal accounting, means over seeds (solved = greedy reward >= signals.success_threshold, "
    "0.5 by default, after training; "
    "revisited = sampled again after the signal fired, solved in every rollout of the last "
    "visit):",
    "",
    *signal_table(results),
    "",
    *[f"![{n}]({os.path.join(plots_dir, n)})" for n in pngs],
  ]
  write_record(doc, record)
  print("\n".join(record[6:]))
  print(f"wrote the record into {doc} and {len(pngs)} plots into {args.out}")
  return 0


if __name__ == "__main__":
  # SIGINT/SIGTERM as in `coevolve_jax.main`: the run in progress finishes the checkpoint in flight
  # and closes its logs, then the grid exits; the same command resumes it.
  from coevolve_jax import main as run_command  # pylint: disable=g-import-not-at-top

  run_command.stop_on_signals()
  try:
    sys.exit(main())
  except KeyboardInterrupt as e:
    run_command.exit_interrupted(
      e, "rerun the same command to resume the grid (each run from its last checkpoint)"
    )
