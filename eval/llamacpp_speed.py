r"""Greedy AR decoding speed of the public API against transformers and llama.cpp, on the CPU, in one process.

One torch thread and one llama.cpp thread, every expert resident, the shipped proxy target in float32 (or
``--model``), and the same checkpoint converted to a float32 GGUF file for llama.cpp. The decoders run
interleaved round by round (``--repeats`` rounds, each decodes ``--tokens`` tokens after the same prompt of
``--prompt-len`` token ids): the runtime's ``greedy_generate``, the public API's ``SpecFit.generate(method="ar")``
and transformers' ``generate`` (all three exactly as :func:`specfit.eval.runtime_speed.decode_speed` runs them),
and llama.cpp through llama-cpp-python's ``Llama.generate`` on the same token ids (no BOS added, no text
tokenized; greedy sampler, the KV cache cleared before each call so that every call prefills the prompt).
ms per token = one call's wall (and thread CPU) time, prefill included, over the new tokens; medians; each
decoder's speed as a multiple of transformers' and of llama.cpp's. The greedy token ids of all four must be
equal, else the command fails.

llama.cpp is not a dependency of SpecFit. Either install llama-cpp-python (it builds llama.cpp from source)::

    CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" pip install llama-cpp-python==0.3.36

or put its unpacked sdist on ``PYTHONPATH`` (with its Python dependencies, e.g. ``diskcache``, installed) and point
``LLAMA_CPP_LIB_PATH`` at the ``bin`` directory of a shared build of its ``vendor/llama.cpp``; the bindings are pure
ctypes. A build with the measured one's settings (read from its ``CMakeCache.txt``)::

    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF        # GGML_NATIVE is on by default: -march=native
    cmake --build BUILD --target llama
    PYTHONPATH=llama_cpp_python-0.3.36 LLAMA_CPP_LIB_PATH=BUILD/bin python -m specfit.eval.llamacpp_speed ...

The GGUF file comes from llama.cpp's converter (``--convert-with``, :func:`convert_to_gguf`); the
proxy's tokenizer (individual digits, then GPT-2's byte-level rules) is llama.cpp's ``starcoder``
pre-tokenizer, which the converter does not detect from its hash, so the conversion names it and then checks
that llama.cpp tokenizes sample texts as the checkpoint's tokenizer does.

Usage::

    python -m specfit.eval.llamacpp_speed --gguf proxy-f32.gguf --convert-with LLAMA_CPP_DIR   # convert, measure
    python -m specfit.eval.llamacpp_speed --gguf proxy-f32.gguf --repeats 9 --json out.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from itertools import islice
from pathlib import Path

import numpy as np
import torch

from specfit.core.errors import SpecFitInputError
from specfit.eval.machine import command_line, machine, publish, run_main
from specfit.eval.runtime_speed import decode_speed

#: How to make ``import llama_cpp`` work; part of the error when it does not.
INSTALL_HINT = ("install llama-cpp-python (it builds llama.cpp): "
                "CMAKE_ARGS=\"-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF\" pip install llama-cpp-python==0.3.36; "
                "or set PYTHONPATH=<its unpacked sdist> (its dependencies, e.g. diskcache, installed) and "
                "LLAMA_CPP_LIB_PATH=<the directory of a libllama.so built from its vendor/llama.cpp>")

#: Texts whose tokenization by llama.cpp must equal the checkpoint tokenizer's after a conversion: digits,
#: runs of spaces and newlines, punctuation, contractions and multi-byte characters.
TOKENIZER_PROBES = ("Janet has 16 ducks and eats 3 for breakfast; 1234567 + 0.25 = ?",
                    "def f(x):\n    return x  *  2\n\n\n  # done",
                    "I've been told he's there, 'RE you sure? We'Ve a'lL",
                    "naïve café 😀 日本語 ------======= ......!!!!")

LLAMA_CPP = "llama.cpp Llama.generate"
PUBLIC = "public SpecFit.generate(method='ar')"
TRANSFORMERS = "transformers generate"


def import_llama_cpp():
    """The ``llama_cpp`` module (llama-cpp-python's bindings).

    Raises
    ------
    SpecFitInputError
        On field ``llama_cpp`` when it cannot be imported, with :data:`INSTALL_HINT`.
    """
    try:
        import llama_cpp
    except (ImportError, OSError) as err:  # OSError: the bindings found no loadable libllama
        raise SpecFitInputError("llama_cpp", f"cannot be imported ({type(err).__name__}: {err}); {INSTALL_HINT}") from None
    return llama_cpp


def _check_gguf(gguf: str | os.PathLike) -> Path:
    path = Path(gguf)
    if not path.is_file():
        raise SpecFitInputError("--gguf", f"{path} is not a file: convert the checkpoint first "
                                          "(--convert-with LLAMA_CPP_DIR, or llama.cpp's convert_hf_to_gguf.py --outtype f32)")
    return path


_CONVERT = """
import runpy, sys
sys.path.insert(0, {src!r})
from conversion.base import TextModel
if {pre!r} != "auto":
    TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outtype", {outtype!r}, "--outfile", {out!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def convert_to_gguf(model_dir: str | os.PathLike, out: str | os.PathLike, llama_cpp_dir: str | os.PathLike,
                    pre_tokenizer: str = "starcoder", outtype: str = "f32") -> Path:
    """Convert a Hugging Face checkpoint to a GGUF file with llama.cpp's own converter, then check its tokenizer.

    Runs ``<llama_cpp_dir>/convert_hf_to_gguf.py MODEL --outtype OUTTYPE`` in a subprocess (this interpreter;
    the converter needs ``torch``, ``transformers`` and its bundled ``gguf-py``), with the converter's
    pre-tokenizer detection (``TextModel.get_vocab_base_pre``, a hash of one sample's tokens) replaced by
    ``pre_tokenizer`` unless that is ``"auto"``: the checkpoint and the converter stay untouched. It writes to a
    temporary file beside ``out`` and renames it when the conversion and the tokenizer check passed.

    Parameters
    ----------
    pre_tokenizer : str
        llama.cpp's name of the checkpoint's pre-tokenizer (``tokenizer.ggml.pre``); the shipped proxy's is
        ``"starcoder"`` (individual digits, then GPT-2's byte-level split).

    Returns
    -------
    Path
        ``out``.

    Raises
    ------
    SpecFitInputError
        On ``--convert-with`` when ``llama_cpp_dir`` holds no ``convert_hf_to_gguf.py`` or the converter fails
        (its last output lines in the message); on ``--pre-tokenizer`` when llama.cpp tokenizes one of
        :data:`TOKENIZER_PROBES` differently from the checkpoint's tokenizer.
    """
    src = Path(llama_cpp_dir).resolve()
    script = src / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise SpecFitInputError("--convert-with", f"{src} holds no convert_hf_to_gguf.py (llama.cpp's source directory; "
                                                  "llama-cpp-python's sdist has it under vendor/llama.cpp)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".gguf.tmp", dir=out.parent)
    os.close(fd)
    try:
        code = _CONVERT.format(src=str(src), pre=pre_tokenizer, model=str(model_dir), outtype=outtype, out=tmp,
                               script=str(script))
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
            raise SpecFitInputError("--convert-with", f"convert_hf_to_gguf.py failed (exit {proc.returncode}):\n{tail}")
        bad = tokenizer_mismatches(model_dir, tmp)
        if bad:
            raise SpecFitInputError("--pre-tokenizer", f"{pre_tokenizer!r}: llama.cpp tokenizes {bad[0]!r} differently "
                                                       "from the checkpoint's tokenizer")
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def tokenizer_mismatches(model_dir: str | os.PathLike, gguf: str | os.PathLike) -> list[str]:
    """The :data:`TOKENIZER_PROBES` that llama.cpp (the GGUF file's vocabulary) tokenizes differently from the
    checkpoint's Hugging Face tokenizer (no special tokens added by either); empty when all agree.

    Raises
    ------
    SpecFitInputError
        On ``--pre-tokenizer`` when llama.cpp cannot load the file's vocabulary (an unknown pre-tokenizer name).
    """
    from transformers import AutoTokenizer

    llama_cpp = import_llama_cpp()
    try:
        vocab = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    except ValueError as err:  # llama.cpp rejects the file, e.g. an unknown tokenizer.ggml.pre
        raise SpecFitInputError("--pre-tokenizer", f"llama.cpp cannot load the converted vocabulary ({err}); "
                                                   "is the pre-tokenizer a name llama.cpp knows?") from None
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [t for t in TOKENIZER_PROBES
            if vocab.tokenize(t.encode(), add_bos=False, special=False) != tok.encode(t, add_special_tokens=False)]


def llama_cpp_decoder(gguf: str | os.PathLike, prompt: list[int], tokens: int, threads: int = 1):
    """A callable that decodes ``tokens`` token ids greedily after ``prompt`` (token ids) with llama.cpp and returns
    them (a list of ``tokens`` ints).

    ``Llama`` with ``threads`` threads for decode and prefill, a context of ``len(prompt) + tokens + 8``,
    logits of the last position only; each call clears the KV cache (``Llama.reset``) so that it prefills the
    whole prompt as the other decoders do, and samples with llama.cpp's greedy sampler (``temp=0``,
    ``repeat_penalty=1``: argmax of the logits). The prompt is passed as token ids: no BOS, no tokenization.

    Raises
    ------
    SpecFitInputError
        On ``llama_cpp`` when the bindings cannot be imported, on ``--gguf`` when the file is missing.
    """
    path = _check_gguf(gguf)
    llama_cpp = import_llama_cpp()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + tokens + 8, n_batch=max(len(prompt), 8),
                          n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)

    def run() -> list[int]:
        llm.reset()
        return list(islice(llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0), tokens))

    return run


def compare(model_dir: str, gguf: str | os.PathLike, prompt: list[int], tokens: int, repeats: int) -> dict:
    """:func:`specfit.eval.runtime_speed.decode_speed` with llama.cpp as a fourth decoder, interleaved with the others.

    Returns
    -------
    dict
        ``decode_speed``'s result (``ms_per_token``, ``speed_vs_transformers``, ``cpu_ms_per_token``, ...,
        ``same_tokens``) plus ``speed_vs_llama_cpp`` and ``cpu_speed_vs_llama_cpp`` (llama.cpp's ms / the
        decoder's ms: below 1 is slower than llama.cpp).

    Raises
    ------
    SpecFitInputError
        On ``token ids`` when the decoders' greedy token ids differ.
    """
    run_llama = llama_cpp_decoder(gguf, prompt, tokens, threads=torch.get_num_threads())
    d = decode_speed(model_dir, prompt, tokens, repeats, extra_runs={LLAMA_CPP: run_llama})
    if not d["same_tokens"]:
        raise SpecFitInputError("token ids", f"the decoders' greedy token ids differ over {tokens} tokens: "
                                             "the GGUF file does not decode as the checkpoint does")
    for key, src in (("speed_vs_llama_cpp", "ms_per_token"), ("cpu_speed_vs_llama_cpp", "cpu_ms_per_token")):
        ref = d[src][LLAMA_CPP]
        d[key] = {name: ref / v for name, v in d[src].items()}
    return d


def format_table(d: dict) -> str:
    """A markdown table of :func:`compare`'s result."""
    lines = [f"greedy AR decoding, every expert resident, {d['tokens']} tokens, median of {d['repeats']} rounds "
             f"(token ids equal: {d['same_tokens']})", "",
             "| decoder | ms / token | tok/s | × transformers | × llama.cpp | CPU ms / token | × llama.cpp (CPU) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, ms in d["ms_per_token"].items():
        lines.append(f"| {name} | {ms:.3f} | {1e3 / ms:.0f} | {d['speed_vs_transformers'][name]:.2f} | "
                     f"{d['speed_vs_llama_cpp'][name]:.3f} | {d['cpu_ms_per_token'][name]:.3f} | "
                     f"{d['cpu_speed_vs_llama_cpp'][name]:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="the checkpoint converted to GGUF (float32); written first with --convert-with")
    ap.add_argument("--model", default=None, help="Qwen3-MoE checkpoint directory (default: the shipped proxy)")
    ap.add_argument("--convert-with", default=None, metavar="LLAMA_CPP_DIR",
                    help="first convert --model to --gguf with this llama.cpp source directory's convert_hf_to_gguf.py")
    ap.add_argument("--pre-tokenizer", default="starcoder",
                    help="llama.cpp's pre-tokenizer name for the conversion ('auto': the converter's detection)")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per generate call")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=9, help="interleaved rounds")
    ap.add_argument("--json", default=None, help="also write the full result to this file")
    args = ap.parse_args(argv)
    for field, v in (("--tokens", args.tokens), ("--prompt-len", args.prompt_len), ("--repeats", args.repeats)):
        if v < 1:
            raise SpecFitInputError(field, f"must be a positive integer, got {v}")
    if args.convert_with is None:
        _check_gguf(args.gguf)
    import_llama_cpp()
    if args.model is None:
        from specfit.models.proxy import paths

        args.model = str(paths()["target"])
    if args.convert_with is not None:
        convert_to_gguf(args.model, args.gguf, args.convert_with, args.pre_tokenizer)
    torch.set_num_threads(1)  # as runtime_speed; llama.cpp gets the same thread count
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    prompt = np.random.default_rng(0).integers(1, vocab, args.prompt_len).tolist()  # runtime_speed's prompt
    import llama_cpp

    d = compare(args.model, args.gguf, prompt, args.tokens, args.repeats)
    result = {"decode": d, "model": args.model, "gguf": str(args.gguf), "llama_cpp_python": llama_cpp.__version__,
              "machine": machine(device="cpu"), "command": command_line("specfit.eval.llamacpp_speed", argv)}
    publish(result, format_table(d), args.json)
    return 0


if __name__ == "__main__":
    run_main(main)
