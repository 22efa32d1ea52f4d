"""The docs' pictures, drawn from the code they show: `python -m jaxllm.pictures docs/img` (needs
matplotlib, the `plot` extra). Each picture is what a function of the code returns (the 120B
config's mesh on its nodes, the planner's memory for it, each pipeline schedule's table, a page
pool after two prompts with one prefix) and an SVG that draws it; the SVG carries the digest of
what it drew, so a test can tell a picture the code has moved past."""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxllm.config import MESH_AXES, Schedule, load_config
from jaxllm.plan.hardware import ACCELERATORS
from jaxllm.plan.memory import memory
from jaxllm.plan.plot import draw_memory, draw_schedule, schedule_picture
from jaxllm.serve.pages import PagePool

CONFIG_120B = "configs/120b.py"
GPU = ACCELERATORS["a100-80gb"]  # the 120B config's GPUs
SCHEDULES = {  # S = 4 throughout; the chunked kinds with 2 chunks per stage
    "gpipe": Schedule(stages=4, repeats=1, microbatches=8, kind="gpipe"),
    "circular": Schedule(stages=4, repeats=2, microbatches=4, kind="circular"),
    "1f1b": Schedule(stages=4, repeats=1, microbatches=8, kind="1f1b"),
    "interleaved_1f1b": Schedule(stages=4, repeats=2, microbatches=8, kind="interleaved_1f1b"),
    "zero_bubble": Schedule(stages=4, repeats=1, microbatches=8, kind="zero_bubble"),
    "interleaved_zero_bubble": Schedule(stages=4, repeats=2, microbatches=8, kind="interleaved_zero_bubble"),
}


@dataclass(frozen=True)
class Picture:
    what: Callable[[], dict]  # what the picture shows, as plain data: its digest is the picture's
    draw: Callable[[dict, object], tuple[float, float]]  # (data, figure) → the figure's size in inches


def digest(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _mesh_120b() -> dict:
    p = load_config(CONFIG_120B).parallel
    shape = [getattr(p, axis) for axis in MESH_AXES]
    coords = np.stack(np.unravel_index(np.arange(np.prod(shape)), shape), axis=-1)  # make_mesh's device order
    return {"axes": dict(zip(MESH_AXES, shape, strict=True)), "per_node": GPU.per_node, "coords": coords.tolist()}


def _draw_mesh(data: dict, fig) -> tuple[float, float]:
    split = [i for i, size in enumerate(data["axes"].values()) if size > 1]  # the axes the layout uses
    names = list(data["axes"])
    coords, per_node = np.asarray(data["coords"]), data["per_node"]
    nodes = len(coords) // per_node
    ax = fig.subplots()
    colour = coords[:, split[0]] if split else np.zeros(len(coords))
    ax.imshow(colour.reshape(nodes, per_node), cmap="tab10", alpha=0.45, aspect="auto")
    for device, c in enumerate(coords):
        label = "\n".join(f"{names[i]} {c[i]}" for i in split)
        ax.text(device % per_node, device // per_node, label, ha="center", va="center", fontsize=7)
    ax.set(xticks=range(per_node), yticks=range(nodes), xlabel="GPU in the node (NVLink)", ylabel="node (network)")
    sizes = " × ".join(f"{names[i]} {data['axes'][names[i]]}" for i in split)
    ax.set_title(f"{CONFIG_120B} on {len(coords)} GPUs: {sizes}; each cell one GPU, its place on the mesh")
    return 9, 6


def _memory_120b() -> dict:
    planned = memory(load_config(CONFIG_120B))
    return {"planned": {k: round(v) for k, v in planned.items()}}


def _draw_memory(data: dict, fig) -> tuple[float, float]:
    draw_memory(fig.subplots(), data["planned"], title=f"{CONFIG_120B}: planned memory per GPU")
    return 6, 7


def _schedule(kind: str) -> Callable[[], dict]:
    return lambda: schedule_picture(SCHEDULES[kind])


def _draw_schedule(data: dict, fig) -> tuple[float, float]:
    draw_schedule(fig.subplots(), data)
    return 11, 1.2 + 0.45 * len(data["grid"])


def _pages_with_a_shared_prefix() -> dict:
    """A pool of 4-token pages after two prompts that share an 8-token system prompt: the second
    takes the first's two full pages from the prefix cache and writes only its own."""
    pool = PagePool(pages=12, page_size=4, salt="picture", prefix_cache=True)
    system = list(range(100, 108))
    prompts = {"prompt A": system + [1, 2, 3, 4, 5], "prompt B": system + [6, 7, 8]}
    tables = {}
    for name, tokens in prompts.items():
        shared = pool.share(tokens)
        tables[name] = shared + pool.take(pool.pages_for(len(tokens)) - len(shared))
        pool.remember(tokens, tables[name])
    holders = [sum(page in t for t in tables.values()) for page in range(1, pool.capacity + 1)]  # pages 1, 2, …
    return {"page_size": pool.page_size, "prompts": prompts, "tables": tables, "holders": holders}


def _draw_pages(data: dict, fig) -> tuple[float, float]:
    import matplotlib.patches as patches

    colours = {0: "white", 1: "#9ecae1", 2: "#fdae6b"}  # free, one holder, shared
    ax = fig.subplots()
    ps, rows = data["page_size"], list(data["tables"].items())
    for row, (name, table) in enumerate(rows):
        tokens, y = data["prompts"][name], len(rows) - row
        ax.text(-0.3, y + 0.4, name, ha="right", va="center", fontsize=9)
        for i, page in enumerate(table):
            held = data["holders"][page - 1]
            ax.add_patch(patches.Rectangle((i * 1.1, y), 1, 0.8, facecolor=colours[held], edgecolor="black"))
            ax.text(i * 1.1 + 0.5, y + 0.55, f"page {page}", ha="center", fontsize=8)
            ax.text(i * 1.1 + 0.5, y + 0.2, " ".join(map(str, tokens[i * ps : (i + 1) * ps])), ha="center", fontsize=6)
    ax.text(-0.3, 0.4, "the pool", ha="right", va="center", fontsize=9)
    for i, held in enumerate(data["holders"]):
        ax.add_patch(patches.Rectangle((i * 0.55, 0), 0.5, 0.8, facecolor=colours[held], edgecolor="black"))
        ax.text(i * 0.55 + 0.25, 0.35, str(i + 1), ha="center", fontsize=7)
    labels = ("free", "one sequence's", "shared: the prefix cache")
    legend = [patches.Patch(facecolor=colours[held], edgecolor="black", label=labels[held]) for held in colours]
    ax.legend(handles=legend, loc="upper center", fontsize=8, ncols=3, bbox_to_anchor=(0.5, 0.02))
    ax.set(xlim=(-2.5, 6.5), ylim=(-0.3, len(rows) + 1.2))
    ax.set_title(f"{ps}-token pages: prompt B takes the full pages of their system prompt from the prefix cache")
    ax.set_axis_off()
    return 9, 3.6


PICTURES = {
    "mesh-120b.svg": Picture(_mesh_120b, _draw_mesh),
    "memory-120b.svg": Picture(_memory_120b, _draw_memory),
    "paged-cache.svg": Picture(_pages_with_a_shared_prefix, _draw_pages),
    **{f"pipeline-{kind}.svg": Picture(_schedule(kind), _draw_schedule) for kind in SCHEDULES},
}


def drawn_digest(svg: pathlib.Path) -> str | None:
    """The digest an SVG written here carries (in its description), or None."""
    found = re.search(r"<dc:description>jaxllm picture ([0-9a-f]+)</dc:description>", svg.read_text())
    return found and found.group(1)


def write(directory: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    with matplotlib.rc_context({"svg.hashsalt": "jaxllm", "svg.fonttype": "none"}):
        for name, picture in PICTURES.items():
            what = picture.what()
            fig = plt.figure()
            fig.set_size_inches(*picture.draw(json.loads(json.dumps(what)), fig))  # as a test reads it: plain JSON
            fig.tight_layout()
            metadata = {"Date": None, "Description": f"jaxllm picture {digest(what)}"}
            fig.savefig(directory / name, format="svg", metadata=metadata)
            plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=pathlib.Path, nargs="?", default=pathlib.Path("docs/img"))
    write(parser.parse_args().directory)


if __name__ == "__main__":
    main()
