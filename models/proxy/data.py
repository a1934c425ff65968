"""Training and held-out text for the proxy models, read from the repository's ``data/proxy`` copy.

Sources (see ``data/proxy/*/PROVENANCE.md``): the plain-English corpus (Gutenberg, State of the
Union, tinyshakespeare), GSM8K train, and CNN/DailyMail articles from the FRANK file. The
evaluation uses GSM8K *test* and ``frank_cnndm_test_250.jsonl``; to keep it clean the first
:data:`CNN_HELD_OUT` FRANK articles (file order) and all of GSM8K test are never trained on and
serve as the held-out set. Spec-Bench is not used at all.
"""

from __future__ import annotations

import json
from pathlib import Path

#: Default location of the data copy shipped with the repository (not package data).
DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "proxy"
#: Number of leading FRANK CNN/DM articles reserved for evaluation (never trained on).
CNN_HELD_OUT = 100
#: End-of-text token: separates documents and ends generations.
EOS = "<|endoftext|>"


def gsm8k_prompt(question: str) -> str:
    """Prompt format the proxy target was trained on for GSM8K: ``"Question: ...\\nAnswer:"``."""
    return f"Question: {question.strip()}\nAnswer:"


def _jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def gsm8k(split: str, data_dir: Path = DATA_DIR) -> list[dict]:
    """GSM8K records (``question``, ``answer``) of ``split`` in ``{"train", "test"}``."""
    return _jsonl(Path(data_dir) / "gsm8k" / f"{split}.jsonl")


def gsm8k_texts(split: str, data_dir: Path = DATA_DIR) -> list[str]:
    """GSM8K problems as training documents: the prompt followed by the worked answer."""
    return [f"{gsm8k_prompt(r['question'])} {r['answer'].strip()}" for r in gsm8k(split, data_dir)]


def cnn_articles(split: str, data_dir: Path = DATA_DIR) -> list[str]:
    """FRANK CNN/DM articles: ``"train"`` = all but the first :data:`CNN_HELD_OUT`, ``"held_out"`` = those."""
    recs = _jsonl(Path(data_dir) / "cnn_dailymail" / "frank_cnndm_test_250.jsonl")
    if split == "train":
        recs = recs[CNN_HELD_OUT:]
    elif split == "held_out":
        recs = recs[:CNN_HELD_OUT]
    else:
        raise ValueError(f"split: must be 'train' or 'held_out', got {split!r}")
    return [r["article"].strip() for r in recs]


def corpus_texts(data_dir: Path = DATA_DIR) -> list[str]:
    """The plain-English corpus, one document per file (Latin-1 safe, CRLF normalised)."""
    root = Path(data_dir) / "corpus"
    files = sorted(p for p in root.rglob("*.txt"))
    return [p.read_text(encoding="latin-1").replace("\r\n", "\n").strip() for p in files]


def training_sources(data_dir: Path = DATA_DIR) -> dict[str, list[str]]:
    """All training documents grouped by source: ``gsm8k``, ``cnn``, ``corpus``."""
    return {
        "gsm8k": gsm8k_texts("train", data_dir),
        "cnn": cnn_articles("train", data_dir),
        "corpus": corpus_texts(data_dir),
    }


def held_out_sources(data_dir: Path = DATA_DIR) -> dict[str, list[str]]:
    """Held-out documents (never trained on): GSM8K test and the reserved CNN/DM articles."""
    return {"gsm8k_test": gsm8k_texts("test", data_dir), "cnn_held_out": cnn_articles("held_out", data_dir)}
