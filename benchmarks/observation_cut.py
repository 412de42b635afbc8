"""Cost of cutting one long observation at a number of Qwen tokens (`envs.base.truncate_observation`
with `max_tokens`, the `:paper` presets' 4,096), against tokenizing the whole text (what it did
before, the reference), on the same texts in the same run.

    .venv/bin/python benchmarks/observation_cut.py [--mb 2] [--max-tokens 4096]

Texts: JSON rows (a BFCL/AppWorld API result), one run of letters (a single pre-token), a run of
digits, a run of spaces (128 characters a token) and CJK text, each `--mb` million characters.
Prints a markdown table (milliseconds, milliseconds per MB, ratio to the reference) and checks
that both cut at the same character. At 10 M characters tokenizing the run of spaces whole fails
(tokenizers' regex gives up and panics); the window never tokenizes more than about 0.7 M
characters for 4,096 tokens (Qwen's longest token is 128 characters).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from common import machine, markdown_table

from coevolve_jax.tokenizer import get_tokenizer
from envs.base import token_prefix_end


def _texts(chars: int) -> dict[str, str]:
  rng = random.Random(0)
  rows = [{"id": i, "name": f"file_{i}.txt", "size": rng.randint(0, 10**6)} for i in range(20_000)]
  unit = json.dumps(rows)
  units = {"json": unit, "letters": "a", "digits": "7", "spaces": " ", "cjk": "漢字テキスト"}
  return {name: (u * (chars // len(u) + 1))[:chars] for name, u in units.items()}


def _ms(fn) -> tuple[float, object]:
  start = time.perf_counter()
  out = fn()
  return (time.perf_counter() - start) * 1e3, out


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--mb", type=float, default=2.0, help="million characters per text")
  parser.add_argument("--max-tokens", type=int, default=4096)
  args = parser.parse_args()
  tok = get_tokenizer()
  tok.encode_text("warm up")  # builds the plain tokenizer outside the timings
  n, mb = args.max_tokens, args.mb
  rows = [["text", "whole text ms", "window ms", "window ms/MB", "ratio", "same cut"]]
  for name, text in _texts(int(mb * 1e6)).items():
    window_ms, end = _ms(lambda t=text: token_prefix_end(t, n))
    try:
      whole_ms, enc = _ms(lambda t=text: tok.encode_plain(t))
    except KeyboardInterrupt:
      raise
    except BaseException as e:  # noqa: BLE001  (tokenizers' regex panics on a ~10 M space run)
      rows.append([name, f"fails: {type(e).__name__}", f"{window_ms:.1f}", f"{window_ms / mb:.1f}"])
      rows[-1] += ["-", "-"]
      continue
    reference = enc.offsets[n - 1][1] if len(enc.ids) > n else None
    rows.append(
      [
        name,
        f"{whole_ms:.0f}",
        f"{window_ms:.1f}",
        f"{window_ms / mb:.1f}",
        f"{window_ms / whole_ms:.4f}",
        "yes" if end == reference else f"NO ({end} != {reference})",
      ]
    )
  print(machine())
  print(f"{mb:g} M characters per text, cut at {n} tokens")
  print(markdown_table(rows))


if __name__ == "__main__":
  main()
