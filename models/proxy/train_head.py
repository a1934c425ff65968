"""Train the proxy EAGLE-3 head on the proxy target's hidden states.

Objective (EAGLE-3, Li et al. 2025, §3.2 "training-time test"): the head is unrolled for
``ttt_steps`` draft steps. Step 0 reads the target's fused features; step j > 0 reads the head's
own output hidden state of step j-1 at the same slot, exactly as when it drafts depth j+1 of a
tree. Slot s of step j attends to the step-0 slots <= s and to its own slot of steps 1..j (the
ancestors it would see in a chain). Each step is trained with cross-entropy against the target's
next-token distribution restricted to the draft vocabulary (soft labels), weighted 0.8^j.

The draft vocabulary is the ``draft_vocab_size`` most frequent tokens of the training stream
(EAGLE-3's frequency-based reduced vocabulary); ``d2t``/``t2d`` encode it. The token embedding is
the target's (frozen); ``lm_head`` and ``norm`` start from the target's rows.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

#: Head shape relative to the target (hidden size = the target's).
HEAD_SHAPE = dict(intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
#: Size of the draft vocabulary.
DRAFT_VOCAB = 3072


def load_target(target_dir, device="cpu"):
    """Load the proxy target and its tokenizer (float32, eval mode, grouped-GEMM experts)."""
    import torch
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    from specfit.models.proxy.train_target import use_grouped_mm

    model = Qwen3MoeForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).to(device).eval()
    use_grouped_mm(model)
    return model, AutoTokenizer.from_pretrained(str(target_dir))


def draft_vocabulary(streams: dict[str, np.ndarray], weights: dict[str, float], vocab_size: int,
                     draft_vocab_size: int):
    """The most frequent tokens (under the training mixture ``weights``) as the draft vocabulary.

    Returns
    -------
    tuple
        ``(d2t, t2d, coverage)``: d2t (draft_vocab_size,) int64 offsets (target id = draft id + d2t),
        t2d (vocab_size,) bool, and the fraction of training tokens the draft vocabulary covers.
    """
    import torch

    counts = np.zeros(vocab_size, dtype=np.float64)
    for name, s in streams.items():
        counts += weights[name] * np.bincount(s, minlength=vocab_size) / len(s)
    keep = np.sort(np.argsort(-counts, kind="stable")[:draft_vocab_size])
    d2t = torch.from_numpy(keep - np.arange(draft_vocab_size)).long()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.from_numpy(keep)] = True
    return d2t, t2d, float(counts[keep].sum() / counts.sum())


def ttt_logits(head, input_ids, aux, ttt_steps: int = 3):
    """Draft logits of an EAGLE-3 head unrolled for ``ttt_steps`` steps (training-time test).

    Slot s of step j feeds token ``input_ids[:, s + 1 + j]`` at position s+1+j; step 0 pairs it with
    the fused target feature of position s, step j > 0 with the head's step j-1 output at slot s.
    It attends to the step-0 slots <= s and to its own slot of steps 1..j, which is what a tree
    node at depth j+1 sees when drafting after committing tokens 0..s (see
    :meth:`models.eagle3.Eagle3Drafter.draft_levels`).

    Parameters
    ----------
    head : models.eagle3.Eagle3Head
    input_ids : torch.Tensor
        (B, T) token ids.
    aux : torch.Tensor
        (B, T, 3H) target features (:func:`models.eagle3.select_aux_hidden`).
    ttt_steps : int
        Unrolled draft steps.

    Returns
    -------
    list of torch.Tensor
        One (B, T-1, draft_vocab_size) tensor per step; step j slot s predicts token s+2+j, so
        only slots s < T-1-j have a label inside the window.
    """
    import torch

    b, t = input_ids.shape
    n = t - 1
    dev = input_ids.device
    hidden = head.fuse(aux[:, :n])
    keys, vals = head.empty_kv(b)
    causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    eye = torch.eye(n, dtype=torch.bool, device=dev)
    ids = torch.cat([input_ids, input_ids.new_zeros(b, ttt_steps)], dim=1)  # padding beyond the window
    out = []
    for j in range(ttt_steps):
        mask = torch.cat([causal] + [eye] * j, dim=1)  # step-0 slots <= s, then own slot of steps 1..j
        pos = torch.arange(1 + j, 1 + j + n, device=dev)
        hidden, logits, k, v = head.step(ids[:, 1 + j: 1 + j + n], hidden, pos, keys, vals, mask)
        keys, vals = torch.cat([keys, k], 1), torch.cat([vals, v], 1)
        out.append(logits)
    return out


def ttt_loss(head, input_ids, aux, target_logits, ttt_steps: int = 3, decay: float = 0.8):
    """Training-time-test loss: soft cross-entropy of each unrolled step against the target.

    Parameters
    ----------
    head, input_ids, aux, ttt_steps
        As :func:`ttt_logits`.
    target_logits : torch.Tensor
        (B, T, V) target logits; position t predicts token t+1.
    decay : float
        Loss weight ratio between consecutive steps.

    Returns
    -------
    tuple
        (loss (scalar tensor), list of top-1 agreement with the target's argmax per step).
    """
    import torch
    import torch.nn.functional as F

    n = input_ids.shape[1] - 1
    draft_ids = torch.arange(head.cfg.draft_vocab_size, device=input_ids.device) + head.d2t
    total, weights, accs = 0.0, 0.0, []
    for j, logits in enumerate(ttt_logits(head, input_ids, aux, ttt_steps)):
        valid = n - j
        tgt = target_logits[:, 1 + j: 1 + j + valid]
        p = torch.softmax(tgt[..., draft_ids].float(), dim=-1)
        logq = F.log_softmax(logits[:, :valid].float(), dim=-1)
        total = total + decay**j * -(p * logq).sum(-1).mean()
        weights += decay**j
        accs.append(float((draft_ids[logits[:, :valid].argmax(-1)] == tgt.argmax(-1)).float().mean()))
    return total / weights, accs


def train_head(target_dir: Path, out_dir: Path, *, data_dir=None, steps: int = 800, batch: int = 16,
               seq_len: int = 256, lr: float = 2e-3, warmup: int = 30, ttt_steps: int = 3,
               ckpt_every: int = 100, max_minutes: float | None = None, seed: int = 0, device: str = "cpu",
               draft_vocab_size: int = DRAFT_VOCAB, source_weights: dict[str, float] | None = None):
    """Train the EAGLE-3 head for the target in ``target_dir`` and save it to ``out_dir``.

    Parameters
    ----------
    target_dir, out_dir : pathlib.Path
        Trained target (Hugging Face directory) and the head's output directory.
    data_dir : pathlib.Path, optional
        Data copy (default :data:`models.proxy.data.DATA_DIR`).
    steps, batch, seq_len : int
        Optimiser steps, windows per step, tokens per window.
    lr, warmup : float, int
        AdamW peak learning rate and warmup steps (then cosine decay to 10 %).
    ttt_steps : int
        Unrolled draft steps of the training-time test.
    ckpt_every : int
        Steps between checkpoints (written atomically).
    max_minutes : float, optional
        Wall-clock cap.
    device : str
        Torch device.
    draft_vocab_size : int
        Size of the draft vocabulary (default :data:`DRAFT_VOCAB`).
    source_weights : dict[str, float], optional
        Sampling mixture over the training sources (default: the target's
        :data:`models.proxy.train_target.SOURCE_WEIGHTS`); also ranks the draft vocabulary.

    Returns
    -------
    dict
        Steps, tokens, minutes and draft-vocabulary coverage; also written to ``train_info.json``.
    """
    import torch

    from specfit.models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layer_ids, save_eagle3, select_aux_hidden
    from specfit.models.proxy import data
    from specfit.models.proxy.train_target import SOURCE_WEIGHTS, lr_at, sample_batch, tokenize_sources

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed + 1)
    target, tok = load_target(target_dir, device)
    for p in target.parameters():
        p.requires_grad_(False)
    tc = target.config
    streams = tokenize_sources(tok, data.training_sources(data_dir or data.DATA_DIR))
    weights = dict(source_weights or SOURCE_WEIGHTS)
    d2t, t2d, coverage = draft_vocabulary(streams, weights, tc.vocab_size, draft_vocab_size)
    cfg = Eagle3Config(hidden_size=tc.hidden_size, vocab_size=tc.vocab_size, draft_vocab_size=draft_vocab_size,
                       target_hidden_size=tc.hidden_size, aux_layer_ids=default_aux_layer_ids(tc.num_hidden_layers),
                       rms_norm_eps=tc.rms_norm_eps, rope_theta=10000.0, **HEAD_SHAPE)
    head = Eagle3Head(cfg).to(device)
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head.lm_head.weight.copy_(target.lm_head.weight[torch.arange(draft_vocab_size) + d2t])
        head.norm.weight.copy_(target.model.norm.weight)
    head.embed_tokens.weight.requires_grad_(False)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "train_log.jsonl"  # reopened per record: checkpoints replace out_dir
    log_path.write_text("")
    t0 = time.time()
    step = 0
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        x = torch.from_numpy(sample_batch(streams, weights, batch, seq_len, rng)).to(device)
        with torch.no_grad():
            out = target(input_ids=x, output_hidden_states=True)
        aux = select_aux_hidden(out.hidden_states, cfg.aux_layer_ids)
        loss, accs = ttt_loss(head, x, aux, out.logits, ttt_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with open(log_path, "a") as log:
            log.write(json.dumps({"step": step + 1, "loss": loss.item(), "acc": accs, "seconds": time.time() - t0}) + "\n")
        timed_out = max_minutes is not None and time.time() - t0 > 60 * max_minutes
        if (step + 1) % ckpt_every == 0 or step + 1 == steps or timed_out:
            save_eagle3(head, out_dir)
        if timed_out:
            break
    info = {"steps": step + 1, "tokens": (step + 1) * batch * seq_len, "minutes": (time.time() - t0) / 60,
            "ttt_steps": ttt_steps, "draft_vocab_size": draft_vocab_size, "draft_vocab_coverage": coverage,
            "source_weights": weights, "lr": lr, "warmup": warmup}
    (out_dir / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
