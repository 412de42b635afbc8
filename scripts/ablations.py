"""CoEvolve ablation grid at CPU scale: runs each variant, writes a markdown table and plots.

    .venv/bin/python scripts/ablations.py --out docs/ablations --seeds 0

Variants (paper Sec. 4 ablations; docs/design.md §1.1-1.3): the full loop, no forgetting / no
boundary / no rare signal, random re-exploration (no signals), no validation, and GRPO only (no
feedback rounds; the reference every other row is compared with, in the same invocation). Each
variant is the CPU preset (`configs/bfcl.py:cpu`) with one switch changed, run in this process one
after another (they share JAX's compilation cache), each in its own workdir under `--workdir`.

Outputs: the record of the run (date, machine, exact command, table, links to the plots) written
into the ablations document (`--doc`, default `--out` plus `.md`: `docs/ablations.md`) between its
`ablations:record` markers, replacing the previous record and keeping the rest of the document
(`write_record`); and PNG plots under `--out` (`docs/ablations/`): reward curves, eval success,
signal shares per round, validation pass rate per round, similarity of synthesized tasks to the
evaluation split. matplotlib is needed for the plots (`pip install -e '.[plots]'`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shlex
import statistics
import sys
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
}
REFERENCE = "grpo_only"


def load_config(variant: str, seed: int, overrides: dict[str, Any]):
  spec = importlib.util.spec_from_file_location(
    "bfcl_config", os.path.join(ROOT, "configs", "bfcl.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config("cpu")
  cfg.seed = seed
  for key, value in {**VARIANTS[variant], **overrides}.items():
    node = cfg
    *path, leaf = key.split(".")
    for part in path:
      node = node[part]
    node[leaf] = value
  return cfg


def read_jsonl(path: str) -> list[dict[str, Any]]:
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def collect(workdir: str) -> dict[str, Any]:
  """What the table and plots need from one finished run's workdir."""
  with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
    summary = json.load(f)
  metrics = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "reward/mean" in r]
  rounds = read_jsonl(os.path.join(workdir, "feedback.jsonl"))
  sims = [v for r in rounds for v in (r.get("eval_similarity") or {}).values()]
  return {
    "summary": summary,
    "rewards": [(r["step"], r["reward/mean"]) for r in metrics],
    "rounds": rounds,
    "similarity": sims,
  }


def mean(xs: list[float]) -> float | None:
  return statistics.fmean(xs) if xs else None


def fmt(x: Any, digits: int = 3) -> str:
  if x is None:
    return "-"
  return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def table(results: dict[str, list[dict[str, Any]]]) -> list[str]:
  ref = mean([mean([r for _, r in run["rewards"]]) or 0.0 for run in results.get(REFERENCE, [])])
  head = (
    "| variant | runs | eval before | eval after | mean rollout reward | vs grpo_only | "
    "tasks accepted | validation pass rate | signals F/B/R | max sim. to eval (mean) | "
    "feedback_share | wall s |"
  )
  lines = [head, "|" + " --- |" * (head.count("|") - 1)]
  for name, runs in results.items():
    s = [run["summary"] for run in runs]
    reward = mean([mean([r for _, r in run["rewards"]]) or 0.0 for run in runs])
    passes = [p for x in s for p in x.get("validation_pass_rate", []) if p is not None]
    sig = [x["signals"] for x in s]
    sims = [v for run in runs for v in run["similarity"]]
    lines.append(
      "| "
      + " | ".join(
        [
          name,
          str(len(runs)),
          fmt(mean([x["eval_before"] for x in s])),
          fmt(mean([x["eval_after"] for x in s])),
          fmt(reward),
          fmt(reward / ref, 2) + "x" if ref else "-",
          fmt(mean([float(x["tasks_accepted"]) for x in s]), 1),
          fmt(mean(passes), 2),
          "/".join(
            fmt(mean([float(g[k]) for g in sig]), 1) for k in ("forgetting", "boundary", "rare")
          ),
          fmt(mean(sims), 2),
          fmt(mean([float(x.get("feedback_share", 0.0)) for x in s]), 4),
          fmt(mean([float(x["wall_s"]) for x in s]), 0),
        ]
      )
      + " |"
    )
  return lines


def plots(results: dict[str, list[dict[str, Any]]], out: str) -> list[str]:
  """Writes the PNGs; returns their file names."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  names = []

  def save(fig, name):
    fig.tight_layout()
    fig.savefig(os.path.join(out, name), dpi=110)
    plt.close(fig)
    names.append(name)

  fig, ax = plt.subplots(figsize=(7, 4))
  for variant, runs in results.items():
    for i, run in enumerate(runs):
      steps, rewards = zip(*run["rewards"]) if run["rewards"] else ((), ())
      ax.plot(steps, rewards, marker="o", label=variant if i == 0 else None)
  ax.set(xlabel="GRPO step", ylabel="mean rollout reward", title="Reward curves")
  ax.legend(fontsize=7)
  save(fig, "reward_curves.png")

  fig, ax = plt.subplots(figsize=(7, 4))
  labels = list(results)
  before = [mean([r["summary"]["eval_before"] for r in results[v]]) for v in labels]
  after = [mean([r["summary"]["eval_after"] for r in results[v]]) for v in labels]
  xs = range(len(labels))
  ax.bar([x - 0.2 for x in xs], before, 0.4, label="before")
  ax.bar([x + 0.2 for x in xs], after, 0.4, label="after")
  ax.set_xticks(list(xs), labels, rotation=30, fontsize=7)
  ax.set(ylabel="held-out success rate", title="Evaluation success")
  ax.legend()
  save(fig, "eval_success.png")

  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for variant, runs in results.items():
    rounds = runs[0]["rounds"]
    if not rounds:
      continue
    shares = []
    for r in rounds:
      ev = {k: v["events"] for k, v in r["per_signal"].items()}
      total = sum(ev.values()) or 1
      shares.append(ev.get("boundary", 0) / total)
    axes[0].plot([r["round"] for r in rounds], shares, marker="o", label=variant)
    axes[1].plot(
      [r["round"] for r in rounds], [r["pass_rate"] for r in rounds], marker="o", label=variant
    )
  axes[0].set(
    xlabel="feedback round",
    ylabel="boundary share of explored contexts",
    title="Signal shares per round",
  )
  axes[1].set(
    xlabel="feedback round", ylabel="validation pass rate", title="Validation pass rate per round"
  )
  axes[0].legend(fontsize=7)
  save(fig, "signals_and_validation.png")

  fig, ax = plt.subplots(figsize=(7, 4))
  data = [(v, [x for r in runs for x in r["similarity"]]) for v, runs in results.items()]
  data = [(v, d) for v, d in data if d]
  if data:
    ax.boxplot([d for _, d in data], tick_labels=[v for v, _ in data])
    ax.tick_params(axis="x", rotation=30, labelsize=7)
  ax.set(
    ylabel="max MinHash Jaccard to any eval task",
    title="Similarity of synthesized tasks to evaluation tasks",
  )
  save(fig, "eval_similarity.png")
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

  load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
  return (
    f"{platform.node()}: {platform.processor() or platform.machine()}, "
    f"{os.cpu_count()} CPU cores, Python {platform.python_version()}, JAX {jax.__version__} "
    f"on {jax.default_backend()}, load average at the end {load[0]:.1f}"
  )


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=os.path.join(ROOT, "docs", "ablations"), help="plots folder")
  p.add_argument("--doc", default="", help="ablations document (default: --out plus .md)")
  p.add_argument("--workdir", default=os.path.join(ROOT, "runs", "ablations"))
  p.add_argument("--seeds", default="0", help="comma-separated seeds")
  p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
  p.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="KEY=JSON",
    help="extra config override for every variant, e.g. train.steps=9",
  )
  args = p.parse_args(argv)
  variants = args.variants.split(",")
  if unknown := set(variants) - set(VARIANTS):
    p.error(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
  overrides = {}
  for item in args.set:
    key, _, value = item.partition("=")
    overrides[key] = json.loads(value)
  from coevolve_jax.loop import CoEvolveRun  # pylint: disable=g-import-not-at-top

  os.makedirs(args.out, exist_ok=True)
  results: dict[str, list[dict[str, Any]]] = {}
  for variant in variants:
    for seed in (int(s) for s in args.seeds.split(",")):
      workdir = os.path.join(args.workdir, f"{variant}-s{seed}")
      print(f"=== {variant} seed {seed} -> {workdir}", flush=True)
      CoEvolveRun(load_config(variant, seed, overrides), workdir).fit()
      results.setdefault(variant, []).append(collect(workdir))
  lines = table(results)
  try:
    pngs = plots(results, args.out)
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
    "Each row is `configs/bfcl.py:cpu` with one switch changed; `vs grpo_only` is the ratio "
    "of mean rollout rewards to the GRPO-only run of this same invocation.",
    "",
    *lines,
    "",
    *[f"![{n}]({os.path.join(plots_dir, n)})" for n in pngs],
  ]
  write_record(doc, record)
  print("\n".join(lines))
  print(f"wrote the record into {doc} and {len(pngs)} plots into {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
