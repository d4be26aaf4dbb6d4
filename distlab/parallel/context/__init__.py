"""``dl.cp``: context parallelism, exact attention over a sequence split across ranks.

Reading order:

    layout.py           split / unsplit: which part of the sequence each rank holds (contiguous or
                        zig-zag: chunks r and 2n-1-r of 2n, balancing causal work)
    ring_attention.py   K/V blocks round a ring, partial softmaxes merged by log-sum-exp; dK/dV round
                        the ring backward (Liu et al. 2023)
    ulysses.py          all-to-all to a head split, local attention, all-to-all back (Jacobs et al. 2023)
    gpt.py              parallelize(gpt): the GPT's attention swapped for either, positions per rank

    local = dl.cp.split(x, dim=2, group=None, zigzag=True)        # (B, H, s, D) -> (B, H, s/n, D)
    out = dl.cp.ring_attention(q, k, v, causal=True, group=None, zigzag=True)
    out = dl.cp.ulysses_attention(q, k, v, causal=True, group=None, zigzag=False)
    full = dl.cp.unsplit(out, dim=2, group=None, zigzag=True)     # the whole sequence, in order

Both attentions equal plain attention on the gathered sequence, forward and backward. They talk
only through `dl.comm` (``ring_shift``, ``all_to_all``) and `parallel/collectives.py` (unsplit's
all-gather), which record every step; nothing here is labelled.
"""
from .gpt import ContextParallelAttention, ContextParallelGPT, ContextTensorParallelGPT, parallelize
from .layout import chunk_ids, split, unsplit
from .ring_attention import RingAttention, ring_attention
from .ulysses import ulysses_attention

__all__ = ["split", "unsplit", "ring_attention", "ulysses_attention", "RingAttention", "chunk_ids",
           "parallelize", "ContextParallelGPT", "ContextParallelAttention",
           "ContextTensorParallelGPT"]
