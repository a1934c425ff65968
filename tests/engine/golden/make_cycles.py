"""Write the golden cycle records the engine's behaviour is compared against (``cycles.json``).

Run from the repository root: ``.venv/bin/python tests/engine/golden/make_cycles.py [out.json] [--measured]``.

The records come from the shipped proxy target with both shipped heads (``eagle3``, ``eagle3-lite``)
at three expert-cache sizes (16, 32 and every expert per layer), for the methods ``ar``, ``eagle3``,
``eagle3-scan``, ``specfit`` and ``oracle`` (greedy, float32, one torch thread, the default
``qwen3-30b-a3b-pcie4`` profile and frequency predictor of :meth:`specfit.SpecFit.from_pretrained`).
Each setting decodes the prompts one after another through one :class:`specfit.SpecFit`, so the
calibrated methods' online state carries from one prompt to the next as in a deployment.

Host time is measured by the engine (``time.thread_time``) and feeds its decisions (the measured host
ms per draft level and per cycle), so measured clocks make the decisions differ between runs. The
records are made with a frozen clock: every time the engine reads is 0, host work costs 0 ms. With
an engine that takes a clock (``SpecDecoder.clock``) the script passes
:class:`specfit.engine.clock.FrozenClock`; with one that reads ``time`` directly (the engine before
its clock existed: the committed records were made that way, from commit e0e3fd2) it replaces the
engine modules' ``time`` with a frozen one.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
OUT = Path(__file__).with_name("cycles.json")
HEADS = ("eagle3", "eagle3-lite")
CACHES = (16, 32, "all")
METHODS = ("ar", "eagle3", "eagle3-scan", "specfit", "oracle")
PROMPTS = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
           "The city council met on Tuesday to discuss the new budget for schools and roads.",
           "Question: A train travels 60 miles in 1.5 hours. What is its average speed?\nAnswer:")
NEW_TOKENS = 16
FROZEN = True
#: Record fields measured by a clock or a timer (not compared).
TIMING = ("draft_ms", "predict_ms", "tree_ms", "solve_ms", "verify_ms", "transfer_ms", "compute_ms", "accept_ms",
          "host_cpu_ms", "hidden_host_ms", "host_thread_ms")


def frozen_engine_time():
    """Replace ``time`` in the engine's modules by a clock that reads 0 (for an engine without a clock)."""
    import specfit.engine.decoder as decoder

    decoder.time = types.SimpleNamespace(perf_counter=lambda: 0.0, thread_time=lambda: 0.0)


def load(head: str, slots):
    """The proxy target with ``slots`` expert-cache slots per layer and the head ``head``."""
    from specfit import SpecFit

    return SpecFit.from_pretrained(ROOT / "models/proxy/target", ROOT / "models/proxy" / head, cache_slots=slots,
                                   dtype="float32")


def run_setting(sf, head: str, slots, method: str) -> dict:
    """The records of one (head, cache, method) setting: per prompt its output ids and cycle records."""
    prompts = []
    for text in PROMPTS:
        dec = sf.decoder(method)
        if FROZEN and hasattr(dec, "clock"):
            from specfit.engine.clock import FrozenClock

            dec.clock = FrozenClock()
        with torch.no_grad():
            gen = dec.generate(sf.encode(text), NEW_TOKENS, eos_id=sf.eos_token_id)
        cycles = [{k: v for k, v in c.to_json().items() if k not in TIMING} for c in gen.cycles]
        prompts.append({"output_ids": gen.output_ids, "cycles": cycles})
    return {"head": head, "cache_slots": slots, "method": method, "prompts": prompts}


def generate_all(measured: bool = False) -> list[dict]:
    """Every setting's records, in the order of HEADS x CACHES x METHODS (``measured``: with the
    engine's measured clocks, to see that they change the decisions between runs)."""
    torch.set_num_threads(1)
    from specfit.engine import decoder

    global FROZEN
    FROZEN = not measured
    if FROZEN and "clock" not in decoder.SpecDecoder.__init__.__code__.co_varnames:
        frozen_engine_time()
    out = []
    for h in HEADS:
        for s in CACHES:
            sf = load(h, s)
            out += [run_setting(sf, h, s, m) for m in METHODS]
    return out


def main(argv: list[str]) -> None:
    measured = "--measured" in argv
    argv = [a for a in argv if a != "--measured"]
    out = Path(argv[1]) if len(argv) > 1 else OUT
    data = {"new_tokens": NEW_TOKENS, "prompts": list(PROMPTS), "settings": generate_all(measured)}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    main(sys.argv)
