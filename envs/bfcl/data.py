"""BFCL multi-turn data: tasks from the data bfcl-eval ships, a held-out split, and tool schemas.

bfcl-eval is imported lazily through `import_bfcl()`, which first points `BFCL_PROJECT_ROOT` at a
scratch directory (otherwise importing it writes result/score folders into site-packages).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import importlib
import json
import os
import pathlib
import tempfile
from typing import Any

import numpy as np

from coevolve_jax.types import Task

MULTI_TURN_CATEGORIES = (
  "multi_turn_base",
  "multi_turn_miss_func",
  "multi_turn_miss_param",
  "multi_turn_long_context",
)
_PREAMBLE_MARKER = "Tool description:"
# BFCL parameter types -> JSON schema types.
_TYPE_MAP = {"dict": "object", "float": "number", "tuple": "array", "any": "string"}


def import_bfcl(module: str = "bfcl_eval") -> Any:
  """Imports a bfcl_eval module after setting BFCL_PROJECT_ROOT to a scratch dir if unset."""
  if "BFCL_PROJECT_ROOT" not in os.environ:
    root = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
    root = root / "coevolve_jax" / "bfcl"
    try:
      root.mkdir(parents=True, exist_ok=True)
    except OSError:
      root = pathlib.Path(tempfile.mkdtemp(prefix="bfcl_root_"))
    os.environ["BFCL_PROJECT_ROOT"] = str(root)
  return importlib.import_module(module)


def _turn_text(messages: list[dict[str, str]]) -> str:
  """Joins the user contents of one BFCL turn ("" for the empty turns of miss_func)."""
  return "\n".join(m["content"] for m in messages if m.get("role") == "user")


@functools.lru_cache(maxsize=8)
def _load_raw(category: str) -> tuple[list[dict[str, Any]], dict[str, list[list[str]]]]:
  utils = import_bfcl("bfcl_eval.utils")
  entries = utils.load_dataset_entry(category)
  truths = {g["id"]: g["ground_truth"] for g in utils.load_ground_truth_entry(category)}
  return entries, truths


def load_bfcl_tasks(category: str = "multi_turn_base") -> list[Task]:
  """Loads the real BFCL entries of a multi-turn category as Tasks (source "bfcl").

  Args:
    category: one of MULTI_TURN_CATEGORIES.

  Returns:
    One Task per entry, in file order. Extra fields (excluded_function, missed_function, path,
    category, long_context) are kept in `provenance`.

  Raises:
    ValueError: an unknown or non-multi-turn category.
  """
  if category not in MULTI_TURN_CATEGORIES:
    raise ValueError(
      f"unsupported BFCL category {category!r}; expected one of {MULTI_TURN_CATEGORIES}"
    )
  entries, truths = _load_raw(category)
  tasks = []
  for e in entries:
    prov = {
      "category": category,
      "long_context": "long_context" in category,
      "excluded_function": list(e.get("excluded_function", [])),
      "path": list(e.get("path", [])),
    }
    if "missed_function" in e:
      prov["missed_function"] = {k: [f["name"] for f in v] for k, v in e["missed_function"].items()}
    tasks.append(
      Task(
        task_id=e["id"],
        env="bfcl",
        turns=[_turn_text(t) for t in e["question"]],
        ground_truth=copy.deepcopy(truths[e["id"]]),
        initial_config=copy.deepcopy(e["initial_config"]),
        involved_classes=list(e["involved_classes"]),
        source="bfcl",
        provenance=prov,
      )
    )
  return tasks


def split_tasks(tasks: list[Task], eval_size: int, seed: int) -> tuple[list[Task], list[Task]]:
  """Seeded held-out split: returns (train, eval); eval has `eval_size` tasks, train the rest.

  Both keep the input order. Training code must use only the environment states of `train`.

  Raises:
    ValueError: eval_size outside [0, len(tasks)].
  """
  if not 0 <= eval_size <= len(tasks):
    raise ValueError(f"eval_size {eval_size} outside [0, {len(tasks)}]")
  perm = np.random.default_rng(seed).permutation(len(tasks))
  eval_idx = set(int(i) for i in perm[:eval_size])
  train = [t for i, t in enumerate(tasks) if i not in eval_idx]
  held = [t for i, t in enumerate(tasks) if i in eval_idx]
  return train, held


def data_release(categories: list[str]) -> dict[str, Any]:
  """Which BFCL data a score is on: the bfcl-eval package version, its file-name prefix (the
  release it names its data by, e.g. "BFCL_v4") and, per category, the prompt and possible-answer
  files with the first 16 hex digits of each file's SHA-256 (summary.json, the eval report).
  The paper evaluates on BFCL-V3; docs/design.md §3 says how the shipped files differ."""
  import importlib.metadata  # noqa: PLC0415

  consts = import_bfcl("bfcl_eval.constants.eval_config")
  prefix = consts.VERSION_PREFIX
  files: dict[str, dict[str, str]] = {}
  for category in dict.fromkeys(c for c in categories if c):
    name = f"{prefix}_{category}.json"
    entry = {}
    for kind, folder in (("prompt", consts.PROMPT_PATH), ("answer", consts.POSSIBLE_ANSWER_PATH)):
      path = pathlib.Path(folder) / name
      digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else "missing"
      entry[kind] = f"{kind == 'answer' and 'possible_answer/' or ''}{name} sha256:{digest}"
    files[category] = entry
  return {
    "package": f"bfcl-eval=={importlib.metadata.version('bfcl-eval')}",
    "release": prefix,
    "files": files,
  }


DEFAULT_STATE = "<the backend's default state>"  # a class an entry gives no config for


def class_states(task: Task) -> dict[str, str]:
  """Class name -> canonical JSON of the state the entry starts it from (`DEFAULT_STATE` for a
  class the entry gives no config: its backend loads its own default scenario)."""
  return {
    c: json.dumps(task.initial_config[c], sort_keys=True)
    if c in task.initial_config
    else DEFAULT_STATE
    for c in task.involved_classes
  }


def disjoint_states(entries: list[Task], eval_entries: list[Task]) -> tuple[list[Task], int]:
  """The entries' environment states with every state an evaluation entry starts from removed,
  class by class (docs/design.md §1.4, "Exploration states"): each class keeps the entry's own
  state when no evaluation entry starts that class from it, else the backend's default state
  when no evaluation entry uses that, else the class is left out; an entry with no class left
  is dropped. So no exploration (D0, a round's context on a D0 task) practises inside a state
  an evaluation entry is scored in. Ids, turns and answers are kept (only states are read).

  Returns:
    (the entries with their kept classes and states, in order; how many classes were changed
    to the default or left out).
  """
  used: dict[str, set[str]] = {}
  for t in eval_entries:
    for c, state in class_states(t).items():
      used.setdefault(c, set()).add(state)
  out, changed = [], 0
  for t in entries:
    config, classes = {}, []
    for c, state in class_states(t).items():
      if state not in used.get(c, ()):
        classes.append(c)
        if c in t.initial_config:
          config[c] = t.initial_config[c]
      else:
        changed += 1
        if DEFAULT_STATE not in used.get(c, ()):
          classes.append(c)  # at the default state, which no evaluation entry starts from
    if classes:  # configs of classes the entry does not involve are never loaded: dropped
      out.append(dataclasses.replace(t, initial_config=config, involved_classes=classes))
  return out, changed


@functools.lru_cache(maxsize=16)
def _class_docs(class_name: str) -> tuple[dict[str, Any], ...]:
  config = import_bfcl("bfcl_eval.constants.executable_backend_config")
  root = pathlib.Path(import_bfcl().__file__).parent / "data" / "multi_turn_func_doc"
  path = root / config.MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]
  with open(path, encoding="utf-8") as f:
    return tuple(json.loads(line) for line in f if line.strip())


def _convert_schema(node: Any, keep_descriptions: bool) -> Any:
  """Recursively maps BFCL types to JSON schema types; optionally drops descriptions."""
  if isinstance(node, list):
    return [_convert_schema(v, keep_descriptions) for v in node]
  if not isinstance(node, dict):
    return node
  out: dict[str, Any] = {}
  for key, value in node.items():
    if key == "description" and not keep_descriptions and isinstance(value, str):
      continue
    if key == "type" and isinstance(value, str):
      out[key] = _TYPE_MAP.get(value, value)
    elif key == "properties" and isinstance(value, dict):  # Property names are not schema keywords.
      out[key] = {k: _convert_schema(v, keep_descriptions) for k, v in value.items()}
    else:
      out[key] = _convert_schema(value, keep_descriptions)
  return out


def compact_description(description: str) -> str:
  """The tool-specific part of a BFCL description (class preamble dropped), first sentence only."""
  text = description.split(_PREAMBLE_MARKER, 1)[-1].strip()
  for i, ch in enumerate(text):
    if ch in ".!?" and (i + 1 == len(text) or text[i + 1].isspace()):
      return text[: i + 1]
  return text


def convert_doc(doc: dict[str, Any], style: str = "full") -> dict[str, Any]:
  """One BFCL function doc -> {"type": "function", "function": {name, description, parameters}}."""
  if style not in ("full", "compact"):
    raise ValueError(f"unknown tool style {style!r}")
  full = style == "full"
  desc = doc.get("description", "")
  params = _convert_schema(doc.get("parameters", {"type": "dict", "properties": {}}), full)
  params.setdefault("properties", {})
  return {
    "type": "function",
    "function": {
      "name": doc["name"],
      "description": desc if full else compact_description(desc),
      "parameters": params,
    },
  }


def tool_schemas(
  involved_classes: list[str], style: str = "full", excluded: list[str] | tuple[str, ...] = ()
) -> list[dict[str, Any]]:
  """The tools of the given BFCL classes in Qwen/OpenAI format, in doc-file order.

  Args:
    involved_classes: backend class names, e.g. ["GorillaFileSystem", "TwitterAPI"].
    style: "full" (BFCL descriptions) or "compact" (first sentence of the tool-specific description,
      no parameter descriptions).
    excluded: function names to leave out (an entry's `excluded_function`).

  Raises:
    KeyError: an unknown class name. ValueError: an unknown style.
  """
  skip = set(excluded)
  return [
    convert_doc(d, style) for c in involved_classes for d in _class_docs(c) if d["name"] not in skip
  ]


def function_docs(
  names: list[str], involved_classes: list[str], style: str = "full"
) -> list[dict[str, Any]]:
  """Schemas of the named functions of the given classes (used for miss_func's late-added tools)."""
  wanted = set(names)
  return [s for s in tool_schemas(involved_classes, style) if s["function"]["name"] in wanted]


def schemas_by_name(schemas: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """Maps tool name -> its "function" dict (name, description, parameters)."""
  return {s["function"]["name"]: s["function"] for s in schemas}
