"""Activation memory of a transformer layer and of the microbatches a pipeline keeps in flight.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
16-bit activations, s sequence length, b micro-batch, h hidden, a heads, t tensor-parallel size:

    no parallelism              s b h (34 + 5 a s / h)                      (Eq. 1)
    tensor parallel             s b h (10 + 24/t + 5 a s / (h t))           (Eq. 2)
    tensor + sequence parallel  s b h (34 + 5 a s / h) / t                  (Eq. 3)
    selective recomputation     drop the 5 a s / h attention term           (Eq. 4: 34 s b h / t with SP)
    full recomputation          keep only each layer's input, 2 s b h (/ t with SP)

Pipelines (Sec. 4.2.3 and Narayanan et al. 2021): 1F1B's first stage holds p microbatches of L/p
layers -- L layers' worth, whatever p; GPipe holds all m; interleaved with v chunks multiplies
1F1B's by (1 + (p - 1) / (p v)); ZB-H1 keeps 1F1B's p (Qi et al. 2023).
"""
from __future__ import annotations

RECOMPUTE = ("none", "selective", "full")


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int,
                               tp: int = 1, sp: bool = False, recompute: str = "none") -> float:
    """Bytes one transformer layer stores for the backward, per Korthikanti et al. 2022."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if sp and tp == 1:
        sp = False                      # sequence parallelism shards over the TP group only
    sbh = seq_len * micro_batch * hidden
    attention_scores = 5 * heads * seq_len / hidden       # softmax in/out, dropout mask: 5as/h
    if recompute == "full":
        return 2 * sbh / (tp if sp else 1)
    kept_scores = 0.0 if recompute == "selective" else attention_scores
    if sp:
        return sbh * (34 + kept_scores) / tp
    return sbh * (10 + 24 / tp + kept_scores / tp)


def pipeline_in_flight(schedule: str, p: int, m: int, v: int = 1, stage: int = 0) -> float:
    """Microbatches whose activations pipeline rank ``stage`` holds at its peak, in units of one
    microbatch through one whole stage (interleaved counts its 1/v-sized chunks).

    gpipe m; 1f1b min(p - i, m); zb-h1 min(p, m) on every rank (distlab's ZB-H1 keeps W's inputs);
    zb-h2 min(2p - 1, m) at most; interleaved min(p v + p - 1 - 2i, m v) / v (Megatron's warm-up).
    """
    if m < 1 or p < 1 or v < 1 or not 0 <= stage < p:
        raise ValueError(f"need p >= 1, m >= 1, v >= 1 and 0 <= stage < p; "
                         f"got p={p}, m={m}, v={v}, stage={stage}")
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - stage, m))
    if schedule == "zb-h1":
        return float(min(p, m))
    if schedule == "zb-h2":
        return float(min(2 * p - 1, m))
    if schedule == "interleaved":
        return min(p * v + p - 1 - 2 * stage, m * v) / v
    raise ValueError(f"unknown schedule {schedule!r}: choose gpipe, 1f1b, interleaved, zb-h1 or zb-h2")
