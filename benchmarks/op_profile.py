"""Where a traced call's device time goes, by XLA operation (CPU thunks, GPU kernels).

    .venv/bin/python benchmarks/op_profile.py TRACE_DIR [--hlo=HLO_DIR] [--top=25] [--per=31]

Reads the trace events `jax.profiler.trace(TRACE_DIR)` wrote (the newest `*.trace.json.gz`
under TRACE_DIR) and sums the durations of the events that name an HLO operation
(`args.hlo_op`), grouped by program and operation. With `--hlo`, the folder that
`--xla_dump_to=HLO_DIR --xla_dump_hlo_as_text` filled while the traced programs compiled, each
operation is named by its source (the JAX op path of its metadata, e.g.
`mlp/BTD,DF->BTF/dot_general`) and output shape, and operations of one source and shape are
summed together (the same product in every layer is one row). Point `--hlo` at a dump that
holds only the traced compilations: a program compiled for several shapes reads "(varies)"
(rollout_bench.py compiles its traced call again for that). `rollout_bench.py --profile=DIR`
writes both for one generate call and prints this table.

Durations of operations that ran at the same time on different threads (XLA:CPU runs
independent thunks concurrently) add up past the wall time; the table prints both sums so the
overlap is visible. Standard library only.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re

# `%name = f32[32,512]{1,0} opcode(...), ... metadata={op_name="jit(f)/while/body/mlp/..."`
_INSTRUCTION = re.compile(
  r"^\s*(?:ROOT\s+)?%(\S+) = (\S+?)(?:\{[^}]*\})? ([\w-]+)\((?:[^\n]*?op_name=\"([^\"]*)\")?"
)
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(\S+) \(")
_CALLS = re.compile(r"calls=%([\w.-]+)")


def hlo_sources(hlo: str | list[str]) -> dict[tuple[str, str], tuple[str, str]]:
  """{(program, operation): (output shape, source op path)} from an XLA text dump's optimized
  modules (`module_NNNN.<program>.<backend>_after_optimizations.txt`; the program is the name the
  trace gives, e.g. `jit__generate_steps`), found in the folder `hlo` or given as a list of
  paths. A fusion is named by its root's source, or by the
  product inside it with " + epilogue" where it holds a dot (XLA:CPU fuses a projection with the
  norm or activation after it; the root alone would hide the product). A program compiled for
  several shapes may reuse an operation name: its shape then reads "(varies)", and its source too
  where the sources differ."""
  seen: dict[tuple[str, str], set[tuple[str, str]]] = collections.defaultdict(set)
  paths = glob.glob(os.path.join(hlo, "*after_optimizations.txt")) if isinstance(hlo, str) else hlo
  for path in paths:
    program = os.path.basename(path).split(".")[1]
    dots: dict[str, str] = {}  # computation -> the source of a dot inside it
    computation, entries = "", []
    with open(path, encoding="utf-8") as f:
      for line in f:
        if start := _COMPUTATION.match(line):
          computation = start.group(1)
        m = _INSTRUCTION.match(line)
        if not m:
          continue
        source = _source(m.group(4)) if m.group(4) else m.group(1)  # no metadata: its HLO name
        if m.group(3) == "dot":
          dots.setdefault(computation, source)
        called = _CALLS.search(line)
        entries.append((m.group(1), m.group(2), source, called.group(1) if called else ""))
    for name, shape, source, called in entries:
      if called in dots and dots[called] != source:
        source = f"{dots[called]} + epilogue"
      seen[(program, name)].add((shape, source))
  out = {}
  for key, values in seen.items():
    shapes, sources = {v[0] for v in values}, {v[1] for v in values}
    out[key] = (
      shapes.pop() if len(shapes) == 1 else "(varies)",
      sources.pop() if len(sources) == 1 else "(varies)",
    )
  return out


def _source(op_name: str) -> str:
  """A JAX op path without the program and control-flow prefixes."""
  return re.sub(r"^jit\([^)]*\)/((while|cond|body|checkpoint)/)*", "", op_name)


def _events(trace_dir: str) -> list[dict]:
  paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  if not paths:
    raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir} (a jax.profiler trace?)")
  with gzip.open(max(paths, key=os.path.getmtime), "rt", encoding="utf-8") as f:
    trace = json.load(f)
  return trace["traceEvents"] if isinstance(trace, dict) else trace


def op_table(trace_dir: str, hlo: str | list[str] | None = None) -> tuple[list[dict], float]:
  """Rows {program, op, shape, ms, count}, most time first, and the traced span in ms (first op
  start to last op end). `hlo`: see `hlo_sources` (None: operations keep their HLO names).

  Raises:
    FileNotFoundError: no trace under `trace_dir`.
  """
  sources = hlo_sources(hlo) if hlo else {}
  totals: dict[tuple[str, str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
  first, last = float("inf"), 0.0
  for e in _events(trace_dir):
    args = e.get("args") or {}
    if e.get("ph") != "X" or "hlo_op" not in args:
      continue
    program = args.get("hlo_module", "?")
    shape, source = sources.get((program, args["hlo_op"]), ("", args["hlo_op"]))
    row = totals[(program, source, shape)]
    row[0] += e.get("dur", 0.0) / 1e3
    row[1] += 1
    first, last = min(first, e["ts"]), max(last, e["ts"] + e.get("dur", 0.0))
  rows = [
    {"program": p, "op": op, "shape": s, "ms": ms, "count": int(n)}
    for (p, op, s), (ms, n) in totals.items()
  ]
  rows.sort(key=lambda r: -r["ms"])
  return rows, (last - first) / 1e3 if rows else 0.0


def render(rows: list[dict], span_ms: float, top: int = 25, per: int = 0) -> str:
  """A markdown table of the `top` rows; `per` > 0 adds a column of ms per that many calls (e.g.
  per decode step)."""
  total = sum(r["ms"] for r in rows)
  head = ["program", "operation (source)", "shape", "ms", "share", "count"]
  if per:
    head.append(f"ms per 1/{per}")
  table = [head]
  for r in rows[:top]:
    line = [
      r["program"].removeprefix("jit_"),
      r["op"],
      r["shape"],
      f"{r['ms']:.1f}",
      f"{r['ms'] / total:.1%}" if total else "-",
      str(r["count"]),
    ]
    if per:
      line.append(f"{r['ms'] / per:.2f}")
    table.append(line)
  widths = [max(len(x[i]) for x in table) for i in range(len(head))]
  lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(x, widths)) + " |" for x in table]
  lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
  lines.append(
    f"\noperation time {total:.1f} ms over a traced span of {span_ms:.1f} ms "
    f"({len(rows)} operation groups; a sum above the span is operations overlapping)"
  )
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("trace_dir")
  p.add_argument("--hlo", default="", help="the --xla_dump_to folder of the traced programs")
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--per", type=int, default=0, help="also print ms per this many calls")
  args = p.parse_args()
  rows, span = op_table(args.trace_dir, args.hlo or None)
  print(render(rows, span, args.top, args.per))


if __name__ == "__main__":
  main()
