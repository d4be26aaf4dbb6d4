"""What a learner sees from a checker: distlab's own rings pass (a correct ring may skip an empty
chunk), planted wrong rings fail on what a ring must do (bytes per rank, one chunk per message, the
neighbours), a function of several outputs is judged output by output, and a wrong answer in Jupyter
prints its message once, without the checker's traceback."""
import torch
import torch.distributed as dist

import pytest

import distlab as dl
from distlab.exercises import comm


def _step(send, recv, r, n):
    reqs = [dist.isend(send, (r + 1) % n), dist.irecv(recv, (r - 1) % n)]
    [q.wait() for q in reqs]


def ring_of_whole_tensors(t):
    """Right numbers, every send to the right, N-1 sends: but each message is the whole tensor."""
    n, r = dist.get_world_size(), dist.get_rank()
    passing, total = t.clone(), t.clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(t)
        _step(passing, incoming, r, n)
        total += incoming
        passing = incoming
    return t.copy_(total)


def ring_gathering_twice(t):
    """Right numbers and chunk-sized messages, but the all-gather runs twice: more bytes than a ring."""
    n = dist.get_world_size()
    mine = comm.ring_reduce_scatter(t)
    sizes = [c.numel() for c in torch.tensor_split(t.flatten(), n)]
    comm.ring_all_gather(mine, sizes)
    return t.copy_(comm.ring_all_gather(mine, sizes).view_as(t))




def test_distlabs_own_rings_pass_at_every_size_the_checker_tries():
    assert dl.exercises.check("ring_all_reduce", dl.comm.ring_all_reduce, quiet=True).passed
    assert dl.exercises.check("ring_all_reduce", dl.comm.pipelined_all_reduce, world_sizes=(2, 3),
                              quiet=True).passed
    assert dl.exercises.check("ring_reduce_scatter", dl.comm.ring_reduce_scatter, world_sizes=(2, 3),
                              quiet=True).passed
    assert dl.exercises.check("ring_all_gather", lambda c, s: dl.comm.ring_all_gather(c, sizes=s),
                              world_sizes=(2, 3), quiet=True).passed


@pytest.mark.parametrize("wrong, world, words", [
    (ring_of_whole_tensors, 2, "one message carried 4 elements; a ring moves one chunk at a time"),
    (ring_of_whole_tensors, 3, "one message carried"),
    (ring_gathering_twice, 3, "a ring moves at most 2 x (N-1) chunks"),
    (comm.ring_reduce_scatter, 2, "at least 1 must leave this rank"),
])
def test_wrong_rings_are_refused_for_what_a_ring_must_do(wrong, world, words):
    res = dl.exercises.check("ring_all_reduce", wrong, world_sizes=(world,), quiet=True)
    assert not res.passed and words in res.problem, res.problem


def test_a_ring_turned_round_is_told_which_neighbour():
    def reduce_scatter_backwards(t):
        n, r = dist.get_world_size(), dist.get_rank()
        chunks = [c.clone() for c in torch.tensor_split(t.flatten(), n)]
        for s in range(n - 1):
            send, recv = (r + s + 1) % n, (r + s + 2) % n
            incoming = torch.empty_like(chunks[recv])
            reqs = [dist.isend(chunks[send], (r - 1) % n), dist.irecv(incoming, (r + 1) % n)]
            [q.wait() for q in reqs]
            chunks[recv] += incoming
        return chunks[r]

    res = dl.exercises.check("ring_reduce_scatter", reduce_scatter_backwards, world_sizes=(3,), quiet=True)
    assert not res.passed
    assert "in a ring a rank sends only to its right neighbour" in res.problem, res.problem


def test_several_outputs_are_judged_one_by_one_and_named():
    def router_unnormalised(logits, k):
        weight, expert = logits.softmax(dim=-1).topk(k, dim=-1)
        return expert, weight

    res = dl.exercises.check("top_k_router", router_unnormalised, quiet=True)
    assert not res.passed
    assert "case 'top-2 of 6 experts', weight: element 0 of 20 (index [0, 0])" in res.problem, res.problem
    res = dl.exercises.check("top_k_router", lambda logits, k: logits.topk(k)[1], quiet=True)
    assert "expected 2 outputs (expert, weight), got Tensor" in res.problem, res.problem


def _cell_output(source, capsys):
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.run_cell(source)
    return capsys.readouterr().out


def test_a_wrong_answer_in_jupyter_prints_once_without_the_checkers_traceback(capsys):
    out = _cell_output("import distlab as dl\n"
                       "def top_k_router(logits, k):\n"
                       "    weight, expert = logits.softmax(-1).topk(k)\n"
                       "    return expert, weight\n"
                       'dl.exercises.check("top_k_router", top_k_router).require();', capsys)
    assert out.count("weight: element") == 1, out
    assert "NOT YET top_k_router" in out and "hint:" in out
    assert "top_k_router: not passed yet (what differs is printed above)" in out
    assert "Traceback" not in out and "harness.py" not in out and "require()" not in out
    out = _cell_output("def stub(logits, k):\n"
                       '    raise NotImplementedError("not implemented yet")\n'
                       'dl.exercises.check("top_k_router", stub).require();', capsys)
    assert "NotImplementedError" in out and "not implemented yet; write it in the cell above" in out
    assert "Traceback" not in out and "harness.py" not in out


def test_outside_jupyter_the_exception_still_carries_the_whole_message():
    res = dl.exercises.check("top_k_router", lambda logits, k: (logits.topk(k)[1], logits.topk(k)[0]),
                             quiet=True)
    with pytest.raises(dl.exercises.ExerciseNotPassed, match="weight: element"):
        res.require()
    with pytest.raises(AssertionError):
        res.require()
