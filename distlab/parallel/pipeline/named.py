"""Pipeline stages of *your* model, by module names: a stage runs its named modules one after another.

    chain = dl.pp.chain(model)           # ['embed', 'blocks.0', 'blocks.1', 'blocks.2', 'norm', 'head']
    stages = dl.pp.cut(chain, at=["blocks.1", "blocks.2"])    # cut before each: 3 stages
    #      [['embed', 'blocks.0'], ['blocks.1'], ['blocks.2', 'norm', 'head']]
    stage = dl.pp.named_stage(model, stages[r])               # this rank's stage module
    pipe = dl.pp.Pipeline(stage, r, 3, schedule="1f1b", microbatches=4)

A stage is the composition of its modules, so the model must *be* that chain: its forward calls its
modules in that order, each feeding the next, with nothing between them (a residual, a reshape, an
``x + pos`` belongs inside a module). That is what a pipeline needs anyway -- one tensor on each
link between ranks -- and what torch's ``torch.distributed.pipelining`` finds by tracing (its
``SplitPoint.BEGINNING`` at a module name is ``cut(..., at=[name])``). A stage keeps the model's
parameter names (``blocks.1.mlp.fc.weight`` on whichever stage holds ``blocks.1``) and shares the
model's parameters, so results compare with one process name by name.

Hugging Face decoders (Llama, Qwen2, Mistral, GPT-2...) are chains but for what their parent hands
every block (rotary embeddings, positions, causal mask): `decoders.py` recognises them, so
``chain(llama)`` lists ``model.embed_tokens, model.layers.0, ..., model.norm, lm_head`` and a stage
recomputes what its blocks need. A module that returns a ``ModelOutput``, tuple or dict passes one
tensor on: see `tensor_of`.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from .decoders import decoder_of


def chain(model: nn.Module) -> list[str]:
    """The model's children in registration order, an ``nn.ModuleList`` / ``nn.Sequential`` child
    opened into its items (``blocks.0``, ``blocks.1``...): the chain most models are written as.
    A Hugging Face decoder gives its blocks' chain (`decoders.py`)."""
    decoder = decoder_of(model)
    if decoder is not None:
        return decoder.chain(model)
    out = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            out += [f"{name}.{i}" for i in range(len(child))]
        else:
            out.append(name)
    return out


def cut(names: list[str], at: list[str]) -> list[list[str]]:
    """``names`` cut before each of ``at`` (in chain order): len(at) + 1 stages, none empty."""
    missing = [a for a in at if a not in names]
    if missing:
        raise ValueError(f"cut points {missing} are not in the chain {names}")
    points = sorted(names.index(a) for a in at)
    if len(set(points)) != len(points) or (points and points[0] == 0):
        raise ValueError(f"cut points {at} must be distinct and after the first module {names[0]!r}: "
                         "every stage needs at least one module")
    bounds = [0, *points, len(names)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


class NamedStage(nn.Module):
    """Modules ``names`` of ``model`` run in order, registered under their own dotted names.

    ``output``: which tensor of a module's ``ModelOutput`` / tuple / dict flows on (see `tensor_of`):
    a key or index for the stage's last module, or ``{module name: key or index}``; by default
    ``last_hidden_state``, else ``logits``, else the first tensor. In a Hugging Face decoder the
    stage also holds the parameterless modules its blocks need (e.g. ``model.rotary_emb``).
    """

    def __init__(self, model: nn.Module, names: list[str], output=None):
        super().__init__()
        if not names:
            raise ValueError("a stage needs at least one module name")
        self.names = list(names)
        self.decoder = decoder_of(model)
        self.picks = dict(output) if isinstance(output, dict) else {self.names[-1]: output}
        unknown = sorted(set(self.picks) - set(self.names))
        if unknown:
            raise ValueError(f"output= names modules {unknown} that are not in this stage {self.names}")
        helpers = self.decoder.helpers(self.names) if self.decoder is not None else []
        for name in self.names + helpers:
            try:
                module = model.get_submodule(name)
            except AttributeError:
                raise ValueError(f"{type(model).__name__} has no module {name!r}; its chain is "
                                 f"{chain(model)}") from None
            self._place(name, module)

    def _place(self, name: str, module: nn.Module) -> None:
        """Register ``module`` at ``name`` (``blocks.1`` -> a container ``blocks`` holding ``1``)."""
        parent: nn.Module = self
        *path, leaf = name.split(".")
        for part in path:
            if part not in parent._modules:
                parent.add_module(part, nn.Module())
            parent = parent._modules[part]
        if leaf in parent._modules:
            raise ValueError(f"module {name!r} is named twice in this stage")
        parent.add_module(leaf, module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared: dict = {}        # a decoder's positions, rotary and masks: made once per forward
        for name in self.names:
            if self.decoder is not None:
                x = self.decoder.call(self, name, x, shared)
            else:
                x = self.get_submodule(name)(x)
            x = tensor_of(x, self.picks.get(name), f"module {name!r}")
        return x


def named_stage(model: nn.Module, names: list[str], output=None) -> NamedStage:
    """The stage module that runs ``names`` of ``model`` in order (shares its parameters); ``output``
    names the tensor that flows on where a module returns several (see `NamedStage`)."""
    return NamedStage(model, names, output)


def tensor_of(out, output=None, what: str = "the stage"):
    """The one tensor of ``out`` that flows to the next module or stage.

    A tensor is itself. From a ``ModelOutput`` or dict: ``out[output]`` if ``output`` is given, else
    ``last_hidden_state``, else ``logits``, else the first tensor value; from a tuple or list:
    ``out[output]``, else the first tensor. Anything else, or nothing that is a tensor: a ValueError
    saying what ``what`` returned and how to name the tensor.
    """
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        items = [(k, v) for k, v in out.items()]
        default = [k for k in ("last_hidden_state", "logits") if isinstance(out.get(k), torch.Tensor)]
    elif isinstance(out, (tuple, list)):
        items, default = list(enumerate(out)), []
    else:
        raise ValueError(f"{what} returned a {type(out).__name__}, not a tensor: a pipeline passes one "
                         "tensor between stages; make it return a tensor (or a ModelOutput, tuple or dict "
                         "holding one)")
    tensors = [k for k, v in items if isinstance(v, torch.Tensor)]
    shown = ", ".join(f"{k!r}: {type(v).__name__}" for k, v in items) or "nothing"
    if output is not None:
        if output not in tensors:
            raise ValueError(f"{what} returned a {type(out).__name__} of {{{shown}}}: output={output!r} "
                             f"is not one of its tensors {tensors}")
        return out[output]
    if not (default or tensors):
        raise ValueError(f"{what} returned a {type(out).__name__} holding no tensor ({{{shown}}}): a "
                         "pipeline passes one tensor between stages; make it return one")
    return out[(default or tensors)[0]]


def check_stages(model: nn.Module, stages: list[list[str]]) -> None:
    """Every parameter of ``model`` on exactly one stage; no module on two."""
    seen: dict[int, int] = {}
    for s, names in enumerate(stages):
        for name, p in NamedStage(model, names).named_parameters():
            if seen.setdefault(id(p), s) != s:
                raise ValueError(f"parameter {name!r} is on stages {seen[id(p)]} and {s}: give each module "
                                 "one stage; a weight tied between two modules (an embedding and its head, "
                                 "tie_word_embeddings=True) cannot be cut apart: untie it")
    orphans = [n for n, p in model.named_parameters() if id(p) not in seen]
    if orphans:
        raise ValueError(f"parameters on no stage: {orphans[:4]}: add their modules to a stage")
