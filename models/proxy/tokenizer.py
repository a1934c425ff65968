"""Train the proxy models' tokenizer: a small byte-level BPE with single-digit numbers.

Why this tokenizer (also in the target's model card): the proxy target has ~20 M parameters, so a
151k-entry Qwen3 vocabulary would spend most of them on embeddings and the lm_head; a 4096-entry
byte-level BPE trained on the same text keeps every byte representable (no unknown tokens), and
splitting numbers into single digits (as Qwen's pre-tokenizer does) keeps GSM8K arithmetic learnable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from specfit.models.proxy.data import EOS

#: Vocabulary size of the proxy tokenizer (including the special token).
VOCAB_SIZE = 4096


def train_tokenizer(texts: Iterable[str], out_dir: Path, vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE and save it as Hugging Face tokenizer files.

    Parameters
    ----------
    texts : iterable of str
        Training documents (training split only, never held-out text).
    out_dir : pathlib.Path
        Directory that receives ``tokenizer.json`` and ``tokenizer_config.json``.
    vocab_size : int
        Total vocabulary size, special token included.

    Returns
    -------
    transformers.PreTrainedTokenizerFast
        The trained tokenizer; ``eos_token = pad_token = "<|endoftext|>"`` (id 0).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.model_max_length = 2048
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast
