"""Draw a radix-tree prefix cache with matplotlib (for notebooks and READMEs).

    from common.radix_draw import draw_tree
    ax = draw_tree(cache, tokenizer=tok)     # boxes: a node's tokens, its KV slots, its lock_ref
    ax.figure.savefig("tree.png")

Works on any object shaped like RadixCache (`root_node`, `evictable_leaves`; nodes with `children`, `key`,
`value`, `lock_ref`), so it imports no stage. Colour says how many running requests lock a node; a dashed red
border marks the unlocked leaves, the ones eviction may take next.
"""

from __future__ import annotations

from typing import Any

UNLOCKED = "#eef2f7"
EVICTABLE_EDGE = "#c0392b"


def node_label(node: Any, tokenizer: Any = None, width: int = 18) -> str:
    """Two lines: the node's tokens (decoded when a tokenizer is given), then `slots a..b  lock N`."""
    ids = list(node.key)
    text = tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))
    text = text.replace("\n", "\\n")
    if len(text) > width:
        text = text[: width - 1] + "…"
    slots = node.value.tolist()
    if not slots:
        where = "no slots"
    elif slots == list(range(slots[0], slots[0] + len(slots))):
        where = f"slots {slots[0]}..{slots[-1]}" if len(slots) > 1 else f"slot {slots[0]}"
    else:
        where = f"{len(slots)} slots from {slots[0]}"
    return f"{text}\n{where}  lock {node.lock_ref}"


def layout(root: Any) -> dict[int, tuple[float, float, Any]]:
    """id(node) -> (x, y, node): leaves side by side, a parent centred over its children, depth downwards."""
    places: dict[int, tuple[float, float, Any]] = {}
    next_leaf = [0.0]

    def place(node: Any, depth: int) -> float:
        kids = sorted(node.children.values(), key=lambda c: tuple(c.key))
        if kids:
            xs = [place(child, depth + 1) for child in kids]
            x = (xs[0] + xs[-1]) / 2
        else:
            x, next_leaf[0] = next_leaf[0], next_leaf[0] + 1
        places[id(node)] = (x, -float(depth), node)
        return x

    place(root, 0)
    return places


def lock_colour(lock_ref: int) -> Any:
    import matplotlib

    if lock_ref == 0:
        return UNLOCKED
    return matplotlib.colormaps["Oranges"](0.3 + 0.15 * min(lock_ref, 4))  # deeper orange: more requests


def draw_tree(cache: Any, ax: Any = None, tokenizer: Any = None, title: str | None = None) -> Any:
    """Draw the cache's tree on ax (a new figure when None) and return ax."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    places = layout(cache.root_node)
    width = max(x for x, _, _ in places.values()) + 1
    depth = -min(y for _, y, _ in places.values()) + 1
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 2.2 * width), max(2.0, 1.3 * depth)))
    evictable = {id(n) for n in cache.evictable_leaves}
    for x, y, node in places.values():
        for child in node.children.values():
            cx, cy, _ = places[id(child)]
            ax.plot([x, cx], [y, cy], color="#888888", linewidth=1, zorder=1)
    for x, y, node in places.values():
        is_root = node is cache.root_node
        label = f"root\n{cache.total_size()} tokens" if is_root else node_label(node, tokenizer)
        marked = id(node) in evictable
        ax.text(x, y, label, ha="center", va="center", fontsize=8, family="monospace", zorder=2,
                bbox=dict(boxstyle="round,pad=0.4", facecolor="white" if is_root else lock_colour(node.lock_ref),
                          edgecolor=EVICTABLE_EDGE if marked else "#444444", linestyle="--" if marked else "-",
                          linewidth=1.5 if marked else 1.0))
    ax.set_xlim(-0.7, width - 0.3)
    ax.set_ylim(-depth + 0.4, 0.6)
    ax.axis("off")
    ax.legend(handles=[Patch(facecolor=UNLOCKED, edgecolor="#444444", label="unlocked"),
                       Patch(facecolor=lock_colour(1), edgecolor="#444444", label="locked (lock_ref > 0)"),
                       Patch(facecolor="white", edgecolor=EVICTABLE_EDGE, linestyle="--", label="evictable leaf")],
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=7, frameon=False)  # below the tree
    if title:
        ax.set_title(title)
    return ax
