"""Benchmarks for coevolve_jax, one package per benchmark behind the `Suite` protocol.

    envs/base.py      Env (one episode) and Suite (one benchmark) protocols
    envs/bfcl/        BFCL multi-turn: real backends, official checker, explorers, synthesis
    envs/appworld/    AppWorld: servers in AppWorld's own venv, world builder, episodes, synthesis

`make_suite(cfg, workdir)` builds the suite named by `cfg.env`; `check_setup(cfg)` checks, without
JAX and in seconds, what that suite needs on this machine (so a run fails before minutes of set-up).
Environments are plain Python (no JAX), `reset()` / `step(action)`.
"""

from __future__ import annotations

import importlib
from typing import Any

# Suite name -> its module; each module defines `Suite` (the class), `check_setup(cfg)` and
# `validate_config(cfg)`.
SUITES = {"bfcl": "envs.bfcl.suite", "appworld": "envs.appworld.suite"}


class SuiteUnavailable(RuntimeError):
  """What a suite needs on this machine is missing; the message gives the set-up steps."""


def _module(name: str):
  if name not in SUITES:
    raise ValueError(f"env must be one of {sorted(SUITES)}, got {name!r}")
  return importlib.import_module(SUITES[name])


def check_setup(cfg: Any) -> None:
  """Raises SuiteUnavailable (with the set-up steps) when `cfg.env`'s suite cannot run here."""
  _module(cfg.env).check_setup(cfg)


def validate_config(cfg: Any) -> None:
  """Checks the fields only `cfg.env`'s suite reads; ValueError names the first bad one."""
  _module(cfg.env).validate_config(cfg)


def make_suite(cfg: Any, workdir: str):
  """The `Suite` named by `cfg.env`, built from the run config; it may write under `workdir`.

  Raises:
    ValueError: unknown `cfg.env`.
    SuiteUnavailable: the suite's environment or data is missing.
  """
  return _module(cfg.env).Suite(cfg, workdir)
