"""Code editing: successive edits of one file, with a corpus shared across requests.

    python examples/code_edit_pipeline.py [--model qwen2.5-coder-0.5b]

Each request asks for one change to the file as the previous answer left it.
One ``MixtureDrafter`` instance serves every call, with an opt-in shared
corpus of earlier outputs (``history_tokens``): later edits draft from
earlier versions as well as from their own prompt. Per turn: tau and whether
the output is identical to plain greedy decoding.
"""

import argparse
import inspect
import re
import textwrap

import freespec
from freespec import models
from freespec.drafters.mixture import MixtureDrafter

EDITS = [
    "Rename the parameter `width` to `line_width`.",
    "Add type hints to the function signature.",
    "Add a one-line docstring at the top of the function body.",
]


def extract_code(answer: str, fallback: str) -> str:
    match = re.search(r"```(?:python)?\n(.*?)```", answer, re.S)
    return match.group(1) if match else fallback


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-new-tokens", type=int, default=300)
    args = parser.parse_args()
    model, tokenizer = models.load(args.model)
    code = textwrap.dedent(inspect.getsource(textwrap.TextWrapper._split_chunks)).replace("self, text", "text")
    code = code.replace("def _split_chunks(", "def split_chunks(width, ")
    drafter = MixtureDrafter(history_tokens=100_000)  # opt-in: requests see earlier outputs
    freespec.patch(model, drafter=drafter)
    for turn, edit in enumerate(EDITS, 1):
        messages = [{"role": "user", "content": f"{edit} Output the whole code.\n\n```python\n{code}```"}]
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        fast = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        stats = freespec.stats(model)
        plain = model.generate.__wrapped__(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        answer = tokenizer.decode(fast[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"turn {turn}: {edit}\n  identical: {fast.tolist() == plain.tolist()}; {stats.summary()}")
        code = extract_code(answer, code)
    print(f"final code:\n{code}")


if __name__ == "__main__":
    main()
