"""Optional adapters: code that puts our components behind other projects' interfaces.

Contrib modules are not used by the main job (`coevolve_jax.main` and everything it imports never
imports them) and may depend on packages that are not installed (each says which and degrades or
stands alone without them). Each has its own tests.

- `jetstream`: the rollout engine's jitted prefill / decode steps behind JetStream's functional
  `Engine` contract (google-jetstream 0.2.x, optional).
"""
