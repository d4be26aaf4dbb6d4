"""``torchrun --max-restarts`` with gloo, for real: a distlab training run whose rank 1 is killed once
(``fail_at_step``, first attempt only) is restarted by torchrun, resumes from its newest checkpoint
(``--resume``) and ends exactly where an uninterrupted run ends.

Without a store prefix per attempt (`distlab.launch.torchrun`) the second attempt read the dead attempt's
gloo addresses from torchrun's one store and failed ("connect refused") or hung, about one time in two.
"""
import json
import os
import subprocess
import sys

import torch

import distlab as dl
from distlab.checkpoint import reshard


def test_torchrun_max_restarts_resumes_from_the_checkpoint(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    ck, out = tmp_path / "ck", tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(dl.__file__)),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "-m", "distlab.cli",
         "train", "--strategy", "ddp", "--steps", "4", "--global-batch", "8", "--checkpoint-dir", str(ck),
         "--checkpoint-every", "2", "--resume", "--option", "fail_at_step=3", "--json", str(out)],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exitcode: -9" in done.stderr                      # attempt 0: rank 1 was killed ...
    assert "Connection refused" not in done.stderr            # ... and attempt 1 met its own peers
    plain = dl.train("ddp", world_size=2, steps=4, global_batch=8)
    assert json.loads(out.read_text())["losses"] == plain.losses
    final = reshard.consolidate(ck, 4)["params"]
    assert final.keys() == plain.params.keys()
    assert all(torch.equal(final[k], v) for k, v in plain.params.items())
