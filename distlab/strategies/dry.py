"""Dry runs of `dl.train`: a strategy's real code at real size, one step, on tensors without storage.

    r = dl.train("3d:dp=16,tp=8,pp=8", model="llama3-70b", world_size=1024, backend="fake", ranks=[0, 1023])
    r.memory[1]["peak"]     # rank 1023's peak bytes by category, as a real run's ledger reports them
    r.comm[0]["sent_by_op"] # rank 0's bytes per collective in the step

What runs is what a real run runs: `dl.launch(..., backend="fake", ranks=...)` (`distlab.launch.fake`) calls
the strategy's ``train_rank(spec)`` here as each listed rank, on torch's fake process group, with
``dl.device()`` the ``meta`` device. The model is built there (`base.build_model`: parameters with shapes,
no bytes), sharded by the strategy's own code (flat ZeRO buffers with their padding, FSDP's dim-0
shards, Megatron's column and row blocks, pipeline stages), and one step runs forward, backward and the
optimizer on meta tensors (`base.dry_batch`: token ids of the right shape, no data set). The memory
ledger (`distlab.memory`) counts every storage by its ``nbytes``, so the model states come out to the byte
(compare `dl.theory.memory`); the traced collectives record the bytes their algorithm would send.

What a dry run cannot know: values (losses are NaN), anything a rank learns from its peers' values (a
skipped fp16 step, a gradient norm), time. Where the sizes themselves follow from values, the dry run
takes the bound a memory planner must: expert parallelism's router has no scores to route by, so every
expert receives its whole capacity C = ceil(capacity_factor k T / E) (`parallel.expert.dispatch.
at_capacity`): a dry run of ``ep`` measures the capacity-bound step, its all-to-all bytes
`dl.theory.moe_step_all_to_all_bytes` at capacity_factor x the tokens, its expert activations those of
a real step whose router fills every expert (tests/test_dry_run_ep.py); a real step of k T choices can
fill at most k T of the E C slots, so at capacity factor 1.25 the dry run counts up to 25% more expert
rows than any real run holds. Like torchtitan's fake-backend dry run and Megatron's
``--fake-process-group``; users ask for it because estimates miss (Megatron-LM#525: 23.3 GB estimated, a
32 GB GPU out of memory).
"""
from __future__ import annotations

from .spec import TrainSpec


def check(spec: TrainSpec, world: int, backend: str) -> None:
    """Refuse what a dry run cannot do, and a real-size model outside one, before anything starts."""
    from ..models import REAL_SIZE
    if backend != "fake":
        if isinstance(spec.model, str) and spec.model in REAL_SIZE:
            raise ValueError(f"model {spec.model!r} is a real-size preset: train it in a dry run, "
                             "backend='fake' with ranks=[...] (it would need hundreds of GB here)")
        return
    if spec.strategy == "single":
        raise ValueError("strategy 'single' runs for real in this process: a dry run of one rank is "
                         "strategy='ddp', world_size=1, backend='fake', ranks=[0]")
    if spec.restart.max_restarts or spec.restart.shrink:
        raise ValueError("a dry run restarts nothing: drop max_restarts and shrink with backend='fake'")
    checks = spec.numerics.skip_nonfinite or spec.numerics.nan_at_step is not None
    if spec.precision == "fp16-mixed" or checks:
        raise ValueError("a dry run has no values to check for inf/NaN: use precision='bf16-mixed' or 'fp32' "
                         "and drop skip_nonfinite / nan_at_step with backend='fake'")
    if spec.checkpoint.checkpoint_dir is not None:
        raise ValueError("a dry run's tensors hold no values to save: drop checkpoint_dir with "
                         "backend='fake'")
    if spec.profiling.profile is not None:
        raise ValueError("a dry run computes on the meta device and sends nothing: no time to profile, "
                         "drop profile with backend='fake'")


def default_rows(spec: TrainSpec, world: int) -> int:
    """A global batch for a dry run of ``spec`` on ``world`` ranks: one row per microbatch, as the large
    runs train (Llama 3: micro-batch 1), 2 pp microbatches per replica with a pipeline (1 without)."""
    d = spec.layout.degrees(world)
    per_replica = spec.layout.microbatches or (2 * d["pp"] if d["pp"] > 1 else 1)
    return d["dp"] * d["ep"] * per_replica * spec.grad_accum


def default_steps(backend: str) -> int:
    """One step shows a dry run's peak (the optimizer's states exist from the first); 20 otherwise."""
    return 1 if backend == "fake" else 20


def seed_pipeline_shapes(pipe, rows: int, model, seq_shards: int = 1) -> None:
    """Tell a dry run's pipeline the shape of what crosses each stage boundary (b, s, h) per microbatch.

    A real receiver learns it from a small header the sender sends first (`parallel.pipeline.p2p`); a
    fake group delivers nothing, so the header would be empty. The shapes are known from the layout: this
    replica's ``rows`` cut into ``pipe.microbatches`` (``tensor_split``, as the pipeline cuts them), the
    model's sequence (over ``seq_shards``: sequence or context parallel ranks) and width, its dtype."""
    import torch
    if not (rows and pipe.num_stages > 1):
        return
    cfg, dtype = model.cfg, next(model.parameters()).dtype
    sizes = [len(c) for c in torch.arange(rows).tensor_split(pipe.microbatches)]
    for stage in range(pipe.num_stages - 1):
        for j, b in enumerate(sizes):
            pipe.links.shapes[(stage, j)] = (torch.Size([b, cfg.seq_len // seq_shards, cfg.d_model]), dtype)


class MetaAutocast:
    """``torch.autocast`` for the meta device of a dry run, which autocast does not know (on meta tensors
    it is a no-op: a bf16-mixed dry run would save fp32 activations where the real run saves bf16).

    The same policy as CPU autocast, applied above autograd (a ``TorchFunctionMode``, as autocast sits
    above autograd in the dispatcher): the matmul family (``LOWER``: linear, matmul, mm, bmm, addmm,
    baddbmm, scaled-dot-product attention, convolutions) casts its fp32 floating inputs to ``dtype``;
    every other op runs in the dtypes it is given (``x + y`` of bf16 and fp32 is fp32, as on the real
    device). A parameter (a leaf that requires grad) is cast once per autocast region and the copy reused,
    as autocast's cast cache does, so the bytes the ledger counts equal a real run's
    (tests/test_dry_run.py compares a bf16-mixed CPU run with its dry run, to the byte)::

        real:  x (fp32) --linear[AutocastCPU: cast x, W to bf16]--> y (bf16) -- saves x_bf16, W_bf16
        dry:   x (meta fp32) --linear[MetaAutocast: cast x, W]--> y (meta bf16) -- saves the same shapes
    """

    def __init__(self, dtype):
        from torch.overrides import TorchFunctionMode
        import torch
        import torch.nn.functional as F

        lower = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
                 torch.Tensor.__rmatmul__, torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm,
                 torch.addmm, torch.baddbmm, torch.addbmm, F.scaled_dot_product_attention, F.conv1d,
                 F.conv2d, F.conv3d}
        cache: dict[int, torch.Tensor] = {}

        def cast(t):
            if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32):
                return t
            if t.is_leaf and t.requires_grad:              # a weight: cast once per region
                if id(t) not in cache:
                    cache[id(t)] = t.to(dtype)
                return cache[id(t)]
            return t.to(dtype)

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in lower:
                    args, kwargs = [cast(a) for a in args], {k: cast(v) for k, v in kwargs.items()}
                return func(*args, **kwargs)

        self.mode, self.cache, self.dtype = Mode(), cache, dtype

    def __enter__(self):
        from ..runtime import current_run
        run = current_run()
        self.outer, run.dry_autocast = run.dry_autocast, lambda: MetaAutocast(self.dtype)   # for recompute
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        from ..runtime import current_run
        current_run().dry_autocast = self.outer
        self.cache.clear()                                 # autocast clears its cache on leaving
        return self.mode.__exit__(*exc)


def skip_init():
    """A context for building a model on the meta device: its initialisers (``normal_``, ``uniform_``,
    ``nn.init.*``) return their tensor untouched. On meta they compute nothing anyway, but through
    Python decompositions: 7 ms per call, 6 s of a 405B dry run's 9 s per rank before this."""
    import torch
    from torch.overrides import TorchFunctionMode

    names = {"normal_", "uniform_", "zero_", "fill_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
             "xavier_uniform_", "xavier_normal_", "zeros_", "ones_", "constant_"}

    class NoInit(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            first = args[0] if args else kwargs.get("tensor")       # nn.init.normal_(tensor=...) too
            if getattr(func, "__name__", "") in names and isinstance(first, torch.Tensor) and first.is_meta:
                return first
            return func(*args, **kwargs)
    return NoInit()
