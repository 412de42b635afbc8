"""The generic side of the feedback loop (paper Sec. 3.1-3.3), shared by every suite.

    signals.py    forgetting, boundary and rare signals from a step's rollouts
    rounds.py     signal events, context selection, a round's result, commit to the pool
    pool.py       the append-only task pool with leak and near-duplicate filters
    llm.py        the text-LLM client protocol (`complete`), token budgets, Gemini
    local_llm.py  a local model served by our own engine as a text LLM
    factory.py    the configured explorer LLM

Exploration, abstraction and validation depend on the benchmark: they live in its suite under
`envs/` (e.g. `envs/bfcl/synthesis.py`). Nothing here imports `envs`.
"""
