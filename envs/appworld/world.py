"""Offline AppWorld world builder: seeded worlds and tasks from the shipped app models, factories.

Runs INSIDE the AppWorld virtual environment (`.venv-appworld/bin/python envs/appworld/world.py
--root DIR --num-scenarios N ...`), never in this project's environment: it imports `appworld`
(pydantic < 2) and the standard library only. The project side calls it through
`envs.appworld.server.build_worlds`.

What one task is, in AppWorld's own on-disk format (appworld/task.py, appworld/ground_truth.py), so
that the unmodified `AppWorld(task_id)` and `appworld.evaluator.evaluate_task` load and grade it:
  <root>/data/tasks/<task_id>/specs.json          instruction, supervisor, datetime, db_version
  <root>/data/tasks/<task_id>/dbs/<app>.db        the seeded world: every app's database
  <root>/data/tasks/<task_id>/ground_truth/       evaluation.py, answer.json, test_data.json,
                                                  metadata.json, public/private_data.json
  <root>/data/api_docs/standard/<app>.json        API docs, built from the app code
  <root>/data/datasets/<split>.txt                task ids per split
  <root>/coevolve_tasks.jsonl                     our index: id, instruction, scenario, solution
A world is a population of people (admin.MainUser; one of them the supervisor, with account
passwords in the supervisor app) plus app records built by the shipped polyfactory factories, with
the clock frozen at the task's datetime. Task ids follow AppWorld's `<scenario>_<n>` form: tasks of
one scenario share an instruction template and differ in their worlds, which is what scenario goal
completion (SGC) groups by.

Nothing built here is committed: the data root lives under the run's workdir or a temp folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import sys
import time
from typing import Any

# Run as a script, this file's folder (envs/appworld/, whose env.py, data.py, server.py could shadow
# installed modules of those names) is sys.path[0]; drop it so that `import appworld` and its own
# imports find the installed packages.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

ANSWER_REQUIREMENT = "assert answers match."
NO_CHANGE_REQUIREMENT = "assert no notes were added, removed or edited."
SPLITS = ("train", "dev", "test_normal")

# Instruction templates over the Simple Note app; each gives (instruction, answer, tests, solution)
# for a built world; `tests` is the evaluation code body (AppWorld's `evaluate` signature).
_PREAMBLE = """\
pw = {a["account_name"]: a["password"] for a in apis.supervisor.show_account_passwords()}
me = apis.supervisor.show_profile()
token = apis.simple_note.login(username=me["email"], password=pw["simple_note"])["access_token"]
notes, page = [], 0
while True:
    batch = apis.simple_note.search_notes(access_token=token, page_index=page, page_limit=20)
    if not batch:
        break
    notes += batch
    page += 1
"""

_EVAL_HEADER = """\
import json


def _user(models, main_user):
    return models.end.simple_note.User.find_one(email=main_user.email)


def _notes(collection, user):
    notes = collection.simple_note.Note.find_all(user_id=user.id)
    return sorted((n.title, n.content) for n in notes)


def _todos(collection):
    return sorted((t.title, t.priority, t.is_completed) for t in collection.todoist.Task.find_all())


def evaluate(test, public_data, private_data, main_user, models, ground_truth_answer):
    user = _user(models, main_user)
    start_user = models.start.simple_note.User.find_one(email=main_user.email)
    answer = json.loads(models.end.supervisor.Task.first().answer)
"""

_EVAL_ANSWER = f'''\
    with test("{ANSWER_REQUIREMENT}"):
        test.answer(answer, ground_truth_answer)
    with test("{NO_CHANGE_REQUIREMENT}"):
        test.case(_notes(models.end, user), "==", _notes(models.start, start_user))
'''


def _cutoff(world: dict, rng: random.Random) -> str:
  """A date (YYYY-MM-DD) taken from one of the supervisor's notes, so the answer is non-trivial."""
  return rng.choice(sorted(n["created_at"][:10] for n in world["notes"]))


def _count_notes(world: dict, rng: random.Random) -> tuple[str, object, str, str]:
  day = _cutoff(world, rng)
  instruction = f"How many notes have I created in Simple Note since {day} (that day included)?"
  answer = sum(n["created_at"][:10] >= day for n in world["notes"])
  solution = _PREAMBLE + (
    f"apis.supervisor.complete_task(answer=sum(n['created_at'][:10] >= {day!r} for n in notes))\n"
  )
  return instruction, answer, _EVAL_ANSWER, solution


def _count_tagged(world: dict, rng: random.Random) -> tuple[str, object, str, str]:
  tag = rng.choice(sorted({t for n in world["notes"] for t in n["tags"]}))
  instruction = f'How many of my Simple Note notes are tagged "{tag}"?'
  answer = sum(tag in n["tags"] for n in world["notes"])
  solution = _PREAMBLE + (
    f"apis.supervisor.complete_task(answer=sum({tag!r} in n['tags'] for n in notes))\n"
  )
  return instruction, answer, _EVAL_ANSWER, solution


def _latest_title(world: dict, rng: random.Random) -> tuple[str, object, str, str]:
  days = sorted({n["created_at"][:10] for n in world["notes"]})
  day = rng.choice(days[1:] or days)  # some note was created before it
  instruction = (
    f"What is the title of the last note I created in Simple Note before {day}? "
    "If there is none, answer None."
  )
  earlier = [n for n in world["notes"] if n["created_at"][:10] < day]
  answer = max(earlier, key=lambda n: n["created_at"])["title"] if earlier else None
  solution = _PREAMBLE + (
    f"earlier = [n for n in notes if n['created_at'][:10] < {day!r}]\n"
    "latest = max(earlier, key=lambda n: n['created_at']) if earlier else None\n"
    "apis.supervisor.complete_task(answer=latest['title'] if latest else None)\n"
  )
  return instruction, answer, _EVAL_ANSWER, solution


def _create_note(world: dict, rng: random.Random) -> tuple[str, object, str, str]:
  del world
  title = f"{rng.choice(['Groceries', 'Ideas', 'Travel', 'Books', 'Chores'])} {rng.randint(2, 99)}"
  content = rng.choice(["milk and eggs", "call the plumber", "pack the charger", "read chapter 3"])
  instruction = (
    f'Create a note in Simple Note titled "{title}" with the content "{content}". '
    "Mark the task complete when done."
  )
  tests = f"""\
    with test("assert the answer is None."):
        test.case(answer, "==", None)
    with test("assert exactly one note was added, with the requested title and content."):
        added = sorted(set(_notes(models.end, user)) - set(_notes(models.start, start_user)))
        test.case(added, "==", [({title!r}, {content!r})])
    with test("assert no existing note was removed or edited."):
        gone = set(_notes(models.start, start_user)) - set(_notes(models.end, user))
        test.case(gone, "==", set())
"""
  solution = _PREAMBLE + (
    f"apis.simple_note.create_note(access_token=token, title={title!r}, "
    f"content={content!r})\napis.supervisor.complete_task()\n"
  )
  return instruction, None, tests, solution


def _delete_note(world: dict, rng: random.Random) -> tuple[str, object, str, str]:
  title = rng.choice(world["notes"])["title"]
  instruction = f'Delete my Simple Note note titled "{title}". Mark the task complete when done.'
  tests = f"""\
    with test("assert the answer is None."):
        test.case(answer, "==", None)
    with test("assert the note titled {title} is gone and every other note is unchanged."):
        expected = [n for n in _notes(models.start, start_user) if n[0] != {title!r}]
        test.case(_notes(models.end, user), "==", expected)
"""
  solution = _PREAMBLE + (
    f"target = [n for n in notes if n['title'] == {title!r}][0]\n"
    "apis.simple_note.delete_note(access_token=token, "
    "note_id=target['note_id'])\napis.supervisor.complete_task()\n"
  )
  return instruction, None, tests, solution


_TODO_PREAMBLE = """\
pw = {a["account_name"]: a["password"] for a in apis.supervisor.show_account_passwords()}
me = apis.supervisor.show_profile()
token = apis.todoist.login(username=me["email"], password=pw["todoist"])["access_token"]
projects = apis.todoist.show_projects(access_token=token, page_limit=20)
"""


def _project_tasks(project: str) -> str:
  return _TODO_PREAMBLE + (
    f"pid = [p for p in projects if p['name'] == {project!r}][0]['project_id']\n"
    "tasks = apis.todoist.show_tasks(access_token=token, project_id=pid)['no_section_tasks']\n"
  )


def _count_open_todos(world: dict, rng: random.Random) -> tuple[str, object, str, str]:
  project = rng.choice(sorted({t["project"] for t in world["todos"]}))
  priority = rng.choice(["high", "medium", "low"])
  instruction = (
    f'How many tasks in my Todoist project "{project}" are not completed yet and have '
    f"{priority} priority?"
  )
  answer = sum(
    t["project"] == project and not t["done"] and t["priority"] == priority for t in world["todos"]
  )
  tests = f'''\
    with test("{ANSWER_REQUIREMENT}"):
        test.answer(answer, ground_truth_answer)
    with test("assert no Todoist task was added, removed or edited."):
        test.case(_todos(models.end), "==", _todos(models.start))
'''
  solution = _project_tasks(project) + (
    "apis.supervisor.complete_task(answer=sum(1 for t in tasks if not t['is_completed'] "
    f"and t['priority'] == {priority!r}))\n"
  )
  return instruction, answer, tests, solution


def _complete_todo(world: dict, rng: random.Random) -> tuple[str, object, str, str]:
  todo = rng.choice([t for t in world["todos"] if not t["done"]] or world["todos"])
  instruction = (
    f'Mark my Todoist task "{todo["title"]}" in the project "{todo["project"]}" as completed. '
    "Mark the task complete when done."
  )
  tests = f"""\
    with test("assert the answer is None."):
        test.case(answer, "==", None)
    with test("assert the task is completed and no other Todoist task changed."):
        expected = sorted(
            (t, p, True if t == {todo["title"]!r} else done) for t, p, done in _todos(models.start)
        )
        test.case(_todos(models.end), "==", expected)
"""
  solution = _project_tasks(todo["project"]) + (
    f"target = [t for t in tasks if t['title'] == {todo['title']!r}][0]\n"
    "apis.todoist.update_task(access_token=token, task_id=target['task_id'], is_completed=True)\n"
    "apis.supervisor.complete_task()\n"
  )
  return instruction, None, tests, solution


TEMPLATES = {
  "count_notes": (_count_notes, 1),  # name -> (builder, difficulty)
  "count_tagged": (_count_tagged, 1),
  "latest_title": (_latest_title, 1),
  "create_note": (_create_note, 1),
  "delete_note": (_delete_note, 2),
  "count_open_todos": (_count_open_todos, 2),
  "complete_todo": (_complete_todo, 2),
}
TEMPLATE_APPS = {"count_open_todos": ["todoist"], "complete_todo": ["todoist"]}  # else simple_note
_TAGS = ("work", "personal", "ideas", "travel", "health")
_PROJECTS = ("Home", "Work", "Garden", "Trip", "Study")
_TODO_TITLES = (
  "Buy paint",
  "Call the bank",
  "Renew passport",
  "Fix the fence",
  "Book tickets",
  "Water the plants",
  "Read the report",
  "Pay rent",
  "Clean the garage",
  "Plan menu",
)


def _populate(mc, rng: random.Random, num_people: int, num_notes: int) -> tuple[Any, dict]:
  """Fills `mc` with people, the supervisor, and their Simple Note and Todoist accounts (notes;
  the supervisor's Todoist projects and tasks); -> (supervisor, world)."""
  from appworld.common.datetime import DateTime  # noqa: PLC0415

  people: list[Any] = []
  while len(people) < num_people:  # faker repeats names now and then; unique_by rejects them
    person = mc.admin.MainUser.factory().build()
    if any(p.email == person.email or p.first_name == person.first_name for p in people):
      continue
    person.save()
    people.append(person)
  boss = people[0]
  sup = mc.supervisor.Supervisor(
    first_name=boss.first_name,
    last_name=boss.last_name,
    email=boss.email,
    phone_number=boss.phone_number,
    birthday=boss.birthday,
    sex=boss.sex,
  )
  sup.save()
  password = f"pw-{rng.getrandbits(40):010x}"
  mc.supervisor.AccountPassword(
    supervisor_id=sup.id, account_name="simple_note", password=password
  ).save()
  mc.supervisor.AccountPassword(
    supervisor_id=sup.id, account_name="todoist", password=password
  ).save()
  notes, todos = [], []
  for person in people:  # a Todoist account each; the supervisor's projects hold the tasks
    member = mc.todoist.User(
      first_name=person.first_name,
      last_name=person.last_name,
      email=person.email,
      password=password if person is boss else f"pw-{rng.getrandbits(40):010x}",
      verified=True,
    )
    member.save()
    if person is not boss:
      continue
    titles = rng.sample(_TODO_TITLES, len(_TODO_TITLES))  # unique across the projects
    for name in ["Inbox", *rng.sample(_PROJECTS, 2)]:
      project = mc.todoist.Project(user_id=member.id, name=name, is_inbox=name == "Inbox")
      project.save()
      mc.todoist.ProjectCollaboratorLink(project_id=project.id, user_id=member.id).save()
      if name == "Inbox":
        continue
      count = rng.randint(3, 5)
      for k, title in enumerate(titles[:count]):
        priority, done = rng.choice(["high", "medium", "low"]), rng.random() < 0.3
        mc.todoist.Task(
          project_id=project.id,
          user_id=member.id,
          title=title,
          priority=priority,
          is_completed=done,
          order_index=k,
          due_date=DateTime.now().add(days=rng.randint(1, 30)),
        ).save()
        todos.append({"project": name, "title": title, "priority": priority, "done": done})
      titles = titles[count:]
  for person in people:  # everyone has an account; only the supervisor's notes matter
    user = mc.simple_note.User.factory().build(
      first_name=person.first_name,
      last_name=person.last_name,
      email=person.email,
      password=password if person is boss else f"pw-{rng.getrandbits(40):010x}",
      verified=True,
    )
    user.save()
    count = num_notes if person is boss else rng.randint(1, 3)
    numbers = rng.sample(range(10, 99), count)
    for i, number in enumerate(numbers):
      created = DateTime.now().subtract(days=rng.randint(1, 300), minutes=i)
      tags = rng.sample(_TAGS, rng.randint(1, 2))
      note = mc.simple_note.Note.factory().build(
        user_id=user.id,
        title=f"Note {number}",
        content=f"content {number}",
        tags=tags,
        created_at=created,
        updated_at=created,
        pinned=False,
      )
      note.save()
      if person is boss:
        notes.append({"title": note.title, "tags": tags, "created_at": created.isoformat()})
  return sup, {"notes": notes, "todos": todos}


def _write_api_docs(data: str) -> None:
  from appworld.collections.api_docs import ApiDocCollection  # noqa: PLC0415
  from appworld.common.constants import CANARY_STRING  # noqa: PLC0415

  folder = os.path.join(data, "api_docs", "standard")
  os.makedirs(folder, exist_ok=True)
  for app, apis in ApiDocCollection.build().items():
    if app == "admin":
      continue
    docs = {name: {**dict(doc), "canary_string": CANARY_STRING} for name, doc in apis.items()}
    with open(os.path.join(folder, f"{app}.json"), "w", encoding="utf-8") as f:
      json.dump(docs, f, default=str)


def _fill_api_docs_table(mc) -> None:
  from appworld.collections.api_docs import ApiDocCollection  # noqa: PLC0415

  rows = [
    mc.api_docs.ApiDoc(
      app_name_=d["app_name"],
      api_name=d["api_name"],
      path=d["path"],
      method=d["method"],
      description=d["description"],
      parameters=d["parameters"],
      response_schemas=d["response_schemas"],
    )
    for apis in ApiDocCollection.build().values()
    for d in apis.values()
  ]
  mc.api_docs.ApiDoc.save_all(rows)


def _write_ground_truth(folder: str, answer, tests: str, difficulty: int, solution: str) -> None:
  os.makedirs(folder, exist_ok=True)
  requirements = re.findall(r'with test\("(.*?)"\):', tests)
  files = {
    "public_data.json": {},
    "private_data.json": {},
    "test_data.json": [{"requirement": r, "label": "no_op_fail"} for r in requirements],
    "metadata.json": {
      "mode": "minimal",
      "difficulty": difficulty,
      "num_apps": 1,
      "num_apis": len(set(re.findall(r"apis\.(\w+\.\w+)", solution))),
      "num_solution_code_lines": len(solution.strip().splitlines()),
    },
  }
  for name, value in files.items():
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
      json.dump(value, f, indent=1)
  with open(os.path.join(folder, "answer.json"), "w", encoding="utf-8") as f:
    f.write(json.dumps(answer))
  with open(os.path.join(folder, "evaluation.py"), "w", encoding="utf-8") as f:
    f.write(_EVAL_HEADER + tests)


def build_task(
  task_id: str, template: str, seed: int, num_people: int, num_notes: int, api_docs_db: str = ""
) -> dict:
  """Builds one task (world, instruction, evaluation, answer) under path_store.data.

  The api_docs table is the same in every world: with `api_docs_db` (an earlier task's
  dbs/api_docs.db) it is copied instead of being rebuilt (about 2 s per task on 2 cores).
  Returns the task's row for coevolve_tasks.jsonl.
  """
  from appworld.apps import get_all_apps  # noqa: PLC0415
  from appworld.apps.admin.models import MainUserMunch  # noqa: PLC0415
  from appworld.apps.api_lib import set_local_date_and_time, unset_local_date_and_time  # noqa: PLC0415
  from appworld.collections.models import ModelCollection  # noqa: PLC0415
  from appworld.common.constants import DB_VERSION  # noqa: PLC0415
  from appworld.common.datetime import DateTime  # noqa: PLC0415
  from appworld.common.path_store import path_store  # noqa: PLC0415
  from appworld.common.random import set_random_seed  # noqa: PLC0415
  from appworld.task import Task  # noqa: PLC0415

  rng = random.Random(seed)
  set_random_seed(seed, python=True, faker_=True, model_factory=True)
  when = DateTime(2023, 5, 18, 12, 0, 0).add(days=rng.randint(0, 200))
  freezer = set_local_date_and_time(when)
  mc = ModelCollection.load(
    to_db_home_path=f":memory:build-{task_id}", load_apps=get_all_apps(), create_db=True
  )
  try:
    sup, world = _populate(mc, rng, num_people, num_notes)
    builder, difficulty = TEMPLATES[template]
    instruction, answer, tests, solution = builder(world, rng)
    mc.supervisor.Task(supervisor_id=sup.id, instruction=instruction).save()
    if not api_docs_db:
      _fill_api_docs_table(mc)
    task = Task(
      id=task_id,
      instruction=instruction,
      supervisor=MainUserMunch.from_supervisor(sup),
      datetime=when,
      allowed_apps=get_all_apps(skip_admin=True),
      db_version=DB_VERSION,
      model_collection=mc,
    )
    task.save(delete_if_exists=True, save_ground_truth=False)
    if api_docs_db:
      shutil.copyfile(
        api_docs_db, os.path.join(path_store.data, "tasks", task_id, "dbs", "api_docs.db")
      )
    _write_ground_truth(
      os.path.join(path_store.data, "tasks", task_id, "ground_truth"),
      answer,
      tests,
      difficulty,
      solution,
    )
  finally:
    mc.close()
    unset_local_date_and_time(freezer)
  return {
    "task_id": task_id,
    "scenario": task_id.split("_")[0],
    "template": template,
    "instruction": instruction,
    "answer": answer,
    "difficulty": difficulty,
    "apps": TEMPLATE_APPS.get(template, ["simple_note"]),
    "solution": solution,
    "seed": seed,
  }


def scenario_id(template: str, seed: int, index: int) -> str:
  """AppWorld-style 7-hex scenario id, stable for a (template, seed, index)."""
  return hashlib.sha1(f"{template}:{seed}:{index}".encode()).hexdigest()[:7]


def build(
  root: str,
  num_scenarios: int,
  tasks_per_scenario: int,
  seed: int,
  templates: list[str],
  num_people: int,
  num_notes: int,
  eval_scenarios: int,
) -> list[dict]:
  """Builds `num_scenarios` x `tasks_per_scenario` tasks; the last `eval_scenarios` scenarios form
  test_normal, the rest train; writes the split files and coevolve_tasks.jsonl."""
  os.environ["APPWORLD_ROOT"] = os.path.abspath(root)
  from appworld import update_root  # noqa: PLC0415

  update_root(os.path.abspath(root))
  from appworld.common.path_store import path_store  # noqa: PLC0415

  os.makedirs(os.path.join(path_store.data, "tasks"), exist_ok=True)
  _write_api_docs(path_store.data)
  splits: dict[str, list[str]]
  rows, splits, api_docs_db = [], {s: [] for s in SPLITS}, ""
  for k in range(num_scenarios):
    template = templates[k % len(templates)]
    scenario = scenario_id(template, seed, k)
    split = "test_normal" if k >= num_scenarios - eval_scenarios else "train"
    for n in range(1, tasks_per_scenario + 1):
      row = build_task(
        f"{scenario}_{n}", template, seed * 100003 + k * 101 + n, num_people, num_notes, api_docs_db
      )
      api_docs_db = os.path.join(path_store.data, "tasks", row["task_id"], "dbs", "api_docs.db")
      row["split"] = split
      rows.append(row)
      splits[split].append(row["task_id"])
  os.makedirs(os.path.join(path_store.data, "datasets"), exist_ok=True)
  for split, ids in splits.items():
    split_file = os.path.join(path_store.data, "datasets", f"{split}.txt")
    with open(split_file, "w", encoding="utf-8") as f:
      f.write("".join(f"{i}\n" for i in ids))
  with open(os.path.join(root, "coevolve_tasks.jsonl"), "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)
  return rows


def add_tasks(root: str, specs: list[dict], num_people: int, num_notes: int) -> list[dict]:
  """Builds the given tasks into an already built root; appends their rows to the index."""
  from appworld import update_root  # noqa: PLC0415

  update_root(os.path.abspath(root))
  from appworld.common.path_store import path_store  # noqa: PLC0415

  index = os.path.join(root, "coevolve_tasks.jsonl")
  with open(index, encoding="utf-8") as f:
    first = json.loads(f.readline())
  api_docs_db = os.path.join(path_store.data, "tasks", first["task_id"], "dbs", "api_docs.db")
  rows = []
  for spec in specs:
    if spec["template"] not in TEMPLATES:
      raise ValueError(f"unknown template {spec['template']!r}; known: {sorted(TEMPLATES)}")
    row = build_task(
      spec["task_id"], spec["template"], int(spec["seed"]), num_people, num_notes, api_docs_db
    )
    row["split"] = "synth"
    rows.append(row)
  with open(index, "a", encoding="utf-8") as f:
    f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)
  return rows


# Evaluation code of a derived task (`derive_tasks`): the agent's end state must change the same
# records as the reference solution did and its answer must match. Records are compared as JSON
# without their ids (an added record's id depends on insertion order) and `record_hash` (which
# covers the id); updated records keep their ids. With `private_data["record_to"]` it records the
# reference run's answer and changes to that file instead of testing (how `derive_task` makes
# the expected values: one piece of code computes both sides).
DERIVED_EVALUATION = """\
import json

_DROP = ("id", "record_hash")


def _row(record, keep_id):
    data = {k: v for k, v in record.dict().items() if k not in _DROP or (keep_id and k == "id")}
    return json.dumps(data, sort_keys=True, default=str)


def _changes(models):
    out = {}
    for name in sorted(models.changed_model_names()):
        added, updated, removed = models.changed_records(name)
        out[name] = {
            "added": sorted(_row(r, False) for r in added),
            "updated": sorted(_row(r, True) for r in updated),
            "removed": sorted(r.id for r in removed),
        }
    return out


def evaluate(test, public_data, private_data, main_user, models, ground_truth_answer):
    answer = json.loads(models.end.supervisor.Task.first().answer)
    changes = _changes(models)
    if private_data.get("record_to"):
        with open(private_data["record_to"], "w", encoding="utf-8") as f:
            json.dump({"answer": answer, "changes": changes}, f)
        return
    with test("assert answers match."):
        test.answer(answer, ground_truth_answer)
    with test("assert the database changes match the reference solution's."):
        test.case(changes, "==", private_data["changes"])
"""
DERIVED_REQUIREMENTS = (
  "assert answers match.",
  "assert the database changes match the reference solution's.",
)


def _write_json(path: str, value) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=1)


def _printed_value(output: str):
  """The value a step printed: JSON, else a Python literal, else the text (stripped)."""
  import ast  # noqa: PLC0415

  text = output.strip()
  try:
    return json.loads(text)
  except ValueError:
    pass
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError, MemoryError, RecursionError):
    return text


def derive_task(spec: dict) -> dict:
  """One task derived from an existing task's world (paper Sec. 3.3 on AppWorld).

  `spec`: {task_id, base_task_id, instruction, steps: [code, ...], answer_step: int or None}.
  The new task starts from the base task's databases (its world, supervisor and date) with the
  new instruction. Its ground truth comes from running the steps once here, in order (AppWorld
  in this process, safety guard on): the answer is what step `answer_step` printed (JSON or a
  Python literal, else the text), then `apis.supervisor.complete_task` is called with it; the
  answer and the records added, changed and removed become the expected values of
  `DERIVED_EVALUATION`, so AppWorld's own evaluator grades the task like any official one, with
  no LLM judge. The reference solution (warm-start, hints) is the steps plus that final call.

  Returns the task's index row, with "error" set (and the task folder removed) when a step
  failed or completed the task itself, the answer step printed nothing, or the task neither
  answers anything nor changes the world.
  """
  import sqlite3  # noqa: PLC0415

  from appworld import AppWorld  # noqa: PLC0415
  from appworld.common.path_store import path_store  # noqa: PLC0415

  tasks = os.path.join(path_store.data, "tasks")
  new, base = spec["task_id"], spec["base_task_id"]
  steps, answer_step = [str(code) for code in spec["steps"]], spec.get("answer_step")
  folder = os.path.join(tasks, new)
  row = {
    "task_id": new,
    "scenario": new.split("_")[0],
    "base_task_id": base,
    "instruction": spec["instruction"],
    "solution": "",
    "apps": sorted(set(re.findall(r"apis\.(\w+)\.", "\n".join(steps))) - {"supervisor"}),
    "difficulty": 2,
    "error": None,
  }
  if os.path.exists(folder):
    row["error"] = f"task folder {new} exists already"
    return row
  shutil.copytree(os.path.join(tasks, base), folder)
  try:
    with open(os.path.join(folder, "specs.json"), encoding="utf-8") as f:
      specs = json.load(f)
    specs["instruction"] = spec["instruction"]
    _write_json(os.path.join(folder, "specs.json"), specs)
    db = sqlite3.connect(os.path.join(folder, "dbs", "supervisor.db"))
    try:
      db.execute("UPDATE tasks SET instruction = ?", (spec["instruction"],))
      db.commit()
    finally:
      db.close()
    truth = os.path.join(folder, "ground_truth")
    shutil.rmtree(truth, ignore_errors=True)
    os.makedirs(truth)
    record = os.path.join(truth, "reference_run.json")

    def metadata(code: str) -> dict:
      return {
        "mode": "minimal",
        "difficulty": 2,
        "num_apps": len(row["apps"]),
        "num_apis": len(set(re.findall(r"apis\.(\w+\.\w+)", code))),
        "num_solution_code_lines": len(code.strip().splitlines()),
        "derived_from": base,
      }

    files: dict[str, Any] = {
      "public_data.json": {},
      "private_data.json": {"record_to": record},
      "test_data.json": [],
      "answer.json": None,
      "metadata.json": metadata("\n".join(steps)),
    }
    for name, value in files.items():
      _write_json(os.path.join(truth, name), value)
    with open(os.path.join(truth, "evaluation.py"), "w", encoding="utf-8") as f:
      f.write(DERIVED_EVALUATION)
    world = AppWorld(
      task_id=new,
      experiment_name=f"derive-{new}",
      raise_on_unsafe_syntax=True,
      null_patch_unsafe_execution=True,
    )
    answer, final = None, ""
    try:
      for i, code in enumerate(steps):
        output = world.execute(code)
        if output.startswith("Execution failed"):
          row["error"] = f"step {i} failed: {output[-300:]}"
          break
        if world.task_completed():
          row["error"] = f"step {i} completed the task itself"
          break
        if i == answer_step:
          if output.strip() == "Execution successful.":
            row["error"] = f"the answer step {i} printed nothing"
            break
          answer = _printed_value(output)
      if row["error"] is None:
        final = (
          "apis.supervisor.complete_task(" + ("" if answer is None else f"answer={answer!r}") + ")"
        )
        output = world.execute(final)
        if output.startswith("Execution failed"):
          row["error"] = f"completing the task failed: {output[-300:]}"
        else:
          world.evaluate(suppress_errors=False)
    finally:
      world.close()
    if row["error"] is None:
      with open(record, encoding="utf-8") as f:
        reference = json.load(f)
      if answer is None and not reference["changes"]:
        row["error"] = "the task neither answers anything nor changes the world"
      else:
        solution = "\n".join(code.rstrip() for code in steps + [final]) + "\n"
        _write_json(os.path.join(truth, "private_data.json"), {"changes": reference["changes"]})
        _write_json(os.path.join(truth, "answer.json"), answer)
        _write_json(
          os.path.join(truth, "test_data.json"),
          [{"requirement": r, "label": "no_op_fail"} for r in DERIVED_REQUIREMENTS],
        )
        _write_json(os.path.join(truth, "metadata.json"), metadata(solution))
        row.update(solution=solution, answer=answer, changed=sorted(reference["changes"]))
  except Exception as e:  # noqa: BLE001 - any failure rejects this task only
    row["error"] = f"{type(e).__name__}: {e}"
  if row["error"] is not None:
    shutil.rmtree(folder, ignore_errors=True)
  return row


def derive_tasks(root: str, specs: list[dict]) -> list[dict]:
  """`derive_task` for each spec under `root`; appends the rows of the tasks made to the index
  (split "synth"). Returns every row, failed ones with their "error"."""
  from appworld import update_root  # noqa: PLC0415

  update_root(os.path.abspath(root))
  rows = [derive_task(spec) for spec in specs]
  made = [dict(r, split="synth") for r in rows if r["error"] is None]
  with open(os.path.join(root, "coevolve_tasks.jsonl"), "a", encoding="utf-8") as f:
    f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in made)
  return rows


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--root", required=True, help="AppWorld root to write data/ under")
  p.add_argument("--num-scenarios", type=int, default=5)
  p.add_argument("--tasks-per-scenario", type=int, default=3)
  p.add_argument("--eval-scenarios", type=int, default=1)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--templates", default=",".join(TEMPLATES))
  p.add_argument("--num-people", type=int, default=3)
  p.add_argument("--num-notes", type=int, default=5)
  p.add_argument(
    "--add",
    default="",
    help="JSON file with a list of {task_id, template, seed}: "
    "build these tasks into an existing root (split 'synth'), nothing else",
  )
  p.add_argument(
    "--derive",
    default="",
    help="JSON file with a list of {task_id, base_task_id, instruction, steps, answer_step}: "
    "derive these tasks from the base tasks' worlds into an existing root; prints the rows "
    "(with errors)",
  )
  a = p.parse_args(argv)
  if a.derive:
    with open(a.derive, encoding="utf-8") as f:
      specs = json.load(f)
    print(json.dumps({"rows": derive_tasks(a.root, specs)}))
    return 0
  if a.add:
    with open(a.add, encoding="utf-8") as f:
      specs = json.load(f)
    rows = add_tasks(a.root, specs, a.num_people, a.num_notes)
    print(json.dumps({"tasks": len(rows)}))
    return 0
  templates = [t for t in a.templates.split(",") if t]
  unknown = sorted(set(templates) - set(TEMPLATES))
  if unknown or not templates:
    p.error(f"unknown templates {unknown}; known: {sorted(TEMPLATES)}")
  if not 0 <= a.eval_scenarios < a.num_scenarios:
    p.error("need 0 <= --eval-scenarios < --num-scenarios")
  start = time.perf_counter()
  rows = build(
    a.root,
    a.num_scenarios,
    a.tasks_per_scenario,
    a.seed,
    templates,
    a.num_people,
    a.num_notes,
    a.eval_scenarios,
  )
  print(json.dumps({"tasks": len(rows), "seconds": round(time.perf_counter() - start, 1)}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
