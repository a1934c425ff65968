"""The llama.cpp comparison's input errors: none of these needs llama.cpp, a GGUF file or a model."""

import sys

import pytest

from specfit.core.errors import SpecFitInputError
from specfit.eval.llamacpp_speed import convert_to_gguf, import_llama_cpp, llama_cpp_decoder, main


def test_missing_bindings_name_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    with pytest.raises(SpecFitInputError, match=r"^llama_cpp: cannot be imported.*pip install llama-cpp-python==0\.3\.36"
                                                r".*LLAMA_CPP_LIB_PATH"):
        import_llama_cpp()


def test_main_names_the_bindings_after_a_present_gguf(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(SpecFitInputError, match="^llama_cpp: "):
        main(["--gguf", str(gguf)])


def test_missing_gguf_is_named(tmp_path):
    missing = str(tmp_path / "none.gguf")
    with pytest.raises(SpecFitInputError, match=r"^--gguf: .*none\.gguf is not a file"):
        main(["--gguf", missing])
    with pytest.raises(SpecFitInputError, match="^--gguf: "):
        llama_cpp_decoder(missing, [1, 2], 4)


@pytest.mark.parametrize("flag", ["--tokens", "--prompt-len", "--repeats"])
def test_counts_must_be_positive(flag, tmp_path):
    with pytest.raises(SpecFitInputError, match=f"^{flag}: must be a positive integer, got 0"):
        main(["--gguf", str(tmp_path / "m.gguf"), flag, "0"])


def test_convert_needs_the_converter(tmp_path):
    with pytest.raises(SpecFitInputError, match="^--convert-with: .*holds no convert_hf_to_gguf.py"):
        convert_to_gguf(tmp_path, tmp_path / "out.gguf", tmp_path)
    assert not (tmp_path / "out.gguf").exists()


def _fake_decode_speed(same):
    def decode_speed(model_dir, prompt, tokens, repeats, extra_runs=None):
        assert list(extra_runs) == ["llama.cpp Llama.generate"]
        ms = {"public SpecFit.generate(method='ar')": 4.0, "transformers generate": 12.0, "llama.cpp Llama.generate": 1.0}
        return {"ms_per_token": ms, "cpu_ms_per_token": dict(ms), "same_tokens": same, "tokens": tokens,
                "repeats": repeats, "speed_vs_transformers": {k: 12.0 / v for k, v in ms.items()}}
    return decode_speed


def test_compare_reports_the_ratio_to_llama_cpp_and_fails_on_other_ids(monkeypatch):
    import specfit.eval.llamacpp_speed as mod

    monkeypatch.setattr(mod, "llama_cpp_decoder", lambda gguf, prompt, tokens, threads=1: lambda: [0] * tokens)
    monkeypatch.setattr(mod, "decode_speed", _fake_decode_speed(True))
    d = mod.compare("m", "g.gguf", [1, 2], 4, 3)
    assert d["speed_vs_llama_cpp"]["public SpecFit.generate(method='ar')"] == 0.25
    assert d["cpu_speed_vs_llama_cpp"]["transformers generate"] == 1 / 12
    assert "| llama.cpp Llama.generate | 1.000 | 1000 | 12.00 | 1.000 |" in mod.format_table(d)
    monkeypatch.setattr(mod, "decode_speed", _fake_decode_speed(False))
    with pytest.raises(SpecFitInputError, match="^token ids: the decoders' greedy token ids differ over 4 tokens"):
        mod.compare("m", "g.gguf", [1, 2], 4, 3)
