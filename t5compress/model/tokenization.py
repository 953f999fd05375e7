"""Tokenizers for new models: a SentencePiece unigram model trained on the training text (as T5 does), or bytes.

Both produce a fast tokenizer, so every model and export directory carries a `tokenizer.json` that the
torch-free runtime can load with the `tokenizers` package alone.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterable

from t5compress.config import choose
from t5compress.errors import DataError

log = logging.getLogger(__name__)


def train_unigram(texts: Iterable[str], vocab_size: int = 8000, extra_ids: int = 100):
    """Train a SentencePiece unigram model with T5's special ids (pad 0, eos 1, unk 2) and wrap it as T5TokenizerFast.

    `vocab_size` is a ceiling: on little text SentencePiece picks fewer pieces (hard_vocab_limit=False).
    """
    import tempfile

    import sentencepiece as spm
    from transformers import T5Tokenizer, T5TokenizerFast
    from transformers.utils import logging as hf_logging

    lines = [t for t in texts if t.strip()]
    if not lines:
        raise DataError("cannot train a tokenizer: the training text is empty")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        character_coverage=1.0,
        hard_vocab_limit=False,
        byte_fallback=False,
        split_digits=True,  # digits as single pieces: numbers are spelled consistently, not memorised
        minloglevel=2,
    )
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/spiece.model"
        with open(path, "wb") as f:
            f.write(model.getvalue())
        slow = T5Tokenizer(vocab_file=path, extra_ids=extra_ids, legacy=False)
        # add_prefix_space: the first word gets its "▁" like every other word, as in T5's own tokenizer. The
        # converted tokenizer.json carries that; dropping the kwarg keeps reloads from re-converting from spiece.model.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its "you set add_prefix_space, converting from slow" notice is expected
        try:
            fast = T5TokenizerFast(
                vocab_file=path, extra_ids=extra_ids, legacy=False, from_slow=True, add_prefix_space=True
            )
        finally:
            hf_logging.set_verbosity(verbosity)
        fast.init_kwargs.pop("add_prefix_space", None)
    log.info("trained a unigram tokenizer with %d pieces (+%d sentinels)", slow.sp_model.get_piece_size(), extra_ids)
    return fast


def byte_level(texts: Iterable[str] = (), extra_ids: int = 125):
    """A ByT5-compatible byte tokenizer (id = byte + 3, then sentinels) as a fast tokenizer with a tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<unk>"]
    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    # ByteLevel maps byte b to a printable char; order the vocabulary by byte value, as ByT5 does.
    by_byte = sorted(byte_chars, key=_byte_of)
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({ch: 3 + i for i, ch in enumerate(by_byte)})
    sentinels = [f"<extra_id_{i}>" for i in range(extra_ids)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    tok.add_special_tokens(specials + sentinels)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=sentinels,
        model_max_length=1024,
    )


def _byte_of(ch: str) -> int:
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    table = {v: k for k, v in bytes_to_unicode().items()}
    return table[ch]


TOKENIZERS: dict[str, Callable] = {"unigram": train_unigram, "byte": byte_level}


def new_tokenizer(kind: str, texts: Iterable[str], vocab_size: int = 8000):
    """Build a tokenizer of the registered `kind` ("unigram" or "byte")."""
    factory = choose(TOKENIZERS, kind, "tokenizer")
    return factory(texts, vocab_size=vocab_size) if kind == "unigram" else factory(texts)
