"""The embedded Markov corpus and its datamodule: deterministic, well-formed batches, disjoint splits, learnable."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fly_lightning.recipes.data import LMData, markov_corpus

SMALL = dict(vocab_size=48, seq_len=33, batch_size=8, n_train=80, n_val=20)


def _dm(**kwargs) -> LMData:
    dm = LMData(**{**SMALL, **kwargs})
    dm.setup("fit")
    return dm


def _successors(seqs: torch.Tensor, vocab: int) -> list[set[int]]:
    """For each token, the set of tokens that follow it somewhere in ``seqs``."""
    out: list[set[int]] = [set() for _ in range(vocab)]
    for a, b in zip(seqs[:, :-1].reshape(-1).tolist(), seqs[:, 1:].reshape(-1).tolist(), strict=True):
        out[a].add(b)
    return out


def _conditional_entropy(seqs: torch.Tensor, vocab: int) -> float:
    """Empirical H(x[t+1] | x[t]) in nats, from the bigram counts of ``seqs``."""
    idx = seqs[:, :-1].reshape(-1) * vocab + seqs[:, 1:].reshape(-1)
    counts = torch.bincount(idx, minlength=vocab * vocab).view(vocab, vocab).double()
    p_joint = counts / counts.sum()
    p_prev = p_joint.sum(1, keepdim=True)
    nz = p_joint > 0
    return float(-(p_joint[nz] * torch.log((p_joint / p_prev.clamp_min(1e-300))[nz])).sum())


def _unigram_entropy(seqs: torch.Tensor, vocab: int) -> float:
    p = torch.bincount(seqs.reshape(-1), minlength=vocab).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


# --- markov_corpus ------------------------------------------------------------------------------------------------


def test_corpus_is_deterministic_for_a_seed_and_changes_with_it():
    a = markov_corpus(16, 24, 32, seed=3)
    b = markov_corpus(16, 24, 32, seed=3)
    c = markov_corpus(16, 24, 32, seed=4)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_corpus_does_not_touch_the_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    markov_corpus(8, 16, 32, seed=0)
    assert torch.equal(torch.rand(3), expected)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 12),
    seq_len=st.integers(1, 40),
    vocab=st.integers(2, 64),
    branching=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_corpus_shape_dtype_range_and_branching(n, seq_len, vocab, branching, seed):
    seqs = markov_corpus(n, seq_len, vocab, seed=seed, branching=branching)
    assert seqs.shape == (n, seq_len)
    assert seqs.dtype == torch.long
    assert int(seqs.min()) >= 0 and int(seqs.max()) < vocab
    # first-order chain with `branching` choices: no token is ever followed by more than `branching` distinct tokens
    assert max(len(s) for s in _successors(seqs, vocab)) <= branching


def test_branching_one_is_a_deterministic_chain():
    seqs = markov_corpus(64, 20, 16, seed=1, branching=1)
    assert all(len(s) <= 1 for s in _successors(seqs, 16))
    assert _conditional_entropy(seqs, 16) == 0.0


# --- LMData -------------------------------------------------------------------------------------------------


def test_split_sizes_and_disjoint_splits():
    dm = _dm()
    assert len(dm.train_set) == SMALL["n_train"]
    assert len(dm.val_set) == SMALL["n_val"]
    train, val = dm.train_set.tensors[0], dm.val_set.tensors[0]
    assert train.shape == (SMALL["n_train"], SMALL["seq_len"])
    assert val.shape == (SMALL["n_val"], SMALL["seq_len"])
    # no validation sequence is a copy of a training sequence (33 tokens: a collision by chance is ~impossible)
    assert not (val[:, None, :] == train[None, :, :]).all(-1).any()


def test_batches_shapes_dtypes_and_token_range():
    dm = _dm()
    train_batches = list(dm.train_dataloader())
    val_batches = list(dm.val_dataloader())
    # drop_last on train: only full batches; validation keeps the remainder
    assert len(train_batches) == SMALL["n_train"] // SMALL["batch_size"]
    assert len(val_batches) == math.ceil(SMALL["n_val"] / SMALL["batch_size"])
    for batch in train_batches:
        assert isinstance(batch, list | tuple) and len(batch) == 1  # the model reads batch[0]
        (tokens,) = batch
        assert tokens.shape == (SMALL["batch_size"], SMALL["seq_len"])
        assert tokens.dtype == torch.long
        assert int(tokens.min()) >= 0 and int(tokens.max()) < SMALL["vocab_size"]
    assert [b[0].shape[0] for b in val_batches] == [8, 8, 4]
    for (tokens,) in val_batches:
        assert tokens.dtype == torch.long and tokens.shape[1] == SMALL["seq_len"]
        assert int(tokens.min()) >= 0 and int(tokens.max()) < SMALL["vocab_size"]


def test_drop_last_leaves_out_only_a_partial_batch():
    dm = _dm(n_train=83)  # 10 full batches of 8, 3 sequences left out per epoch
    seen = torch.cat([b[0] for b in dm.train_dataloader()])
    assert seen.shape[0] == 80
    assert len({tuple(r) for r in seen.tolist()}) == 80  # a permutation: no sequence twice


def test_datamodule_is_deterministic_for_a_seed():
    a, b, c = _dm(seed=7), _dm(seed=7), _dm(seed=8)
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    assert torch.equal(a.val_set.tensors[0], b.val_set.tensors[0])
    assert not torch.equal(a.train_set.tensors[0], c.train_set.tensors[0])
    # the shuffled training order is seeded too, and does not depend on the global RNG
    torch.manual_seed(1)
    order_a = [x[0] for x in a.train_dataloader()]
    torch.manual_seed(2)
    order_b = [x[0] for x in b.train_dataloader()]
    assert all(torch.equal(x, y) for x, y in zip(order_a, order_b, strict=True))
    # ... and it is shuffled: not the stored order
    assert not torch.equal(torch.cat(order_a), a.train_set.tensors[0][: len(order_a) * SMALL["batch_size"]])


def test_val_loader_is_in_stored_order():
    dm = _dm()
    assert torch.equal(torch.cat([b[0] for b in dm.val_dataloader()]), dm.val_set.tensors[0])


def test_corpus_is_learnable():
    """The next token is far more predictable from the current one than without context: below log(vocab)."""
    vocab = 64
    dm = _dm(vocab_size=vocab, seq_len=65, n_train=512, n_val=16)
    seqs = dm.train_set.tensors[0]
    h_cond = _conditional_entropy(seqs, vocab)
    h_uni = _unigram_entropy(seqs, vocab)
    # the default chain has 4 choices per token: the entropy rate is at most log(4), far under log(vocab)
    assert h_cond <= math.log(4) + 1e-9
    assert h_cond < math.log(vocab) - 2.0
    # and the task needs the context: the tokens alone are close to uniform, so a bigram model must be learnt
    assert h_uni > math.log(vocab) - 0.5
    assert max(len(s) for s in _successors(seqs, vocab)) <= 4
