"""The embedded default data: token sequences from a seeded first-order Markov chain.

No download and no file: every machine generates the same corpus, and a model can learn it (the loss falls well below
the uniform ``log(vocab)`` towards ``log(branching)``), which makes the default run a real, checkable training job.
"""

from __future__ import annotations

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset


def markov_corpus(n_seqs: int, seq_len: int, vocab: int, seed: int = 0, branching: int = 4) -> torch.Tensor:
    """``[n_seqs, seq_len]`` int64 tokens; each token allows ``branching`` equally likely next tokens."""
    g = torch.Generator().manual_seed(seed)
    table_VB = torch.randint(0, vocab, (vocab, branching), generator=g)
    seqs = torch.empty(n_seqs, seq_len, dtype=torch.long)
    seqs[:, 0] = torch.randint(0, vocab, (n_seqs,), generator=g)
    choice = torch.randint(0, branching, (n_seqs, seq_len), generator=g)
    for t in range(1, seq_len):
        seqs[:, t] = table_VB[seqs[:, t - 1], choice[:, t]]
    return seqs


class MarkovLMData(L.LightningDataModule):
    """Train/validation splits of the embedded corpus (``test`` and ``predict`` use the validation split).

    Args:
        vocab_size: token ids in ``[0, vocab_size)``; must match the model.
        seq_len: tokens per sample (the model sees ``seq_len - 1`` inputs and targets).
        batch_size: samples per batch.
        n_train: training sequences.
        n_val: validation sequences.
        seed: corpus seed.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 129,
        batch_size: int = 8,
        n_train: int = 2048,
        n_val: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str | None = None) -> None:
        h = self.hparams
        data = markov_corpus(h.n_train + h.n_val, h.seq_len, h.vocab_size, h.seed)
        self.train_set = TensorDataset(data[: h.n_train])
        self.val_set = TensorDataset(data[h.n_train :])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(self.hparams.seed),
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        """The held-out sequences (the validation split: the corpus has no separate test split)."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The held-out sequences, whose greedy continuations ``predict`` returns."""
        return self.val_dataloader()
