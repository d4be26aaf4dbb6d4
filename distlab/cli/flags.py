"""``distlab train``'s flags, and the keywords of `dl.train` they become.

The options of the typed spec (`distlab.strategies.spec`: one dataclass per concern, each field with its
rule and docstring) are a table here, `OPTIONS`: one row per keyword, its flag, how argparse reads its
value, and its help, grouped by concern in ``--help``. `train_keywords` turns every flag given into its
keyword (a flag not given: not a keyword, so the spec's default holds), then ``--option KEY=VALUE``
(any keyword, the value read as JSON where it can be). The table is written out rather than read from
the spec because the spec imports torch, and ``distlab --help`` answers without it; tests/test_cli_fast.py
checks that every keyword of the spec has a row here or is in `BY_NAME` (set by the strategy's name), that
every row is a keyword of the spec, and that each flag parses into the spec.

    distlab train --strategy diloco --world-size 4 --sync-every 4 --outer-lr 0.5
    distlab train --strategy zero3 --world-size 4 --quantize int8 --offload cpu
    distlab train --strategy ddp --world-size 2 --data text --workers 2 --engine ray
"""
from __future__ import annotations

import argparse
import json
from typing import NamedTuple

from .parser import Defaults


class Opt(NamedTuple):
    """A flag of ``distlab train`` for the spec's keyword ``keyword``: ``--keyword-with-dashes`` unless
    ``flag`` names another (``--no-overlap``), read by argparse with ``how``."""

    keyword: str
    help: str
    how: dict
    flag: str | None = None

    @property
    def name(self) -> str:
        return self.flag or "--" + self.keyword.replace("_", "-")


def _int(metavar: str) -> dict:
    return {"type": int, "metavar": metavar}


def _float(metavar: str) -> dict:
    return {"type": float, "metavar": metavar}


def _bytes(value: str) -> int | str:
    """``--memory-limit 67108864`` (bytes) or ``--memory-limit 64MB`` (the spec's rule reads it)."""
    return int(value) if value.isdigit() else value


def _one_of(*choices) -> dict:
    return {"choices": choices}


ON = {"action": "store_const", "const": True}         # --prefetch: prefetch=True
OFF = {"action": "store_const", "const": False}       # --no-overlap: overlap=False
TEXT = {"metavar": "DIR"}

#: the spec's keywords with a flag of their own, by concern (a group of ``--help``); defaults are the spec's
OPTIONS: dict[str, tuple[Opt, ...]] = {
    "data parallel (ddp, zero1-3, fsdp)": (
        Opt("bucket_mb", "gradient bucket size in MiB (default 25)", _float("MB")),
        Opt("comm", "torch's collectives (default), or distlab's pipelined ring", _one_of("torch", "ring")),
        Opt("overlap", "communicate after backward, not during it", OFF, "--no-overlap"),
        Opt("naive", "ddp: one all-reduce per parameter after backward (the textbook)", ON),
        Opt("compression", "ddp: gradient compression (default none)", _one_of("none", "powersgd")),
        Opt("powersgd_rank", "PowerSGD's rank, its low-rank factors' width (default 4)", _int("R")),
        Opt("error_feedback", "PowerSGD: drop the compression error instead of carrying it into the next "
            "step", OFF, "--no-error-feedback"),
        Opt("max_inflight", "ZeRO: flat gradient buckets alive at once (default 1)", _int("N")),
        Opt("prefetch", "ZeRO-3: gather the next unit early", ON),
        Opt("quantize", "zero3, fsdp: all-gather weights and reduce-scatter gradients as block-scaled int8 "
            "or fp8 packets (ZeRO++ qwZ/qgZ; default: exact collectives)", _one_of("int8", "fp8")),
        Opt("hsdp", "fsdp: R replicas of (world / R) shards", _int("R")),
        Opt("param_dtype", "fsdp: gather and compute dtype", _one_of("bf16", "fp16")),
        Opt("reshard_after_forward", "fsdp: keep the gathered parameters from forward to backward", OFF,
            "--no-reshard-after-forward")),
    "local-sgd, diloco": (
        Opt("sync_every", "inner steps between syncs (default 8)", _int("H")),
        Opt("outer_lr", "diloco: the outer Nesterov SGD's learning rate (default 0.7)", _float("LR")),
        Opt("outer_momentum", "diloco: the outer SGD's momentum (default 0.9)", _float("M"))),
    "pipeline, context and expert parallel": (
        Opt("microbatches", "pp: microbatches per pipeline step (default 2 pp when the rows allow, else pp)",
            _int("M")),
        Opt("virtual", "pp-interleaved: stages per rank (default 2)", _int("V")),
        Opt("balance", "pp: cut the model into stages of equal layers (default) or equal parameters",
            _one_of("layers", "params")),
        Opt("zigzag", "cp: each rank holds chunks r and 2n-1-r of 2n (default: on for ring, off for "
            "Ulysses)", {"action": argparse.BooleanOptionalAction}),
        Opt("experts", "ep: experts split over the ranks (default), or every expert on every rank",
            _one_of("split", "replicated"))),
    "memory": (
        Opt("recompute", "recompute activations in backward: each whole block (full, the default), or only "
            "attention's scores and softmax (selective)",
            {"nargs": "?", "const": "full", "choices": ["full", "selective"]}),
        Opt("memory_limit", "out of memory the moment the ledger crosses this: bytes, or e.g. 64MB",
            {"type": _bytes, "metavar": "BYTES"}),
        Opt("offload", "zero1-3, fsdp: the optimizer state and fp32 masters in host memory (cpu, "
            "ZeRO-Offload) or in files under --offload-dir (disk, ZeRO-Infinity)", _one_of("cpu", "disk")),
        Opt("offload_dir", "--offload disk: the directory its files go under (default: a temporary one)",
            TEXT)),
    "numerics (fp16-mixed)": (
        Opt("loss_scale", "fp16: the initial loss scale S (default 65536.0)", _float("S")),
        Opt("growth_interval", "fp16: good steps in a row before S doubles (default 2000)", _int("N")),
        Opt("skip_nonfinite", "skip, on every rank, a step with an inf/NaN gradient", ON),
        Opt("spike_factor", "a gradient norm above F x the median so far is a spike (default 5.0)",
            _float("F"))),
    "checkpoints and restarts": (
        Opt("checkpoint_dir", "save sharded checkpoints here", TEXT),
        Opt("checkpoint_every", "save every K steps and at the end", _int("K")),
        Opt("keep_last", "keep only the newest N checkpoints", _int("N")),
        Opt("resume", "continue from the latest complete checkpoint (from scratch when there is none; "
            "--option resume=S: from step S)", ON),
        Opt("async_save", "write checkpoints in the background (training stalls only for a copy to CPU "
            "memory)", ON),
        Opt("engine", "who starts and restarts the ranks: local (dl.launch here, the default) or ray (Ray "
            "Train, pip install 'distlab[ray]'; --max-restarts is its max_failures)",
            _one_of("local", "ray"))),
    "fault injection": (
        Opt("fail_at_step", "SIGKILL a rank at step S (first attempt only)", _int("S")),
        Opt("fail_rank", "the rank --fail-at-step kills (default: the last)", _int("R")),
        Opt("fail_in", "kill it at the start of the step (default) or while saving checkpoint S",
            _one_of("step", "save")),
        Opt("nan_at_step", "a NaN in one gradient at step S", _int("S")),
        Opt("nan_rank", "the rank whose gradient gets the NaN (default 0)", _int("R"))),
    "data": (
        Opt("data", "the model's synthetic data (default), or the shipped text corpus through dl.data's "
            "loader", _one_of("synthetic", "text")),
        Opt("workers", "text: loader threads reading ahead (default 0: each step reads its own batch)",
            _int("N")),
        Opt("read_ahead", "text: batches in flight per worker (default 2)", _int("N")),
        Opt("data_latency", "text: seconds of (simulated) slow storage per batch read (default 0.0)",
            _float("S")),
        Opt("shuffle", "text: keep the corpus's order (default: shuffled each epoch)", OFF, "--no-shuffle"),
        Opt("drop_last", "text: skip an epoch's tail shorter than a batch", ON)),
    "output": (                                       # then --option, --json, --progress, --traceback
        Opt("profile", "torch.profiler traces to DIR (DIR/trace.json: every rank); comm and MFU printed",
            TEXT),),
}
_NAMED = "the strategy's name sets it: 3d:dp=2,tp=2,pp=2,schedule=gpipe, tp-sp, cp-ulysses"
#: the spec's keywords without a flag of their own, and why; ``--option KEY=VALUE`` sets any of them
WITHOUT_FLAG = {**dict.fromkeys(("dp", "tp", "pp", "cp", "ep", "zero", "sequence_parallel", "schedule",
                                 "attention"), _NAMED),
                "no_sync": "on by default (zero3: off); --option no_sync=false communicates every micro-step",
                "heartbeat": "dl.train sets it for its restarts"}


def add_train_parser(sub) -> None:
    """``distlab train`` on the subparsers ``sub``: the run's own flags, then `OPTIONS` by concern."""
    p = sub.add_parser("train", help="train a model with a parallel strategy and print per-step losses",
                       formatter_class=Defaults)
    p.add_argument("--strategy", default="single",
                   help="single, ddp, zero1, zero2, zero3, fsdp, tp, pp-1f1b, local-sgd, diloco, "
                        "3d:dp=2,tp=2,pp=2, ... (see `distlab strategies`)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks to launch (default 1; under torchrun, torchrun's WORLD_SIZE, which it must "
                        "equal)")
    p.add_argument("--model", default="gpt-tiny",
                   help="gpt-tiny, gpt-small, gpt-wide, gpt-moe-tiny (for ep) or mlp; with --backend fake "
                        "also gpt3-175b, llama3-8b, llama3-70b, llama3-405b")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps; a dry run (--backend fake) takes 1 unless given (default: 20)")
    p.add_argument("--seed", type=int, default=0, help="weights and data")
    p.add_argument("--global-batch", type=int, default=None,
                   help="rows per step, over all ranks (default 16; a dry run one row per microbatch)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"], help="optimizer")
    p.add_argument("--weight-decay", type=float, default=0.0, help="weight decay")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per step")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed", "fp16-mixed"],
                   help="compute precision")
    p.add_argument("--clip", type=float, default=None, help="clip the gradient norm to this")
    for title, rows in OPTIONS.items():
        if title == "output":
            _dry_run_flags(p.add_argument_group("dry run (no training: the fake backend)"))
        group = p.add_argument_group(title)
        for row in rows:
            group.add_argument(row.name, dest=row.keyword, default=None, help=row.help, **row.how)
        if title == "checkpoints and restarts":
            _restart_flags(group)
        if title == "output":
            _output_flags(group)


def _restart_flags(p) -> None:
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="relaunch a failed run from its newest checkpoint up to K times")
    p.add_argument("--shrink", nargs="?", const="auto", default=None, metavar="SIZES",
                   help="restart on one rank fewer each time, or on the given world sizes (e.g. 3,2)")


def _dry_run_flags(p) -> None:
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "fake"],
                   help="fake: a dry run of the --ranks listed, here, at any world size (NaN losses)")
    p.add_argument("--ranks", default=None, metavar="R,R,...",
                   help="with --backend fake: the ranks to run, e.g. 0,1023")


def _output_flags(p) -> None:
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="any option of `distlab strategies` (value parsed as JSON when it can be); "
                        "given after the flags, it wins")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write settings, losses, step times, bytes and memory here ('-': stdout, "
                        "the table then goes to stderr)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a bar with step, loss and it/s on stderr (default: when stderr is a terminal)")
    p.add_argument("--traceback", action="store_true", help="on an error, show the full traceback")


def train_keywords(args) -> dict:
    """``distlab train``'s flags as `dl.train`'s keywords (the strategy aside): the same keywords a
    notebook would pass, parsed into the same typed spec (`distlab.strategies.parse`)."""
    kw = dict(model=args.model, seed=args.seed, lr=args.lr, optimizer=args.optimizer,
              weight_decay=args.weight_decay, grad_accum=args.grad_accum, precision=args.precision,
              clip=args.clip)
    flags = {"steps": args.steps, "global_batch": args.global_batch}      # None: train's default
    flags.update({row.keyword: getattr(args, row.keyword, None) for rows in OPTIONS.values() for row in rows})
    kw.update({k: v for k, v in flags.items() if v is not None})         # a flag not given: not a keyword
    if args.backend != "auto":
        kw["backend"] = args.backend
    if args.ranks is not None:
        try:
            kw["ranks"] = [int(r) for r in args.ranks.split(",")]
        except ValueError:
            raise ValueError(f"--ranks expects rank numbers separated by commas (e.g. 0,1023), got "
                             f"{args.ranks!r}") from None
    kw.update(_restart_args(args))
    for item in args.option:
        if "=" not in item:
            raise ValueError(f"--option expects KEY=VALUE (e.g. --option microbatches=4), got {item!r}")
        key, value = item.split("=", 1)
        try:
            kw[key] = json.loads(value)
        except json.JSONDecodeError:
            kw[key] = value
    return kw


def _restart_args(args) -> dict:
    """``max_restarts`` and ``shrink`` for `dl.train` from ``--max-restarts`` and ``--shrink [SIZES]``."""
    out = {"max_restarts": args.max_restarts} if args.max_restarts else {}
    if args.shrink is not None:
        try:
            out["shrink"] = True if args.shrink == "auto" else [int(n) for n in args.shrink.split(",")]
        except ValueError:
            raise ValueError(f"--shrink expects world sizes like 3,2 (or nothing: one rank fewer per "
                             f"restart), got {args.shrink!r}") from None
    return out
