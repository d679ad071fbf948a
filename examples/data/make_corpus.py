"""Generate ``corpus.txt``: deterministic English-like text for the byte-level demo.

Nothing is downloaded. A small grammar over a fixed vocabulary writes sentences about
gardens, rivers and machines, grouped into paragraphs with titles, so a tiny model has
structure to learn (spelling, punctuation, recurring phrases). Same seed, same bytes:

    python3 examples/data/make_corpus.py --mb 2
"""

import argparse
import random
from pathlib import Path

SUBJECTS = ["the gardener", "a quiet river", "the old machine", "my neighbour", "the small boat",
            "a patient teacher", "the northern wind", "every careful reader", "the tall lighthouse",
            "a curious child", "the market square", "our village baker"]
VERBS = ["watches", "follows", "remembers", "carries", "repairs", "describes", "measures",
         "greets", "paints", "listens to", "builds", "counts"]
OBJECTS = ["the morning light", "a row of apple trees", "the long road home", "seven silver fish",
           "the turning gears", "a letter from the coast", "the evening bells", "a field of barley",
           "the broken clock", "the sound of rain", "a map of the hills", "the first snow"]
ADVERBS = ["slowly", "every day", "without a word", "before dawn", "with great care",
           "in the autumn", "now and then", "as the tide turns"]
LINKS = ["and then", "because", "while", "although", "so that", "until"]
TITLES = ["On Gardens", "The River Book", "Notes on Machines", "Letters from the Coast",
          "A Village Year", "The Lighthouse Keeper", "Small Repairs", "Weather and Seasons"]


def sentence(rng: random.Random) -> str:
    def clause():
        return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    s = clause()
    if rng.random() < 0.5:
        s += f" {rng.choice(ADVERBS)}"
    if rng.random() < 0.4:
        s += f", {rng.choice(LINKS)} {clause()}"
    end = rng.choices([".", "!", "?"], weights=[8, 1, 1])[0]
    return s[0].upper() + s[1:] + end


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("corpus.txt"))
    args = p.parse_args()
    rng, parts, size, chapter = random.Random(args.seed), [], 0, 1
    while size < args.mb * 2**20:
        block = [f"Chapter {chapter}: {rng.choice(TITLES)}\n\n"]
        for _ in range(rng.randint(3, 7)):
            block.append(" ".join(sentence(rng) for _ in range(rng.randint(3, 8))) + "\n\n")
        text = "".join(block)
        parts.append(text)
        size += len(text)
        chapter += 1
    args.out.write_text("".join(parts))
    print(f"wrote {args.out} ({size} bytes, {chapter - 1} chapters)")


if __name__ == "__main__":
    main()
