"""Data parallelism: every rank holds the whole model, sees 1/N of the batch, and averages gradients.

Reading order:

    ddp.py             NaiveDDP: one all-reduce per parameter after backward (the textbook version),
                       then DDP: gradients bucketed and all-reduced during backward (overlap)
    buckets.py         flat buffers and the bucketing DDP and ZeRO share
    backward_hooks.py  knowing, during backward, when a bucket's gradients are all there
    powersgd.py        PowerSGDDDP: gradients all-reduced as rank-r factors P Q^T (Vogels et al. 2019)
    local_sgd.py       LocalSGD and DiLoCo: H steps alone, then parameters averaged / an outer step
                       (Stich 2019; Douillard et al. 2023)
"""
from .ddp import DDP, NaiveDDP
from .local_sgd import DiLoCo, LocalSGD
from .powersgd import PowerSGD, PowerSGDDDP

__all__ = ["NaiveDDP", "DDP", "PowerSGD", "PowerSGDDDP", "LocalSGD", "DiLoCo"]
