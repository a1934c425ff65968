"""Test configuration and shared fixtures.

* Under CI (CI=true), hypothesis draws the same examples on every run so that a submission's result
  does not depend on luck; locally it keeps exploring new ones.
* ``tiny_checkpoint`` builds a tiny random Qwen3-MoE checkpoint with transformers (``save_pretrained``
  into a folder, nothing downloaded): the one builder every model test uses.
* ``one_torch_thread`` runs a test module with one torch CPU thread and restores the previous count.
* ``--device`` (default ``cpu``; ``cuda``, ``cuda:1`` where a GPU exists) places the tests that take the
  ``device`` fixture there: the runtime's equality with transformers, tree verify against sequential
  decode, every method's greedy output against AR on the proxy, and the pipeline
  (``pytest --device cuda``).
"""

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="compute device of the tests that take the `device` fixture: cpu (default), cuda, cuda:1")


def pytest_configure(config):
    """Refuse a ``--device`` this machine lacks before any test runs (it would otherwise fail every one)."""
    name = config.getoption("--device")
    if name != "cpu":
        from specfit.core.errors import SpecFitInputError
        from specfit.models.devices import resolve_device

        try:
            resolve_device(name)
        except SpecFitInputError as err:
            raise pytest.UsageError(f"--device {name}: {err.rule}") from None


@pytest.fixture(scope="session")
def device(request) -> str:
    """The ``--device`` option: where the device-aware tests place the model (``"cpu"`` unless told)."""
    return request.config.getoption("--device")


def build_tiny_checkpoint(path, *, vocab_size: int = 64, layers: int = 4, experts: int = 8, top_k: int = 2,
                          hidden_size: int = 32, intermediate_size: int = 40, max_position_embeddings: int = 128,
                          seed: int = 0, sharpen: float | None = None, **config):
    """Save a tiny random Qwen3-MoE (``layers`` layers, ``experts`` experts, top-``top_k``) to ``path``.

    ``sharpen`` multiplies the lm_head so greedy text is not one constant token; ``config`` overrides
    any other ``Qwen3MoeConfig`` field. Returns the config.
    """
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**{**dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   moe_intermediate_size=16, num_experts=experts, num_experts_per_tok=top_k,
                                   norm_topk_prob=True, max_position_embeddings=max_position_embeddings), **config})
    model = Qwen3MoeForCausalLM(cfg).eval()
    if sharpen is not None:
        with torch.no_grad():
            model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(path)
    return cfg


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """The tiny-checkpoint builder (:func:`build_tiny_checkpoint`) as a fixture."""
    return build_tiny_checkpoint


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch CPU thread while the module runs (tiny matrices gain nothing from more); restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
