"""`per_rank(before, after)`: each rank's small tensor before and after a collective, as two grids."""
from __future__ import annotations

import matplotlib.pyplot as plt


def per_rank(before: list, after: list, title: str = "", fmt: str = "{:g}"):
    """Draw rank rows of values, before (left) and after (right); lengths may differ per rank."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 0.6 + 0.45 * len(before)))
    for ax, values, label in ((axes[0], before, "before"), (axes[1], after, "after")):
        width = max(len(v) for v in values)
        for r, row in enumerate(values):
            y = len(values) - 1 - r
            for i, v in enumerate(row):
                ax.add_patch(plt.Rectangle((i, y), 0.95, 0.9, color=plt.cm.tab10(r % 10), alpha=0.25))
                ax.text(i + 0.47, y + 0.45, fmt.format(float(v)), ha="center", va="center", fontsize=9)
        ax.set_xlim(0, max(width, 1))
        ax.set_ylim(0, len(values))
        ax.set_yticks([len(values) - 1 - r + 0.45 for r in range(len(values))])
        ax.set_yticklabels([f"rank {r}" for r in range(len(values))])
        ax.set_xticks([])
        ax.set_title(label)
        for side in ("top", "right", "bottom"):
            ax.spines[side].set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
