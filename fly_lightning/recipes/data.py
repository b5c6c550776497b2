"""The recipe's data: the embedded default (token sequences from a seeded first-order Markov chain) or real text.

The default needs no download and no file: every machine generates the same corpus, and a model can learn it (the
loss falls well below the uniform ``log(vocab)`` towards ``log(branching)``), which makes the default run a real,
checkable training job. ``--data.path`` trains on real text instead (``fly_lightning.recipes.text``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

from fly_lightning.recipes import text
from fly_lightning.recipes.errors import RecipeError


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


class EpochSampler(Sampler[int]):
    """A seeded shuffle per epoch (from the seed and the epoch number alone) that starts past the samples already
    consumed: a run resumed mid-epoch sees the rest of the interrupted epoch's order, not a new start, so that it
    reaches the same losses as an uninterrupted one. Under DDP, Lightning's sampler wrapper splits what it yields
    among the ranks; the consumed count is over all ranks, so the split stays as it was."""

    def __init__(self, n: int, seed: int, consumed: Callable[[], int]) -> None:
        self.n, self.seed, self.consumed, self.epoch = n, seed, consumed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g)[self.consumed() :].tolist())

    def __len__(self) -> int:
        return self.n


class ResumableLoader(DataLoader):
    """A DataLoader that Lightning treats as resumable (``state_dict``/``load_state_dict``): its position lives in
    Lightning's own restored progress, which ``EpochSampler`` reads, so there is nothing else to save."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class LMData(L.LightningDataModule):
    """Train/validation splits of the embedded corpus, or of real text (``test`` and ``predict`` use the validation
    split).

    Args:
        path: real text: a text file, a folder of text / JSONL files, or a JSONL file (``text`` or chat ``messages``);
            None: the embedded Markov corpus.
        tokenizer: with ``path``: ``bytes`` (UTF-8 bytes, 256 ids) or a local Hugging Face tokenizer directory; None
            (the default): the ``--model.pretrained`` directory's tokenizer when there is one, else bytes.
        vocab_size: token ids in ``[0, vocab_size)``; must match the model (and hold the tokenizer's vocabulary).
        seq_len: tokens per sample (the model sees ``seq_len - 1`` inputs and targets).
        batch_size: samples per batch.
        n_train: training sequences of the embedded corpus.
        n_val: validation sequences of the embedded corpus.
        val_fraction: with ``path``: the share of packed sequences held out (at least one).
        seed: corpus seed, split and shuffling seed.
    """

    def __init__(
        self,
        path: str | None = None,
        tokenizer: str | None = None,
        vocab_size: int = 256,
        seq_len: int = 129,
        batch_size: int = 8,
        n_train: int = 2048,
        n_val: int = 64,
        val_fraction: float = 0.05,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tokenizer: text.Tokenizer | None = None

    def setup(self, stage: str | None = None) -> None:
        h = self.hparams
        if h.path is None:
            data = markov_corpus(h.n_train + h.n_val, h.seq_len, h.vocab_size, h.seed)
            self.train_set = TensorDataset(data[: h.n_train])
            self.val_set = TensorDataset(data[h.n_train :])
            return
        self.tokenizer = text.load_tokenizer(h.tokenizer)
        if self.tokenizer.vocab_size > h.vocab_size:
            raise RecipeError(
                f"data.tokenizer {h.tokenizer} has {self.tokenizer.vocab_size} tokens but data.vocab_size is "
                f"{h.vocab_size}: pass --data.vocab_size (and a model of that vocabulary)"
            )
        train, val = text.split(
            text.pack(text.read_documents(h.path), self.tokenizer, h.seq_len), h.val_fraction, h.seed
        )
        self.train_set, self.val_set = TensorDataset(train), TensorDataset(val)

    def train_dataloader(self) -> DataLoader:
        return ResumableLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            sampler=EpochSampler(len(self.train_set), self.hparams.seed, self._consumed_samples),
            drop_last=len(self.train_set) >= self.hparams.batch_size,  # a small real corpus still makes a batch
        )

    def _consumed_samples(self) -> int:
        """Samples of the current epoch already trained on, over all ranks: Lightning's restored batch count when a
        run resumes mid-epoch, 0 at an epoch's start."""
        trainer = self.trainer
        if trainer is None:
            return 0
        ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        return ready * self.hparams.batch_size * trainer.world_size

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        """The held-out sequences (the validation split: the corpus has no separate test split)."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The held-out sequences, whose greedy continuations ``predict`` returns."""
        return self.val_dataloader()
