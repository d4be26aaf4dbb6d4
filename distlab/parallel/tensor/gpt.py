"""`dl.tp`: tensor parallelism (Megatron-LM) and sequence parallelism, from the full model.

    gpt = dl.models.build("gpt-tiny", seed=0)            # same seed on every rank: same full weights
    gpt = dl.tp.parallelize(gpt, sequence_parallel=True)  # each rank keeps 1/t of every big matrix
    loss = gpt.loss(ids, targets)                         # same ids on every rank of the TP group
    loss.backward()
    full = dl.tp.full_state_dict(gpt)                     # the full weights again, names unchanged

`parallelize` builds a new module, `TensorParallelGPT`, that takes over the GPT's children (the GPT
given is consumed: use the returned model) with these replaced (names stay the same, so state dicts
line up with the plain GPT):

    tok              VocabParallelEmbedding         vocab rows split; g (or reduce-scatter under SP)
    blocks[i].attn   ParallelAttention              q, k, v column-parallel (heads split), proj row-parallel
    blocks[i].mlp    ParallelMLP                    fc column-parallel, proj row-parallel
    head             ColumnParallelLinear           vocab split; tied to tok's shard when the GPT is tied
    loss             vocab_parallel_cross_entropy   no gather of the b s V logits
    ln1, ln2, ln_f, pos                             replicated; under SP they act on sequence shards
                                                    and their gradients are all-reduced over the group

Under SP the residual stream between the linears is (b, s/t, h) on each rank (Korthikanti et al. 2022).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...models import GPT
from .. import collectives as C
from ..mesh import as_group
from .layers import ParallelAttention, ParallelMLP
from .linear import ColumnParallelLinear, check_divisible, sync_replicated_grad
from .plan import parallelize_plan
from .regions import sequence_positions
from .vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy


class TensorParallelGPT(GPT):
    """A `GPT` whose big matrices are this rank's shards: ``forward`` returns this rank's vocabulary
    slice of the logits, (b, s, V/t) for ids [vocab_start, vocab_start + V/t); ``loss`` never gathers
    them. Built by `parallelize` from a full GPT, whose modules it takes over."""

    def __init__(self, gpt: GPT, group=None, sequence_parallel: bool = False):
        nn.Module.__init__(self)               # not GPT.__init__: that would build new full-size layers
        group = as_group(group)                          # a 1-D mesh: its process group
        t = C.group_size(group)
        sp = sequence_parallel and t > 1
        self.cfg, self.group, self.sequence_parallel = gpt.cfg, group, sp
        for block in gpt.blocks:
            block.attn = ParallelAttention.from_module(block.attn, group, sp)
            block.mlp = ParallelMLP.from_module(block.mlp, group, sp)
        self.tok = VocabParallelEmbedding.from_embedding(gpt.tok, group, sequence_parallel=sp)
        self.pos, self.blocks, self.ln_f = gpt.pos, gpt.blocks, gpt.ln_f      # replicated
        self.head = ColumnParallelLinear.from_linear(gpt.head, group, sequence_parallel=sp)
        if self.cfg.tied:
            self.head.weight = self.tok.weight         # the same row block of E on each rank
        if sp:                                         # replicated, but applied to sequence shards
            for ln in [self.ln_f, *(m for block in self.blocks for m in (block.ln1, block.ln2))]:
                for p in ln.parameters():
                    sync_replicated_grad(p, group)
            for p in self.pos.parameters():            # none for a shape without a table (Llama)
                sync_replicated_grad(p, group)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token + position embeddings, (b, s, h); under SP this rank's sequence shard, (b, s/t, h)."""
        s = ids.shape[1]
        if self.sequence_parallel:
            check_divisible("sequence length", s, C.group_size(self.group),
                            "use a sequence length that is a multiple of the TP degree")
            return self.tok(ids) + self.pos(sequence_positions(s, self.group, ids.device))
        return self.tok(ids) + self.pos(torch.arange(s, device=ids.device))

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(ids)                                              # (b, s, V/t)
        per_token = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                 self.tok.vocab_start, self.group)
        return per_token.mean()


def parallelize(gpt: nn.Module, group=None, sequence_parallel: bool = False, *,
                plan: dict | None = None) -> nn.Module:
    """The tensor-parallel form of a full `distlab.models.GPT` over ``group`` (default: all ranks).

    Every rank must pass the same full weights (build with the same seed); each keeps its shard. The
    returned model takes over ``gpt``'s modules: use it, not ``gpt``. Raises ValueError when heads,
    hidden, vocab (or, with ``sequence_parallel``, the sequence length) do not divide by the group size.

    ``plan={"blocks.*.mlp.fc": "colwise", ...}``: any model (your own ``nn.Module``), split module by
    module as the plan says (`plan.py`, like torch's ``parallelize_module``); returns the model itself,
    changed in place. ``group``: a process group, or a 1-D mesh (``mesh["tp"]``) standing for one."""
    group = as_group(group)
    if plan is not None:
        if sequence_parallel:
            raise ValueError("sequence_parallel is offered for distlab's GPT only; drop it with plan=")
        return parallelize_plan(gpt, plan, group)
    if not isinstance(gpt, GPT):
        raise TypeError(f"parallelize(model) without a plan expects a distlab.models.GPT, got "
                        f"{type(gpt).__name__}: pass plan={{'module.name': 'colwise' | 'rowwise' | ...}} "
                        "(see dl.tp.STYLES), as torch's parallelize_module does")
    if isinstance(gpt, TensorParallelGPT) or any(isinstance(b.attn, ParallelAttention) for b in gpt.blocks):
        raise ValueError("this GPT is already tensor-parallel (parallelize takes over its modules); "
                         "parallelize a fresh full GPT")
    cfg, t = gpt.cfg, C.group_size(group)
    check_divisible("heads", cfg.heads, t, "build the model with GPTConfig(heads=...) a multiple of it")
    check_divisible("d_model", cfg.d_model, t, "choose GPTConfig(d_model=...) a multiple of it")
    check_divisible("vocab", cfg.vocab, t, "pad GPTConfig(vocab=...) to a multiple of it")
    if sequence_parallel:
        check_divisible("seq_len", cfg.seq_len, t, "choose GPTConfig(seq_len=...) a multiple of it")
    return TensorParallelGPT(gpt, group, sequence_parallel)


def _gather_full(model: nn.Module, grads: bool, local: dict | None = None) -> dict[str, torch.Tensor]:
    out = {}
    for mod_name, mod in model.named_modules():
        dims = getattr(mod, "shard_dims", {})
        group = getattr(mod, "group", None)
        for p_name, p in mod.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            value = p.grad if grads else p.detach() if local is None else local[name]
            if value is None:
                continue
            if p_name in dims:
                value = C.all_gather(value, dims[p_name], group)
                if hasattr(mod, "unpack"):                 # a packed q|k|v linear (plan.py): reorder
                    value = mod.unpack(value)
            out[name] = value.detach().clone()
    return out


def full_state_dict(model: nn.Module, local: dict | None = None) -> dict[str, torch.Tensor]:
    """Every parameter at full size, keyed as in the plain GPT (collective: call on every rank).

    ``local``: this rank's tensor-parallel parameters by name, when the module holds less: under
    ``dl.fully_shard`` (applied after TP) ``dl.full_state_dict(model)`` gathers them over dp first."""
    return _gather_full(model, grads=False, local=local)


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient at full size, keyed like `full_state_dict` (collective)."""
    return _gather_full(model, grads=True)


def gather_logits(logits: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather vocabulary-split logits (b, s, V/t) into the full (b, s, V) (for checks, not the loss)."""
    return C.all_gather(logits.detach(), -1, group)
