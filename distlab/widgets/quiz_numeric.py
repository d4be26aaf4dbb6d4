"""Numeric interview questions drawn with random parameters and answered by dl.theory.

Each generator takes a ``random.Random`` and returns a Question whose right choice comes from a
theory function and whose wrong choices are the classic slips (forgetting a factor 2, the ring's
(N-1)/N, the master copy...)."""
from __future__ import annotations

import random

from distlab import theory
from distlab.theory import GB
from distlab.widgets.quiz_bank import Question


def _numeric(rng: random.Random, topic: str, prompt: str, right: float, wrong: list[float], unit: str,
             explanation: str, digits: int = 3) -> Question:
    """Shuffle the right value among distinct wrong ones, formatted with ``digits`` significant digits."""
    def fmt(x: float) -> str:
        number = f"{x:,.0f}" if abs(x) >= 10**digits else f"{x:.{digits}g}"
        return f"{number} {unit}".strip()

    choices = [fmt(right)]
    for value in wrong:
        if fmt(value) not in choices:
            choices.append(fmt(value))
    rng.shuffle(choices)
    return Question(topic, prompt, tuple(choices), choices.index(fmt(right)), explanation)


def model_states(rng):
    p = rng.choice([1, 3, 7, 13, 34, 70])
    master = rng.choice([True, False])
    right = theory.memory(p * 1e9, master_weights=master).total / GB
    return _numeric(rng, "Memory math", f"A {p}B model trains with bf16 mixed precision and Adam "
                    f"({'with' if master else 'without'} fp32 master weights), no sharding. "
                    "Model states per GPU?", right, [p * 16, p * 12, p * 20, p * 8, p * 4], "GB",
                    "bf16 params 2 + grads 2 bytes; Adam's two fp32 moments 8; master copy +4: "
                    "16 or 12 bytes/param.")


def zero_stage(rng):
    p, n, stage = rng.choice([7.5, 13, 30, 70]), rng.choice([8, 16, 64, 128]), rng.randint(1, 3)
    right = theory.memory(p * 1e9, dp=n, zero=stage).total / GB
    wrong = [theory.memory(p * 1e9, dp=n, zero=s).total / GB for s in range(4) if s != stage] + [16 * p / n]
    return _numeric(rng, "ZeRO", f"{p}B parameters, mixed-precision Adam (K = 12), ZeRO stage {stage} over "
                    f"{n} GPUs. Model-state memory per GPU?", right, wrong, "GB",
                    "ZeRO paper: stage 1 2+2+12/N, stage 2 2+14/N, stage 3 16/N bytes per parameter.")


def ring_time(rng):
    s, n, bw = rng.choice([1, 2, 4, 10]), rng.choice([4, 8, 16, 64]), rng.choice([25, 50, 100, 450])
    right = theory.comm_time("all_reduce", s * 1e9, n, bw * 1e9)
    return _numeric(rng, "Collectives", f"Ring all-reduce of {s} GB over {n} GPUs with {bw} GB/s links "
                    "(ignore latency). How long?", right * 1e3,
                    [s / bw * 1e3, 2 * s / bw * 1e3, (n - 1) / n * s / bw * 1e3, n * s / bw * 1e3], "ms",
                    "Each rank sends and receives 2(N-1)/N x S: time = 2(N-1)/N x S / B.")


def one_f_one_b(rng):
    p, m = rng.choice([2, 4, 8]), rng.choice([4, 8, 16, 32])
    right = theory.bubble("1f1b", p, m)
    return _numeric(rng, "Bubbles", f"1F1B pipeline, p = {p} stages, m = {m} microbatches, "
                    "equal F and B times. What fraction of the step is idle?", right,
                    [(p - 1) / m, 1 / p, (p - 1) / (m + p), (m - 1) / (m + p - 1)], "",
                    "Bubble (p-1)(t_f+t_b) over step (m+p-1)(t_f+t_b): (p-1)/(m+p-1).")


def interleaved(rng):
    p, v = rng.choice([4, 8]), rng.choice([2, 4])
    m = p * rng.choice([1, 2, 4])
    right = theory.bubble("interleaved", p, m, v=v, convention="ideal")
    return _numeric(rng, "Bubbles", f"Interleaved 1F1B, p = {p}, m = {m}, v = {v} chunks per GPU. "
                    "Bubble as a fraction of the ideal compute time?", right,
                    [(p - 1) / m, (p - 1) / (v * m + p - 1), v * (p - 1) / m, (p - 1) / (m * v * v)], "",
                    "Narayanan et al. 2021: the bubble shrinks v-fold, (p-1)/(v m) of the ideal time.")


def dp_traffic(rng):
    p, n = rng.choice([1, 7, 13]), rng.choice([2, 8, 64])
    right = theory.dp_volume(2 * p * 1e9, n) / GB
    return _numeric(rng, "Collectives", f"DDP on {n} GPUs, a {p}B model with bf16 gradients. "
                    "Bytes each GPU sends per step (ring all-reduce)?", right,
                    [2 * p, 4 * p, (n - 1) / n * 2 * p, 2 * p * n], "GB",
                    "2(N-1)/N x Psi, with Psi = 2 bytes x parameters.")


def train_days(rng):
    p, d = rng.choice([7, 13, 70]), rng.choice([1, 2, 15])
    gpus, mfu = rng.choice([256, 1024, 2048]), rng.choice([0.3, 0.4, 0.5])
    right = theory.training_time(p * 1e9, d * 1e12, gpus, 989e12, mfu) / 86400
    return _numeric(rng, "Scaling", f"Train {p}B parameters on {d}T tokens with {gpus} H100s "
                    f"(989 TFLOPS bf16) at {mfu:.0%} MFU. About how many days?", right,
                    [right / 3, right * 2, right * mfu, right / mfu], "days",
                    "6 N D FLOPs / (GPUs x peak x MFU) seconds, / 86400.", digits=2)


def activations(rng):
    s, h, a = rng.choice([1024, 2048, 4096]), rng.choice([4096, 8192]), rng.choice([32, 64])
    right = theory.activation_bytes_per_layer(s, 1, h, a) / GB
    return _numeric(rng, "Memory math", f"Activation memory of one transformer layer, s = {s}, b = 1, "
                    f"h = {h}, a = {a} heads, bf16, no recomputation (Korthikanti et al.)?", right,
                    [34 * s * h / GB, 2 * s * h / GB, right * 2, 5 * a * s * s / GB], "GB",
                    "s b h (34 + 5 a s / h) bytes: 34 sbh for the linear parts, "
                    "5 a s^2 b for the attention scores.")


def gpt_params(rng):
    h, layers = rng.choice([(768, 12), (1024, 24), (2048, 24), (4096, 32), (5120, 40)])
    v = 50257
    right = theory.gpt_params(h, layers, v) / 1e9
    return _numeric(rng, "Memory math", f"GPT with h = {h}, L = {layers}, vocabulary {v}, tied embeddings. "
                    "How many parameters?", right,
                    [layers * 12 * h * h / 1e9 * 2, (h * v * 2 + layers * 12 * h * h) / 1e9 * 1.5,
                     layers * 4 * h * h / 1e9], "B",
                    "h v + L (12 h^2 + 13 h) + 2 h: 4h^2 attention + 8h^2 MLP per layer dominate.")


def mfu(rng):
    p, tps, gpus = rng.choice([7, 13]), rng.choice([2500, 3000, 3500]), rng.choice([8, 64])
    right = theory.mfu(p * 1e9, tps * gpus, gpus, 989e12) * 100
    return _numeric(rng, "Scaling", f"A {p}B model trains at {tps} tokens/s per H100 (989 TFLOPS bf16). MFU?",
                    right, [right / 3, right * 2, right / 2, right * 1.5], "%",
                    "6 N tokens/s / peak: each token costs 6 N FLOPs (2 forward, 4 backward).", digits=2)


def zero_bubble(rng):
    p = rng.choice([4, 8, 16])
    right = theory.bubble_time("zb-h1", p, 4 * p, t_f=1, t_b=2, t_w=1)
    return _numeric(rng, "Bubbles", f"p = {p} stages, T_F = T_B(input) = T_W = 1. "
                    "Idle time per rank under ZB-H1 (Qi et al. 2023), in units of T_F?",
                    right, [3 * (p - 1), 0, 2 * (p - 1), p], "",
                    "1F1B idles (p-1)(T_F+T_B+T_W) = 3(p-1); ZB-H1 (p-1)(T_F+T_B-T_W) = p-1.")


def busbw(rng):
    n, s, t = rng.choice([8, 16]), rng.choice([1, 4]), rng.choice([0.02, 0.05, 0.1])
    right = theory.busbw("all_reduce", s * 1e9, t, n) / 1e9
    return _numeric(rng, "Collectives", f"nccl-tests all_reduce of {s} GB on {n} GPUs "
                    f"takes {t * 1e3:.0f} ms. busbw?", right, [s / t, s / t * n, s / t / 2], "GB/s",
                    "algbw = S/t; busbw = algbw x 2(N-1)/N for all-reduce.")


def tp_traffic(rng):
    s, h, t = rng.choice([2048, 4096]), rng.choice([4096, 8192]), rng.choice([2, 4, 8])
    right = theory.tp_volume(s, 1, h, t) / 1e6
    message = s * h * 2 / 1e6
    return _numeric(rng, "DP vs TP", f"Megatron TP over {t} GPUs, s = {s}, b = 1, h = {h}, bf16. "
                    "MB each GPU sends per layer per microbatch (forward + backward, ring)?", right,
                    [message * 2, message * 4, right / 2, message * 2 * (t - 1) / t], "MB",
                    "Two all-reduces of b s h forward and two backward, each 2(t-1)/t x the message.")


GENERATORS = [model_states, zero_stage, ring_time, one_f_one_b, interleaved, dp_traffic, train_days,
              activations, gpt_params, mfu, zero_bubble, busbw, tp_traffic]


def numeric_questions(rng: random.Random) -> list[Question]:
    """One question from each generator, parameters drawn from ``rng``."""
    return [make(rng) for make in GENERATORS]
