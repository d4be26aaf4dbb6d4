"""Conceptual interview questions on distributed training, each with its explanation."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Question:
    """A multiple-choice question; ``choices[answer]`` is right."""

    topic: str
    prompt: str
    choices: tuple[str, ...]
    answer: int
    explanation: str


def _q(topic: str, prompt: str, right: str, wrong: list[str], explanation: str) -> Question:
    return Question(topic, prompt, (right, *wrong), 0, explanation)


CONCEPTUAL = [
    _q("DP vs TP", "What does data parallelism (DDP) replicate on every GPU?",
       "The whole model, gradients and optimizer state",
       ["One slice of every weight matrix, plus its gradient", "Only the activations of its own micro-batch",
        "Nothing: every GPU holds 1/N of every tensor"],
       "DDP keeps a full replica per rank and all-reduces gradients; memory per GPU does not shrink with N."),
    _q("DP vs TP", "What does tensor parallelism split?",
       "Each layer's weight matrices, by rows or columns",
       ["The global batch into equal micro-batches per GPU", "The layers into consecutive pipeline stages",
        "The optimizer state, leaving weights whole"],
       "Megatron TP shards the columns/rows of each linear layer; every GPU computes part of every layer."),
    _q("ZeRO", "ZeRO stage 1 shards what across the data-parallel ranks?",
       "Optimizer states", ["Parameters and their gradients", "Activations saved for the backward",
                            "Gradients, but not the optimizer state"],
       "Stage 1 = P_os: Adam moments and the fp32 master copy (K = 12 bytes/param) are split N ways."),
    _q("ZeRO", "What does ZeRO stage 2 add to stage 1?",
       "Sharding the gradients", ["Sharding the parameters as well", "Offloading optimizer state to CPU",
                                  "Splitting layers into pipeline stages"],
       "P_os+g: each rank keeps (reduce-scatters into) only the gradient shard its optimizer shard needs."),
    _q("ZeRO", "Compared with DDP, how much does ZeRO-3 communicate per step?",
       "About 1.5x DDP's volume: 3(N-1)/N vs 2(N-1)/N",
       ["Exactly the same volume, in different collectives", "About half: it sends shards, not full tensors",
        "About N times more on N ranks"],
       "Parameters are all-gathered for the forward and again for the backward, plus a reduce-scatter of "
       "grads: 3(N-1)/N Psi instead of 2(N-1)/N Psi."),
    _q("ZeRO", "Compared with DDP, how much do ZeRO-1 and ZeRO-2 communicate per step?",
       "The same volume as DDP's one all-reduce per step",
       ["1.5x more, because parameters are gathered twice",
        "Twice as much: a reduce-scatter and an all-gather", "Nothing extra, and the all-reduce is skipped"],
       "Ring all-reduce is itself reduce-scatter + all-gather; "
       "ZeRO-1/2 just keep the scattered shard in between."),
    _q("ZeRO", "FSDP's FULL_SHARD in PyTorch corresponds most closely to which ZeRO stage?",
       "Stage 3", ["Stage 1 (optimizer states only)", "Stage 2 (optimizer states and gradients)",
                   "Stage 0 (plain DDP, nothing sharded)"],
       "FULL_SHARD shards parameters, gradients and optimizer state and gathers parameters just in time."),
    _q("Placement", "Why is tensor parallelism usually kept inside one node?",
       "It all-reduces activations in every layer, twice",
       ["It needs no communication, so nodes gain nothing", "It only works with exactly 8 GPUs per group",
        "Pipeline parallelism forbids it across node boundaries"],
       "Two all-reduces of b*s*h per layer forward and two backward need NVLink bandwidth, "
       "too much for inter-node links."),
    _q("Placement", "Why does pipeline parallelism suit slow inter-node links?",
       "Only boundary activations cross the link",
       ["It sends no data between stages at all", "It all-reduces the weights less often than DDP",
        "It compresses gradients before sending them"],
       "Point-to-point traffic of b*s*h per microbatch at each stage boundary is small next to TP's "
       "per-layer all-reduces."),
    _q("Bubbles", "1F1B versus GPipe with the same p and m: what changes?",
       "Same bubble, fewer activations held (p instead of m)",
       ["Smaller bubble, but the same activation memory", "Larger bubble, in exchange for less memory",
        "Nothing: the two schedules are the same"],
       "Both idle (p-1)/(m+p-1) of the step; "
       "1F1B starts backwards early so a stage holds at most p microbatches."),
    _q("Bubbles", "Interleaved 1F1B with v chunks per GPU mainly buys what, at what price?",
       "A v times smaller bubble for v times more messages",
       ["No bubble at all, for twice the activation memory", "Less memory, for a bubble v times larger",
        "Fewer point-to-point messages, for a larger bubble"],
       "Narayanan et al. 2021: bubble (p-1)/(v m) of ideal time; "
       "each microbatch crosses v times as many boundaries."),
    _q("Bubbles", "What idea lets zero-bubble schedules (Qi et al. 2023) fill the pipeline's idle time?",
       "Splitting the backward into input- and weight-gradient passes",
       ["Running two copies of the model at the same time", "Skipping the backward pass of the last stage",
        "Using micro-batches larger than the global batch"],
       "Only the input gradient is on the critical path; W passes move into the warm-up/cool-down gaps."),
    _q("Bubbles", "In 1F1B, which pipeline stage holds the most activations?",
       "The first stage, which has the most warm-up",
       ["The last stage, which computes the loss", "The middle stage, between the two ends",
        "All stages hold the same number of micro-batches"],
       "Stage i runs p - i warm-up forwards before its first backward and so keeps p - i microbatches in "
       "flight; stage 0 sets the memory peak."),
    _q("Collectives", "A ring all-reduce is equivalent to which two collectives in sequence?",
       "Reduce-scatter then all-gather", ["Broadcast then reduce to the root", "All-to-all then a broadcast",
                                          "Gather to one rank then scatter from it"],
       "Each rank reduces 1/N of the buffer (N-1 steps) then circulates the reduced chunks (N-1 steps)."),
    _q("Collectives", "Why do nccl-tests report busbw alongside algbw?",
       "It compares with link peak whatever N is",
       ["busbw adds the latency term that algbw leaves out", "busbw is measured on the PCIe bus only",
        "algbw ignores the message size, busbw does not"],
       "busbw scales algbw by the algorithm's traffic factor: for all-reduce busbw = algbw x 2(N-1)/N, "
       "the bytes each rank actually moves per second."),
    _q("Collectives", "For tiny messages on many ranks, which all-reduce algorithm usually wins?",
       "Tree: O(log N) latency terms", ["Ring: O(N) latency terms", "Naive: everything through one root",
                                        "None: they always take equal time"],
       "Ring pays 2(N-1) latencies; trees pay about 2 log2 N. For large messages the ring's bandwidth wins."),
    _q("Collectives", "Mixture-of-experts expert parallelism relies mainly on which collective?",
       "All-to-all", ["All-reduce of the expert outputs", "Broadcast of the router's choices",
                      "Reduce-scatter of the token embeddings"],
       "Tokens are dispatched to the ranks holding their experts and combined back: "
       "two all-to-alls per layer."),
    _q("Failure modes", "A job hangs and finally dies with an NCCL watchdog timeout. A common cause?",
       "One rank skipped or reordered a collective",
       ["The learning rate is too high for the batch", "The model is too small to keep GPUs busy",
        "Too many data loader worker processes"],
       "Collectives match by order; "
       "a rank that diverges (a data-dependent branch, a crash) leaves peers waiting."),
    _q("Failure modes", "Training runs out of memory in backward, not forward: the memory ledger shows the "
       "gradients pushing weights + gradients + optimizer state over the limit. Likely fix?",
       "Shard gradients and weights (ZeRO-3)",
       ["Recompute activations in the backward", "Raise the learning rate so it converges sooner",
        "Add more data loader workers"],
       "Backward's peak adds a gradient for every weight; when model states dominate, shard them "
       "(ZeRO-2/3, FSDP; lesson 14). Recomputation cures an OOM from activations, which peaks in forward."),
    _q("Failure modes", "Loss becomes NaN with fp16 but not bf16. Why?",
       "fp16's narrow exponent overflows",
       ["bf16 has more mantissa bits than fp16", "fp16 matrix multiplies are slower",
        "NCCL drops fp16 packets"],
       "fp16 tops out at 65504 and needs loss scaling; bf16 keeps fp32's 8-bit exponent, "
       "trading mantissa precision."),
    _q("Failure modes", "How do you avoid a corrupt checkpoint when a job is killed mid-save?",
       "Write a temporary file, then rename",
       ["Save more often, always to the same file", "Save only on rank 0 and skip the barrier",
        "Compress the file so it is written faster"],
       "A rename is atomic on POSIX; "
       "readers see the old complete file or the new complete file, never half."),
    _q("Failure modes", "After resuming from a checkpoint the loss spikes. What was probably not restored?",
       "Optimizer state, LR schedule or data position",
       ["The model architecture and its layer sizes", "The NCCL version the job was built with",
        "The number of transformer layers"],
       "Adam moments reset to zero and a restarted warm-up or replayed data change the trajectory."),
    _q("Failure modes",
       "Two pipeline ranks each call a blocking send to the other before receiving. What happens?",
       "They can deadlock", ["It always works: sends are buffered", "The data arrives twice on each rank",
                             "NCCL reorders the calls automatically"],
       "Blocking sends may wait for the matching recv; order them (even/odd) or use batch_isend_irecv."),
    _q("Failure modes", "One GPU is 20% slower than the others in synchronous DDP. The step time is...",
       "set by the slowest rank, every step",
       ["the average of all the ranks' times", "set by the fastest rank",
        "unchanged: the others do its work"],
       "Every step ends with an all-reduce, so all ranks wait for the straggler."),
    _q("Training", "Gradient accumulation over k micro-batches matches one k-times-larger batch when...",
       "each micro-batch loss is divided by k",
       ["the learning rate is multiplied by k", "k equals the world size exactly",
        "never: the maths differs"],
       "Summed gradients of the scaled losses (or averaged gradients) equal the mean gradient of the "
       "large batch."),
    _q("Training", "What does DDP's no_sync() context do?",
       "Skips the gradient all-reduce", ["Disables autograd for the block", "Stops the data loader workers",
                                         "Freezes the parameters until it exits"],
       "On accumulation steps gradients accumulate locally and are all-reduced once, "
       "on the last micro-batch."),
    _q("Training", "Why does DDP bucket gradients and start all-reducing during backward?",
       "To overlap communication with backward",
       ["To halve the memory the gradients take", "To avoid floating-point rounding error",
        "Because NCCL only accepts 25 MB messages"],
       "Buckets fill in reverse layer order; each is sent while earlier layers are still computing."),
    _q("Training", "What goes wrong with very small DDP buckets?",
       "Per-message latency dominates", ["Gradients are lost between buckets", "Memory grows quadratically",
                                         "Overlap with backward becomes impossible"],
       "Each all-reduce pays alpha; too many tiny ones waste time, too few large ones overlap less."),
    _q("Training", "Why keep fp32 master weights in bf16 mixed precision?",
       "Small updates vanish in bf16",
       ["bf16 cannot represent gradients at all", "GPUs cannot multiply bf16 matrices",
        "To make the checkpoints smaller"],
       "bf16 has 8 significant bits: w + lr*g rounds back to w once lr*g is below w / 256; "
       "fp32 keeps the sum."),
    _q("Training", "What does Megatron's sequence parallelism shard?",
       "Norm and dropout activations, by sequence",
       ["The vocabulary of the embedding table", "The optimizer state across the TP group",
        "Attention heads across nodes"],
       "Korthikanti et al. 2022: LayerNorm/dropout activations are split along the sequence within the TP "
       "group; the all-reduce becomes reduce-scatter + all-gather and activations drop to 1/t."),
    _q("Training", "What does selective activation recomputation recompute?",
       "The attention softmax/dropout part",
       ["The whole transformer layer, every time", "Only the MLP block of each layer",
        "The optimizer step on every rank"],
       "The 5as/h term is cheap to redo and big to store; it keeps 34sbh per layer, saving most memory "
       "for ~3% extra FLOPs."),
    _q("Scaling", "What is the critical batch size (McCandlish et al. 2018)?",
       "Where larger batches stop paying off",
       ["The largest batch that fits in GPU memory", "The batch at which the loss becomes NaN",
        "Always 256, whatever the model"],
       "Below it, doubling the batch halves the steps; above it, you pay compute for little progress."),
    _q("Scaling", "Goyal et al. 2017 trained ImageNet with large batches using which learning-rate rule?",
       "Linear in the batch size, with warm-up",
       ["Keep the learning rate fixed", "Scale it with the square of the batch size",
        "Divide it by the world size"],
       "The linear scaling rule plus gradual warm-up kept SGD accuracy up to batch 8k."),
    _q("Scaling", "Weak scaling efficiency of 90% on 8 GPUs means...",
       "7.2x the throughput of one GPU", ["8 GPUs are 90% faster than one", "Each step takes 90% longer",
                                     "Only 90% of the GPUs do useful work"],
       "Efficiency = T_N / (N T_1)."),
    _q("Setup", "Which torch.distributed backend is meant for CPU tensors?",
       "gloo", ["NCCL", "cuDNN", "MPI only"],
       "NCCL drives NVIDIA GPUs; gloo runs collectives on CPU (and is what distlab uses on laptops)."),
    _q("Setup", "Why broadcast parameters from rank 0 (or seed identically) before DDP training?",
       "Replicas must start equal",
       ["To save memory on the other ranks", "To warm up the NCCL communicators",
        "It is only needed for ZeRO, not DDP"],
       "Averaging gradients keeps replicas equal only if they start equal."),
]
