"""The tree's layering rules, read from the imports of every module (module level, inside
functions and under `TYPE_CHECKING` alike), and the protocols' members on their implementations.

Rules (README "Architecture"): the core (`coevolve_jax/`, the feedback package included) never
imports a benchmark (`envs/`); the model, the rollout engine and the GRPO objective import none of
the feedback package, the benchmarks or the run's loop; the loop's modules name no benchmark;
AppWorld never imports BFCL; and no two modules import each other, directly or around a circle.
"""

import ast
import importlib
import inspect
import pathlib
import re

import pytest

from coevolve_jax import suite as suite_lib
from coevolve_jax.feedback.synthesis import Synthesizer
from coevolve_jax.hooks import TrainingHook
from coevolve_jax.rollout.slots import SlotEngine

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The run's loop: the job's orchestration, which may know the feedback package but no benchmark
# (the command line, coevolve_jax/main.py, names the configs it is run with).
LOOP = (
  "coevolve_jax.loop",
  "coevolve_jax.components",
  "coevolve_jax.scheduler",
  "coevolve_jax.evaluation",
  "coevolve_jax.workdir",
  "coevolve_jax.hooks",
  "coevolve_jax.diagnostics",
  "coevolve_jax.backtest",
  "coevolve_jax.gate",
)
LOWER = ("coevolve_jax.models", "coevolve_jax.rollout", "coevolve_jax.grpo")


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for base in ("coevolve_jax", "envs"):
    for path in (ROOT / base).rglob("*.py"):
      parts = path.relative_to(ROOT).with_suffix("").parts
      name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
      out[name] = path
  return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
  """The project modules `name` imports anywhere in its file (names of `from x import y` that
  are modules count as such)."""
  path = MODULES[name]
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
      else:
        module = node.module or ""
      found.add(module)
      found.update(f"{module}.{a.name}" for a in node.names)
  out = set()
  for target in found:
    while target and target not in MODULES:
      target = target.rpartition(".")[0]
    if target and target != name:
      out.add(target)
  return out


GRAPH = {name: _imports(name) for name in MODULES}


def _under(name: str, prefixes) -> bool:
  return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_core_never_imports_a_benchmark():
  bad = {
    name: sorted(t for t in deps if _under(t, ("envs",)))
    for name, deps in GRAPH.items()
    if _under(name, ("coevolve_jax",))
  }
  assert {k: v for k, v in bad.items() if v} == {}


def test_model_rollout_and_objective_import_no_feedback_benchmark_or_loop():
  banned = ("coevolve_jax.feedback", "envs", *LOOP)
  bad = {
    name: sorted(t for t in deps if _under(t, banned))
    for name, deps in GRAPH.items()
    if _under(name, LOWER)
  }
  assert {k: v for k, v in bad.items() if v} == {}


def test_the_loop_names_no_benchmark():
  named = {}
  for name in LOOP:
    text = MODULES[name].read_text(encoding="utf-8")
    if hits := sorted(set(re.findall(r"\b(bfcl|appworld|BFCL|AppWorld)\b", text))):
      named[name] = hits
  assert named == {}


def test_appworld_never_imports_bfcl():
  bad = {
    name: sorted(t for t in deps if _under(t, ("envs.bfcl",)))
    for name, deps in GRAPH.items()
    if _under(name, ("envs.appworld",))
  }
  assert {k: v for k, v in bad.items() if v} == {}


def _circles() -> list[list[str]]:
  """The import graph's strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(GRAPH[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(GRAPH):
    if v not in index:
      visit(v)
  return out


def test_no_import_circles():
  assert _circles() == []


def test_the_circle_finder_finds_a_planted_circle(monkeypatch):
  """The rule above can fail: two modules that import each other form a circle."""
  monkeypatch.setitem(
    GRAPH, "coevolve_jax.types", GRAPH["coevolve_jax.types"] | {"coevolve_jax.grpo"}
  )
  monkeypatch.setitem(
    GRAPH, "coevolve_jax.grpo", GRAPH["coevolve_jax.grpo"] | {"coevolve_jax.types"}
  )
  assert ["coevolve_jax.grpo", "coevolve_jax.types"] in _circles()


def _members(protocol) -> set[str]:
  """A Protocol's declared members: its annotated attributes and its methods."""
  methods = {
    n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_")
  }
  return methods | set(getattr(protocol, "__annotations__", {}))


def _instance_attributes(cls) -> set[str]:
  """Attributes the class declares, or that an `__init__` of it or of a base class assigns
  (`self.x = ...`, `self.x, self.y = ...`, `self.x: T = ...`)."""
  names = set(dir(cls))
  for klass in inspect.getmro(cls):
    if "__init__" not in vars(klass) or klass is object:
      continue
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(klass.__init__)))
    for node in ast.walk(tree):
      targets = node.targets if isinstance(node, ast.Assign) else []
      targets += [node.target] if isinstance(node, ast.AnnAssign) else []
      for target in targets:
        for t in target.elts if isinstance(target, ast.Tuple) else [target]:
          if (
            isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
          ):
            names.add(t.attr)
  return names


def _implementations():
  suites = [importlib.import_module(path).Suite for path in suite_lib.SUITES.values()]
  bfcl_synth = importlib.import_module("envs.bfcl.synthesis")
  aw_synth = importlib.import_module("envs.appworld.synthesis")
  engine = importlib.import_module("coevolve_jax.rollout.engine").Engine
  replay = importlib.import_module("coevolve_jax.testing.replay_engine").ReplayEngine
  return [
    *((suite_lib.Suite, s) for s in suites),
    (Synthesizer, bfcl_synth.BfclSynthesizer),
    (Synthesizer, aw_synth.LLMWorldSynthesizer),
    (Synthesizer, aw_synth.GeneratedWorldSynthesizer),
    (Synthesizer, aw_synth.OfficialD0),
    (SlotEngine, engine),
    (SlotEngine, replay),
    (TrainingHook, importlib.import_module("coevolve_jax.hooks").GroupLog),
    (TrainingHook, importlib.import_module("coevolve_jax.diagnostics").Diagnostics),
    (TrainingHook, importlib.import_module("coevolve_jax.diagnostics").RolloutLog),
    (suite_lib.Env, importlib.import_module("envs.bfcl.env").BfclEnv),
    (suite_lib.Env, importlib.import_module("envs.appworld.env").AppWorldEnv),
  ]


@pytest.mark.parametrize("protocol, cls", _implementations(), ids=lambda x: x.__name__)
def test_every_implementation_has_every_member_of_its_protocol(protocol, cls):
  missing = _members(protocol) - _instance_attributes(cls)
  assert not missing, f"{cls.__name__} lacks {sorted(missing)} of {protocol.__name__}"
