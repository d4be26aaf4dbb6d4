"""`parse`: a strategy name and keywords -> the typed `TrainSpec`, the one way a spec is made from what a
user writes (``dl.train(...)``'s arguments, ``distlab train``'s flags).

A strategy name is a preset of the layout plus the keywords its family reads (`NAMED`); a mesh spells
its layout out in its name, ``"3d:dp=2,tp=2,pp=2,schedule=gpipe"``, and takes every layout keyword::

    parse("zero2", bucket_mb=1)                  Layout(dp=None, zero=2), DataParallel(bucket_mb=1)
    parse("3d:dp=2,tp=2,pp=2,schedule=gpipe")    Layout(dp=2, tp=2, pp=2, schedule="gpipe")
    parse("3d:dp=2,tp=2", pp=2, schedule="gpipe")    the same layout (keywords win over the name)

Names are checked here: an unknown strategy is a ValueError, a keyword the strategy does not read a
TypeError, each with a did-you-mean; values are checked by each field's rule as the spec is made.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, fields

from ..checkpoint.options import OPTIONS as CHECKPOINT_OPTIONS
from ..rules import Flag, Number, Whole, rule_of
from .spec import CONCERNS, WHERE, DataLoading, DataParallel, Layout, Numerics, Restart, TrainSpec


@dataclass(frozen=True)
class Named:
    """A strategy name: the layout it sets (None: the ranks left) and the keywords its family reads."""

    layout: dict
    reads: tuple[str, ...] = ()


_DDP = ("bucket_mb", "overlap", "comm", "naive", "no_sync", "compression", "powersgd_rank", "error_feedback")
_OFFLOAD = ("offload", "offload_dir")
_ZERO = ("bucket_mb", "overlap", "comm", "no_sync", "max_inflight") + _OFFLOAD
_PIPE = ("microbatches", "balance")
_MESH = tuple(f.name for f in fields(Layout) if f.name != "experts") + ("sp", "bucket_mb")
#: every strategy name (the mesh as "3d"): what it sets, what its family reads (``single`` takes ddp's
#: keywords and ignores them, so one set of keywords runs the reference and ddp side by side)
NAMED = {
    "single": Named({}, _DDP),
    "ddp": Named({"dp": None}, _DDP),
    "zero1": Named({"dp": None, "zero": 1}, _ZERO),
    "zero2": Named({"dp": None, "zero": 2}, _ZERO),
    "zero3": Named({"dp": None, "zero": 3}, _ZERO + ("prefetch", "quantize")),
    "fsdp": Named({"dp": None, "zero": 3},
                  ("hsdp", "param_dtype", "reshard_after_forward", "no_sync", "quantize") + _OFFLOAD),
    "tp": Named({"tp": None}, ("sequence_parallel",)),
    "tp-sp": Named({"tp": None, "sequence_parallel": True}),
    "pp-gpipe": Named({"pp": None, "schedule": "gpipe"}, _PIPE),
    "pp-1f1b": Named({"pp": None, "schedule": "1f1b"}, _PIPE),
    "pp-interleaved": Named({"pp": None, "schedule": "interleaved"}, _PIPE + ("virtual",)),
    "pp-zb-h1": Named({"pp": None, "schedule": "zb-h1"}, _PIPE),
    "ep": Named({"ep": None}, ("dp", "experts", "bucket_mb")),
    "cp-ring": Named({"cp": None, "attention": "ring"}, ("dp", "tp", "zigzag", "bucket_mb")),
    "cp-ulysses": Named({"cp": None, "attention": "ulysses"}, ("dp", "tp", "zigzag", "bucket_mb")),
    "local-sgd": Named({"dp": None}, ("sync_every", "comm")),
    "diloco": Named({"dp": None}, ("sync_every", "outer_lr", "outer_momentum", "comm")),
    "3d": Named({}, _MESH),
}
#: how `names` and the CLI show the mesh entry: the form `dl.train` takes
MESH_FORM = "3d:dp=D,tp=T,pp=P"
ALIASES = {"sp": "sequence_parallel"}
#: the keywords every strategy takes: the loop's (memory), the numerics', the checkpoint's, the data's and
#: the profiler's
SHARED = (("memory_limit", "recompute") + CHECKPOINT_OPTIONS + tuple(f.name for f in fields(DataLoading))
          + ("profile",))
TOP = tuple(f.name for f in fields(TrainSpec) if f.name not in CONCERNS and f.name != "strategy")
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def names() -> list[str]:
    """Every strategy name, the mesh in the form `dl.train` takes (``3d:dp=D,tp=T,pp=P``)."""
    return [MESH_FORM if n == "3d" else n for n in NAMED]


def key(strategy: str) -> str:
    """The entry of `NAMED` for ``strategy`` (every mesh: "3d"); an unknown name is a ValueError."""
    found = "3d" if strategy.startswith("3d:") else strategy
    if found not in NAMED:
        close = difflib.get_close_matches(strategy, list(NAMED), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown strategy {strategy!r}{hint}: choose one of {names()} "
                         "(meshes as '3d:dp=2,tp=2,pp=2')")
    return found


def options(strategy: str) -> tuple[str, ...]:
    """The keywords ``strategy`` reads: its family's, then those every strategy takes (`SHARED`, and the
    numerics', refused by value where unsupported: `numerics.check`)."""
    return NAMED[key(strategy)].reads + SHARED + tuple(f.name for f in fields(Numerics))


def parse(strategy: str = "single", **keywords) -> TrainSpec:
    """The `TrainSpec` of ``strategy`` with ``keywords`` (`dl.train`'s parameters and options)."""
    rule_of(TrainSpec, "strategy").check("strategy", strategy)
    name = key(strategy)
    given = {**_read_mesh(strategy), **keywords} if name == "3d" else dict(keywords)
    check_names(strategy, [k for k in given if k not in TOP + tuple(f.name for f in fields(Restart))])
    for alias, field_name in ALIASES.items():        # the alias's own name in its error
        if alias in given:
            rule_of(Layout, field_name).check(alias, given[alias])
            given[field_name] = given.pop(alias)
    preset = TrainSpec(strategy, layout=Layout(**NAMED[name].layout))     # what the name alone says
    return preset.replace(**given)                                          # each keyword into its concern


def describe(keyword: str) -> str:
    """What ``keyword`` sets, in words: the docstring of its field in the typed spec (an alias: its
    field's), as ``distlab strategies`` lists it."""
    if keyword in ALIASES:
        return f"the same as {ALIASES[keyword]}"
    cls = CONCERNS[WHERE[keyword]] if keyword in WHERE else TrainSpec
    return next((f.metadata.get("doc", "") for f in fields(cls) if f.name == keyword), "")


def keywords_of(spec: TrainSpec) -> dict:
    """The keywords that, beside ``spec.strategy``, `parse` turns back into ``spec``: every field whose
    value is not what the name alone gives (``parse(s.strategy, **keywords_of(s)) == s``)."""
    base, out = parse(spec.strategy), {}
    for name in TOP:
        if getattr(spec, name) != getattr(base, name):
            out[name] = getattr(spec, name)
    for concern in CONCERNS:
        mine, theirs = getattr(spec, concern), getattr(base, concern)
        out.update({f.name: getattr(mine, f.name) for f in fields(mine)
                    if getattr(mine, f.name) != getattr(theirs, f.name)})
    return out


def check_names(strategy: str, given) -> None:
    """TypeError for any of ``given`` (keyword names) that ``strategy`` does not read: names its valid
    options, the closest one, and the strategies that do take a misplaced one."""
    valid = options(strategy)
    for k in given:
        if k in valid:
            continue
        close = difflib.get_close_matches(k, valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        takers = [n for n in names() if k in options(n)]
        where = f"; {k!r} is an option of {', '.join(takers)}" if takers and not close else ""
        own = ", ".join(NAMED[key(strategy)].reads) or "none of its own"
        raise TypeError(f"strategy {strategy!r} has no option {k!r}{hint}{where}. Its options: {own}; "
                        f"and, for every strategy, {', '.join(SHARED)}")


def _read_mesh(strategy: str) -> dict:
    """``"3d:dp=2,tp=2,pp=2,zero=1"`` -> {"dp": 2, "tp": 2, "pp": 2, "zero": 1}: each value read as its
    field's rule takes it (an integer, a number, true/false, a word); a degree not named is 1."""
    found: dict = {}
    for item in filter(None, (s.strip() for s in strategy[3:].split(","))):
        k, eq, value = item.partition("=")
        k = k.strip()
        if not eq or k not in _MESH:
            close = difflib.get_close_matches(k, _MESH, n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close and eq else ""
            raise ValueError(f"{strategy!r}: cannot read {item!r}{hint}; write key=value with keys from "
                             f"{_MESH}, e.g. '3d:dp=2,tp=2,pp=2'")
        found[k] = _read_value(strategy, k, value.strip())
    return found


def _read_value(strategy: str, k: str, text: str):
    """The value of ``k=text`` written in a mesh's name, as its keyword would be given."""
    rule = rule_of(DataParallel, k) if k == "bucket_mb" else rule_of(Layout, ALIASES.get(k, k))
    if isinstance(rule, Flag) or k in ALIASES or k == "zigzag":
        if text.lower() not in _TRUE + _FALSE:
            raise ValueError(f"{strategy!r}: {k}={text!r} must be true or false (or 1 or 0)")
        return text.lower() in _TRUE
    converter = int if isinstance(rule, Whole) or k == "zero" else float if isinstance(rule, Number) else str
    try:
        return converter(text)
    except ValueError:
        raise ValueError(f"{strategy!r}: {k}={text!r} must be "
                         f"{'an integer' if converter is int else 'a number'}") from None
