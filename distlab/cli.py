"""The ``distlab`` command.

    distlab train --strategy zero2 --world-size 4 --model gpt-tiny --steps 20
    distlab train --strategy ddp --world-size 2 --comm ring --bucket-mb 0.1 --json out.json
    distlab train --strategy zero2 --world-size 4 --steps 100 --checkpoint-dir ck --checkpoint-every 10 \
                  --resume
    distlab train --strategy zero2 --world-size 4 --steps 100 --checkpoint-dir ck --checkpoint-every 10 \
                  --max-restarts 2 --shrink --async-save
    distlab strategies

Under torchrun the same command runs on every rank (``--world-size`` must equal torchrun's) and
rank 0 prints; after a failure, the same command with ``--resume`` continues from the latest
complete checkpoint, and ``torchrun --max-restarts K ... --resume`` does that on its own (each attempt
meets under its own store prefix: `distlab._torchrun`). Without torchrun, ``--max-restarts K`` relaunches
the ranks itself (`distlab.restart`).

``train`` runs `dl.train` and prints the loss of every step, then bytes sent per rank per step and
each rank's peak memory by category. Other subcommands may be added by other modules.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model with a parallel strategy and print per-step losses")
    p.add_argument("--strategy", default="single",
                   help="single, ddp, zero1, zero2, zero3, fsdp, tp, pp-1f1b, ...")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks to launch (default 1; under torchrun, torchrun's WORLD_SIZE, "
                        "which it must equal)")
    p.add_argument("--model", default="gpt-tiny", help="gpt-tiny, gpt-small, gpt-wide or mlp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"])
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    p.add_argument("--clip", type=float, default=None)
    p.add_argument("--comm", default=None, choices=["torch", "ring"], help="collectives (data parallel)")
    p.add_argument("--bucket-mb", type=float, default=None)
    p.add_argument("--no-overlap", action="store_true", help="communicate after backward, not during it")
    p.add_argument("--prefetch", action="store_true", help="ZeRO-3: gather the next unit early")
    p.add_argument("--hsdp", type=int, default=None, metavar="R",
                   help="fsdp: R replicas of (world / R) shards")
    p.add_argument("--param-dtype", default=None, choices=["bf16", "fp16"],
                   help="fsdp: gather and compute dtype")
    p.add_argument("--no-reshard-after-forward", action="store_true",
                   help="fsdp: keep the gathered parameters from forward to backward")
    p.add_argument("--checkpoint-dir", default=None, help="save sharded checkpoints here")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="save every K steps and at the end")
    p.add_argument("--keep-last", type=int, default=None, metavar="N",
                   help="keep only the newest N checkpoints")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint (from scratch when there is none)")
    p.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background (training stalls only for a copy to CPU memory)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="relaunch a failed run from its newest checkpoint up to K times")
    p.add_argument("--shrink", nargs="?", const="auto", default=None, metavar="SIZES",
                   help="restart on one rank fewer each time, or on the given world sizes (e.g. 3,2)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra strategy option (value parsed as JSON when it can be)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write losses, bytes and memory here")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a bar with step, loss and it/s on stderr (default: when stderr is a terminal)")


def _options(args) -> dict:
    opts = {}
    if args.comm:
        opts["comm"] = args.comm
    if args.bucket_mb is not None:
        opts["bucket_mb"] = args.bucket_mb
    if args.no_overlap:
        opts["overlap"] = False
    if args.prefetch:
        opts["prefetch"] = True
    for key in ("hsdp", "param_dtype"):
        if getattr(args, key) is not None:
            opts[key] = getattr(args, key)
    if args.no_reshard_after_forward:
        opts["reshard_after_forward"] = False
    for key in ("checkpoint_dir", "checkpoint_every", "keep_last"):
        if getattr(args, key) is not None:
            opts[key] = getattr(args, key)
    if args.resume:
        opts["resume"] = True
    if args.async_save:
        opts["async_save"] = True
    for item in args.option:
        if "=" not in item:
            raise SystemExit(f"--option expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        try:
            opts[key] = json.loads(value)
        except json.JSONDecodeError:
            opts[key] = value
    return opts


def _restart_args(args) -> dict:
    """``max_restarts`` and ``shrink`` for `dl.train` from ``--max-restarts`` and ``--shrink [SIZES]``."""
    out = {"max_restarts": args.max_restarts} if args.max_restarts else {}
    if args.shrink is not None:
        try:
            out["shrink"] = True if args.shrink == "auto" else [int(n) for n in args.shrink.split(",")]
        except ValueError:
            raise SystemExit(f"--shrink expects world sizes like 3,2 (or nothing), "
                             f"got {args.shrink!r}") from None
    return out


def _run_train(args) -> int:
    from .train import train
    world = args.world_size if args.world_size is not None else (
        1 if args.strategy == "single" else int(os.environ.get("WORLD_SIZE", 1)))
    report = train(args.strategy, world_size=world, model=args.model, steps=args.steps,
                   seed=args.seed, global_batch=args.global_batch, lr=args.lr, optimizer=args.optimizer,
                   weight_decay=args.weight_decay, grad_accum=args.grad_accum, precision=args.precision,
                   clip=args.clip, options=_options(args), progress=args.progress,
                   **_restart_args(args))
    if os.environ.get("RANK", "0") != "0":       # under torchrun every rank has the report: one prints it
        return 0
    print(f"{args.strategy} on {report.world_size} rank(s), {args.model}, global batch {args.global_batch}")
    for step, loss in enumerate(report.losses):
        print(f"step {step:4d}  loss {loss:.6f}")
    for r, (comm, mem) in enumerate(zip(report.comm, report.memory)):
        peak = mem.get("peak", {})
        parts = "  ".join(f"{k} {v / 2**20:.3f}" for k, v in peak.items())
        print(f"rank {r}: sent {comm.get('sent_per_step', 0) / 2**20:.3f} MiB/step   peak MiB: {parts}")
    for r in getattr(report, "restarts", []):
        print(f"restart {r.attempt}: {r.world_size} -> {r.next_world_size} ranks, resumed from step "
              f"{r.resumed_from}, lost {r.lost_steps} step(s) and {r.lost_seconds:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"strategy": args.strategy, "world_size": report.world_size, "losses": report.losses,
                       "comm": report.comm, "memory": [{k: v for k, v in m.items() if k != "timeline"}
                                                        for m in report.memory]}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distlab", description="distributed training, from send/recv up")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    sub.add_parser("strategies", help="list the strategy names train accepts")
    args = parser.parse_args(argv)
    if args.command == "train":
        return _run_train(args)
    if args.command == "strategies":
        from .strategies import names
        print("\n".join(names()))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
