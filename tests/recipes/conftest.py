"""Shared by the recipe tests: a tiny Hugging Face tokenizer written to disk (no download)."""

from pathlib import Path

import pytest

TINY_WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "user", "assistant", ":", "hello", "hi"]


def write_tiny_tokenizer(path: Path) -> Path:
    """A word-level Hugging Face tokenizer with a chat template, saved to ``path`` (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[EOS]", *TINY_WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} [EOS] {% endfor %}"
    fast.save_pretrained(path)
    return path


@pytest.fixture
def tiny_tokenizer():
    """``tiny_tokenizer(dir)`` writes the tokenizer to ``dir`` and returns it."""
    return write_tiny_tokenizer
