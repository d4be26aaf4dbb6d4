"""`diagnose`: the flight recorder's rings (`distlab.launch.flight`), read after a launch hung, in words.

    flight = {rank: [record, ...]}            each rank's last operations, oldest first; a record
                                              without "finished" is one the rank still waits in
    diagnose(flight, returned=[2])  ->  "ranks 0, 1, 3 wait in all_reduce #17 of group world; rank 2
                                         never entered it, last finished broadcast #16 of group world"

Ranks that agree on the program agree on each group's sequence numbers, so the operation a group's
ranks wait in is matched by (group, number) -- or, point to point, by (direction, peer, number) --
and each member that is not in it is named with the last thing it finished (or that it returned, or
failed, as the launcher saw).
"""
from __future__ import annotations

P2P = ("send", "recv", "isend", "irecv")   # point to point: counted per (direction, peer)
SENDS = ("send", "isend")


def diagnose(flight: dict[int, list[dict]], returned=(), failed=()) -> str:
    """What each rank was doing, in words, from every rank's records (``returned``/``failed``: ranks the
    launcher saw return or fail). One line per operation ranks wait in, naming the members of its group
    that are not in it and the last thing each of them finished; then the ranks waiting in nothing."""
    waiting = {r: _waits_in(records) for r, records in flight.items()}
    lines, told = [], set()
    for key in sorted({_key(w) for w in waiting.values() if w is not None}, key=str):
        ranks = sorted(r for r, w in waiting.items() if w is not None and _key(w) == key)
        first = waiting[ranks[0]]
        told.update(ranks)
        absent = _absent(first, ranks, flight, waiting, returned, failed)
        told.update(absent)
        one = len(ranks) == 1
        verb = (("was" if one else "were") + " waiting in {} when " + ("it" if one else "they") + " failed"
                if set(ranks) <= set(failed) else ("waits" if one else "wait") + " in {}")
        said = verb.format(_name(first))
        lines.append(f"{_ranks(ranks)} {said}" + "".join(f"; {a}" for a in absent.values()))
    for r in sorted(set(flight) - told):
        lines.append(f"rank {r} {_state(r, flight, waiting, returned, failed)}")
    return "\n".join(lines)


def _waits_in(records: list[dict]) -> dict | None:
    """The oldest operation this rank entered and never finished: the one it is blocked behind."""
    return next((r for r in records if r["finished"] is None), None)


def _key(record: dict) -> tuple:
    return (record["op"], record["group"], record["seq"], record["peer"])


def _name(record: dict) -> str:
    if record["op"] in P2P:
        way = "to" if record["op"] in SENDS else "from"
        peer = "any rank" if record["peer"] is None else f"rank {record['peer']}"
        return f"{record['op']} #{record['seq']} {way} {peer}"
    return f"{record['op']} #{record['seq']} of group {record['group']}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _absent(first: dict, ranks: list[int], flight, waiting, returned, failed) -> dict[int, str]:
    """{2: "rank 2 never entered it, last finished broadcast #16 of group world"} for every member missing."""
    if first["op"] in P2P:                                 # its peer (none for a receive from anyone)
        members = [] if first["peer"] is None else [first["peer"]]
    else:
        members = first["ranks"] if first["ranks"] is not None else sorted(flight)
    parts = {}
    for m in [m for m in members if m not in ranks]:
        if first["op"] in P2P:
            parts[m] = (f"rank {m} {_matching_p2p(first, ranks[0], flight.get(m, []))} and "
                        f"{_state(m, flight, waiting, returned, failed)}")
            continue
        same = [r for r in flight.get(m, []) if r["op"] not in P2P and r["group"] == first["group"]
                and r["seq"] >= first["seq"]]
        other = next((r for r in same if r["seq"] == first["seq"] and r["op"] != first["op"]), None)
        if other is not None:                              # the ranks disagree on the program
            parts[m] = f"rank {m} entered {_name(other)} instead (the ranks issue different collectives)"
        elif not same:                                     # one that passed this call is not the culprit
            parts[m] = f"rank {m} never entered it and {_state(m, flight, waiting, returned, failed)}"
    return parts


def _matching_p2p(first: dict, me: int, theirs: list[dict]) -> str:
    way = "recv" if first["op"] in SENDS else "send"
    matched = [r for r in theirs if r["peer"] == me and (r["op"] in SENDS) == (way == "send")]
    direction = "to" if way == "send" else "from"
    return f"posted {len(matched)} {way}{'s' * (len(matched) != 1)} {direction} rank {me}"


def _state(rank: int, flight, waiting, returned, failed) -> str:
    """"waits in all_reduce #3 of group dp" / "returned from the function; last finished ..." / ..."""
    done = [r for r in flight.get(rank, []) if r["finished"] is not None]
    last = f"last finished {_name(done[-1])}" if done else "it finished no operation"
    if waiting.get(rank) is not None:
        return f"waits in {_name(waiting[rank])}"
    if rank in returned:
        return f"returned from the function; {last}"
    if rank in failed:
        return f"failed; {last}"
    return f"is in no operation (computing, sleeping, or stuck outside torch.distributed); {last}"
