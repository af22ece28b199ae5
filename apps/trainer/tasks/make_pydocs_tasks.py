"""Writes the example tasks in this folder from the embedded corpus's held-out split
(`pydocs_validation`, which the debug model's `pydocs` training never reads): one task in the
shape of each common benchmark, so the formats are shown with data a debug run can score above
chance. Deterministic; `python apps/trainer/tasks/make_pydocs_tasks.py` rewrites the same files.

- pydocs_hellaswag: HellaSwag's fields (ctx, endings, label as a string), 1-shot, random sampler
- pydocs_arc: ARC's (question, choices.text/choices.label, answerKey letter), 1-shot from a
  separate file, first_n sampler
- pydocs_piqa: PIQA's (goal, sol1, sol2, label), 0-shot
- pydocs_mmlu: MMLU's (question, choices, answer index), lettered choices, 0-shot
- pydocs_lambada: LAMBADA's (text), the last word
- pydocs_wikitext: WikiText's (page), rolling perplexity

Each multiple-choice item's wrong choices are the ends of other sentences of the split.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from titan_data import pydocs_documents

HERE = Path(__file__).parent


def sentences(docs) -> list[str]:
    """Prose sentences of 40-110 characters: paragraphs joined, split after a period."""
    found = []
    for doc in docs:
        for paragraph in re.split(r"\n\s*\n", doc):
            lines = paragraph.splitlines()
            if not lines or any(line.startswith((" ", "*", "=", "-", ">")) for line in lines):
                continue  # code, grammar, headings
            text = " ".join(line.strip() for line in lines)
            for s in (p.strip() for p in re.split(r"(?<=\.) ", text)):
                if 40 <= len(s) <= 110 and s.endswith(".") and s.count('"') % 2 == 0:
                    found.append(s)
    return list(dict.fromkeys(found))


def halves(s: str) -> tuple[str, str]:
    """The sentence cut at the word boundary nearest its middle: (head, rest)."""
    words = s.split(" ")
    cut = max(2, len(words) // 2)
    return " ".join(words[:cut]), " ".join(words[cut:])


def choice_sets(pool: list[str], n: int, k: int, rng: random.Random):
    """n items: (head, choices, gold) with k choices, the right rest among k - 1 others."""
    items = []
    for i in range(n):
        head, right = halves(pool[i % len(pool)])
        others = [halves(s)[1] for s in rng.sample(pool, k + 3) if halves(s)[1] != right][: k - 1]
        choices = others + [right]
        rng.shuffle(choices)
        items.append((head, choices, choices.index(right)))
    return items


def write_jsonl(name: str, rows: list[dict]) -> None:
    with open(HERE / name, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    rng = random.Random(0)
    held_out = pydocs_documents("validation")
    pool = sentences(held_out)
    shots = sentences(pydocs_documents("train"))[:50]

    write_jsonl(
        "pydocs_hellaswag.jsonl",
        [{"ctx": h, "endings": c, "label": str(g)} for h, c, g in choice_sets(pool, 300, 4, rng)],
    )
    letters = ["A", "B", "C", "D"]
    short = [s for s in pool if len(s) <= 80]
    short_shots = [s for s in shots if len(s) <= 80]
    for name, source, n in (
        ("pydocs_arc.jsonl", short, 200),
        ("pydocs_arc_shots.jsonl", short_shots, 20),
    ):
        write_jsonl(
            name,
            [
                {
                    "question": f"{h} ...",
                    "choices": {"text": c, "label": letters},
                    "answerKey": letters[g],
                }
                for h, c, g in choice_sets(source, n, 4, rng)
            ],
        )
    write_jsonl(
        "pydocs_piqa.jsonl",
        [
            {"goal": h, "sol1": c[0], "sol2": c[1], "label": g}
            for h, c, g in choice_sets(pool, 200, 2, rng)
        ],
    )
    write_jsonl(
        "pydocs_mmlu.jsonl",
        [{"question": h, "choices": c, "answer": g} for h, c, g in choice_sets(short, 200, 4, rng)],
    )
    write_jsonl("pydocs_lambada.jsonl", [{"text": s.rstrip(".")} for s in pool[:200]])
    write_jsonl("pydocs_wikitext.jsonl", [{"page": doc} for doc in held_out[:8]])


if __name__ == "__main__":
    main()
