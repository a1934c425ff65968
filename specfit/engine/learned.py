"""What the engine learned online, saved to and restored from a ``learned.json`` file.

The file (SPECFIT.md, "JSON contracts", ``learned.json``) is one JSON object::

    {"format": 1,
     "identity": {"target", "head", "profile", "offload", "predictor", "admission", "device", "clock"},
     "sets": {"<dataset, or 'default' for the API>": [
         {"key": {"method", "total_tokens", "depth", "top_k", "cache_slots", "eviction",
                  "temperature", "top_p"},
          "covers": [prompt ids this state learned from, in order],   # written by specfit eval
          "online": OnlineModel.to_json()}, ...]}}

``identity`` names what makes the learning transferable (the target and head checkpoints, the cost
model it was priced on, the offload mode, the expert predictor, the cache admission rule, the device
type, the clock its host ms were read from: ``counted`` or ``measured``, :mod:`specfit.engine.clock`); ``key`` names the setting of one :class:`specfit.engine.online.OnlineModel` (the key of
:attr:`specfit.pipeline.SpecFit.online`). A warm start from a file whose identity or key differs is
refused with one line naming the differing field (:func:`check_identity`, :func:`check_key`).
"""

from __future__ import annotations

import json
from pathlib import Path

from specfit.core.errors import SpecFitInputError

#: learned.json's format version.
FORMAT = 1
#: The file name a run folder holds.
FILE_NAME = "learned.json"
#: Fields of an online model's key, in the order of :attr:`SpecFit.online`'s tuple keys.
KEY_FIELDS = ("method", "total_tokens", "depth", "top_k", "cache_slots", "eviction", "temperature", "top_p")


def key_to_json(key: tuple) -> dict:
    """``SpecFit.online``'s key ``(method, TreeSettings, cache_slots, eviction, temperature, top_p)`` as a dict."""
    method, tree, slots, eviction, temperature, top_p = key
    return {"method": method, "total_tokens": tree.total_tokens, "depth": tree.depth, "top_k": tree.top_k,
            "cache_slots": slots, "eviction": eviction, "temperature": float(temperature), "top_p": float(top_p)}


def key_from_json(data) -> tuple:
    """The tuple key :func:`key_to_json` wrote; a missing field is refused naming it."""
    from specfit.engine import TreeSettings

    if not isinstance(data, dict):
        raise SpecFitInputError("warm_start", "an entry's key must be an object")
    for f in KEY_FIELDS:
        if f not in data:
            raise SpecFitInputError("warm_start", f"an entry's key lacks {f!r}")
    return (data["method"], TreeSettings(data["total_tokens"], data["depth"], data["top_k"]), data["cache_slots"],
            data["eviction"], float(data["temperature"]), float(data["top_p"]))


def entries(online: dict, covers: dict | None = None) -> list[dict]:
    """The entries of one set: each online model of ``online`` (``SpecFit.online``) with its key, and
    the prompt ids it learned from where ``covers`` (key -> list of ids) gives them."""
    out = []
    for key, model in online.items():
        e = {"key": key_to_json(key), "online": model.to_json()}
        if covers is not None:
            e["covers"] = list(covers.get(key, []))
        out.append(e)
    return out


def document(identity: dict, sets: dict) -> dict:
    """The learned.json object of ``identity`` and ``sets`` (set name -> entries)."""
    return {"format": FORMAT, "identity": dict(identity), "sets": sets}


def write(path: str | Path, doc: dict) -> None:
    """Write ``doc`` to ``path`` atomically (temporary file + rename)."""
    from specfit.core.io import atomic_write_text, dumps

    atomic_write_text(Path(path), dumps(doc, indent=1) + "\n")


def read(path: str | Path) -> dict:
    """The learned.json object at ``path``, or ``path/learned.json`` for a run folder.

    Raises
    ------
    SpecFitInputError
        (field ``warm_start``) No such file, not JSON, an unknown format, or no ``sets``.
    """
    p = Path(path)
    if p.is_dir():
        p = p / FILE_NAME
    if not p.is_file():
        raise SpecFitInputError("warm_start", f"no such file: {p} (a run folder holds {FILE_NAME})")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecFitInputError("warm_start", f"{p} is not a JSON file: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SpecFitInputError("warm_start", f"{p} is not a learned.json of format {FORMAT}")
    if not isinstance(doc.get("identity"), dict) or not isinstance(doc.get("sets"), dict):
        raise SpecFitInputError("warm_start", f"{p} lacks 'identity' or 'sets'")
    return doc


def check_identity(saved: dict, current: dict) -> None:
    """Refuse a warm start learned on another target, head, profile or mode: one line naming the field."""
    for k in sorted(set(saved) | set(current)):
        if saved.get(k) != current.get(k):
            hint = " (the shipped heads' folders: --draft lite is eagle3-lite, strong is eagle3)" if k == "head" else ""
            raise SpecFitInputError("warm_start", f"learned with {k}={saved.get(k)!r}, this run has "
                                                  f"{k}={current.get(k)!r}{hint}")


def pick_set(doc: dict, name: str | None) -> list:
    """The entries of set ``name`` (a dataset), or of the file's only set; refused when neither exists."""
    sets = doc["sets"]
    if name is not None and name in sets:
        return sets[name]
    if len(sets) == 1:
        return next(iter(sets.values()))
    raise SpecFitInputError("warm_start", f"learned on {', '.join(sorted(sets)) or 'nothing'}; "
                                          f"name one of them, none is {name!r}")


def check_key(items: list, wanted: dict) -> dict:
    """The entry whose key matches ``wanted`` (a partial key: its fields must all be equal).

    Raises
    ------
    SpecFitInputError
        No entry of ``wanted["method"]`` (field ``warm_start``, naming ``method``), or the method's
        entry differs in another field (naming it and both values).
    """
    same = [e for e in items if isinstance(e, dict) and e.get("key", {}).get("method") == wanted["method"]]
    if not same:
        have = sorted({str(e.get("key", {}).get("method")) for e in items if isinstance(e, dict)})
        raise SpecFitInputError("warm_start", f"learned with method={', '.join(have) or 'none'}, this run has "
                                              f"method={wanted['method']!r}")
    for e in same:
        if all(_same(e["key"].get(k), v) for k, v in wanted.items()):
            return e
    e = same[0]
    k = next(k for k, v in wanted.items() if not _same(e["key"].get(k), v))
    raise SpecFitInputError("warm_start", f"learned with {k}={e['key'].get(k)!r}, this run has {k}={wanted[k]!r}")


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


__all__ = ["FILE_NAME", "FORMAT", "KEY_FIELDS", "check_identity", "check_key", "document", "entries", "key_from_json",
           "key_to_json", "pick_set", "read", "write"]
