"""Every socket a launch listens on, in the parent and in every rank, is on loopback (the default
``host``): the rendezvous store under fork and under spawn, and gloo's own connections."""
from __future__ import annotations

import ipaddress
import os
import socket
import struct

import pytest

import distlab as dl


def _listening(pid: int) -> list[str]:
    """Local addresses of the TCP sockets process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:             # 0A: LISTEN
                    found.append(_address(local.split(":")[0], family))
    return found


def _address(hex_ip: str, family) -> str:
    raw = bytes.fromhex(hex_ip)
    words = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, words)


def _sockets_of_rank_and_parent():
    import torch
    import torch.distributed as dist
    dist.all_reduce(torch.ones(1))                  # gloo's pairs are connected by now
    return {"rank": _listening(os.getpid()), "parent": _listening(os.getppid())}


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc (Linux)")
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_every_listening_socket_is_on_loopback(method):
    run = dl.launch(_sockets_of_rank_and_parent, world_size=2, start_method=method, output="quiet")
    seen = [a for r in run.results for a in r["rank"] + r["parent"]]
    assert seen, "found no listening socket at all: the probe is broken"
    assert all(ipaddress.ip_address(a).is_loopback for a in seen), run.results


def test_the_probe_sees_a_socket_on_every_interface():
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen(1)
    try:
        assert "0.0.0.0" in _listening(os.getpid())
    finally:
        s.close()


def test_gloo_is_pinned_to_loopback_only_for_a_loopback_rendezvous(monkeypatch):
    # (this machine's hostname may already resolve to loopback, which hides the gloo half of the
    # end-to-end test above: check the rule itself)
    from distlab.launch.rank import _pin_gloo_to_loopback
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    _pin_gloo_to_loopback("10.1.2.3")
    assert "GLOO_SOCKET_IFNAME" not in os.environ           # a multi-node address: the user's network
    _pin_gloo_to_loopback("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    _pin_gloo_to_loopback("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"       # the user's own choice wins
