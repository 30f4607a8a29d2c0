"""A character-level tokenizer made with `tokenizers` and saved in Hugging Face format.

Every character of ``charset`` is one token; ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>`` come first (ids
0-3). Encoding a text prepends ``<bos>``; decoding joins characters without spaces, so
``AutoTokenizer.from_pretrained(dir)`` round-trips ``"07+45="`` exactly.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
DEFAULT_CHARSET = "0123456789+-*="


def build_char_tokenizer(charset: str = DEFAULT_CHARSET):
    """A ``PreTrainedTokenizerFast`` over ``charset`` plus the four special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if len(set(charset)) != len(charset):
        raise ValueError(f"charset {charset!r} repeats a character")
    specials = list(SPECIAL_TOKENS.values())
    vocab = {tok: i for i, tok in enumerate(specials + list(charset))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    bos = SPECIAL_TOKENS["bos_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
    )
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1 << 16, **SPECIAL_TOKENS)


def save_char_tokenizer(directory: str | Path, charset: str = DEFAULT_CHARSET) -> int:
    """Write tokenizer.json, tokenizer_config.json and the special tokens map; returns the vocab size."""
    tokenizer = build_char_tokenizer(charset)
    Path(directory).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return len(tokenizer)
