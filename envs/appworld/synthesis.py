"""AppWorld synthesis (paper Sec. 3.2-3.3): what the programmatic explorer knows and plans.

The explorer discovers the apps' APIs in a live world through `apis.api_docs`
(`DISCOVER_APIS`); the task families whose every API it found are the ones it may synthesize
(`families`). For each marked trajectory `plan_worlds` picks the marked task's family (or a
random discovered one) and a fresh seed; the suite then builds those worlds with the offline world
builder (envs/appworld/world.py) and validates each by execution (the family's solution scores
1.0, completing at once scores 0.0).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np

from coevolve_jax.feedback.signals import SignalEvent


def code_reply(code: str) -> str:
  """The assistant reply that runs `code`: one fenced python block."""
  return f"```python\n{code.rstrip()}\n```"


# APIs each generated task family's solution calls (envs/appworld/world.py _PREAMBLE + template).
FAMILY_APIS = {
  "count_notes": (
    "supervisor.show_account_passwords",
    "supervisor.show_profile",
    "simple_note.login",
    "simple_note.search_notes",
    "supervisor.complete_task",
  ),
  "count_tagged": ("simple_note.login", "simple_note.search_notes", "supervisor.complete_task"),
  "latest_title": ("simple_note.login", "simple_note.search_notes", "supervisor.complete_task"),
  "create_note": ("simple_note.login", "simple_note.create_note", "supervisor.complete_task"),
  "delete_note": (
    "simple_note.login",
    "simple_note.search_notes",
    "simple_note.delete_note",
    "supervisor.complete_task",
  ),
  "count_open_todos": (
    "todoist.login",
    "todoist.show_projects",
    "todoist.show_tasks",
    "supervisor.complete_task",
  ),
  "complete_todo": (
    "todoist.login",
    "todoist.show_projects",
    "todoist.show_tasks",
    "todoist.update_task",
    "supervisor.complete_task",
  ),
}
DISCOVER_APIS = """\
import json
found = {}
for app in apis.api_docs.show_app_descriptions():
    names = [a["name"] for a in apis.api_docs.show_api_descriptions(app_name=app["name"])]
    found[app["name"]] = names
print(json.dumps(found))
"""


def parse_inventory(text: str) -> dict[str, list[str]]:
  """App -> API names from the output of `DISCOVER_APIS`.

  Raises:
    RuntimeError: the output is not that JSON (the discovery code failed in the world).
  """
  try:
    return json.loads(text)
  except ValueError as e:
    raise RuntimeError(f"API discovery through apis.api_docs failed: {text[:500]}") from e


def families(inventory: dict[str, list[str]]) -> list[str]:
  """Task families whose every API is in `inventory` (app -> API names)."""
  found = {f"{app}.{name}" for app, names in inventory.items() for name in names}
  return [f for f, needed in FAMILY_APIS.items() if set(needed) <= found]


def plan_worlds(
  events: Sequence[SignalEvent],
  known_families: Sequence[str],
  rng: np.random.Generator,
  round_idx: int,
  max_contexts: int,
) -> tuple[list[dict], dict[str, tuple[str, str]]]:
  """World specs for up to `max_contexts` events drawn uniformly without replacement.

  Returns:
    (specs for the world builder: task_id, template, seed; task_id -> (signal or "random",
    parent task id)).
  """
  known = set(known_families)
  picked = [events[int(i)] for i in rng.permutation(len(events))[:max_contexts]]
  specs, origin = [], {}
  for k, event in enumerate(picked):
    family = event.task.provenance.get("template")
    if family not in known:
      family = str(rng.choice(sorted(known)))
    seed = int(rng.integers(1 << 30))
    scenario = hashlib.sha1(f"syn:{round_idx}:{k}:{seed}".encode()).hexdigest()[:7]
    specs.append({"task_id": f"{scenario}_1", "template": family, "seed": seed})
    origin[f"{scenario}_1"] = (event.signal or "random", event.task.task_id)
  return specs, origin
