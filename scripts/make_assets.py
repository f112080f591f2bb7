"""Regenerate the bundled SFT assets deterministically.

    python scripts/make_assets.py     # writes mlir_train/assets/{alpaca_tasks.json,tokenizer/}

``alpaca_tasks.json``: generated alpaca-format instruction tasks whose answers can be checked
(arithmetic, sums with worked steps, sorting/reversing words, unit conversion, counting, ...).
``tokenizer/``: a ByteLevel BPE tokenizer trained on that data with the ``tokenizers`` library,
saved as an HF tokenizer directory with ``<|endoftext|>`` (eos, pad), ``<|im_start|>``,
``<|im_end|>`` and a ChatML ``chat_template``, plus the other added tokens of Qwen3's official
tokenizer in its order (``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``,
``<tool_response>``, ... with its special / not-special flags), after the trained vocabulary so
that every earlier token id stays as it was.

``generate_records`` is also used by ``benchmarks/preprocess.py`` for a 52k-record file.
"""

from __future__ import annotations

import argparse
import json
import os
import random

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "mlir_train", "assets")
NUM_RECORDS = 3000
VOCAB_SIZE = 1536
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The rest of Qwen3's added tokens (tokenizer_config.json of Qwen/Qwen3-8B: ids 151646-151668),
# in its order: its special ones, then the ones it adds as plain (not special) tokens.
QWEN3_SPECIAL = ["<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                 "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                 "<|video_pad|>"]
QWEN3_ADDED = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WORDS = """apple river mountain candle garden window silver forest planet bridge ocean pencil
tiger orange castle meadow rocket violin desert island lantern marble needle pepper harbor
jacket kettle ladder mirror noodle parrot quilt saddle tunnel umbrella valley wagon yogurt zebra
anchor basket cactus dragon engine feather glacier hammer igloo jungle koala lemon magnet
nectar oyster puzzle quartz ribbon shadow thunder velvet walnut falcon copper cherry breeze
autumn winter summer spring morning evening crystal pebble comet canyon blossom cloud
""".split()

UNITS = [  # (from, to, factor, instruction noun)
    ("kilometers", "meters", 1000), ("meters", "centimeters", 100), ("kilograms", "grams", 1000),
    ("hours", "minutes", 60), ("minutes", "seconds", 60), ("liters", "milliliters", 1000),
    ("days", "hours", 24), ("weeks", "days", 7), ("feet", "inches", 12), ("yards", "feet", 3),
]


def _words(rng: random.Random, lo: int, hi: int) -> list[str]:
    return rng.sample(WORDS, rng.randint(lo, hi))


def _arithmetic(rng):
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    op, symbol, value = rng.choice([("Add", "+", a + b), ("Subtract", "-", a - b),
                                    ("Multiply", "*", a * b)])
    if rng.random() < 0.5:
        return f"What is {a} {symbol} {b}?", "", f"{a} {symbol} {b} = {value}"
    return f"{op} the two numbers.", f"{a} {symbol} {b}", str(value)


def _sum_with_steps(rng):
    numbers = [rng.randint(1, 500) for _ in range(rng.randint(3, 14))]
    lines, total = [], 0
    for n in numbers:
        lines.append(f"{total} + {n} = {total + n}")
        total += n
    return ("Add up the numbers, showing each step.", " ".join(map(str, numbers)),
            "\n".join(lines) + f"\nThe total is {total}.")


def _sort_words(rng):
    words = _words(rng, 3, 12)
    reverse = rng.random() < 0.3
    order = "reverse alphabetical" if reverse else "alphabetical"
    return (f"Sort the words in {order} order.", " ".join(words),
            " ".join(sorted(words, reverse=reverse)))


def _reverse_words(rng):
    words = _words(rng, 3, 12)
    return "Reverse the order of the words.", " ".join(words), " ".join(reversed(words))


def _reverse_letters(rng):
    word = rng.choice(WORDS)
    return f"Spell the word \"{word}\" backwards.", "", word[::-1]


def _convert(rng):
    src, dst, factor = rng.choice(UNITS)
    amount = rng.randint(1, 250)
    return (f"Convert {amount} {src} to {dst}.", "",
            f"{amount} {src} is {amount * factor} {dst}, because one of {src} is {factor} {dst}.")


def _count(rng):
    words = _words(rng, 2, 15)
    letter = rng.choice("aeiourstn")
    text = " ".join(words)
    if rng.random() < 0.5:
        return "How many words are in the text?", text, str(len(words))
    return (f"How many times does the letter \"{letter}\" appear in the text?", text,
            str(text.count(letter)))


def _extremes(rng):
    numbers = [rng.randint(-99, 999) for _ in range(rng.randint(3, 10))]
    which, value = rng.choice([("largest", max(numbers)), ("smallest", min(numbers))])
    return f"Find the {which} number in the list.", ", ".join(map(str, numbers)), str(value)


def _parity(rng):
    n = rng.randint(0, 100000)
    return f"Is {n} even or odd?", "", f"{n} is {'even' if n % 2 == 0 else 'odd'}."


def _uppercase(rng):
    text = " ".join(_words(rng, 2, 10))
    return "Rewrite the text in capital letters.", text, text.upper()


TASKS = (_arithmetic, _sum_with_steps, _sort_words, _reverse_words, _reverse_letters, _convert,
         _count, _extremes, _parity, _uppercase)


def generate_records(num_records: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for _ in range(num_records):
        instruction, input_text, output = rng.choice(TASKS)(rng)
        records.append({"instruction": instruction, "input": input_text, "output": output})
    return records


def train_tokenizer(records: list[dict], out_dir: str) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    import sys
    sys.path.insert(0, ROOT)
    from mlir_train.data.records import Sample, Turn
    from mlir_train.data.templates import TemplateSpec, render

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    # Train on the texts as the templates render them, so the prompt scaffolding compresses well.
    alpaca = TemplateSpec("alpaca", "<|endoftext|>")
    chatml = TemplateSpec("chatml", "<|endoftext|>")
    texts = []
    for i, r in enumerate(records):
        sample = Sample((Turn(r["instruction"], r["output"], r["input"]),))
        texts.append(render(sample, chatml if i % 4 == 0 else alpaca)[0])
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN3_SPECIAL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_ADDED])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:] + QWEN3_SPECIAL, model_max_length=32768)
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=ASSETS)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    records = generate_records(NUM_RECORDS)
    with open(os.path.join(args.out, "alpaca_tasks.json"), "w") as f:
        f.write("[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n]\n")
    train_tokenizer(records, os.path.join(args.out, "tokenizer"))
    print(f"wrote {len(records)} records and a {VOCAB_SIZE}-token tokenizer (+ {len(QWEN3_SPECIAL + QWEN3_ADDED)} "
          f"added tokens) to {args.out}")


if __name__ == "__main__":
    main()
