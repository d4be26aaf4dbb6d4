"""Small models and synthetic data that every strategy trains, so results compare across lessons.

Reading order:

    mlp.py      `MLP`: Linear+GELU layers, the simplest model to shard; GPT-2's initialisation
    moe.py      `moe.MoE`: a mixture of experts, every expert here (router, capacity, balance loss)
    gpt.py      `GPT`, `GPTConfig`: a GPT-2 style decoder, dense or with a `moe.MoE` in every block
    data.py     `MarkovTokens`, `TeacherRegression`: synthetic data indexed by step; `shard`: a rank's rows
    presets.py  `PRESETS`, `build`, `dataset_for`: the named models of `dl.train`, the CLI and the lessons,
                the real sizes (GPT-3 175B, Llama 3) for dry runs; `config`: a name or a ModelPreset's shape

    model = dl.models.build("gpt-moe-tiny", seed=0)
    ids, targets = dl.models.dataset_for("gpt-moe-tiny").batch(step=0, size=8)
    loss = model.loss(ids, targets)       # cross-entropy + aux_coef * the layers' balance losses

Everything is deterministic given the seed, on any world size. Nothing here imports `distlab.parallel`:
the parallel wrappers take these models (`dl.ep.parallelize` splits the experts of `moe.MoE`), never
the reverse.
"""
from .data import MarkovTokens, TeacherRegression, shard
from .gpt import GPT, Block, CausalSelfAttention, FeedForward, GPTConfig, attention_core, causal_attention
from .mlp import MLP
from .presets import PRESETS, REAL_SIZE, build, config, dataset_for

__all__ = ["GPT", "GPTConfig", "PRESETS", "REAL_SIZE", "config", "Block", "CausalSelfAttention",
           "FeedForward", "attention_core",
           "causal_attention", "MLP", "MarkovTokens", "TeacherRegression", "build", "dataset_for", "shard"]
