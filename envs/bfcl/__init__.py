"""BFCL multi-turn (bfcl-eval's data, real backends and official checker) as a CoEvolve suite.

env.py           BfclEnv: one episode (training and official loop semantics)
data.py          entries, tool docs and schemas, the seeded train / eval split
calls.py         model tool calls <-> BFCL call strings (parsed, never eval'ed)
execution.py     execution on per-episode backend instances, the official checker
backends.py      every backend call in a pool of worker processes, bounded in time and memory
worker.py        the worker process
sandbox.py       a backend state to explore in, call by call
values.py        argument values drawn from schemas and the current state
explorer.py      exploration contexts, triplets, the programmatic (LLM-free) explorer
llm_explorer.py  the LLM explorer, LLM context summary, abstraction and judge
abstraction.py   template abstraction of explored runs into tasks
validation.py    validation by execution (replay, determinism, official checker)
synthesis.py     D0 and one feedback round: explore -> abstract -> validate
suite.py         BfclSuite: the `coevolve_jax.suite.Suite` the loop uses
"""
