"""Helpers that several benchmarks share (the contracts, `Env` and `Suite`, are the core's:
`coevolve_jax.suite`)."""

from __future__ import annotations


def truncate_observation(text: str, max_chars: int, max_tokens: int = 0) -> str:
  """An environment output as the model is shown it: cut to `max_tokens` Qwen tokens when that
  is > 0 (the paper cuts observations at 4,096 tokens), else to `max_chars` characters, plus a
  marker saying how much was dropped."""
  if max_tokens > 0:
    from coevolve_jax.tokenizer import get_tokenizer  # noqa: PLC0415 (tokenizer files, once)

    enc = get_tokenizer().tokenizer.encode(text, add_special_tokens=False)
    if len(enc.ids) <= max_tokens:
      return text
    end = enc.offsets[max_tokens - 1][1]
    return f"{text[:end]}... [truncated {len(enc.ids) - max_tokens} tokens]"
  if len(text) <= max_chars:
    return text
  return f"{text[:max_chars]}... [truncated {len(text) - max_chars} characters]"
