"""How a piece is cut out of its tensor: the four cuts distlab's layouts make, and a cut of a cut.

A parameter of logical shape (d0, d1, ...) that no rank holds whole is held in pieces, each cut out of
it in one of four ways (`distlab.parallel.placement` says which layout cuts which way):

    W (5, 2) over 2 ranks    rank 0                     rank 1
      rows                   W[0:3]                     W[3:5]              (ceil(5 / 2) = 3 rows a rank)
      block, dim 1           W[:, 0:1]                  W[:, 1:2]
      flat, in a bucket      W.flatten()[0:6]           W.flatten()[6:10]   (bucket [W | b (2,)], 12
                                                        and b whole          elements, 6 a rank)

``packed=k`` (a fused q|k|v): the tensor is k blocks side by side along ``dim``, and rank i holds block i
of each. ``then``: a cut of the piece this cut leaves (fully_shard over tensor-parallel blocks: rows of
this rank's block). `take` cuts a piece out, `put` writes one back in place: the same arithmetic both
ways, so a checkpoint can be written in one layout and read back in any other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KEYS = {"whole": (), "rows": ("start", "stop"), "flat": ("start", "stop"),
        "block": ("dim", "index", "parts", "packed")}          # the fields each kind uses


@dataclass(frozen=True)
class Cut:
    """How a piece is cut out of its logical tensor (see the module docstring for the kinds)."""

    kind: str = "whole"                 # "whole" | "rows" | "flat" | "block"
    start: int = 0                      # rows, flat: [start, stop)
    stop: int = 0
    dim: int = 0                        # block: block `index` of `parts` along `dim`, of each of `packed`
    index: int = 0
    parts: int = 1
    packed: int = 1
    then: Cut | None = None             # a cut of this cut's piece

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This cut's piece of ``full`` (a view where one exists)."""
        piece = self._take(full)
        return piece if self.then is None else self.then.take(piece)

    def put(self, full: torch.Tensor, piece: torch.Tensor) -> None:
        """Write ``piece`` where this cut sits in ``full`` (a contiguous tensor of the logical shape)."""
        if self.then is not None:                    # read, write the inner piece into it, write it back
            outer = self._take(full).clone()
            self.then.put(outer, piece)
            piece = outer
        if self.kind == "whole":
            full.copy_(piece)
        elif self.kind == "rows":
            full[self.start:self.stop].copy_(piece)
        elif self.kind == "flat":
            full.view(-1)[self.start:self.stop].copy_(piece.reshape(-1))
        else:
            view = self._block(full)
            view.copy_(piece.reshape(view.shape))

    def _take(self, full: torch.Tensor) -> torch.Tensor:
        if self.kind == "whole":
            return full
        if self.kind == "rows":
            return full[self.start:self.stop]
        if self.kind == "flat":
            return full.reshape(-1)[self.start:self.stop]
        shape = (*full.shape[:self.dim], full.shape[self.dim] // self.parts, *full.shape[self.dim + 1:])
        return self._block(full).reshape(shape)

    def _block(self, full: torch.Tensor) -> torch.Tensor:
        """(..., packed, d / packed, ...) narrowed to this rank's block of each packed part."""
        d = full.shape[self.dim]
        split = [*full.shape[:self.dim], self.packed, d // self.packed, *full.shape[self.dim + 1:]]
        size = d // self.packed // self.parts
        return full.view(split).narrow(self.dim + 1, self.index * size, size)

    def as_dict(self) -> dict:
        """The JSON form a manifest records (only the fields this kind uses)."""
        out = {"kind": self.kind, **{k: getattr(self, k) for k in KEYS[self.kind]}}
        return out if self.then is None else {**out, "then": self.then.as_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> Cut:
        """The cut a manifest records (`as_dict`); an unknown kind or field is refused."""
        if d.get("kind") not in KEYS or set(d) - {"kind", "then", *KEYS[d["kind"]]}:
            raise ValueError(f"{d} is not a cut: kinds {sorted(KEYS)}, fields as_dict writes")
        fields = {k: int(d[k]) for k in KEYS[d["kind"]]}
        then = cls.from_dict(d["then"]) if d.get("then") is not None else None
        return cls(d["kind"], **fields, then=then)
