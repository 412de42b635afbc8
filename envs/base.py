"""Helpers that several benchmarks share (the contracts, `Env` and `Suite`, are the core's:
`coevolve_jax.suite`)."""

from __future__ import annotations


# Cutting by tokens encodes a window of the text, not all of it: `_WINDOW_CHARS_PER_TOKEN`
# characters per token kept to start with (Qwen averages 2-4 on JSON, code and prose; the window
# grows when that is not enough), and inside one pre-token longer than the window (a run of
# letters or CJK of tens of KB) `_MARGIN_TOKENS` tokens of the window beyond the cut.
_WINDOW_CHARS_PER_TOKEN = 4
_MARGIN_TOKENS = 64


def token_prefix_end(text: str, max_tokens: int) -> int | None:
  """Where `text` is cut to keep its first `max_tokens` Qwen tokens: the character offset just
  after the last kept token, or None when the text has at most `max_tokens` tokens.

  The text is tokenized as text from outside the model (`QwenTokenizer.encode_text`: special
  token strings count as their characters' tokens, as the prompt will hold them). Only a window
  of `text` is tokenized: a window that ends two pre-tokens (words, digit, space or punctuation
  runs) after the kept tokens gives them exactly as tokenizing the whole text does, since BPE
  never merges across pre-tokens; the window starts at 4 characters per kept token and grows
  (at least doubling, by the characters per token seen so far) until that holds, the whole text
  at most. Inside a single pre-token longer than the window, the cut is taken once 64 more
  tokens of it follow (BPE's merges there depend only on nearby characters in practice). The
  cost is that of tokenizing about 4 x `max_tokens` characters (tens of milliseconds for 4,096
  tokens), whatever the length of `text`; text of long tokens costs about 2 x what is kept (a
  run of spaces, 128 characters a token: about 0.5 s for 4,096 tokens).

  Raises:
    ValueError: max_tokens < 1.
  """
  if max_tokens < 1:
    raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
  from coevolve_jax.tokenizer import get_tokenizer  # noqa: PLC0415 (tokenizer files, once)

  window = _WINDOW_CHARS_PER_TOKEN * max_tokens + _MARGIN_TOKENS
  while True:
    whole = window >= len(text)
    enc = get_tokenizer().encode_plain(text if whole else text[:window])
    if len(enc.ids) > max_tokens:
      word, last_word = enc.word_ids[max_tokens - 1], enc.word_ids[-1]
      safe = word is not None and last_word is not None and word < last_word - 1
      if whole or safe or len(enc.ids) >= max_tokens + _MARGIN_TOKENS and word == last_word:
        return enc.offsets[max_tokens - 1][1]
    elif whole:
      return None
    per_token = window / max(len(enc.ids), 1)
    window = max(2 * window, int(1.25 * per_token * (max_tokens + _MARGIN_TOKENS)))


def truncate_observation(text: str, max_chars: int, max_tokens: int = 0) -> str:
  """An environment output as the model is shown it: cut to its first `max_tokens` Qwen tokens
  when that is > 0 (the paper cuts observations at 4,096 tokens; `token_prefix_end`, a few
  milliseconds per MB of `text`), else to `max_chars` characters, plus a marker saying how many
  characters were dropped (`... [truncated N characters]`)."""
  if max_tokens > 0:
    end = token_prefix_end(text, max_tokens)
    if end is None:
      return text
  elif len(text) <= max_chars:
    return text
  else:
    end = max_chars
  return f"{text[:end]}... [truncated {len(text) - end} characters]"
