"""Every parallelism of large-model training, one folder each, each read top to bottom.

Reading order (each folder's ``__init__`` states the order of its own files):

    collectives.py   the one traced wrapper every parallelism talks through (flat_collectives.py:
                     its asynchronous flat-buffer half, for DDP, ZeRO and FSDP; quantized_collectives.py:
                     its all-gather and reduce-scatter in int8/fp8 packets, ZeRO++'s qwZ and qgZ)
    data/            DDP: NaiveDDP first, then the bucketed, overlapped DDP; PowerSGD, Local SGD, DiLoCo
    zero/            ZeRO stages 1, 2, 3: the optimizer state, then gradients, then parameters sharded
    tensor/          Megatron tensor parallelism and sequence parallelism
    pipeline/        pipeline schedules (pure), stage splitting, the executor, zero bubble
    context/         context parallelism: sequence layouts, ring attention, Ulysses
    expert/          expert parallelism: the model's mixture-of-experts layer (models/moe.py) with its
                     experts split over ranks, tokens dispatched by all-to-all
    elastic/         replicas that leave and join while the others step: a quorum per step through the
                     store, a gloo group per membership, healing from a live peer
    mesh.py          the device mesh that composes them: torch.arange(world).view(dp, pp, tp)
    placement.py     where each parameter's piece lives under any of them (what a checkpoint records)

Dependencies point one way: nothing here imports strategies, checkpoints, plots or widgets.
"""
