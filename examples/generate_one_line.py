"""One line turns speculation on in Hugging Face generate().

    python examples/generate_one_line.py [--model qwen2.5-coder-0.5b]

Loads an offline model, generates greedily, patches, generates again: the two
outputs are token-identical, and freespec.stats() tells how many target
forwards it took.
"""

import argparse

import freespec
from freespec import models

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="smollm2-135m")
args = parser.parse_args()

model, tokenizer = models.load(args.model)
messages = [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome, "
                                        "then show it again with type hints."}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)

plain = model.generate(**inputs, max_new_tokens=200, do_sample=False)

freespec.patch(model)  # <- the one line
fast = model.generate(**inputs, max_new_tokens=200, do_sample=False)

print(tokenizer.decode(fast[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print("identical to plain generate():", fast.tolist() == plain.tolist())
print(freespec.stats(model).summary())
