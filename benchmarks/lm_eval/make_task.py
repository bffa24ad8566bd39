"""Write the local multiple-choice task `inferlab_mc40` for lm-evaluation-harness (40 questions).

Simple factual and pattern questions a 135M model mostly gets right, so that the accuracy is
informative and disagreements between servers show up question by question. Deterministic:
the same file every run. Usage: python make_task.py  (writes mc40.jsonl beside this file).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]  # fmt: skip
CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Germany", "Berlin"),
            ("Spain", "Madrid"), ("England", "London"), ("Russia", "Moscow"), ("Egypt", "Cairo")]  # fmt: skip
OPPOSITES = [("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("day", "night"),
             ("open", "closed"), ("happy", "sad"), ("early", "late")]  # fmt: skip
SOUNDS = [("dog", "barks"), ("cat", "meows"), ("cow", "moos"), ("duck", "quacks")]
COLOURS = [("grass", "green"), ("the sky on a clear day", "blue"), ("snow", "white"), ("a ripe banana", "yellow")]


def questions(rng: random.Random) -> list[dict]:
    items: list[tuple[str, str, list[str]]] = []
    for i, day in enumerate(DAYS[:6]):
        items.append((f"The day after {day} is", DAYS[i + 1], DAYS))
    for i, month in enumerate(MONTHS[:6]):
        items.append((f"The month after {month} is", MONTHS[i + 1], MONTHS))
    for country, city in CAPITALS:
        items.append((f"The capital of {country} is", city, [c for _, c in CAPITALS]))
    for word, opp in OPPOSITES:
        items.append((f"The opposite of {word} is", opp, [o for _, o in OPPOSITES]))
    for animal, sound in SOUNDS:
        items.append((f"A {animal}", sound, [s for _, s in SOUNDS]))
    for thing, colour in COLOURS:
        items.append((f"The colour of {thing} is", colour, ["green", "blue", "white", "yellow", "red"]))
    for a, b in [(2, 3), (4, 4), (1, 6), (5, 2)]:
        items.append((f"{a} + {b} =", str(a + b), [str(n) for n in range(2, 11)]))
    out = []
    for question, answer, pool in items:
        wrong = rng.sample([p for p in pool if p != answer], 3)
        choices = wrong + [answer]
        rng.shuffle(choices)
        out.append({"question": question, "choices": choices, "label": choices.index(answer)})
    assert len(out) == 40, len(out)
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("mc40.jsonl")
    path.write_text("".join(json.dumps(q) + "\n" for q in questions(random.Random(0))))
    print(f"wrote {path}")
