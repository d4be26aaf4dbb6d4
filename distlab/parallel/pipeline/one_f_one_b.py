"""1F1B, the textbook way: one stage per rank, three loops, every send and receive written out.

PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training"), also
DAPPLE's early-backward schedule (Fan et al. 2021). Rank r holds stage r of p; the batch is cut
into m microbatches. Rank r runs p - r - 1 forwards to fill the pipe (warm-up), then alternates one
forward with one backward (steady state), then finishes the backwards still owed (cool-down):

    p = 4, m = 6   warm-up    steady: F(j + warm-up), B(j)          cool-down
         rank 0:   F0 F1 F2 | F3 B0 F4 B1 F5 B2                   | B3 B4 B5
         rank 1:   F0 F1    | F2 B0 F3 B1 F4 B2 F5 B3             | B4 B5
         rank 2:   F0       | F1 B0 F2 B1 F3 B2 F4 B3 F5 B4       | B5
         rank 3:            | F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 |

The idle share of the step is GPipe's, (p - 1) / (m + p - 1) with equal forward and backward times
(`dl.theory.bubble("1f1b", p, m)`), but rank r holds the activations of at most p - r microbatches
instead of all m: a backward frees each one as soon as the pipe is full.

Every F receives its input from stage r - 1 (stage 0: microbatch j of ``x``) and sends its output to
r + 1; every B receives d loss / d output from r + 1 (the last stage: its own loss) and sends
d loss / d input to r - 1. Sends are posted and never waited for mid-step, receives block (`p2p.py`).
This is `dl.pp.schedule("1f1b", p, m)[r]` run by hand; `executor.py` runs any schedule's list, and the
tests check the two equal (loss and gradients) and in the same order.
"""
from __future__ import annotations

import torch

from ...runtime import device, group_rank, group_size
from .executor import default_loss
from .p2p import Links


def one_f_one_b(stage: torch.nn.Module, x: torch.Tensor | None, target: torch.Tensor | None,
                microbatches: int, loss_fn=None, group=None) -> torch.Tensor | None:
    """One training step of 1F1B over ``group`` (stage = my rank in it). ``x`` on the first stage,
    ``target`` on the last; returns the mean microbatch loss there (None elsewhere). Gradients
    accumulate into ``stage``'s ``.grad`` as ``loss.backward()`` on the whole batch would."""
    p, r, m = group_size(group), group_rank(group), microbatches
    first, last, loss_fn = r == 0, r == p - 1, loss_fn or default_loss
    links = Links(group, p, device())
    inputs = x.to(device()).tensor_split(m) if first else None
    targets = target.to(device()).tensor_split(m) if last else None
    weights = [t.shape[0] / target.shape[0] for t in targets] if last else None   # n_j / n
    losses, stash = [], []                  # stash: (input, output) of each microbatch awaiting its B

    def forward(j: int) -> None:
        inp = inputs[j] if first else links.recv_activation(r, j).take().requires_grad_()
        out = stage(inp)                                         # (b, ...) -> (b, ...)
        if last:
            loss = loss_fn(out, targets[j])
            losses.append(loss.detach())
            out = loss * weights[j]                              # backward from (n_j / n) loss_j
        else:
            links.send_activation(r, j, out.detach())
        stash.append((inp, out))

    def backward(j: int) -> None:
        inp, out = stash.pop(0)                                  # the oldest microbatch in flight
        grad = None if last else links.recv_grad(r, j).take()    # d loss / d out, from stage r + 1
        torch.autograd.backward(out, grad)
        if not first:
            links.send_grad(r, j, inp.grad)                      # d loss / d inp, to stage r - 1

    warmup = min(p - r - 1, m)
    for j in range(warmup):                                      # warm-up: fill the pipe
        forward(j)
    for j in range(m - warmup):                                  # steady state: one F, one B
        forward(j + warmup)
        backward(j)
    for j in range(m - warmup, m):                               # cool-down: drain it
        backward(j)
    links.wait_sends()
    return sum(w * loss for w, loss in zip(weights, losses)) if last else None
