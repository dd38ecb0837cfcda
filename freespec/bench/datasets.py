"""Benchmark workloads: Spec-Bench JSONL files and three built-in sets.

Every workload is a list of ``Item``: one conversation of user turns. Turn
``k`` is asked with the earlier turns and the model's own answers to them in
the history, so an item of three turns is three prompts.

``load_dataset(spec)`` takes

- a path to a JSONL file in Spec-Bench's format, one object per line with
  ``question_id``, ``category`` and ``turns`` (a list of user messages), read
  as it is;
- ``builtin:code-edit``: "here is a function, apply this change, output the
  whole function", on functions of the Python standard library read with
  ``inspect.getsource``; category = kind of change (``rename``,
  ``add-parameter``, ``fix-bug``, ``type-hints``, ``docstring``,
  ``change-constant``); each item's prediction is the code shown;
- ``builtin:rag``: a question answered from 2-4 supplied documents cut from
  the docstrings of standard-library modules; category = kind of question
  (``quote``, ``explain``, ``summarize``);
- ``builtin:multi-turn-edit``: sessions of successive edits to one small file
  (a few standard-library functions), each turn seeing the model's previous
  version; category = ``turn1`` .. ``turn4``.

The built-in sets are built at run time, without network, and are the same
on every run with the same Python version (the standard library's source is
what varies between versions; ``results.json`` records the version).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import random
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .jsonl import read_jsonl


@dataclass(frozen=True)
class Item:
    """One conversation: ``turns`` are the user's messages, in order.

    ``turn_categories`` overrides ``category`` per turn (multi-turn-edit
    reports each turn position apart). ``predictions``: per turn, a text the
    answer is expected to mostly repeat (code-edit: the code shown), or None;
    methods with ``{prediction=true}`` pass it as ``generate(prediction=...)``.
    """

    item_id: str
    category: str
    turns: tuple[str, ...]
    turn_categories: tuple[str, ...] | None = None
    predictions: tuple[str | None, ...] | None = None

    def category_of(self, turn: int) -> str:
        return self.turn_categories[turn] if self.turn_categories else self.category

    def prediction_of(self, turn: int) -> str | None:
        return self.predictions[turn] if self.predictions and turn < len(self.predictions) else None


BUILTIN = ("code-edit", "rag", "multi-turn-edit")


def load_dataset(spec: str, limit: int | None = None, categories: Sequence[str] | None = None) -> list[Item]:
    """Items of ``spec`` (a JSONL path or ``builtin:NAME``), filtered and limited.

    ``categories`` keeps only those categories (an unknown one raises).
    ``limit`` keeps the first ``limit`` items taken round-robin over the
    categories (each category in file order), so a short run still covers
    every category: categories ``a a a b b c`` with ``limit=4`` -> ``a b c a``.
    """
    if spec.startswith("builtin:"):
        name = spec[len("builtin:"):]
        builders = {"code-edit": code_edit_items, "rag": rag_items, "multi-turn-edit": multi_turn_edit_items}
        if name not in builders:
            raise ValueError(f"unknown built-in dataset {spec!r}; built-in: "
                             + ", ".join("builtin:" + n for n in BUILTIN))
        items = builders[name]()
    else:
        items = read_spec_bench(spec)
    if categories:
        known = {item.category_of(t) for item in items for t in range(len(item.turns))} | {i.category for i in items}
        unknown = sorted(set(categories) - known)
        if unknown:
            raise ValueError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)} in {spec}; "
                             f"known: {', '.join(sorted(known))}")
        items = [item for item in items if item.category in categories
                 or any(item.category_of(t) in categories for t in range(len(item.turns)))]
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        items = round_robin(items, limit)
    return items


def round_robin(items: list[Item], limit: int) -> list[Item]:
    """The first ``limit`` items, one category at a time in order of first appearance."""
    queues: dict[str, list[Item]] = {}
    for item in items:
        queues.setdefault(item.category, []).append(item)
    out: list[Item] = []
    depth = 0
    while len(out) < limit and any(depth < len(q) for q in queues.values()):
        for queue in queues.values():
            if depth < len(queue) and len(out) < limit:
                out.append(queue[depth])
        depth += 1
    return out


def read_spec_bench(path: str | Path) -> list[Item]:
    """Items of a Spec-Bench JSONL file (``question_id``, ``category``, ``turns``, and an optional
    ``prediction``: a text for the first turn, or a list of texts or nulls, one per turn)."""
    return read_jsonl(path, spec_bench_item, "Spec-Bench record",
                      missing_hint=f" (or use builtin:{'|'.join(BUILTIN)})")


def spec_bench_item(record: dict) -> Item:
    """``{"question_id": 7, "category": "qa", "turns": ["hi"]}`` -> ``Item("7", "qa", ("hi",))``."""
    turns = record["turns"]
    if isinstance(turns, str):
        turns = [turns]
    if not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError("turns must be a non-empty list of strings")
    predictions = record.get("prediction")
    if isinstance(predictions, str):
        predictions = [predictions]
    if predictions is not None and not (isinstance(predictions, list)
                                        and all(p is None or isinstance(p, str) for p in predictions)):
        raise ValueError("prediction must be a string or a list of strings or nulls, one per turn")
    return Item(str(record["question_id"]), str(record.get("category", "all")), tuple(turns),
                predictions=tuple(predictions) if predictions else None)


# --------------------------------------------------------------------------- code sources
# Functions of 10-60 lines from the standard library; names that are missing or
# out of range on this Python version are skipped (the choice stays deterministic).
CODE_SOURCES = (
    "textwrap:dedent", "textwrap:indent", "textwrap:shorten", "textwrap:TextWrapper._split",
    "textwrap:TextWrapper._handle_long_word", "textwrap:TextWrapper._fix_sentence_endings",
    "string:capwords", "string:Formatter._vformat", "string:Template.substitute",
    "string:Template.safe_substitute", "shlex:split", "shlex:quote", "shlex:shlex.push_source",
    "shlex:shlex.get_token", "json.encoder:py_encode_basestring_ascii", "json.encoder:JSONEncoder.encode",
    "json.encoder:JSONEncoder.iterencode", "heapq:_siftdown", "heapq:_siftup", "heapq:nsmallest",
    "heapq:nlargest", "fnmatch:fnmatch", "fnmatch:filter", "difflib:get_close_matches",
    "difflib:SequenceMatcher.ratio", "difflib:SequenceMatcher.get_opcodes",
    "difflib:SequenceMatcher.get_grouped_opcodes", "difflib:IS_LINE_JUNK", "colorsys:rgb_to_hls",
    "colorsys:rgb_to_hsv", "colorsys:hsv_to_rgb", "colorsys:yiq_to_rgb", "calendar:Calendar.itermonthdays",
    "calendar:TextCalendar.formatmonth", "base64:b64encode", "base64:b64decode", "base64:b85encode",
    "glob:_iglob", "glob:escape", "statistics:median", "statistics:mode", "statistics:median_low",
    "statistics:variance", "statistics:quantiles", "statistics:fmean", "statistics:geometric_mean",
    "ipaddress:ip_address", "ipaddress:collapse_addresses", "ipaddress:_count_righthand_zero_bits",
    "urllib.parse:urlsplit", "urllib.parse:urlunsplit", "urllib.parse:quote_from_bytes",
    "urllib.parse:unquote", "html:escape", "csv:Sniffer.sniff", "gettext:c2py", "gettext:_as_int",
    "functools:total_ordering", "functools:_c3_merge", "functools:_make_key", "copy:deepcopy",
    "copy:copy", "copy:_reconstruct", "quopri:decode", "quopri:needsquoting",
    "graphlib:TopologicalSorter.prepare", "graphlib:TopologicalSorter.get_ready",
    "graphlib:TopologicalSorter._find_cycle", "graphlib:TopologicalSorter.add",
    "random:Random.choices", "random:Random.shuffle", "random:Random.triangular",
)


@dataclass(frozen=True)
class CodeSource:
    module: str
    qualname: str
    source: str  # dedented source of one function

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]


def code_sources(min_lines: int = 10, max_lines: int = 60) -> list[CodeSource]:
    """The functions of ``CODE_SOURCES`` with ``min_lines..max_lines`` lines, in list order."""
    out = []
    for entry in CODE_SOURCES:
        module_name, qualname = entry.split(":")
        try:
            obj = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            source = textwrap.dedent(inspect.getsource(obj))
            ast.parse(source)
        except (ImportError, AttributeError, OSError, TypeError, SyntaxError):
            continue
        if min_lines <= len(source.splitlines()) <= max_lines:
            out.append(CodeSource(module_name, qualname, source))
    return out


# --------------------------------------------------------------------------- code edits
EDIT_KINDS = ("rename", "add-parameter", "fix-bug", "type-hints", "docstring", "change-constant")

# operator twins used to inject a bug: the first one found (in this order) is flipped
_BUG_SWAPS = ((" <= ", " < "), (" >= ", " > "), (" < ", " <= "), (" > ", " >= "), (" == ", " != "),
              (" != ", " == "), (" + 1", " - 1"), (" - 1", " + 1"))
_STRING_LITERAL = re.compile(r"""(['"]).*?(?<!\\)\1""")


def _function_node(source: str) -> ast.FunctionDef:
    node = ast.parse(source).body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ValueError("not a function")
    return node


def _body_start_line(fn: ast.FunctionDef) -> int:
    """0-based index of the first body line after the docstring."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str) and len(body) > 1:
        body = body[1:]
    return body[0].lineno - 1


def make_edit(src: CodeSource, kind: str, where: str = "the function") -> tuple[str, str] | None:
    """(code shown, instruction) for an edit of ``kind``, or None if it does not apply.

    ``where`` names the function in the instruction. ``fix-bug`` shows the code
    with one operator flipped (``<=`` -> ``<``, ...) on the first body line
    that has one outside string literals, and names that line.
    """
    code = src.source
    fn = _function_node(code)
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs if a.arg not in ("self", "cls")]
    if kind == "rename":
        if params:
            old = params[0]
            new = {"s": "text", "a": "items", "x": "value", "n": "count"}.get(old, f"{old}_arg")
            return code, (f"Rename the parameter `{old}` to `{new}` everywhere in {where} "
                          f"(the signature and every use in the body).")
        return code, f"Rename the function `{fn.name}` to `{fn.name}_v2`, including any recursive calls."
    if kind == "add-parameter":
        return code, (f"Add a keyword-only parameter `debug: bool = False` to {where}; when it is true, "
                      f"it prints its arguments with `print()` before doing anything else.")
    if kind == "type-hints":
        return code, f"Add type hints to every parameter and to the return value of {where}."
    if kind == "docstring":
        what = "Replace the docstring of" if ast.get_docstring(fn) else "Add a docstring to"
        return code, (f"{what} {where} with a Google-style docstring that describes the arguments, "
                      f"the return value and any exceptions raised.")
    if kind == "change-constant":
        body_start = _body_start_line(fn)
        for node in ast.walk(fn):
            if isinstance(node, ast.Constant) and type(node.value) is int and node.value not in (0, 1) \
                    and node.lineno - 1 >= body_start:
                new = node.value * 2 if node.value > 1 else node.value - 1
                return code, (f"Change the integer constant `{node.value}` to `{new}` everywhere it appears "
                              f"in the body of {where}.")
        return None
    if kind == "fix-bug":
        lines = code.splitlines(keepends=True)
        for i in range(_body_start_line(fn), len(lines)):
            code_part = _STRING_LITERAL.sub("''", lines[i].split("#", 1)[0])
            for good, bad in _BUG_SWAPS:
                if good in code_part and lines[i].count(good) == code_part.count(good):
                    buggy_line = lines[i].replace(good, bad, 1)
                    buggy = "".join(lines[:i] + [buggy_line] + lines[i + 1:])
                    return buggy, (f"{where[0].upper() + where[1:]} has a bug on the line "
                                   f"`{buggy_line.strip()}`: an operator or an off-by-one constant is wrong. "
                                   f"Fix it.")
        return None
    raise ValueError(f"unknown edit kind {kind!r}; known: {', '.join(EDIT_KINDS)}")


def _edit_prompt(src: CodeSource, code: str, instruction: str) -> str:
    return (f"Here is a Python function from the standard library module `{src.module}`:\n\n"
            f"```python\n{code}```\n\n{instruction} Output the whole updated function in one ```python code "
            f"block and nothing else.")


def code_edit_items() -> list[Item]:
    """One edit per function, balancing the kinds.

    Function ``i`` gets, among the kinds that apply to it, the one with the
    fewest items so far (ties: the first from ``EDIT_KINDS[i % 6]`` on).
    """
    items = []
    counts = dict.fromkeys(EDIT_KINDS, 0)
    for i, src in enumerate(code_sources()):
        order = [EDIT_KINDS[(i + shift) % len(EDIT_KINDS)] for shift in range(len(EDIT_KINDS))]
        edits = {kind: make_edit(src, kind) for kind in order}
        applicable = [kind for kind in order if edits[kind] is not None]
        kind = min(applicable, key=lambda k: (counts[k], applicable.index(k)))
        counts[kind] += 1
        code, instruction = edits[kind]
        items.append(Item(f"code-edit-{i:03d}-{src.module}.{src.qualname}", kind,
                          (_edit_prompt(src, code, instruction),), predictions=(code,)))
    return items


# --------------------------------------------------------------------------- multi-turn edits
_SESSION_KINDS = ("rename", "type-hints", "add-parameter", "docstring")


def multi_turn_edit_items(num_sessions: int = 8, min_lines: int = 12, max_lines: int = 30) -> list[Item]:
    """Sessions of four successive edits to one file of two short functions.

    Turn 1 shows the file and asks for an edit; later turns ask for another
    edit to "the file as you last wrote it", so the model copies its own
    previous answer with a change.
    """
    sources = code_sources(min_lines, max_lines)
    items = []
    for s in range(num_sessions):
        first, second = sources[(2 * s) % len(sources)], sources[(2 * s + 1) % len(sources)]
        file_text = f"{first.source}\n\n{second.source}"
        turns = []
        for t, kind in enumerate(_SESSION_KINDS):
            target = first if t % 2 == 0 else second
            _, instruction = make_edit(target, kind, where=f"the function `{target.name}`")
            if t == 0:
                turns.append(f"Here is the file `edit_{s}.py`:\n\n```python\n{file_text}```\n\n{instruction} "
                             f"Output the whole updated file in one ```python code block and nothing else.")
            else:
                turns.append(f"Now take the file as you last wrote it. {instruction} Output the whole updated "
                             f"file in one ```python code block and nothing else.")
        items.append(Item(f"multi-turn-edit-{s:02d}-{first.name}-{second.name}", "multi-turn-edit", tuple(turns),
                          tuple(f"turn{t + 1}" for t in range(len(turns)))))
    return items


# --------------------------------------------------------------------------- rag
RAG_MODULES = ("textwrap", "json", "heapq", "bisect", "shlex", "fnmatch", "difflib", "csv", "base64",
               "statistics", "functools", "itertools", "collections", "string", "html", "calendar",
               "copy", "glob", "graphlib", "ipaddress", "random", "urllib.parse", "zlib", "struct")
RAG_KINDS = ("quote", "explain", "summarize")


@dataclass(frozen=True)
class Document:
    title: str
    subject: str  # the first object the chunk documents, e.g. "textwrap.dedent"
    text: str


def rag_documents(chunk_chars: int = 1200) -> list[Document]:
    """Chunks of about ``chunk_chars`` characters (a few hundred tokens) of module docs.

    A module's text is its ``__doc__`` then ``name(signature)`` + docstring of
    each public function and class in ``__all__``/``dir`` order; chunks break
    between entries (an entry longer than a chunk is cut at paragraphs).
    """
    docs = []
    for module_name in RAG_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        entries = []
        if module.__doc__:
            entries.append((module_name, f"Module {module_name}\n\n{inspect.cleandoc(module.__doc__)}"))
        names = getattr(module, "__all__", None) or [n for n in sorted(dir(module)) if not n.startswith("_")]
        for name in names:
            obj = getattr(module, name, None)
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 80:
                continue
            entries.append((f"{module_name}.{name}", f"{module_name}.{name}\n\n{doc}"))
        chunk, subject, part = "", "", 0
        for entry_subject, text in entries:
            for para_block in _split_paragraphs(text, chunk_chars):
                if chunk and len(chunk) + len(para_block) > chunk_chars:
                    docs.append(Document(f"{module_name} documentation, part {part + 1}", subject, chunk.strip()))
                    chunk, part = "", part + 1
                if not chunk:
                    subject = entry_subject
                chunk += para_block + "\n\n"
        if chunk.strip():
            docs.append(Document(f"{module_name} documentation, part {part + 1}", subject, chunk.strip()))
    return docs


def _split_paragraphs(text: str, max_chars: int) -> list[str]:
    blocks, current = [], ""
    for para in text.split("\n\n"):
        if current and len(current) + len(para) > max_chars:
            blocks.append(current.rstrip())
            current = ""
        current += para[:max_chars] + "\n\n"
    if current.strip():
        blocks.append(current.rstrip())
    return blocks


def rag_items(num_questions: int = 60, seed: int = 0) -> list[Item]:
    """Questions about one document, asked with 1-3 other documents beside it.

    Question ``i`` is about document ``docs[i * stride]`` and is of kind
    ``RAG_KINDS[i % 3]``; the other documents and the order come from
    ``random.Random(seed + i)``.
    """
    docs = rag_documents()
    stride = max(1, len(docs) // num_questions)
    items = []
    for i in range(min(num_questions, len(docs))):
        rng = random.Random(seed + i)
        target = docs[(i * stride) % len(docs)]
        others = [d for d in docs if d.title.split(" ")[0] != target.title.split(" ")[0]]
        chosen = [target] + rng.sample(others, rng.randint(1, 3))
        rng.shuffle(chosen)
        number = chosen.index(target) + 1
        kind = RAG_KINDS[i % len(RAG_KINDS)]
        question = {
            "quote": f"Quote, word for word, the sentences of the documents that describe `{target.subject}`, "
                     f"then explain in two sentences what they mean.",
            "explain": f"Using only the documents, explain how to use `{target.subject}`, quoting the relevant "
                       f"passages and citing the document number.",
            "summarize": f"Summarize document [{number}] in a few sentences, quoting its key phrases exactly.",
        }[kind]
        context = "\n\n".join(f"Document [{k + 1}] ({d.title}):\n{d.text}" for k, d in enumerate(chosen))
        prompt = f"Answer the question using the documents below.\n\n{context}\n\nQuestion: {question}"
        items.append(Item(f"rag-{i:03d}-{target.subject}", kind, (prompt,)))
    return items


# --------------------------------------------------------------------------- prompt formatting
PLAIN_FORMAT_NOTE = "the tokenizer has no chat template: prompts use a plain 'User: ...\\nAssistant:' format"


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def format_prompt(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of a conversation ending with a user message, ready for the reply.

    ``messages`` are ``{"role": "user"|"assistant", "content": str}``. With a
    chat template: the template with the generation prompt. Without one (a base
    model): ``"User: ...\\nAssistant: ...\\n"`` turns then ``"Assistant:"``.
    """
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = ""
    for message in messages:
        speaker = "User" if message["role"] == "user" else "Assistant"
        text += f"{speaker}: {message['content'].strip()}\n"
    text += "Assistant:"
    return list(tokenizer(text)["input_ids"])
