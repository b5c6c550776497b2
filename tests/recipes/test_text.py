"""Real text for the recipe: sources, tokenizers (bytes and a local Hugging Face one written here), packing, the
validation split, and the errors a user meets first."""

import json

import pytest
import torch

from fly_lightning.recipes import text
from fly_lightning.recipes.data import LMData
from fly_lightning.recipes.errors import RecipeError

TINY_WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "user", "assistant", ":", "hello", "hi"]


def test_a_text_file_in_bytes_is_packed_into_sequences(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 20)
    tok = text.load_tokenizer("bytes")
    seqs = text.pack(text.read_documents(tmp_path / "a.txt"), tok, 16)
    ids = list(("hello world " * 20).encode()) + [0]
    assert seqs.shape == (len(ids) // 16, 16) and seqs.flatten().tolist() == ids[: seqs.numel()]


def test_a_folder_reads_text_and_jsonl_in_sorted_order(tmp_path):
    (tmp_path / "b.md").write_text("second")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.jsonl").write_text(json.dumps({"text": "third"}) + "\n\n" + json.dumps({"text": "4th"}))
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    assert text.read_documents(tmp_path) == ["first", "second", "third", "4th"]


def test_chat_messages_use_the_tokenizer_template(tmp_path, tiny_tokenizer):
    tok = text.load_tokenizer(str(tiny_tokenizer(tmp_path / "tok")))
    data = tmp_path / "chat.jsonl"
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    data.write_text(json.dumps({"messages": msgs}) + "\n" + json.dumps({"text": "the cat sat"}) + "\n")
    docs = text.read_documents(data)
    assert docs[0] == msgs
    ids = [i for d in docs for i in (*tok.encode(d), tok.eos_id)]
    vocab = {w: i for i, w in enumerate(["[UNK]", "[EOS]", *TINY_WORDS])}
    chat = ["user", ":", "hello", "[EOS]", "assistant", ":", "hi", "[EOS]"]
    assert ids == [vocab[w] for w in (*chat, "[EOS]", "the", "cat", "sat", "[EOS]")]
    assert tok.vocab_size == len(vocab)


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"text": "ok"}\nnot json\n', r"bad.jsonl:2: not JSON"),
        ('{"body": "no text"}\n', r"bad.jsonl:1: expected an object with a 'text' string"),
    ],
)
def test_bad_jsonl_names_the_line(tmp_path, content, match):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(ValueError, match=match):
        text.read_documents(tmp_path / "bad.jsonl")


def test_first_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        text.read_documents(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="no documents"):
        text.read_documents(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        text.load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="chat 'messages' need a Hugging Face tokenizer"):
        text.load_tokenizer("bytes").encode([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="make no sequence"):
        text.pack(["ab"], text.load_tokenizer("bytes"), 64)


def _dm(path, **kw) -> LMData:
    dm = LMData(path=str(path), seq_len=8, batch_size=2, **kw)
    dm.setup("fit")
    return dm


def test_split_is_deterministic_given_the_seed_and_holds_out_a_share(tmp_path):
    (tmp_path / "a.txt").write_text("".join(chr(97 + i % 26) for i in range(800)))
    a, b, c = _dm(tmp_path, seed=1), _dm(tmp_path, seed=1), _dm(tmp_path, seed=2, val_fraction=0.25)
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    assert len(a.val_set) == 5 and len(a.train_set) == 95  # 5% of the 100 sequences
    assert len(c.val_set) == 25 and not torch.equal(a.val_set.tensors[0], c.val_set.tensors[0][:5])
    seen = torch.cat([c.train_set.tensors[0], c.val_set.tensors[0]])
    assert sorted(map(tuple, seen.tolist())) == sorted(
        map(tuple, a.train_set.tensors[0].tolist() + a.val_set.tensors[0].tolist())
    )


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, tiny_tokenizer):
    (tmp_path / "a.txt").write_text("the cat sat on a mat " * 10)
    with pytest.raises(ValueError, match="has 15 tokens but data.vocab_size is 8"):
        _dm(tmp_path / "a.txt", tokenizer=str(tiny_tokenizer(tmp_path / "tok")), vocab_size=8)


def test_non_utf8_text_names_its_file(tmp_path):
    (tmp_path / "a.txt").write_text("fine")
    (tmp_path / "b.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"b\.txt: not UTF-8 text \(byte 3"):
        text.read_documents(tmp_path)


def test_a_model_directory_without_tokenizer_files_is_not_a_tokenizer(tmp_path, tiny_tokenizer):
    """The recipe's own ``hf_model/`` export after a bytes run holds no tokenizer: transformers would load one that
    encodes every text to nothing (a corpus of end-of-sequence ids)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    assert not text.has_tokenizer(tmp_path)
    with pytest.raises(RecipeError, match="holds no tokenizer files"):
        text.load_tokenizer(str(tmp_path))
    tiny_tokenizer(tmp_path / "tok")
    assert text.has_tokenizer(tmp_path / "tok") and text.load_tokenizer(str(tmp_path / "tok")).encode("hello")
