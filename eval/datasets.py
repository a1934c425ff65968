"""Evaluation prompts: GSM8K, CNN/DailyMail, Spec-Bench and user JSONL files, with their templates.

Every method sees exactly the same prompt token ids: :func:`load_prompts` returns the templated
text, and :func:`encode` turns it into ids once per prompt. Templates (one per task, applied the
same way for every method):

* ``gsm8k`` — ``"Question: {question}\\nAnswer:"``, the format the proxy target was trained on
  (:func:`models.proxy.data.gsm8k_prompt`); reference = the worked answer ending ``#### N``.
* ``cnndm`` — ``"Article: {article}\\nSummary:"``; reference = the article's highlights. The
  article is cut to its first ``max_article_tokens`` token ids before templating (default 768;
  FRANK articles run to ~2,000 proxy tokens, the proxy's context is 2,048).
* ``spec-bench`` — Spec-Bench's ``math_reasoning`` (GSM8K test questions, the ``gsm8k`` template)
  and ``summarization`` (``turns[0]`` is already ``"Summarize: " + article``; ``"\\nSummary:"`` is
  appended, the article cut as for ``cnndm``).
* ``PATH.jsonl`` — each line's ``prompt`` string as is (no template); optional ``id`` (string or
  integer, default the line number) and ``reference`` (string).

Data: the copies in ``eval/data`` (see ``eval/data/PROVENANCE.md``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specfit.models.proxy.data import CNN_HELD_OUT, gsm8k_prompt
from specfit.core.errors import SpecFitInputError, check_positive_int
from specfit.core.readers import read_text

#: Folder of the evaluation data copies shipped inside the ``eval`` package.
DATA_DIR = Path(__file__).resolve().parent / "data"
#: Names accepted by :func:`load_prompts` besides a path to a ``.jsonl`` file.
DATASETS = ("gsm8k", "cnndm", "spec-bench")
#: Default cut of a CNN/DailyMail article, in target token ids.
MAX_ARTICLE_TOKENS = 768


@dataclass(frozen=True)
class Prompt:
    """One evaluation prompt.

    Attributes
    ----------
    id : str
        Unique within its dataset.
    dataset : str
        ``gsm8k``, ``cnndm``, ``spec-bench`` or the JSONL file's stem.
    task : str
        ``gsm8k`` (final-answer accuracy), ``cnndm`` (ROUGE) or ``none`` (no task metric).
    text : str
        The templated prompt, or the template's parts when the article still has to be cut
        (see :func:`encode`).
    reference : str or None
        Worked answer (GSM8K) or highlights (CNN/DM).
    article : str or None
        The article to cut and place into ``text`` at ``{article}`` (summarisation only).
    """

    id: str
    dataset: str
    task: str
    text: str
    reference: str | None = None
    article: str | None = None


def _read_jsonl(path: Path, field: str) -> list[tuple[int, object]]:
    lines = read_text(path, field).splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((i, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise SpecFitInputError(field, f"{path} line {i} is not valid JSON ({exc.msg})") from None
    return out


def _gsm8k(data_dir: Path) -> list[Prompt]:
    recs = _read_jsonl(data_dir / "gsm8k" / "test.jsonl", "datasets")
    return [Prompt(f"gsm8k-test-{i - 1}", "gsm8k", "gsm8k", gsm8k_prompt(r["question"]), r["answer"])
            for i, r in recs]


def _cnndm(data_dir: Path) -> list[Prompt]:
    recs = _read_jsonl(data_dir / "cnn_dailymail" / "frank_cnndm_test_250.jsonl", "datasets")[:CNN_HELD_OUT]
    return [Prompt(r["id"], "cnndm", "cnndm", "Article: {article}\nSummary:", r["highlights"], r["article"])
            for _, r in recs]


def _spec_bench(data_dir: Path) -> list[Prompt]:
    out = []
    for _, r in _read_jsonl(data_dir / "spec_bench" / "question.jsonl", "datasets"):
        ref = (r.get("reference") or [None])[0]
        pid = f"spec-bench-{r['question_id']}"
        if r["category"] == "math_reasoning":
            out.append(Prompt(pid, "spec-bench", "gsm8k", gsm8k_prompt(r["turns"][0]), ref))
        elif r["category"] == "summarization":
            article = r["turns"][0].removeprefix("Summarize: ")
            out.append(Prompt(pid, "spec-bench", "cnndm", "Summarize: {article}\nSummary:", ref, article))
    return out


def _user_jsonl(path: Path) -> list[Prompt]:
    out, seen = [], set()
    for i, r in _read_jsonl(path, "datasets"):
        if not isinstance(r, dict):
            raise SpecFitInputError("datasets", f"{path} line {i} must be a JSON object with a 'prompt' string")
        if not isinstance(r.get("prompt"), str) or not r["prompt"]:
            raise SpecFitInputError("datasets", f"{path} line {i} needs a non-empty 'prompt' string")
        pid = r.get("id", i)
        if isinstance(pid, bool) or not isinstance(pid, (str, int)):
            raise SpecFitInputError("datasets", f"{path} line {i}: 'id' must be a string or an integer")
        if str(pid) in seen:
            raise SpecFitInputError("datasets", f"{path} line {i}: 'id' {pid!r} appears twice")
        ref = r.get("reference")
        if ref is not None and not isinstance(ref, str):
            raise SpecFitInputError("datasets", f"{path} line {i}: 'reference' must be a string")
        seen.add(str(pid))
        out.append(Prompt(str(pid), path.stem, "none", r["prompt"], ref))
    if not out:
        raise SpecFitInputError("datasets", f"{path} holds no prompts")
    return out


def load_prompts(name: str, limit: int | None = None, data_dir: str | Path = DATA_DIR) -> list[Prompt]:
    """The prompts of one dataset, in file order.

    Parameters
    ----------
    name : str
        ``gsm8k``, ``cnndm``, ``spec-bench`` or a path to a ``.jsonl`` file (see the module docstring).
    limit : int, optional
        Keep the first ``limit`` prompts (>= 1).
    data_dir : path
        Folder with the data copies (default ``eval/data``).

    Returns
    -------
    list of Prompt

    Raises
    ------
    SpecFitInputError
        Unknown dataset name (field ``--dataset``), a missing or unreadable file, a line that is not
        JSON, a JSONL line without a ``prompt`` string (field ``prompt``), a bad or repeated ``id``,
        a bad ``limit``.
    """
    if limit is not None:
        check_positive_int("limit", limit)
    loaders = {"gsm8k": _gsm8k, "cnndm": _cnndm, "spec-bench": _spec_bench}
    if name in loaders:
        prompts = loaders[name](Path(data_dir))
    elif name.endswith(".jsonl"):
        if not Path(name).is_file():
            raise SpecFitInputError("datasets", f"no such file: {name}")
        prompts = _user_jsonl(Path(name))
    else:
        raise SpecFitInputError("datasets", f"unknown dataset {name!r}; use one of {', '.join(DATASETS)} "
                                             "or a path ending in .jsonl")
    return prompts[:limit]


def encode(prompt: Prompt, tokenizer, max_article_tokens: int = MAX_ARTICLE_TOKENS) -> list[int]:
    """Token ids of a prompt (no special tokens added), the article cut to ``max_article_tokens``.

    Parameters
    ----------
    prompt : Prompt
    tokenizer
        A transformers tokenizer of the target.
    max_article_tokens : int
        Token ids of the article kept (summarisation prompts only).

    Returns
    -------
    list of int
    """
    text = prompt.text
    if prompt.article is not None:
        ids = tokenizer(prompt.article, add_special_tokens=False)["input_ids"][:max_article_tokens]
        text = text.replace("{article}", tokenizer.decode(ids).strip())
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
