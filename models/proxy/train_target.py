"""Train the proxy target: a small ``Qwen3MoeForCausalLM`` with Qwen3-30B-A3B's routing shape.

Routing shape as Qwen3-30B-A3B (Qwen3 technical report, 2025, Table 1 / its config.json):
128 experts per MoE layer, top-8 routing, ``norm_topk_prob = true``, every layer sparse. Width
and depth are scaled down so that training fits the CPU budget. The router load-balancing loss
(Switch Transformer, Fedus et al. 2021, eq. 4, as ``transformers``' ``load_balancing_loss_func``)
is on, weighted by ``router_aux_loss_coef``.

Windows of ``seq_len`` tokens are drawn from each source's token stream with fixed source
weights (GSM8K is up-weighted: the evaluation's τ is measured on GSM8K prompts). A checkpoint
(bf16 safetensors) is written every ``ckpt_every`` steps, so an interrupted run is still usable.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

#: Architecture of the proxy target (everything not listed is the transformers default).
TARGET_CONFIG = dict(
    hidden_size=128,
    intermediate_size=512,  # dense MLP size; unused because every layer is sparse
    moe_intermediate_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    router_aux_loss_coef=0.01,
)

#: Fraction of training windows drawn from each source.
SOURCE_WEIGHTS = {"gsm8k": 0.5, "cnn": 0.1, "corpus": 0.4}


def tokenize_sources(tokenizer, sources: dict[str, list[str]]) -> dict[str, np.ndarray]:
    """Concatenate each source's documents into one token stream, documents ended by EOS.

    Returns
    -------
    dict[str, numpy.ndarray]
        Source name → int32 array of token ids, shape (n_tokens,).
    """
    eos = tokenizer.eos_token_id
    out = {}
    for name, docs in sources.items():
        ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
        out[name] = np.fromiter((t for doc in ids for t in (*doc, eos)), dtype=np.int32)
    return out


def sample_batch(streams: dict[str, np.ndarray], weights: dict[str, float], batch: int, seq_len: int,
                 rng: np.random.Generator) -> np.ndarray:
    """Draw ``batch`` random windows of ``seq_len`` tokens; the source of each is drawn by ``weights``.

    Returns
    -------
    numpy.ndarray
        int64 array of shape (batch, seq_len).
    """
    names = list(weights)
    p = np.array([weights[n] for n in names], dtype=np.float64)
    picks = rng.choice(len(names), size=batch, p=p / p.sum())
    rows = []
    for k in picks:
        s = streams[names[k]]
        start = int(rng.integers(0, len(s) - seq_len))
        rows.append(s[start:start + seq_len])
    return np.stack(rows).astype(np.int64)


def build_target(vocab_size: int, eos_id: int, **overrides):
    """A freshly initialised proxy target (``Qwen3MoeForCausalLM``) with :data:`TARGET_CONFIG`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=vocab_size, eos_token_id=eos_id, bos_token_id=eos_id,
                         pad_token_id=eos_id, **{**TARGET_CONFIG, **overrides})
    model = Qwen3MoeForCausalLM(cfg)
    use_grouped_mm(model)
    return model


def use_grouped_mm(model) -> None:
    """Switch the experts to transformers' grouped-GEMM kernel when available (same math, faster)."""
    try:
        model.set_experts_implementation("grouped_mm")
    except (AttributeError, ValueError, ImportError):
        pass


def save_checkpoint(model, tokenizer, out_dir: Path) -> None:
    """Write the model (bf16 safetensors) and tokenizer to ``out_dir`` atomically (temp dir + rename).

    The config gets ``num_experts`` alongside transformers' ``num_local_experts`` so that loaders
    written for the Qwen3-30B-A3B config find the key they expect.
    """
    import copy

    import torch

    from specfit.models.eagle3 import write_dir_atomically

    def write(tmp: Path):
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(str(tmp))  # training weights stay float32
        tokenizer.save_pretrained(str(tmp))
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.setdefault("num_experts", cfg.get("num_local_experts"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    write_dir_atomically(Path(out_dir), write)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup then cosine decay to 10 % of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def train_target(tokenizer, sources: dict[str, list[str]], out_dir: Path, *, steps: int = 1200,
                 batch: int = 16, seq_len: int = 256, lr: float = 3e-3, warmup: int = 50,
                 ckpt_every: int = 100, max_minutes: float | None = None, seed: int = 0,
                 device: str = "cpu", log_path: Path | None = None):
    """Train the proxy target and save it to ``out_dir``.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerFast
        The proxy tokenizer (saved into ``out_dir`` with the weights).
    sources : dict[str, list[str]]
        Training documents per source (keys of :data:`SOURCE_WEIGHTS`).
    out_dir : pathlib.Path
        Model directory; rewritten atomically at every checkpoint.
    steps, batch, seq_len : int
        Optimiser steps, windows per step, tokens per window.
    lr, warmup : float, int
        AdamW peak learning rate and warmup steps (cosine decay after, :func:`lr_at`).
    ckpt_every : int
        Steps between checkpoints.
    max_minutes : float, optional
        Wall-clock cap: stop early (with a checkpoint) once exceeded.
    device : str
        Torch device, e.g. ``"cpu"`` or ``"cuda"``.
    log_path : pathlib.Path, optional
        JSON-lines log, one record per step (step, loss, aux_loss, lr, seconds).

    Returns
    -------
    dict
        ``{"steps": steps run, "tokens": tokens seen, "minutes": wall time}``.
    """
    import torch

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    streams = tokenize_sources(tokenizer, sources)
    model = build_target(len(tokenizer), tokenizer.eos_token_id).to(device)
    model.config.output_router_logits = True
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    if log_path:  # reopened per record: checkpoints replace the directory the log lives in
        Path(log_path).write_text("")
    t0 = time.time()
    step = 0
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        x = torch.from_numpy(sample_batch(streams, SOURCE_WEIGHTS, batch, seq_len, rng)).to(device)
        out = model(input_ids=x, labels=x, output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lm_loss = out.loss.item() - model.config.router_aux_loss_coef * out.aux_loss.item()
        rec = {"step": step + 1, "loss": lm_loss, "aux_loss": out.aux_loss.item(),
               "lr": opt.param_groups[0]["lr"], "seconds": time.time() - t0}
        if log_path:
            with open(log_path, "a") as log:
                log.write(json.dumps(rec) + "\n")
        timed_out = max_minutes is not None and time.time() - t0 > 60 * max_minutes
        if (step + 1) % ckpt_every == 0 or step + 1 == steps or timed_out:
            model.config.output_router_logits = False
            save_checkpoint(model, tokenizer, out_dir)
            model.config.output_router_logits = True
        if timed_out:
            break
    return {"steps": step + 1, "tokens": (step + 1) * batch * seq_len, "minutes": (time.time() - t0) / 60}
