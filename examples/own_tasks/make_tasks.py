"""Write the example task file: phone-directory questions, one JSON object per line (no download).

Each row has the question's column (``name``), its own directory (the lookup tool's hidden argument), the
ground truth (``answer``), a reference solution in OpenAI message format (for the SFT warm start) and a
``split`` column that holds out the last rows for evaluation::

    python examples/own_tasks/make_tasks.py                 # -> examples/own_tasks/tasks.jsonl (2048 rows)
    python examples/own_tasks/make_tasks.py --rows 64 --heldout 16 --out /tmp/tasks.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ("ada", "bob", "cy", "dan", "eve", "fay", "gus", "hal", "ivy", "jo", "kim", "lee", "max", "ned", "oli", "pam")


def make_row(rng: random.Random, i: int, split: str, people: int = 4) -> dict:
    names = rng.sample(NAMES, people)
    directory = [{"name": n, "extension": rng.randint(10, 99)} for n in names]
    target = rng.choice(directory)
    call = {"name": "lookup", "arguments": json.dumps({"name": target["name"]})}
    return {
        "id": i,
        "name": target["name"],
        "directory": directory,
        "answer": target["extension"],
        "reference": [
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
            {"role": "assistant", "content": f"Final answer: {target['extension']}", "tool_calls": []},
        ],
        "split": split,
    }


def make_tasks(out: str | Path, rows: int = 2048, heldout: int = 128, seed: int = 0) -> Path:
    """Write ``rows`` tasks to ``out``; the last ``heldout`` have split "test"."""
    if not 0 < heldout < rows:
        raise ValueError(f"need 0 < heldout < rows, got heldout={heldout}, rows={rows}")
    rng = random.Random(seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for i in range(rows):
            f.write(json.dumps(make_row(rng, i, "test" if i >= rows - heldout else "train")) + "\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).parent / "tasks.jsonl"))
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--heldout", type=int, default=128, help="rows at the end with split 'test'")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(make_tasks(a.out, a.rows, a.heldout, a.seed))


if __name__ == "__main__":
    main()
