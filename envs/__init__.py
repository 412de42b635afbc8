"""Benchmarks for coevolve_jax, one package per benchmark behind `coevolve_jax.suite.Suite`.

    envs/base.py      helpers several benchmarks share (observation truncation)
    envs/bfcl/        BFCL multi-turn: real backends, official checker, explorers, synthesis hooks
    envs/appworld/    AppWorld: servers in AppWorld's own venv, world builder, episodes, synthesis

Each package's `suite.py` defines `Suite`, `check_setup(cfg)` and `validate_config(cfg)`;
`coevolve_jax.suite.make_suite(cfg, workdir)` imports the one `cfg.env` names. Environments are
plain Python (no JAX), `reset()` / `step(action)`. Nothing in the core imports this package.
"""
