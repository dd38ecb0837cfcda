"""``freespec bench`` and ``freespec replay`` (see README.md beside this file).

datasets.py  workloads: Spec-Bench JSONL, builtin:code-edit, builtin:rag, builtin:multi-turn-edit
methods.py   the --methods grammar (vanilla, hf-pld[:N], freespec[:NAME{k=v}], arctic-suffix)
peers.py     other projects' drafters as freespec Drafters (arctic-inference SuffixDecoding)
runner.py    the interleaved loop: prompts with their history, one method on one prompt, output comparison
report.py    metrics, console/Markdown tables, results.json, plots
replay.py    exact greedy tau of drafters from recorded outputs, without the model
jsonl.py     the one JSON Lines reader (line-numbered errors) and writer
"""
