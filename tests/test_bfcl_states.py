"""Exploration states disjoint from the evaluation entries (issue 40 item 5, docs/design.md
§1.4): BFCL's shipped multi-turn categories share their states (191 of multi_turn_miss_param's
200 entries start from a multi_turn_base entry's state), so the paper variant, which evaluates on
all 200 multi_turn_base entries, used to explore inside the test environments."""

import collections
import json

import pytest

from coevolve_jax import config
from envs.bfcl.data import DEFAULT_STATE, class_states, disjoint_states, load_bfcl_tasks
from envs.bfcl.suite import BfclSuite
from tests.test_config import _get_config


def _used(entries):
  out = collections.defaultdict(set)
  for t in entries:
    for c, s in class_states(t).items():
      out[c].add(s)
  return out


def test_the_shipped_categories_share_states_with_multi_turn_base():
  base, miss = load_bfcl_tasks("multi_turn_base"), load_bfcl_tasks("multi_turn_miss_param")
  key = {json.dumps(t.initial_config, sort_keys=True) for t in base}
  assert sum(json.dumps(t.initial_config, sort_keys=True) in key for t in miss) == 191


def test_disjoint_states_keep_no_class_state_an_eval_entry_starts_from():
  base, miss = load_bfcl_tasks("multi_turn_base"), load_bfcl_tasks("multi_turn_miss_param")
  kept, changed = disjoint_states(miss, base)
  used = _used(base)
  assert kept and changed > 0
  for t in kept:
    assert t.involved_classes and set(t.initial_config) <= set(t.involved_classes)
    for c, s in class_states(t).items():
      assert s not in used[c], (t.task_id, c)
  # A class moved to its default keeps it only where no evaluation entry uses the default;
  # MessageAPI's default is one (17 multi_turn_base entries start from it), so it is left out.
  assert DEFAULT_STATE in used["MessageAPI"]
  assert all(class_states(t).get("MessageAPI") != DEFAULT_STATE for t in kept)
  assert any(class_states(t).get("GorillaFileSystem") == DEFAULT_STATE for t in kept)


@pytest.mark.parametrize("states", ["disjoint", "shared_with_eval"])
def test_the_paper_suite_explores_only_disjoint_states_by_default(tmp_path, states):
  cfg = _get_config("bfcl.py", "paper")
  cfg.model.checkpoint = "/some/hf/folder"
  cfg.explore.eval_states = states
  config.validate(cfg)
  suite = BfclSuite(cfg, str(tmp_path))
  try:
    used = _used(suite.eval_tasks)
    shared = [
      t.task_id for t in suite.train_tasks for c, s in class_states(t).items() if s in used[c]
    ]
    if states == "disjoint":
      assert suite.train_tasks and not shared
    else:  # the choice before 2026-12: all 200 entries as shipped, most in evaluation states
      assert len(suite.train_tasks) == 200 and len(set(shared)) >= 191
  finally:
    suite.close()
