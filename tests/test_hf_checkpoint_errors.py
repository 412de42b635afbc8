"""Bad Hugging Face folders raise CheckpointFormatError (or FileNotFoundError) naming the cause."""

import dataclasses
import json

import pytest
import safetensors.numpy
from flax import nnx

from coevolve_jax.models import CheckpointFormatError, Qwen, from_pretrained, save_pretrained

import kit

CFG = kit.tiny_config(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=1,
  num_attention_heads=2,
  num_key_value_heads=1,
)


@pytest.fixture
def folder(tmp_path):
  return save_pretrained(Qwen(CFG, rngs=nnx.Rngs(0)), tmp_path / "m")


def test_missing_config(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    from_pretrained(tmp_path)


def test_unsupported_model_type_and_rope_scaling(folder):
  cfg = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(json.dumps(dict(cfg, model_type="gemma")))
  with pytest.raises(CheckpointFormatError, match="gemma"):
    from_pretrained(folder)
  (folder / "config.json").write_text(json.dumps(dict(cfg, rope_scaling={"rope_type": "yarn"})))
  with pytest.raises(CheckpointFormatError, match="RoPE scaling"):
    from_pretrained(folder)


@pytest.mark.parametrize(
  "change, fragment",
  [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),  # silently wrong logits if read as SwiGLU
    ({"model_type": "llama", "mlp_bias": True}, "mlp_bias"),
    ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
    ({"rope_scaling": "llama3"}, "must be an object"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "linear"),
    ({"num_attention_heads": None}, "num_attention_heads must be an integer"),
    ({"vocab_size": "64"}, "vocab_size must be an integer"),
    ({"hidden_size": 32.0}, "hidden_size must be an integer"),
    ({"num_key_value_heads": 3}, "not a multiple"),
  ],
)
def test_config_fields_we_cannot_honour_are_named(folder, change, fragment):
  """Every malformed or unsupported config.json field is a CheckpointFormatError naming it,
  never a KeyError / TypeError from deep inside, nor a model that loads with other maths."""
  cfg = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(json.dumps({**cfg, **change}))
  with pytest.raises(CheckpointFormatError, match=fragment):
    from_pretrained(folder)


def test_a_missing_field_or_a_non_object_config_is_named(folder):
  cfg = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(
    json.dumps({k: v for k, v in cfg.items() if k != "vocab_size"})
  )
  with pytest.raises(CheckpointFormatError, match="vocab_size"):
    from_pretrained(folder)
  (folder / "config.json").write_text("[1]")
  with pytest.raises(CheckpointFormatError, match="JSON object"):
    from_pretrained(folder)


def test_missing_and_unknown_tensors(folder):
  path = folder / "model.safetensors"
  tensors = safetensors.numpy.load_file(path)
  safetensors.numpy.save_file({k: v for k, v in tensors.items() if "q_proj" not in k}, path)
  with pytest.raises(CheckpointFormatError, match="lacks 1 tensors"):
    from_pretrained(folder)
  safetensors.numpy.save_file(
    dict(tensors, **{"model.layers.0.extra.weight": tensors["model.norm.weight"]}), path
  )
  with pytest.raises(CheckpointFormatError, match="extra"):
    from_pretrained(folder)


def test_shape_that_does_not_fit_the_config(folder):
  cfg = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=40)))
  with pytest.raises(CheckpointFormatError, match="does not fit"):
    from_pretrained(folder)


def test_truncated_file(folder):
  path = folder / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])
  with pytest.raises(CheckpointFormatError, match="unreadable"):
    from_pretrained(folder)


def test_expert_outside_the_config(tmp_path):
  moe = dataclasses.replace(CFG, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8)
  folder = save_pretrained(Qwen(moe, rngs=nnx.Rngs(0)), tmp_path / "moe")
  path = folder / "model.safetensors"
  tensors = safetensors.numpy.load_file(path)
  extra = tensors["model.layers.0.mlp.experts.0.up_proj.weight"]
  safetensors.numpy.save_file(
    dict(tensors, **{"model.layers.0.mlp.experts.5.up_proj.weight": extra}), path
  )
  with pytest.raises(CheckpointFormatError, match="expert 5"):
    from_pretrained(folder)


def test_eos_ids_of_config_and_generation_config(folder, tmp_path):
  assert from_pretrained(folder).config.eos_token_ids == ()  # none named: the tokenizer's only
  cfg = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(json.dumps(dict(cfg, eos_token_id=5)))
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5]}))
  model = from_pretrained(folder)
  assert model.config.eos_token_ids == (5, 7)  # config.json's first, each once
  again = save_pretrained(model, tmp_path / "again")  # config.json keeps them all
  assert json.loads((again / "config.json").read_text())["eos_token_id"] == [5, 7]
  assert from_pretrained(again).config.eos_token_ids == (5, 7)


@pytest.mark.parametrize(
  "file,text,fragment",
  [
    ("generation_config.json", "{", "not JSON"),
    ("generation_config.json", "[5]", "not a JSON object"),
    ("generation_config.json", '{"eos_token_id": "5"}', "an id or a list of ids"),
    ("generation_config.json", '{"eos_token_id": [5, true]}', "an id or a list of ids"),
    ("generation_config.json", '{"eos_token_id": [5, 64]}', "outside the vocabulary"),
    ("config.json", '{"eos_token_id": -1}', "outside the vocabulary"),
  ],
)
def test_bad_eos_ids_are_named(folder, file, text, fragment):
  if file == "config.json":
    cfg = json.loads((folder / "config.json").read_text())
    text = json.dumps(dict(cfg, **json.loads(text)))
  (folder / file).write_text(text)
  with pytest.raises(CheckpointFormatError, match=fragment):
    from_pretrained(folder)
