"""Real text for the recipe: read documents, tokenise them, pack them into fixed-length sequences.

Sources (``--data.path``): a text file (one document), a folder (its ``*.txt``, ``*.md`` and ``*.jsonl`` files,
recursively, in sorted order) or a JSONL file whose lines hold a ``text`` string or chat ``messages`` (a list of
``{"role", "content"}``, rendered with the tokenizer's chat template).

Tokenizers (``--data.tokenizer``): ``bytes`` (UTF-8 bytes as ids 0-255, NUL between documents: fits the default
model's 256-token vocabulary) or a local Hugging Face tokenizer directory (a model directory holds one); never a
download. Documents are joined with the end-of-sequence token and cut into ``seq_len`` tokens (the remainder is
dropped).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from fly_lightning.recipes.errors import RecipeError, RecipePathError

Document = str | list[dict[str, Any]]  # plain text, or chat messages
TEXT_SUFFIXES = (".txt", ".md")


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:  # in a folder of files, which one
        raise RecipeError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def _jsonl(path: Path) -> Iterator[Document]:
    for n, line in enumerate(_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecipeError(f"{path}:{n}: not JSON ({exc.msg})") from None
        if isinstance(row, dict) and isinstance(row.get("text"), str):
            yield row["text"]
        elif isinstance(row, dict) and isinstance(row.get("messages"), list):
            yield row["messages"]
        else:
            raise RecipeError(f"{path}:{n}: expected an object with a 'text' string or a 'messages' list")


def read_documents(path: str | Path) -> list[Document]:
    """The documents under ``path`` (see the module docstring), in a fixed order."""
    p = Path(path).expanduser()
    if not p.exists():
        raise RecipePathError(f"data.path: {path} does not exist")
    files = (
        sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (*TEXT_SUFFIXES, ".jsonl")) if p.is_dir() else [p]
    )
    docs: list[Document] = []
    for f in files:
        docs.extend(_jsonl(f) if f.suffix == ".jsonl" else [_text(f)])
    if not docs:
        raise RecipeError(f"data.path: no documents in {path} (text files: {', '.join(TEXT_SUFFIXES)}, or .jsonl)")
    return docs


class Tokenizer:
    """``encode(document) -> ids``, the end-of-sequence id placed between documents, and the vocabulary size."""

    def __init__(self, encode: Callable[[Document], list[int]], eos_id: int, vocab_size: int, hf: Any = None) -> None:
        self.encode, self.eos_id, self.vocab_size, self.hf = encode, eos_id, vocab_size, hf


def _bytes_encode(doc: Document) -> list[int]:
    if not isinstance(doc, str):
        raise RecipeError("data.tokenizer=bytes has no chat template: chat 'messages' need a Hugging Face tokenizer")
    return list(doc.encode("utf-8"))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(directory: str | Path) -> bool:
    """Whether a model directory holds tokenizer files (the recipe's own ``hf_model/`` export after a ``bytes`` run
    does not: transformers would load a tokenizer that encodes every text to nothing)."""
    return any((Path(directory).expanduser() / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(spec: str | None) -> Tokenizer:
    """``bytes`` (or None), a local Hugging Face tokenizer directory, or a hub id (``name`` / ``org/name``, from the
    local cache or the hub)."""
    if spec in (None, "bytes"):
        return Tokenizer(_bytes_encode, 0, 256)
    path = Path(spec).expanduser()
    hub_id = not path.exists() and not path.is_absolute() and not spec.startswith((".", "~")) and spec.count("/") <= 1
    if not path.is_dir() and not hub_id:
        raise RecipePathError(f"data.tokenizer: {spec} is not a directory ('bytes', a tokenizer directory, hub id)")
    if path.is_dir() and not has_tokenizer(path):
        raise RecipePathError(f"data.tokenizer: {spec} holds no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(spec if hub_id else str(path), local_files_only=not hub_id)
    except OSError as exc:  # a hub id neither cached nor reachable, or no such repository
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RecipePathError(f"data.tokenizer: cannot load {spec}: {first}") from None
    if not tok("hello world", add_special_tokens=False)["input_ids"]:
        raise RecipeError(f"data.tokenizer: {spec} encodes text to no tokens (a directory without tokenizer files?)")
    eos = tok.eos_token_id if tok.eos_token_id is not None else tok.pad_token_id
    if eos is None:
        raise RecipeError(f"data.tokenizer: {spec} has no end-of-sequence (or padding) token to separate documents")

    def encode(doc: Document) -> list[int]:
        if isinstance(doc, str):
            return tok(doc, add_special_tokens=False)["input_ids"]
        if not tok.chat_template:
            raise RecipeError(f"data.tokenizer: {spec} has no chat template for 'messages' documents")
        return tok.apply_chat_template(doc, tokenize=True, return_dict=False)

    return Tokenizer(encode, int(eos), len(tok), hf=tok)


def pack(docs: list[Document], tokenizer: Tokenizer, seq_len: int) -> torch.Tensor:
    """``[n, seq_len]`` int64: the documents' tokens joined by the end-of-sequence id, cut into sequences."""
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer.encode(doc))
        ids.append(tokenizer.eos_id)
    n = len(ids) // seq_len
    if n == 0:
        raise RecipeError(f"data: {len(ids)} tokens make no sequence of seq_len={seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def split(seqs: torch.Tensor, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded shuffle of the sequences, then ``val_fraction`` of them (at least one) held out for validation."""
    if not 0.0 < val_fraction < 1.0:
        raise RecipeError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    if seqs.shape[0] < 2:
        raise RecipeError(f"data: {seqs.shape[0]} sequence(s): too few for a training and a validation split")
    order = torch.randperm(seqs.shape[0], generator=torch.Generator().manual_seed(seed))
    n_val = min(seqs.shape[0] - 1, max(1, round(val_fraction * seqs.shape[0])))
    return seqs[order[n_val:]], seqs[order[:n_val]]
