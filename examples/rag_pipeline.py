"""RAG: answers that quote retrieved documents, drafted from those documents.

    python examples/rag_pipeline.py [--model qwen2.5-coder-0.5b]

A toy retriever picks the standard-library module docs that share the most
words with the question and puts them in the prompt; the whole document set
also goes to ``generate(documents=...)``, so the drafter can draft from any
document (the prompt's copies are drafted from anyway). Greedy output is
identical to plain decoding; the summary shows tau and tokens/s of both.
"""

import argparse
import importlib
import re
import time

import freespec
from freespec import models

MODULES = ["json", "textwrap", "heapq", "bisect", "shlex", "string", "fnmatch", "difflib"]
QUESTIONS = [
    "What does textwrap.dedent do? Quote the documentation.",
    "How does the heapq module keep a heap? Quote the relevant sentences.",
    "What is shlex for? Quote the documentation.",
]


def documents() -> dict[str, str]:
    return {name: (importlib.import_module(name).__doc__ or "").strip()[:1500] for name in MODULES}


def retrieve(question: str, docs: dict[str, str], k: int = 2) -> list[str]:
    words = set(re.findall(r"\w+", question.lower()))
    def overlap(name):  # the module's name counts heavily, then shared words
        return 10 * (name in words) + len(words & set(re.findall(r"\w+", docs[name].lower())))

    ranked = sorted(docs, key=lambda name: -overlap(name))
    return ranked[:k]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    args = parser.parse_args()
    model, tokenizer = models.load(args.model)
    docs = documents()
    totals = {"plain": [0, 0.0], "freespec": [0, 0.0]}
    for question in QUESTIONS:
        chosen = retrieve(question, docs)
        context = "\n\n".join(f"[{name}]\n{docs[name]}" for name in chosen)
        messages = [{"role": "user", "content": f"Documents:\n{context}\n\nQuestion: {question}"}]
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        start = time.perf_counter()
        plain = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        totals["plain"][1] += time.perf_counter() - start
        freespec.patch(model)
        start = time.perf_counter()
        fast = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                              documents=list(docs.values()), tokenizer=tokenizer)
        totals["freespec"][1] += time.perf_counter() - start
        stats = freespec.stats(model)
        freespec.unpatch(model)
        new = plain.shape[1] - inputs["input_ids"].shape[1]
        totals["plain"][0] += new
        totals["freespec"][0] += fast.shape[1] - inputs["input_ids"].shape[1]
        print(f"Q: {question}\n   retrieved {chosen}; identical: {fast.tolist() == plain.tolist()}; "
              f"tau {stats.tau:.2f}")
    for name, (tokens, seconds) in totals.items():
        print(f"{name:9s} {tokens / seconds:6.1f} tokens/s")


if __name__ == "__main__":
    main()
