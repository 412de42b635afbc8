"""Safe conversion between ToolCall objects and the Python call strings BFCL executes.

BFCL's `execute_multi_turn_func_call` runs call strings with bare `eval()`. We therefore never hand
it model text: `call_to_string` builds the string ourselves from a validated ToolCall (declared
tool, declared identifier argument names, JSON-literal values rendered with `repr`), then re-parses
it with `ast` and checks it is a single call with literal arguments only.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
from typing import Any

from coevolve_jax.types import ToolCall
from envs.bfcl.data import import_bfcl

_MAX_DEPTH = 32


class ToolCallError(ValueError):
  """A tool call that cannot be executed safely (unknown tool, bad argument name or value, ...)."""


def _check_literal(value: Any, path: str, depth: int = 0) -> None:
  """Raises ToolCallError unless `value` is a JSON literal (recursively); `path` names it in
  errors."""
  if depth > _MAX_DEPTH:
    raise ToolCallError(f"argument {path} nests deeper than {_MAX_DEPTH}")
  if value is None or isinstance(value, (bool, str, int)):
    return
  if isinstance(value, float):
    if not math.isfinite(value):
      raise ToolCallError(f"argument {path} is not a finite number: {value!r}")
    return
  if isinstance(value, list):
    for i, v in enumerate(value):
      _check_literal(v, f"{path}[{i}]", depth + 1)
    return
  if isinstance(value, dict):
    for k, v in value.items():
      if not isinstance(k, str):
        raise ToolCallError(f"argument {path} has a non-string key {k!r}")
      _check_literal(v, f"{path}[{k!r}]", depth + 1)
    return
  raise ToolCallError(f"argument {path} has a non-JSON value of type {type(value).__name__}")


def _is_literal_node(node: ast.AST) -> bool:
  if isinstance(node, ast.Constant):
    return node.value is None or isinstance(node.value, (bool, int, float, str))
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
    return isinstance(node.operand, ast.Constant) and isinstance(node.operand.value, (int, float))
  if isinstance(node, (ast.List, ast.Tuple)):
    return all(_is_literal_node(e) for e in node.elts)
  if isinstance(node, ast.Dict):
    return all(
      k is not None and isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys
    ) and all(_is_literal_node(v) for v in node.values)
  return False


def _check_call_string(text: str, name: str) -> None:
  """Defense in depth: `text` must parse as exactly one call of `name` with literal keyword args."""
  try:
    tree = ast.parse(text, mode="eval")
  except SyntaxError as e:
    raise ToolCallError(f"built call does not parse: {e}") from e
  call = tree.body
  if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == name):
    raise ToolCallError(f"built call is not a plain call of {name!r}")
  if call.args or any(kw.arg is None or not _is_literal_node(kw.value) for kw in call.keywords):
    raise ToolCallError(f"built call of {name!r} has non-literal or non-keyword arguments")


def call_to_string(call: ToolCall, schemas_by_name: dict[str, dict[str, Any]]) -> str:
  """Builds the BFCL call string, e.g. "mv(source='a.txt', destination='temp')", from a validated
  call.

  Args:
    call: the parsed tool call.
    schemas_by_name: tool name -> "function" dict ({"name", "description", "parameters"}) of the
      tools this entry offers (see envs.bfcl.data.schemas_by_name).

  Returns:
    A string with one call and literal keyword arguments in the call's argument order.

  Raises:
    ToolCallError: unknown tool, non-identifier or undeclared argument name, missing required
      argument, a value that is not a (finite) JSON literal.
  """
  name = call.name
  if not isinstance(name, str) or not name.isidentifier() or name not in schemas_by_name:
    raise ToolCallError(f"unknown tool {name!r}; available: {sorted(schemas_by_name)}")
  if not isinstance(call.arguments, dict):
    raise ToolCallError(
      f"arguments of {name} must be an object, got {type(call.arguments).__name__}"
    )
  params = schemas_by_name[name].get("parameters", {})
  declared = params.get("properties", {}) or {}
  parts = []
  for arg, value in call.arguments.items():
    if not isinstance(arg, str) or not arg.isidentifier() or arg.startswith("_"):
      raise ToolCallError(f"invalid argument name {arg!r} for {name}")
    if arg not in declared:
      raise ToolCallError(f"{name} has no parameter {arg!r}; declared: {sorted(declared)}")
    _check_literal(value, arg)
    parts.append(f"{arg}={value!r}")
  missing = [p for p in params.get("required", []) or [] if p not in call.arguments]
  if missing:
    raise ToolCallError(f"{name} is missing required argument(s) {missing}")
  text = f"{name}({', '.join(parts)})"
  _check_call_string(text, name)
  return text


@functools.lru_cache(maxsize=512)
def _positional_names(name: str, involved_classes: tuple[str, ...]) -> tuple[str, ...]:
  """Parameter names of backend method `name` (for positional args in BFCL ground truth)."""
  config = import_bfcl("bfcl_eval.constants.executable_backend_config")
  for cls_name in involved_classes:
    cls = getattr(import_bfcl(config.CLASS_FILE_PATH_MAPPING[cls_name]), cls_name)
    method = getattr(cls, name, None)
    if method is not None and not name.startswith("_"):
      return tuple(p for p in inspect.signature(method).parameters if p != "self")
  raise ToolCallError(f"no backend method {name!r} in {list(involved_classes)}")


def parse_call_string(text: str, involved_classes: list[str]) -> ToolCall:
  """Parses a BFCL call string ("sort('a.txt')", "mv(source='a', destination='b')") into a ToolCall.

  Only literal arguments are accepted (parsed with ast.literal_eval, never eval). Positional
  arguments are named from the backend method's signature.

  Raises:
    ToolCallError: not a single plain call with literal arguments, or an unknown method.
  """
  try:
    call = ast.parse(text.strip(), mode="eval").body
  except SyntaxError as e:
    raise ToolCallError(f"cannot parse call {text!r}: {e}") from e
  if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
    raise ToolCallError(f"not a plain call: {text!r}")
  nodes = list(call.args) + [kw.value for kw in call.keywords]
  if any(kw.arg is None for kw in call.keywords) or any(
    isinstance(n, ast.Starred) for n in call.args
  ):
    raise ToolCallError(f"star arguments are not allowed: {text!r}")
  if not all(_is_literal_node(n) for n in nodes):
    raise ToolCallError(f"non-literal argument in {text!r}")
  args: dict[str, Any] = {}
  if call.args:
    names = _positional_names(call.func.id, tuple(involved_classes))
    if len(call.args) > len(names):
      raise ToolCallError(f"too many positional arguments in {text!r}")
    args.update({n: ast.literal_eval(a) for n, a in zip(names, call.args)})
  args.update({kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg is not None})
  args = {k: list(v) if isinstance(v, tuple) else v for k, v in args.items()}
  return ToolCall(name=call.func.id, arguments=args)
