"""Decoder-only Hugging Face models cut between their blocks: what a block needs from its parent,
recomputed on every stage.

A ``LlamaForCausalLM`` is *almost* a chain. Its ``LlamaModel.forward`` makes three things once and
hands them to every decoder layer::

    h = embed_tokens(ids)                                   # (b, s) -> (b, s, d)
    positions = arange(s)                                   # (1, s)
    cos, sin = rotary_emb(h, positions)                     # (1, s, head_dim) each: RoPE, Su et al. 2021
    mask = create_causal_mask(config, h, ...)               # None under sdpa (is_causal), else (b, 1, s, s)
    h = layers.i(h, attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin))  # each i
    logits = lm_head(norm(h))

Only ``h`` has to cross a stage boundary: the positions, the rotary (cos, sin) and the causal mask
depend on nothing but the sequence length (no padding, no KV cache in training), so each stage
recomputes them from the ``h`` it receives -- the same values, no extra messages. That is what the
hand-written wrappers around ``LlamaDecoderLayer`` did; a *family* here writes it once::

    Llama, Qwen2, Mistral (has model.layers + model.rotary_emb):
        model.embed_tokens | model.layers.0 ... model.layers.L-1 | model.norm | lm_head
    GPT-2 (has transformer.h):
        transformer.wte | transformer.wpe | transformer.h.0 ... | transformer.ln_f | lm_head

GPT-2's learned positions are a step of their own: ``transformer.wpe`` maps h to
``drop(h + wpe(arange(s)))``, so the chain stays one tensor per link whatever the cut.

Families are recognised by their module structure, not their class, and ``transformers`` (an
optional extra) is imported only to build a mask, inside a running stage.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn


class Decoder:
    """A family of decoder-only models: its chain of module names, and how a stage calls each name.

    ``base`` is the prefix of the decoder inside the model (``"model."`` in a ``LlamaForCausalLM``,
    ``""`` for a bare ``LlamaModel``); ``blocks`` is the name of its list of blocks.
    """

    blocks = ""

    def __init__(self, model: nn.Module, base: str):
        self.base, self.config = base, model.config
        self.head = ["lm_head"] if isinstance(getattr(model, "lm_head", None), nn.Module) else []

    def block_index(self, name: str) -> int | None:
        """``i`` for the name ``{base}{blocks}.i``, else None."""
        prefix = f"{self.base}{self.blocks}."
        rest = name[len(prefix):] if name.startswith(prefix) else ""
        return int(rest) if rest.isdigit() else None

    def helpers(self, names: list[str]) -> list[str]:
        """Modules without parameters a stage holding ``names`` needs besides them (e.g. the rotary)."""
        return []


class RotaryDecoder(Decoder):
    """Llama, Qwen2, Mistral and kin: blocks called with the rotary (cos, sin), positions and mask."""

    blocks = "layers"

    def chain(self, model: nn.Module) -> list[str]:
        layers = len(model.get_submodule(self.base + "layers"))
        return [f"{self.base}embed_tokens", *(f"{self.base}layers.{i}" for i in range(layers)),
                f"{self.base}norm", *self.head]

    def helpers(self, names: list[str]) -> list[str]:
        return [f"{self.base}rotary_emb"] if any(self.block_index(n) is not None for n in names) else []

    def call(self, stage: nn.Module, name: str, x: torch.Tensor, shared: dict) -> torch.Tensor:
        i = self.block_index(name)
        if i is None:
            return stage.get_submodule(name)(x)              # embed_tokens, norm, lm_head: one tensor in, out
        if not shared:                                       # once per stage forward, as the parent does
            shared["positions"] = positions(x)
            shared["rotary"] = stage.get_submodule(self.base + "rotary_emb")(x, shared["positions"])
        kind = _attention_kind(self.config, i)
        if kind not in shared:
            sliding = kind == "sliding_attention"
            shared[kind] = causal_mask(self.config, x, shared["positions"], sliding=sliding)
        out = stage.get_submodule(name)(x, attention_mask=shared[kind], position_ids=shared["positions"],
                                        position_embeddings=shared["rotary"])
        return out[0] if isinstance(out, tuple) else out     # (transformers 4.x returned a tuple)


class GPT2Decoder(Decoder):
    """GPT-2: learned positions added by the ``wpe`` step, blocks called with the causal mask."""

    blocks = "h"

    def chain(self, model: nn.Module) -> list[str]:
        layers = len(model.get_submodule(self.base + "h"))
        return [f"{self.base}wte", f"{self.base}wpe", *(f"{self.base}h.{i}" for i in range(layers)),
                f"{self.base}ln_f", *self.head]

    def helpers(self, names: list[str]) -> list[str]:
        return [f"{self.base}drop"] if f"{self.base}wpe" in names else []

    def call(self, stage: nn.Module, name: str, x: torch.Tensor, shared: dict) -> torch.Tensor:
        if name == f"{self.base}wpe":                        # h + wpe(positions), then embedding dropout
            return stage.get_submodule(self.base + "drop")(x + stage.get_submodule(name)(positions(x)))
        if self.block_index(name) is None:
            return stage.get_submodule(name)(x)              # wte, ln_f, lm_head
        if "mask" not in shared:
            shared["mask"] = causal_mask(self.config, x, positions(x))
        out = stage.get_submodule(name)(x, attention_mask=shared["mask"])
        return out[0] if isinstance(out, tuple) else out


def decoder_of(model: nn.Module) -> Decoder | None:
    """The family ``model`` belongs to, recognised by its modules (it or its ``.model`` /
    ``.transformer``), or None for a model that is not a Hugging Face decoder."""
    if not hasattr(model, "config"):
        return None
    for base in ("", "model.", "transformer."):
        try:
            inner = model.get_submodule(base.rstrip(".")) if base else model
        except AttributeError:
            continue
        if _has(inner, "embed_tokens", "layers", "rotary_emb", "norm"):
            return RotaryDecoder(model, base)
        if _has(inner, "wte", "wpe", "h", "ln_f", "drop"):
            return GPT2Decoder(model, base)
    return None


def _has(module: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Module) for n in names)


# -- what the parent makes once: positions and the causal mask ----------------------------------------
def positions(x: torch.Tensor) -> torch.Tensor:
    """Token positions 0..s-1 of hidden states (b, s, d), shaped (1, s) as the parent makes them."""
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


def _attention_kind(config, layer: int) -> str:
    """``"full_attention"`` or ``"sliding_attention"`` for layer ``layer`` (Qwen2's ``layer_types``,
    Mistral's ``sliding_window``)."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return kinds[layer]
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return "sliding_attention" if window else "full_attention"


def causal_mask(config, x: torch.Tensor, position_ids: torch.Tensor, sliding: bool = False):
    """The mask the parent passes its blocks, made by transformers' own ``masking_utils`` for the
    configured attention: None under sdpa without padding (its ``is_causal`` path), a (b, 1, s, s)
    additive mask under eager. No padding mask: every row is a full sequence."""
    from transformers import masking_utils      # an optional extra, so imported here, on first use

    make = masking_utils.create_sliding_window_causal_mask if sliding else masking_utils.create_causal_mask
    params = inspect.signature(make).parameters  # the keyword names moved between 4.x and 5.x
    kw = {"config": config, "attention_mask": None, "position_ids": position_ids,
          ("inputs_embeds" if "inputs_embeds" in params else "input_embeds"): x,
          ("cache" if "cache" in params else "past_key_values"): None}
    if "cache_position" in params:
        kw["cache_position"] = position_ids[0]
    return make(**kw)
