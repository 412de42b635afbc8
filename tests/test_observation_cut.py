"""Cutting an observation by tokens (issue 47, item 7): the cut is where tokenizing the whole text
puts it, but only a window of the text is tokenized, so a 10 MB observation costs milliseconds
(it took minutes when the whole text was tokenized)."""

import json
import random
import string
import time

import pytest

from coevolve_jax.tokenizer import get_tokenizer
from envs.base import token_prefix_end, truncate_observation


def _whole_text_cut(text: str, max_tokens: int) -> int | None:
  enc = get_tokenizer().encode_plain(text)
  return None if len(enc.ids) <= max_tokens else enc.offsets[max_tokens - 1][1]


PIECES = [
  *string.printable,
  *"漢字テキストéßü😀",
  "e\u0301",  # a combining accent: NFC joins it with the letter before
  "<|im_end|>",
  "<tool_call>",
  "'s",
  "   ",
  "\r\n",
  "123456",
  '{"key": [1, 2.5, null]}',
]


def test_the_cut_is_where_the_whole_text_puts_it():
  """Random texts of words, digits, space runs, CJK, emoji, combining marks and special-token
  strings, cut at 1-200 tokens: the window's cut equals the whole text's, every time."""
  rng = random.Random(0)
  checked = 0
  for _ in range(300):
    parts = rng.choices(PIECES, k=rng.randint(1, 1500))
    text = "".join(p * rng.choice([1, 1, 1, 2, 7, 40]) for p in parts)
    max_tokens = rng.choice([1, 2, 5, 17, 50, 200])
    expected = _whole_text_cut(text, max_tokens)
    assert token_prefix_end(text, max_tokens) == expected, (max_tokens, text[:200])
    checked += expected is not None and len(text) > 4 * max_tokens + 64  # a window was used
  assert checked > 100


@pytest.mark.parametrize(
  "unit",
  ["a", "7", " ", "漢字テキスト", '{"id": 12, "name": "file_12.txt"}, '],
  ids=["one-long-word", "digits", "one-long-space-run", "cjk", "json"],
)
def test_long_runs_cut_as_the_whole_text(unit):
  """Texts that are one pre-token far longer than the window (a letter, CJK or space run) and
  texts of many tiny pre-tokens: the cut at 4,096 tokens is the whole text's."""
  text = unit * (300_000 // len(unit))
  assert token_prefix_end(text, 4096) == _whole_text_cut(text, 4096)


def test_a_10_mb_observation_is_cut_in_milliseconds(monkeypatch):
  """A 10 MB JSON observation cut at 4,096 tokens (the `:paper` presets) tokenizes a few tens of
  KB, not the 10 MB, and takes well under a second (tokenizing it whole took 30-170 s here)."""
  rng = random.Random(0)
  rows = [{"id": i, "name": f"file_{i}.txt", "size": rng.randint(0, 10**6)} for i in range(200_000)]
  text = (json.dumps(rows) * 2)[:10_000_000]
  tok = get_tokenizer()
  tok.encode_text("warm up")  # builds the plain tokenizer (about 1 s) outside the timing
  seen = []
  real = tok.encode_plain
  monkeypatch.setattr(tok, "encode_plain", lambda t: seen.append(len(t)) or real(t))
  start = time.perf_counter()
  cut = truncate_observation(text, max_chars=8000, max_tokens=4096)
  elapsed = time.perf_counter() - start
  kept = cut.split("... [truncated ")[0]
  assert text.startswith(kept) and len(real(kept).ids) == 4096
  assert cut.endswith(f"... [truncated {len(text) - len(kept)} characters]")
  assert sum(seen) <= 100_000, seen
  assert elapsed < 1.0, elapsed


def test_short_texts_are_kept_and_bad_limits_refused():
  assert truncate_observation("three tokens here", max_chars=1, max_tokens=50) == (
    "three tokens here"
  )
  assert token_prefix_end("", 5) is None
  with pytest.raises(ValueError, match="max_tokens"):
    token_prefix_end("text", 0)
