"""Code editing with transformers.pipeline and a predicted output: the file being edited is the prediction.

    python examples/code_edit_pipeline.py [--model qwen2.5-coder-0.5b] [--edits 3] [--max-new-tokens 300]

Successive edits of one standard-library function: each asks for one change
to the code as the previous answer left it, and passes that code as
``prediction=`` (OpenAI's "Predicted Outputs", Cursor's "speculative edits").
The answer is mostly the code again: freespec drafts it from the prediction,
follows the model where it departs (a renamed parameter, an inserted
docstring) and picks the prediction up again after. A prediction is a hint:
the output is what the model produces without it, token for token; only the
number of forwards changes. Text predictions are tokenized with the call's
``tokenizer=`` (the pipeline passes it through to ``generate()``).

Per edit: whether freespec's output is identical to plain decoding's, and tau
and tokens/s of plain decoding, HF prompt lookup (``prompt_lookup_num_tokens=10``),
freespec, and freespec with ``prediction=``; then the totals and the final code.
"""

import argparse
import inspect
import re
import textwrap

from transformers import pipeline

import freespec
from freespec import models
from freespec.drafters.mixture import MixtureDrafter
from measure import HF_PROMPT_LOOKUP_TOKENS, Totals, run, warm_up

EDITS = (
    "Rename the parameter `width` to `line_width` everywhere.",
    "Add type hints to the function signature.",
    "Add a one-line docstring at the top of the function body.",
    "Replace the `while` loop's condition with an equivalent `for` loop if that is simpler; otherwise keep it.",
)


def extract_code(answer: str, fallback: str) -> str:
    match = re.search(r"```(?:python)?\n(.*?)```", answer, re.S)
    return match.group(1) if match else fallback


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--edits", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=300)
    args = parser.parse_args()
    model, tokenizer = models.load(args.model)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    drafter = MixtureDrafter()  # freespec's default drafter, one instance for every call
    warm_up(pipe, drafter)
    code = textwrap.dedent(inspect.getsource(textwrap.TextWrapper._split_chunks)).replace("self, text", "text")
    code = code.replace("def _split_chunks(", "def split_chunks(width, ")
    totals = Totals()
    for turn, edit in enumerate(EDITS[:args.edits], 1):
        messages = [{"role": "user", "content": f"{edit} Output the whole code.\n\n```python\n{code}```"}]
        plain = run(pipe, messages, args.max_new_tokens)
        lookup = run(pipe, messages, args.max_new_tokens, prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS)
        freespec.patch(model, drafter=drafter)
        fast = run(pipe, messages, args.max_new_tokens)
        predicted = run(pipe, messages, args.max_new_tokens, prediction=code, tokenizer=tokenizer)
        freespec.unpatch(model)
        print(f"\nedit {turn}: {edit}\n   identical to plain decoding: freespec "
              f"{fast.token_ids == plain.token_ids}, with prediction= {predicted.token_ids == plain.token_ids}")
        for name, result in (("plain", plain), ("hf prompt lookup", lookup), ("freespec", fast),
                             ("freespec+prediction", predicted)):
            totals.add(name, result)
            print("   " + totals.line(name, result))
        code = extract_code(predicted.answer, code)
    print("\ntotal\n" + totals.report())
    print(f"\nfinal code:\n{code}")


if __name__ == "__main__":
    main()
