"""Test doubles shipped with the package: stand-ins for the real services and models.

- `gemini_stub`: a loopback HTTP server that answers like the Gemini REST API, so the real
  google-genai client code runs end to end in tests and offline demos.
- `replay_engine`: `ReplayEngine`, a policy in the rollout engine's slot interface that replays
  each task's ground-truth calls (the `--policy=ground_truth` check of `envs.bfcl.evaluate`).

The training job imports none of these.
"""
