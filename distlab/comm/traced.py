"""``dl.comm``'s public entry points: each algorithm run inside a traced call, from outside.

The algorithm files (``ring.py``, ``tree.py``, ``naive.py``, ``all_to_all.py``, ``ring_pipelined.py``,
``shift.py``) carry no labels: every byte they move goes through a primitive of ``p2p.py``, which
records one comm event per step. What those events belong to is said here, once per call:

    dl.comm.ring_all_reduce(t)  =  with p2p.call("ring_all_reduce", t):   # a fresh call id, steps counted
                                       ring.ring_all_reduce(t)             # from 0, size: t's bytes

Called directly (``distlab.comm.ring.ring_all_reduce``), an algorithm runs the same and its steps are
recorded as bare ``"exchange"`` events. The pipelined ring records under the textbook ring's names,
so the two read alike in the trace.
"""
from __future__ import annotations

import functools
import inspect

from . import all_to_all as _all_to_all
from . import naive, ring, ring_pipelined, shift, tree
from .p2p import call


def traced(name: str, algorithm, size_of: str = "input"):
    """``algorithm`` run inside ``call(name, ...)``; the call's size is the bytes of its first argument
    (``size_of="input"``) or of what it returns (``"output"``: an all-gather's size is its result's).
    The entry point keeps the algorithm's name, signature and docstring (``inspect.getsource`` of it
    shows the algorithm)."""
    first = next(iter(inspect.signature(algorithm).parameters))

    @functools.wraps(algorithm)
    def entry(*args, **kwargs):
        with call(name, args[0] if args else kwargs.get(first)) as c:
            result = algorithm(*args, **kwargs)
            if size_of == "output":
                c.message = result
        return result
    return entry


ring_all_reduce = traced("ring_all_reduce", ring.ring_all_reduce)
ring_reduce_scatter = traced("ring_reduce_scatter", ring.ring_reduce_scatter)
ring_all_gather = traced("ring_all_gather", ring.ring_all_gather, size_of="output")
pipelined_all_reduce = traced("ring_all_reduce", ring_pipelined.pipelined_all_reduce)
pipelined_reduce_scatter = traced("ring_reduce_scatter", ring_pipelined.pipelined_reduce_scatter)
pipelined_all_gather = traced("ring_all_gather", ring_pipelined.pipelined_all_gather, size_of="output")
broadcast = traced("broadcast", tree.broadcast)
naive_all_reduce = traced("naive_all_reduce", naive.naive_all_reduce)
all_to_all = traced("all_to_all", _all_to_all.all_to_all)
ring_shift = traced("ring_shift", shift.ring_shift)
start_ring_shift = traced("ring_shift", shift.start_ring_shift)
