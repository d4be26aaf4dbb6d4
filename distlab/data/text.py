"""A real corpus that ships with distlab, byte-tokenised, and greedy text from a GPT trained on it.

``corpus.txt`` (beside this file, package data) is about 4 KB of public-domain prose: the openings of
*A Tale of Two Cities* (Dickens, 1859), the Gettysburg Address (Lincoln, 1863), *Moby-Dick* (Melville,
1851) and *Pride and Prejudice* (Austen, 1813). Tokens are its bytes (vocabulary 256, no tokenizer to
install); sample i is the window of ``seq_len + 1`` bytes starting at byte ``i * seq_len``::

    bytes   I t   w a s   t h e   b e s t   o f   ...
    x       I t _ w a s _ t           (seq_len tokens)
    y         t _ w a s _ t h         (the same, one byte on: next-byte prediction)

    corpus = TextCorpus(seq_len=32)
    x, y = corpus[torch.tensor([0, 5])]            # (2, 32) each
    print(complete(model, "It was the ", 40))      # greedy bytes from a GPT with vocab 256
"""
from __future__ import annotations

import os
from importlib import resources

import torch

VOCAB = 256


def corpus_bytes() -> bytes:
    """The shipped corpus, as bytes."""
    return resources.files(__package__).joinpath("corpus.txt").read_bytes()


def _corpus_path() -> str | None:
    """The shipped corpus's file, if it is one on disk (not inside a zip): process workers read it."""
    path = str(resources.files(__package__).joinpath("corpus.txt"))
    return path if os.path.isfile(path) else None


class TextCorpus:
    """Windows of ``seq_len + 1`` bytes of the corpus, one sample per ``seq_len`` bytes (no overlap)."""

    def __init__(self, seq_len: int = 32, text: bytes | None = None):
        data = corpus_bytes() if text is None else text
        self._path = _corpus_path() if text is None else None
        self._text = None if self._path else bytes(data)
        self.tokens = torch.tensor(list(data), dtype=torch.long)        # (N,) byte values 0..255
        self.seq_len = seq_len
        self.size = (len(self.tokens) - 1) // seq_len
        if self.size < 1:
            raise ValueError(f"a corpus of {len(data)} bytes has no window of {seq_len + 1}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(ids), seq_len), for the sample ids ``ids``."""
        starts = torch.as_tensor(ids, dtype=torch.long).reshape(-1, 1) * self.seq_len
        window = self.tokens[starts + torch.arange(self.seq_len + 1)]    # (B, seq_len + 1)
        return window[:, :-1], window[:, 1:]

    def worker_source(self) -> dict:
        """How a process worker without torch reads this corpus (`distlab.data._worker.Windows`): the
        file, by byte ranges, or (a corpus given as ``text``) the bytes themselves."""
        return {"path": self._path, "text": self._text, "seq_len": self.seq_len}

    def from_bytes(self, payload: bytes, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of ``n`` windows a worker read, concatenated: what ``self[ids]`` gives."""
        if n == 0:
            window = torch.empty((0, self.seq_len + 1), dtype=torch.long)
        else:
            window = torch.frombuffer(bytearray(payload), dtype=torch.uint8).long().view(n, self.seq_len + 1)
        return window[:, :-1], window[:, 1:]


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


@torch.no_grad()
def complete(model, prompt: str, length: int = 60) -> str:
    """``prompt`` and ``length`` more bytes, each the GPT's most likely next byte (greedy decoding) given
    the last ``seq_len`` bytes before it."""
    ids = encode(prompt)
    window = model.cfg.seq_len
    for _ in range(length):
        logits = model(ids[-window:].unsqueeze(0))                      # (1, T, 256)
        ids = torch.cat([ids, logits[0, -1].argmax().reshape(1)])
    return decode(ids)


def before_and_after(report, prompt: str = "It was the ", length: int = 60) -> tuple[str, str]:
    """Greedy text from a `dl.train(..., data="text")` report's model before training (its initial
    weights, from the seed) and after (``report.params``, gathered on rank 0)."""
    from ..models import build
    spec = report.spec
    model = build(spec.model, spec.seed, vocab=VOCAB).eval()
    before = complete(model, prompt, length)
    model.load_state_dict(report.params, strict=False)
    return before, complete(model.eval(), prompt, length)
