"""RAG with transformers.pipeline: BM25 over the standard library's documentation, drafted from the passages.

    pip install 'freespec[rag]'                      # bm25s, the retriever
    python examples/rag_pipeline.py [--model qwen2.5-coder-0.5b] [--questions 4] [--max-new-tokens 160]

The corpus is the Python standard library's own documentation, read offline:
the docstring of every public function and class of 40 modules, one passage
each. A BM25 retriever (``bm25s``) ranks the passages for each question; the
prompt quotes the best three, and ``with freespec.documents(...)`` hands the
best ten to every ``generate()`` the pipeline makes (the pipeline calls
``generate()`` itself, so there is no argument to add; the pipeline's own
``documents=`` goes to the chat template). The answers quote the passages, so
the drafter drafts whole sentences from them.

Per question: the answer, whether freespec's output is identical to plain
decoding's, and tau and tokens/s of plain decoding, HF prompt lookup
(``prompt_lookup_num_tokens=10``) and freespec; then the totals.
"""

import argparse
import importlib
import inspect

from transformers import pipeline

import freespec
from freespec import models
from freespec.drafters.mixture import MixtureDrafter
from measure import HF_PROMPT_LOOKUP_TOKENS, Totals, run, warm_up

MODULES = ("argparse", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv", "dataclasses",
           "datetime", "difflib", "enum", "fnmatch", "functools", "glob", "gzip", "hashlib", "heapq", "html",
           "itertools", "json", "logging", "math", "operator", "os", "pathlib", "random", "re", "shlex", "shutil",
           "statistics", "string", "struct", "subprocess", "tempfile", "textwrap", "threading", "typing",
           "urllib.parse", "zlib")
QUESTIONS = (
    "How do I remove the common leading whitespace from every line of a string?",
    "How can I find where to insert a value in a sorted list so that it stays sorted?",
    "How do I split a shell-like command line into arguments, keeping quoted parts together?",
    "How do I get the n largest elements of a list without sorting all of it?",
    "How can I compare two sequences and get the ratio of how similar they are?",
    "How do I cache the results of an expensive function?",
)
PROMPT_PASSAGES, DOCUMENT_PASSAGES = 3, 10


def standard_library_passages() -> list[str]:
    """One passage per documented public function or class: ``module.name(signature)`` and its docstring."""
    passages = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(getattr(module, "__all__", None) or dir(module)):
            obj = getattr(module, name, None)
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)
                                            or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) >= 80:
                passages.append(f"{module_name}.{name}\n\n{doc[:1500]}")
    return passages


class Retriever:
    """BM25 (bm25s) over the passages."""

    def __init__(self, passages: list[str]):
        try:
            import bm25s
        except ImportError:
            raise SystemExit("this example needs bm25s: pip install 'freespec[rag]'") from None
        self.bm25s, self.passages = bm25s, passages
        self.index = bm25s.BM25()
        self.index.index(bm25s.tokenize(passages, stopwords="en", show_progress=False), show_progress=False)

    def __call__(self, question: str, k: int) -> list[str]:
        query = self.bm25s.tokenize([question], stopwords="en", show_progress=False)
        ids, _ = self.index.retrieve(query, k=k, show_progress=False)
        return [self.passages[i] for i in ids[0].tolist()]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--max-new-tokens", type=int, default=160)
    args = parser.parse_args()
    model, tokenizer = models.load(args.model)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    drafter = MixtureDrafter()  # freespec's default drafter, one instance for every call
    warm_up(pipe, drafter)
    passages = standard_library_passages()
    retrieve = Retriever(passages)
    print(f"{len(passages)} passages from {len(MODULES)} standard-library modules")
    totals = Totals()
    for question in QUESTIONS[:args.questions]:
        found = retrieve(question, DOCUMENT_PASSAGES)
        context = "\n\n".join(f"[{k + 1}] {text}" for k, text in enumerate(found[:PROMPT_PASSAGES]))
        messages = [{"role": "user", "content": f"Answer the question using the passages below. Quote the "
                                                f"sentences that answer it, then explain.\n\n{context}\n\n"
                                                f"Question: {question}"}]
        plain = run(pipe, messages, args.max_new_tokens)
        lookup = run(pipe, messages, args.max_new_tokens, prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS)
        freespec.patch(model, drafter=drafter)
        with freespec.documents(found, tokenizer=tokenizer):  # every generate() inside drafts from them
            fast = run(pipe, messages, args.max_new_tokens)
        freespec.unpatch(model)
        print(f"\nQ: {question}\n   retrieved: {', '.join(p.split(chr(10))[0] for p in found[:PROMPT_PASSAGES])}\n"
              f"A: {fast.answer.strip()}\n   identical to plain decoding: {fast.token_ids == plain.token_ids}")
        for name, result in (("plain", plain), ("hf prompt lookup", lookup), ("freespec", fast)):
            totals.add(name, result)
            print("   " + totals.line(name, result))
    print("\ntotal\n" + totals.report())


if __name__ == "__main__":
    main()
