"""Builds the configured explorer LLM (Gemini, an OpenAI-compatible endpoint, or a local model
served by our engine) from the `explore` config section. Which explorer a suite drives with it
is the suite's business."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from coevolve_jax.feedback.llm import GeminiLLM, GeminiSettings, PrimaryOnlyLLM, TextLLM
from coevolve_jax.feedback.openai_llm import OpenAILLM, OpenAISettings
from coevolve_jax.tokenizer import run_tokenizer_folder

if TYPE_CHECKING:  # annotations only (the model module imports JAX)
  from coevolve_jax.models.qwen import Qwen

EXPLORERS = ("programmatic", "gemini", "openai", "local")


def gemini_settings(section: Any) -> GeminiSettings:
  """GeminiSettings from a config section with the same field names (credentials are not there)."""
  fields = GeminiSettings.__dataclass_fields__
  return GeminiSettings(**{k: section[k] for k in fields if k in section})


def openai_settings(section: Any) -> OpenAISettings:
  """OpenAISettings from a config section with the same field names (the key is not there)."""
  fields = OpenAISettings.__dataclass_fields__
  return OpenAISettings(**{k: section[k] for k in fields if k in section})


def make_llm(
  kind: str,
  explore_cfg: Any,
  policy: Callable[[], Qwen] | None = None,
  tokenizer_folder: str | None = None,
  primary: bool = True,
) -> TextLLM | None:
  """The LLM behind explorer `kind` ("programmatic" -> None).

  Args:
    kind: one of EXPLORERS.
    explore_cfg: the `explore` config section (reads `gemini`, `openai` or `local`).
    policy: zero-argument callable returning the current policy model (for "local" without
      `explore.local.checkpoint`; with it, that Hugging Face folder is served instead).
    tokenizer_folder: the policy's tokenizer (the run's `tokenizer.run_tokenizer_folder`); a
      local checkpoint with its own tokenizer.json uses that one.
    primary: False on a process other than a multi-process job's primary: a remote kind
      (gemini, openai) is then a `PrimaryOnlyLLM` of the same name, with no client and no
      credentials needed (the job's LLM calls run on the primary only).

  Raises:
    ValueError: unknown kind; "local" without a policy or checkpoint.
    LLMError: Gemini credentials, or the OpenAI-compatible endpoint's key, missing.
  """
  if kind not in EXPLORERS:
    raise ValueError(f"explore.explorer must be one of {EXPLORERS}, got {kind!r}")
  if kind == "programmatic":
    return None
  if kind == "gemini":
    gemini = gemini_settings(explore_cfg.gemini)
    return GeminiLLM(gemini) if primary else PrimaryOnlyLLM(f"gemini:{gemini.model}")
  if kind == "openai":
    openai = openai_settings(explore_cfg.openai)
    return OpenAILLM(openai) if primary else PrimaryOnlyLLM(f"openai:{openai.model}")
  from coevolve_jax.feedback.local_llm import LocalLLM  # pylint: disable=g-import-not-at-top

  local = explore_cfg.local
  name = "local:policy"
  model: Qwen | Callable[[], Qwen] | None = policy
  if local.get("checkpoint"):  # another model: a Hugging Face folder, loaded once
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

    from coevolve_jax.models.hf import from_pretrained  # pylint: disable=g-import-not-at-top

    model = from_pretrained(local.checkpoint, dtype=jnp.dtype(local.dtype))
    name = f"local:{os.path.basename(os.path.normpath(local.checkpoint))}"
    tokenizer_folder = run_tokenizer_folder({"checkpoint": local.checkpoint})
  elif model is None:
    raise ValueError("the local explorer needs the policy model or explore.local.checkpoint")
  return LocalLLM(
    model,
    cache_len=local.cache_len,
    max_new_tokens=local.max_new_tokens,
    temperature=local.temperature,
    tokens_per_round=local.tokens_per_round,
    dtype=local.dtype,
    name=name,
    tokenizer_folder=tokenizer_folder,
  )
