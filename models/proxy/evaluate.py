"""Measurements reported in the proxy model cards: held-out perplexity, expert load entropy, τ.

τ (SPECFIT.md §1) = accepted draft tokens + 1 bonus token per cycle, averaged over cycles (AR = 1).
It is measured with greedy decoding and exact greedy verification: the draft tree is grown level
by level with :class:`models.eagle3.Eagle3Drafter`, the ``total_tokens`` nodes with the highest
path probability are kept besides the root (EAGLE-2's reranking, Li et al. 2024, §4; EAGLE's
``total_token`` convention, as :mod:`specfit.engine`), and the target
walks down the kept tree from the root, accepting a child while its token equals the target's
greedy token. The target runs one cached token at a time, so the output is plain greedy decoding
token for token and the accepted path is exactly the one a one-forward tree verification accepts
(siblings carry distinct tokens). This stands in for the runtime's tree-verify path until that
lands; it measures acceptance, not speed.
"""

from __future__ import annotations

import inspect
import math

import numpy as np


def windows(tokenizer, docs: list[str], seq_len: int, max_tokens: int) -> np.ndarray:
    """Non-overlapping ``seq_len`` windows of the EOS-joined documents (at most ``max_tokens`` tokens).

    Returns
    -------
    numpy.ndarray
        int64 (n_windows, seq_len).
    """
    eos = tokenizer.eos_token_id
    ids = [t for doc in tokenizer(docs, add_special_tokens=False)["input_ids"] for t in (*doc, eos)][:max_tokens]
    n = len(ids) // seq_len
    return np.asarray(ids[: n * seq_len], dtype=np.int64).reshape(n, seq_len)


def held_out_stats(model, tokenizer, sources: dict[str, list[str]], seq_len: int = 256,
                   max_tokens: int = 40000, batch: int = 8) -> dict:
    """Held-out perplexity per source and per-layer expert load entropy of a Qwen3-MoE target.

    Parameters
    ----------
    model : transformers.Qwen3MoeForCausalLM
    tokenizer : transformers.PreTrainedTokenizerFast
    sources : dict[str, list[str]]
        Held-out documents per source (:func:`models.proxy.data.held_out_sources`).
    seq_len, max_tokens, batch : int
        Window length, tokens per source, windows per forward.

    Returns
    -------
    dict
        ``perplexity`` {source: exp(mean token NLL)}, ``tokens`` {source: count},
        ``load_entropy_bits`` [per layer], ``max_entropy_bits`` (log2 experts), and
        ``max_load_share`` [per layer] (largest fraction of top-k slots one expert receives).
        Entropy: H = -Σ_e p_e log2 p_e with p_e the share of top-k routing slots of expert e.
    """
    import torch
    import torch.nn.functional as F

    cfg = model.config
    n_exp, top_k = cfg.num_experts, cfg.num_experts_per_tok
    loads = np.zeros((cfg.num_hidden_layers, n_exp), dtype=np.int64)
    ppl, counts = {}, {}
    dev = next(model.parameters()).device
    with torch.no_grad():
        for name, docs in sources.items():
            w = windows(tokenizer, docs, seq_len, max_tokens)
            nll, n = 0.0, 0
            for i in range(0, len(w), batch):
                x = torch.from_numpy(w[i: i + batch]).to(dev)
                out = model(input_ids=x, output_router_logits=True)
                nll += F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten(), reduction="sum").item()
                n += x[:, 1:].numel()
                for layer, logits in enumerate(out.router_logits):
                    idx = logits.topk(top_k, dim=-1).indices.flatten().cpu().numpy()
                    loads[layer] += np.bincount(idx, minlength=n_exp)
            ppl[name], counts[name] = math.exp(nll / n), n
    p = loads / loads.sum(1, keepdims=True)
    ent = -(np.where(p > 0, p * np.log2(np.where(p > 0, p, 1)), 0)).sum(1)
    return {"perplexity": ppl, "tokens": counts, "load_entropy_bits": ent.tolist(),
            "max_entropy_bits": math.log2(n_exp), "max_load_share": p.max(1).tolist()}


def select_tree(levels, total_tokens: int) -> dict[int, dict[int, int]]:
    """Keep the root and the ``total_tokens`` draft nodes with the highest path probability.

    Parameters
    ----------
    levels : iterable of models.eagle3.DraftLevel
    total_tokens : int
        Draft nodes kept besides the root (>= 0).

    Returns
    -------
    dict[int, dict[int, int]]
        ``children[node][token] = child`` over the kept nodes (root = 0). Ties in P are broken
        by node id, so a parent (smaller id, P >= child's) is always kept before its children.
    """
    nodes = []
    for lv in levels:
        nodes += zip(lv.path_prob.tolist(), lv.node_ids.tolist(), lv.parents.tolist(), lv.tokens.tolist())
    nodes.sort(key=lambda r: (-r[0], r[1]))
    children: dict[int, dict[int, int]] = {0: {}}
    for _, nid, parent, token in nodes:
        if len(children) > total_tokens:
            break
        if parent in children:
            children[parent][token] = nid
            children[nid] = {}
    return children


def greedy_tau(target, head, prompt_ids, *, total_tokens: int = 32, depth: int = 6, top_k: int = 4,
               max_new_tokens: int = 128) -> tuple[list[int], list[int]]:
    """Greedy decoding of one prompt with EAGLE-3 drafting; returns (new token ids, τ per cycle).

    Parameters
    ----------
    target : transformers.Qwen3MoeForCausalLM
    head : models.eagle3.Eagle3Head
        Loaded with the target's config (``head.aux_layer_ids`` set).
    prompt_ids : sequence of int
    total_tokens, depth, top_k : int
        Draft tree settings (defaults: the evaluation's 32 / 6 / 4).
    max_new_tokens : int
        Generation length (stops earlier at EOS).

    Returns
    -------
    tuple of list
        The generated ids (equal to plain greedy decoding) and the committed tokens of every
        cycle (accepted draft tokens + 1).
    """
    import torch

    from specfit.models.eagle3 import Eagle3Drafter, select_aux_hidden

    dev = next(target.parameters()).device
    eos = target.config.eos_token_id
    # transformers >= 5.2x names the KV argument `cache`; older releases `past_key_values`
    cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    ids = torch.as_tensor(list(prompt_ids), device=dev)[None]
    drafter = Eagle3Drafter(head)
    with torch.no_grad():
        out = target(input_ids=ids, use_cache=True, output_hidden_states=True)
        cache = out.past_key_values
        drafter.prefill(ids[0], select_aux_hidden(out.hidden_states, head.aux_layer_ids)[0])
        root = int(out.logits[0, -1].argmax())
        generated, taus = [root], []
        while len(generated) < max_new_tokens and root != eos:
            children = select_tree(drafter.draft_levels(root, top_k, depth), total_tokens)
            node, token, accepted, feats = 0, root, [], []
            while True:
                out = target(input_ids=torch.tensor([[token]], device=dev), use_cache=True, output_hidden_states=True,
                             **{cache_arg: cache})
                cache = out.past_key_values
                accepted.append(token)
                feats.append(select_aux_hidden(out.hidden_states, head.aux_layer_ids)[0, -1])
                nxt = int(out.logits[0, -1].argmax())
                if nxt not in children[node] or len(generated) >= max_new_tokens or nxt == eos:
                    break
                node, token = children[node][nxt], nxt
                generated.append(nxt)
            drafter.commit(torch.tensor(accepted, device=dev), torch.stack(feats))
            taus.append(len(accepted))
            root = nxt
            generated.append(nxt)
    return generated[:max_new_tokens], taus


def measure_tau(target, head, tokenizer, questions: list[str], **tree) -> dict:
    """Mean τ over GSM8K-style questions (prompt format :func:`models.proxy.data.gsm8k_prompt`).

    Returns
    -------
    dict
        ``tau`` (mean over all cycles), ``tau_per_prompt_median``, ``cycles``, ``new_tokens``,
        ``prompts`` and the tree settings used.
    """
    from specfit.models.proxy.data import gsm8k_prompt

    all_taus, per_prompt, new = [], [], 0
    for q in questions:
        gen, taus = greedy_tau(target, head, tokenizer(gsm8k_prompt(q))["input_ids"], **tree)
        all_taus += taus
        per_prompt.append(float(np.mean(taus)) if taus else 1.0)
        new += len(gen)
    return {"tau": float(np.mean(all_taus)), "tau_per_prompt_median": float(np.median(per_prompt)),
            "cycles": len(all_taus), "new_tokens": new, "prompts": len(questions), **tree}
