"""Argument values for programmatic exploration: a pool of strings/numbers seen in the environment,
and schema-driven sampling and variation of call arguments. All sampling is driven by a numpy
Generator and ordered containers, so it is deterministic for a seed.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

_STRUCTURAL = frozenset({"type", "contents", "directory", "file", "content", "root"})
_MAX_STR = 80
_FRESH_WORDS = ("notes", "temp", "report", "backup", "draft", "summary", "data", "archive")


class ValuePool:
  """Insertion-ordered, de-duplicated strings and numbers seen so far (config, focus calls,
  observations)."""

  def __init__(self) -> None:
    self.strings: list[str] = []
    self.numbers: list[int | float] = []
    self._seen: set[Any] = set()

  @classmethod
  def from_config(cls, initial_config: dict[str, Any]) -> "ValuePool":
    pool = cls()
    for class_state in initial_config.values():  # Skip the class-name keys themselves.
      pool.add_values(class_state)
    return pool

  def _add(self, value: Any) -> None:
    key = (type(value).__name__, value)
    if key in self._seen:
      return
    self._seen.add(key)
    (self.strings if isinstance(value, str) else self.numbers).append(value)

  def add_values(self, node: Any) -> None:
    """Walks a JSON-like value; keeps short strings (incl. dict keys) and numbers."""
    if isinstance(node, dict):
      for k, v in node.items():
        if (
          isinstance(k, str) and k not in _STRUCTURAL and 0 < len(k) <= _MAX_STR and not k.isdigit()
        ):
          self._add(k)
        self.add_values(v)
    elif isinstance(node, (list, tuple)):
      for v in node:
        self.add_values(v)
    elif isinstance(node, bool) or node is None:
      return
    elif isinstance(node, (int, float)):
      self._add(node)
    elif isinstance(node, str) and node not in _STRUCTURAL and 0 < len(node) <= _MAX_STR:
      self._add(node)

  def add_observation(self, result: str) -> None:
    """Adds the values of a tool result (JSON when it parses, else the whole short string)."""
    try:
      self.add_values(json.loads(result))
    except ValueError:
      self.add_values(result)


def _choice(seq: list[Any], rng: np.random.Generator) -> Any:
  return seq[int(rng.integers(len(seq)))]


def sample_value(
  schema: dict[str, Any], name: str, values: ValuePool, rng: np.random.Generator, depth: int = 0
) -> Any:
  """A JSON value for one parameter schema: enum member, pool value, default, or a simple fresh
  value."""
  if schema.get("enum"):
    return _choice(list(schema["enum"]), rng)
  kind = schema.get("type", "string")
  if "default" in schema and schema["default"] is not None and rng.random() < 0.2:
    return schema["default"]
  if kind == "boolean":
    return bool(rng.integers(2))
  if kind == "integer":
    ints = [v for v in values.numbers if isinstance(v, int) and abs(v) < 10**6]
    return _choice(ints, rng) if ints and rng.random() < 0.6 else int(rng.integers(1, 11))
  if kind == "number":
    nums = [v for v in values.numbers if abs(v) < 10**7]
    return (
      float(_choice(nums, rng))
      if nums and rng.random() < 0.6
      else round(float(rng.uniform(0, 100)), 1)
    )
  if kind == "array":
    if depth > 1:
      return []
    items = schema.get("items", {"type": "string"})
    return [
      sample_value(items, name, values, rng, depth + 1) for _ in range(int(rng.integers(1, 3)))
    ]
  if kind == "object":
    return {}
  if values.strings and rng.random() < 0.8:
    recent = values.strings[-40:] if rng.random() < 0.5 else values.strings
    return _choice(recent, rng)
  word = _choice(list(_FRESH_WORDS), rng)
  return f"{word}.txt" if "file" in name else f"{word}_{int(rng.integers(100))}"


def sample_arguments(
  function: dict[str, Any], values: ValuePool, rng: np.random.Generator, p_optional: float = 0.3
) -> dict[str, Any]:
  """Arguments for a tool ("function" dict): all required parameters, each optional one with
  p_optional."""
  params = function.get("parameters", {})
  required = set(params.get("required", []) or [])
  out = {}
  for pname, pschema in (params.get("properties") or {}).items():
    if pname in required or rng.random() < p_optional:
      out[pname] = sample_value(pschema, pname, values, rng)
  return out


def vary_arguments(
  arguments: dict[str, Any],
  function: dict[str, Any],
  values: ValuePool,
  rng: np.random.Generator,
  n_changes: int = 1,
) -> dict[str, Any]:
  """A copy of `arguments` with `n_changes` declared parameters resampled (optional ones may be
  added)."""
  props = function.get("parameters", {}).get("properties") or {}
  names = list(props)
  out = {k: v for k, v in arguments.items() if k in props}
  if not names:
    return out
  for _ in range(n_changes):
    pname = _choice(names, rng)
    out[pname] = sample_value(props[pname], pname, values, rng)
  return out
