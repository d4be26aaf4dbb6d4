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

distlab's own GPT (`predicted_layer_bytes`) has no dropout, so three of Korthikanti's terms do not
exist there: the two residual-dropout masks (2sbh, split by t only under SP), the attention-dropout
mask (as^2b) and the dropout output (2as^2b; attention @ V reuses the saved softmax), both split by
heads. Removing them leaves, in *elements*,

    sbh(16 + as/h)    ->   TP: sbh(4 + 12/t + as/(ht))    ->   TP+SP: sbh(16 + as/h)/t

times the element size (4 bytes in fp32). What the formula ignores and a measurement
(`distlab.memory.measure_layer`) sees, `unmodelled_bytes`: LayerNorm's per-token mean and 1/std (2bs
fp32 numbers per LayerNorm) and the causal mask (s^2 bools), well under 1% here.
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


def dropout_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                  sp: bool = False) -> float:
    """The dropout terms of Korthikanti's count (2-byte activations, 1-byte masks), split as in Eq. 2/3:
    residual masks 2sbh (/t under SP), attention mask + dropout output 3as^2b (/t by heads)."""
    sbh, as2b = seq_len * micro_batch * hidden, heads * seq_len * seq_len * micro_batch
    return 2 * sbh / (tp if sp and tp > 1 else 1) + 3 * as2b / tp


def predicted_layer_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                          sp: bool = False, element_size: int = 4, dropout: bool = False,
                          recompute: str = "none") -> float:
    """Korthikanti et al.'s per-layer activation bytes (`activation_bytes_per_layer`), without the
    dropout terms unless ``dropout``, rescaled from 2-byte to ``element_size`` activations.
    (Only valid without dropout for element_size != 2, since masks are 1 byte whatever the dtype.)
    ``recompute="selective"`` drops the attention scores' terms (what is left: sbh 16 elements, / t
    with SP), ``"full"`` keeps the layer's input (sbh elements, / t with SP)."""
    total = activation_bytes_per_layer(seq_len, micro_batch, hidden, heads, tp=tp, sp=sp, recompute=recompute)
    if dropout:
        if element_size != 2:
            raise ValueError("with dropout the masks stay 1 byte: only element_size=2 matches the paper")
        return total
    if recompute == "full":
        return total * element_size / 2
    drop = dropout_bytes(seq_len, micro_batch, hidden, heads, tp, sp)
    if recompute == "selective":                       # the attention dropout terms went with the scores
        drop -= 3 * heads * seq_len * seq_len * micro_batch / tp
    return (total - drop) * element_size / 2


def unmodelled_bytes(seq_len: int, micro_batch: int, tp: int = 1, sp: bool = False,
                     stats_element_size: int = 4, recompute: str = "none") -> int:
    """What a layer of distlab's GPT saves beyond Korthikanti's count: each of the two LayerNorms
    keeps a mean and a 1/std per token (fp32; per *local* token under SP), and attention keeps its
    causal mask (s^2 bools; not under selective recomputation, which rebuilds it; nothing under full)."""
    if recompute == "full":
        return 0
    tokens = seq_len * micro_batch // (tp if sp and tp > 1 else 1)
    return 2 * 2 * tokens * stats_element_size + (seq_len * seq_len if recompute == "none" else 0)
