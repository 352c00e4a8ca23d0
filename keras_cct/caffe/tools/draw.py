"""Caffe's ``python/draw_net.py``: a picture of a net (PNG, SVG or PDF).

The graph is draw_net.py's: one box per layer labelled ``name (Type)`` (convolutions and
poolings add ``kernel size``, ``stride`` and ``pad``), filled by type (Convolution and
Deconvolution ``#FF5050``, Pooling ``#FF9900``, InnerProduct ``#CC33FF``, others ``#6495ED``,
in-place neuron layers ``#90EE90``); one grey octagon (``#E0E0E0``) per blob; edges bottom blob
-> layer -> top blob; ``rankdir`` LR (default), TB, RL or BT; ``phase`` TRAIN, TEST or ALL (no
filtering). Through pydot and Graphviz's ``dot`` when both are installed (draw_net.py's own
route), else drawn with matplotlib on a layered layout (each layer one rank after the layers
that wrote its bottoms).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from keras_cct._files import atomic_path, atomic_write
from keras_cct.caffe.io.filter import filter_net
from keras_cct.errors import KerasCCTError

__all__ = ["NetGraph", "net_graph", "draw_net", "layer_color", "RANKDIRS", "FORMATS"]

RANKDIRS = ("LR", "TB", "RL", "BT")
FORMATS = ("png", "svg", "pdf")
ENGINES = ("auto", "pydot", "matplotlib")
BLOB_COLOR = "#E0E0E0"
NEURON_COLOR = "#90EE90"
_POOL = {0: "MAX", 1: "AVE", 2: "STOCHASTIC"}


def layer_color(layer_type: str) -> str:
    """draw_net.py's ``choose_color_by_layertype``."""
    if layer_type in ("Convolution", "Deconvolution"):
        return "#FF5050"
    if layer_type == "Pooling":
        return "#FF9900"
    if layer_type == "InnerProduct":
        return "#CC33FF"
    return "#6495ED"


def layer_label(lp, rankdir: str) -> str:
    """draw_net.py's ``get_layer_label``."""
    sep = " " if rankdir in ("TB", "BT") else "\n"
    if lp.type in ("Convolution", "Deconvolution"):
        cp = lp.convolution_param
        k = cp.kernel_size[0] if len(cp.kernel_size) else 1
        s = cp.stride[0] if len(cp.stride) else 1
        p = cp.pad[0] if len(cp.pad) else 0
        return f"{lp.name}{sep}({lp.type}){sep}kernel size: {k}{sep}stride: {s}{sep}pad: {p}"
    if lp.type == "Pooling":
        pp = lp.pooling_param
        return (f"{lp.name}{sep}({lp.type} {_POOL.get(int(pp.pool), pp.pool)}){sep}kernel size: "
                f"{pp.kernel_size}{sep}stride: {pp.stride}{sep}pad: {pp.pad}")
    return f"{lp.name}{sep}({lp.type})"


def edge_label(lp) -> str:
    """draw_net.py's ``get_edge_label`` (with ``--label-edges``)."""
    if lp.type == "Data":
        return f"Batch {lp.data_param.batch_size}"
    if lp.type in ("Convolution", "Deconvolution"):
        return str(lp.convolution_param.num_output)
    if lp.type == "InnerProduct":
        return str(lp.inner_product_param.num_output)
    return ""


@dataclass
class NetGraph:
    """Nodes (``{key: (label, kind, colour)}``, kind ``layer``/``neuron``/``blob``), edges
    ``(src, dst, label)`` and each node's rank (its column for LR)."""

    name: str
    nodes: Dict[str, Tuple[str, str, str]] = field(default_factory=dict)
    edges: List[Tuple[str, str, str]] = field(default_factory=list)
    rank: Dict[str, float] = field(default_factory=dict)


def net_graph(net, *, rankdir: str = "LR", phase: Optional[str] = "ALL",
              label_edges: bool = True) -> NetGraph:
    """The graph draw_net.py draws for ``net`` (an upgraded ``NetParameter``)."""
    if phase not in (None, "ALL"):
        net = filter_net(net, phase=phase)
    g = NetGraph(net.name or "Net")
    writer: Dict[str, str] = {}  # blob -> the layer node that last wrote it
    for lp in net.layer:
        key = f"{lp.name}_{lp.type}"
        inplace = len(lp.bottom) == 1 and len(lp.top) == 1 and lp.bottom[0] == lp.top[0]
        g.nodes[key] = (layer_label(lp, rankdir), "neuron" if inplace else "layer",
                        NEURON_COLOR if inplace else layer_color(lp.type))
        g.rank[key] = 1 + max([g.rank.get(writer.get(b, ""), -1) for b in lp.bottom] or [-1])
        for b in lp.bottom:
            g.nodes.setdefault(f"{b}_blob", (b, "blob", BLOB_COLOR))
            g.rank.setdefault(f"{b}_blob", g.rank[key] - 0.5)
            g.edges.append((f"{b}_blob", key, ""))
        for t in lp.top:
            g.nodes.setdefault(f"{t}_blob", (t, "blob", BLOB_COLOR))
            g.rank.setdefault(f"{t}_blob", g.rank[key] + 0.5)
            g.edges.append((key, f"{t}_blob", edge_label(lp) if label_edges else ""))
            writer[t] = key
    return g


def _pydot_bytes(g: NetGraph, rankdir: str, fmt: str) -> Optional[bytes]:
    """The picture through pydot + Graphviz (draw_net.py's route), or None when either is
    missing."""
    try:
        import pydot
    except ImportError:
        return None
    if shutil.which("dot") is None:
        return None
    dot = pydot.Dot(g.name, graph_type="digraph", rankdir=rankdir)
    for key, (label, kind, color) in g.nodes.items():
        shape = "octagon" if kind == "blob" else "record"
        text = label.replace('"', '\\"').replace("\n", "\\n")  # draw_net.py's '\\n'
        dot.add_node(pydot.Node(key, label=f'"{text}"', shape=shape, fillcolor=color,
                                style="filled"))
    for src, dst, label in g.edges:
        dot.add_edge(pydot.Edge(src, dst, label=f'"{label}"'))
    return dot.create(format=fmt)


def _octagon(x0, y0, width, height, mutation_size):
    """A matplotlib box style: the octagon Graphviz draws blobs as."""
    from matplotlib.path import Path
    pad = mutation_size * 0.3
    x0, y0, width, height = x0 - pad, y0 - pad, width + 2 * pad, height + 2 * pad
    c = min(width, height) * 0.29
    pts = [(x0 + c, y0), (x0 + width - c, y0), (x0 + width, y0 + c), (x0 + width, y0 + height - c),
           (x0 + width - c, y0 + height), (x0 + c, y0 + height), (x0, y0 + height - c),
           (x0, y0 + c), (x0 + c, y0)]
    return Path(pts, closed=True)


def _positions(g: NetGraph, rankdir: str) -> Tuple[Dict[str, Tuple[float, float]], int, int]:
    """Node -> (x, y) in cell units, and the grid's columns and rows."""
    levels = sorted(set(g.rank.values()))
    column = {r: i for i, r in enumerate(levels)}
    members: Dict[int, List[str]] = {}
    for key in g.nodes:
        members.setdefault(column[g.rank[key]], []).append(key)
    depth = max(len(v) for v in members.values())
    pos = {}
    for col, keys in members.items():
        for i, key in enumerate(keys):
            across = i - (len(keys) - 1) / 2
            along = col if rankdir in ("LR", "TB") else len(levels) - 1 - col
            pos[key] = (along, -across) if rankdir in ("LR", "RL") else (across, -along)
    return pos, len(levels), depth


def _matplotlib_bytes(g: NetGraph, rankdir: str, fmt: str, dpi: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg", force=False)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    pos, n_cols, depth = _positions(g, rankdir)
    levels = sorted(set(g.rank.values()))
    cell_w, cell_h = (1.3, 1.1) if rankdir in ("LR", "RL") else (2.6, 0.75)
    cols, rows = (n_cols, depth) if rankdir in ("LR", "RL") else (depth, n_cols)
    width, height = cols * cell_w + 0.6, rows * cell_h + 0.6
    dpi = int(min(dpi, 30000 / max(width, height)))  # Agg's size limit
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    xs = [p[0] for p in pos.values()]
    ys = [p[1] for p in pos.values()]
    ax.set_xlim(min(xs) - 0.5 - 0.3 / cell_w, max(xs) + 0.5 + 0.3 / cell_w)
    ax.set_ylim(min(ys) - 0.5 - 0.3 / cell_h, max(ys) + 0.5 + 0.3 / cell_h)
    ax.axis("off")
    texts = {}
    for key, (label, kind, color) in g.nodes.items():
        style = _octagon if kind == "blob" else "square,pad=0.3"
        texts[key] = ax.text(*pos[key], label, ha="center", va="center", fontsize=6.5,
                             zorder=3, bbox=dict(boxstyle=style, fc=color, ec="black", lw=0.6))
    fig.canvas.draw()  # sizes the boxes, which the arrows are clipped to
    for src, dst, label in g.edges:
        back = g.rank[dst] < g.rank[src]
        # an edge over other ranks bends a little, off the boxes on its straight line
        span = sum(1 for r in levels if g.rank[src] < r < g.rank[dst])
        ax.annotate("", xy=pos[dst], xytext=pos[src], zorder=1, arrowprops=dict(
            arrowstyle="-|>", lw=0.7, color="black", shrinkA=1, shrinkB=1,
            patchA=texts[src].get_bbox_patch(), patchB=texts[dst].get_bbox_patch(),
            connectionstyle=f"arc3,rad={0.4 if back else min(0.12, 0.25 / max(span, 1)):.3f}"))
        if label:
            mid = ((pos[src][0] + pos[dst][0]) / 2, (pos[src][1] + pos[dst][1]) / 2)
            ax.text(*mid, label, fontsize=5.5, ha="center", va="bottom", zorder=2)
    with atomic_path(path, suffix="." + fmt) as tmp:
        fig.savefig(tmp, format=fmt)


def draw_net(net, path: str, *, rankdir: str = "LR", phase: Optional[str] = "ALL",
             engine: str = "auto", dpi: int = 100, label_edges: bool = True) -> str:
    """Draw ``net`` (an upgraded ``NetParameter``) to ``path``; returns the engine used.

    The format is ``path``'s extension (png, svg, pdf).

    Raises:
        KerasCCTError: an unknown rankdir, phase, format or engine, or ``engine="pydot"`` when
            pydot or Graphviz's ``dot`` is missing.
    """
    if rankdir not in RANKDIRS:
        raise KerasCCTError(f"--rankdir {rankdir}: use one of {', '.join(RANKDIRS)}")
    fmt = os.path.splitext(path)[1].lower().lstrip(".")
    if fmt not in FORMATS:
        raise KerasCCTError(f"{path}: the picture's format comes from its extension; use "
                            f"{', '.join('.' + f for f in FORMATS)}")
    if engine not in ENGINES:
        raise KerasCCTError(f"--engine {engine}: use one of {', '.join(ENGINES)}")
    if not len(net.layer):
        raise KerasCCTError("the net has no layers to draw")
    g = net_graph(net, rankdir=rankdir, phase=phase, label_edges=label_edges)
    if not g.nodes:
        raise KerasCCTError(f"no layer of the net is in phase {phase}; try --phase ALL")
    if engine in ("auto", "pydot"):
        data = _pydot_bytes(g, rankdir, fmt)
        if data is not None:
            atomic_write(path, data)
            return "pydot"
        if engine == "pydot":
            raise KerasCCTError("--engine pydot needs the pydot package and Graphviz's `dot` "
                                "program; install them (pip install pydot; apt-get install "
                                "graphviz) or use --engine matplotlib")
    _matplotlib_bytes(g, rankdir, fmt, dpi, path)
    return "matplotlib"
