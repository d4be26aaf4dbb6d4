"""All-reduce explorer: ranks N, message size and link -> time of ring, tree and naive
algorithms in the alpha-beta model (:func:`distlab.theory.comm_time`) and the bus bandwidth
nccl-tests would report (:func:`distlab.theory.busbw`)."""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W

from distlab import theory
from distlab.theory.comm import ALGORITHMS, OPS
from distlab.widgets.base import Explorer, dropdown, new_figure


@dataclass(frozen=True)
class CommResult:
    """Seconds and busbw (bytes/s) per algorithm, and the fastest algorithm."""

    seconds: dict[str, float]
    busbw: dict[str, float]

    @property
    def fastest(self) -> str:
        return min(self.seconds, key=self.seconds.get)


class AllReduceExplorer(Explorer):
    title = "Collective time (alpha-beta model)"

    def __init__(self, n: int = 8, size_mb: float = 100.0, link: str = "nvlink4"):
        super().__init__({
            "op": dropdown("collective", list(OPS), "all_reduce"),
            "n": dropdown("ranks N", [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], n),
            "size_mb": W.FloatLogSlider(value=size_mb, base=10, min=-3, max=4, description="size (MB)",
                                        continuous_update=False),
            "link": dropdown("link", list(theory.LINKS), link),
        })

    def _times(self, nbytes: float) -> dict[str, float]:
        card = theory.link(self.value("link"))
        return {a: theory.comm_time(self.value("op"), nbytes, self.value("n"),
                                    card.bandwidth, card.latency, a)
                for a in ALGORITHMS}

    def compute(self) -> CommResult:
        nbytes = self.value("size_mb") * 1e6
        seconds = self._times(nbytes)
        return CommResult(seconds, {a: theory.busbw(self.value("op"), nbytes, t, self.value("n"))
                                    for a, t in seconds.items()})

    def render(self, result: CommResult):
        fig = new_figure(6, 3)
        ax = fig.add_subplot()
        sizes = [10 ** (k / 4) for k in range(-12, 17)]               # 1 KB .. 10 GB
        curves = [self._times(s * 1e6) for s in sizes]
        for algorithm in ALGORITHMS:
            ax.loglog(sizes, [c[algorithm] for c in curves], label=algorithm)
            ax.plot(self.value("size_mb"), result.seconds[algorithm], "o", color="black", ms=4)
        ax.set_xlabel("message size (MB)")
        ax.set_ylabel("seconds")
        ax.set_title(f"{self.value('op')} on {self.value('n')} ranks over {self.value('link')}")
        ax.legend(fontsize=8)
        rows = "".join(f"<tr><td>{a}</td><td>{result.seconds[a] * 1e3:.3f} ms</td>"
                       f"<td>{result.busbw[a] / 1e9:.1f} GB/s</td></tr>" for a in ALGORITHMS)
        return fig, f"<table><tr><th>algorithm</th><th>time</th><th>busbw</th></tr>{rows}</table>"


def allreduce_explorer(n: int = 8, size_mb: float = 100.0, link: str = "nvlink4") -> AllReduceExplorer:
    """Interactive collective-time calculator; see :class:`AllReduceExplorer`."""
    return AllReduceExplorer(n, size_mb, link)
