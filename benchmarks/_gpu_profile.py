"""A GPU check of `profile=` (`distlab.launch.profiler`), run once on an H100 (2026-11-27; its output:
benchmarks/results/gpu/nvidia-h100-80gb-hbm3/gpu_profile.log): a 1-rank NCCL launch and
a 1-rank DDP `dl.train`, each profiled; prints the merged trace's processes (a GPU: pid 1000 (rank + 1) +
device), its NCCL kernels and distlab's ranges, and `distlab.viz.profile.measured`.
``python benchmarks/_gpu_profile.py`` (``OUT=dir``: where the traces go)."""
import collections
import json
import os
import tempfile
import time

import torch
import distlab as dl
from distlab.viz.profile import measured
out = os.environ.get("OUT", tempfile.mkdtemp())

def fn():
    import torch.distributed as dist
    from distlab.runtime import tracer
    from distlab.parallel import collectives as c
    m = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048)).cuda()
    x = torch.randn(512, 2048, device="cuda")
    for step in range(4):
        tracer().mark("step", step=step)
        with tracer().span("forward", step=step):
            y = m(x).sum()
        with tracer().span("backward", step=step):
            y.backward()
        for p in m.parameters():
            c.all_reduce_sum(p.grad)
        torch.cuda.synchronize()
    return dist.get_backend()

def main():
    """Launch first (forked ranks: this process must not touch CUDA before), then train."""
    d1 = os.path.join(out, "launch")
    t = time.time()
    run = dl.launch(fn, 1, backend="nccl", profile=d1, output="quiet")
    print("launch", run.results, round(time.time() - t, 1), "s", sorted(os.listdir(d1)))
    data = json.load(open(os.path.join(d1, "trace.json")))
    ev = data["traceEvents"]
    print("pids", sorted({e["pid"] for e in ev}, key=str))
    print("cats", collections.Counter(e.get("cat") for e in ev if e.get("ph") == "X"))
    print("procs", [(e["pid"], e["args"]) for e in ev if e.get("name") == "process_name"])
    comm = [e["name"] for e in ev if "nccl" in e.get("name", "").lower()
            or e.get("name", "").startswith(("c10d", "distlab:all"))]
    print("comm-ish", collections.Counter(comm).most_common(8))
    print("distlab", collections.Counter(e["name"] for e in ev
                                        if e.get("name", "").startswith("distlab:")).most_common(12))
    print("measured", json.dumps(measured(d1, run.trace), indent=0))

    d2 = os.path.join(out, "train")
    t = time.time()
    r = dl.train("ddp", world_size=1, steps=4, model="gpt-tiny", profile=d2)
    print("train", round(time.time() - t, 1), "s", r.run.backend, sorted(os.listdir(d2)))
    print("measured", json.dumps(measured(d2, r.trace), indent=0))
    print("torch", torch.__version__, torch.cuda.get_device_name(0))


if __name__ == "__main__":
    main()
