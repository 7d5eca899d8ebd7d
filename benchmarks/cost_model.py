"""An alpha-beta cost model of the all-reduce algorithms across nodes, fitted from
``make bench-hosts``'s measurements, and the automatic choice it implies from 2 to 1024 nodes.

Run as ``python benchmarks/cost_model.py [--csv benchmarks/results/hierarchical_np4.csv
--out benchmarks/results]`` (no MPI): writes ``cost_model.md`` and prints it.

The model (Hockney's alpha-beta: a message of S bytes costs alpha + S beta; the algorithms'
step counts from Thakur, Rabenseifner and Gropp, "Optimization of collective communication
operations in MPICH", IJHPCA 19(1), 2005), for P nodes of L ranks and S bytes:

* node level (shared memory, :class:`ShmAllReduce` over the L ranks of each node, all nodes
  at once): ``T_node = a_node + S b_node``;
* leaders level (``MPI_Allreduce`` among the P leaders; MPICH's large-message algorithm,
  Rabenseifner's reduce-scatter + all-gather): ``T_lead = 2 ceil(log2 P) a_net + 2 (P-1)/P S b_net``;
* broadcast in the node (``MPI_Bcast``): ``T_bcast = a_bcast + S b_bcast``;
* hierarchical = node + leaders + bcast + ``a_wait + S b_wait`` (the window barrier in which the
  others wait, asleep, for their leader, and the levels' contention when they run together:
  fitted to the measured hierarchical time's excess over the three levels);
* flat MPI over all P L ranks, Rabenseifner's with its own fitted constants:
  ``T_flat = 2 ceil(log2 PL) a_flat + 2 (PL-1)/PL S b_flat``;
* the ring over all P L ranks: ``T_ring = 2 (PL-1) a_ring + 2 (PL-1)/PL S b_ring``.

Each (a, b) pair is fitted by least squares on relative error over the measured sizes (every
size counts alike, 4 KiB as 64 MiB) at the measured P = 2, L = 2; the model then scales the
step counts with P. It ignores what grows with P on a real network besides (contention in the
switch, the placement of ranks): it says how the algorithms' terms scale, not what a given
cluster will measure.
"""

from __future__ import annotations

import argparse
import csv
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

#: sizes (bytes) of the prediction tables
SIZES = [8, 64 << 10, 256 << 10, 1 << 20, 16 << 20, 64 << 20]
NODES = [2, 4, 16, 64, 256, 1024]
#: the automatic choice's threshold on a group that spans nodes (mpidist._backends.mpi.collectives)
HIER_OVER_MPI = 1 << 20


def load(path: Path) -> dict[str, dict[int, float]]:
    """variant -> size -> seconds."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    with open(path) as f:
        for row in csv.DictReader(f):
            out[row["variant"]][int(row["size_bytes"])] = float(row["time_us"]) * 1e-6
    return out


def fit(sizes: list[int], times: list[float], steps: float, share: float) -> tuple[float, float]:
    """(a, b) with ``t = steps a + share S b``, least squares on relative error."""
    x = np.array([[steps, share * s] for s in sizes], float) / np.array(times)[:, None]
    a, b = np.linalg.lstsq(x, np.ones(len(times)), rcond=None)[0]
    return max(float(a), 0.0), max(float(b), 0.0)


def log2c(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


class Model:
    def __init__(self, data: dict[str, dict[int, float]], p: int = 2, ll: int = 2) -> None:
        sizes = sorted(data["raw"])
        self.sizes = sizes

        def t(v: str) -> list[float]:
            return [data[v][s] for s in sizes]

        self.node = fit(sizes, t("node"), 1, 1)
        self.net = fit(sizes, t("leaders"), 2 * log2c(p), 2 * (p - 1) / p)
        self.bcast = fit(sizes, t("bcast"), 1, 1)
        n = p * ll
        self.flat = fit(sizes, t("raw"), 2 * log2c(n), 2 * (n - 1) / n)
        self.ring = fit(sizes, t("ring"), 2 * (n - 1), 2 * (n - 1) / n)
        hier = t("hierarchical")
        excess = [h - self.level_sum(p, s) for h, s in zip(hier, sizes)]
        x = np.array([[1.0, s] for s in sizes]) / np.array(hier)[:, None]
        a, b = np.linalg.lstsq(x, np.array(excess) / np.array(hier), rcond=None)[0]
        self.wait = (max(float(a), 0.0), max(float(b), 0.0))
        self.ll = ll

    def level_sum(self, p: int, s: int) -> float:
        (an, bn), (al, bl), (ab, bb) = self.node, self.net, self.bcast
        return an + s * bn + 2 * log2c(p) * al + 2 * (p - 1) / p * s * bl + ab + s * bb

    def predict(self, alg: str, p: int, s: int) -> float:
        n = p * self.ll
        if alg == "hierarchical":
            return self.level_sum(p, s) + self.wait[0] + s * self.wait[1]
        a, b = self.flat if alg == "mpi" else self.ring
        steps = 2 * log2c(n) if alg == "mpi" else 2 * (n - 1)
        return steps * a + 2 * (n - 1) / n * s * b


def auto(s: int) -> str:
    """mpidist's automatic choice for float32 on a group spanning nodes of several ranks."""
    return "hierarchical" if s >= HIER_OVER_MPI else "mpi"


def human(n: int) -> str:
    for unit, k in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n >> k} {unit}"
    return f"{n} B"


def report(m: Model, data: dict[str, dict[int, float]], source: str) -> str:
    us = 1e6
    lines = [
        "# Cost model of the all-reduce across nodes (alpha-beta, fitted)",
        "",
        f"Fitted by `benchmarks/cost_model.py` from `{source}` (make bench-hosts: 2 hosts of 2 ranks,",
        "the link shaped to 10 Gbit/s, on the 2-core VM; the model and its limits: the script's docstring).",
        "",
        "## Fitted parameters",
        "",
        "| level | alpha (us) | beta (ns/byte) | 1/beta (GB/s) |",
        "|---|---:|---:|---:|",
    ]
    for name, (a, b) in [
        ("node: shared-memory all-reduce, 2 ranks", m.node),
        ("leaders: MPI_Allreduce between nodes, per step", m.net),
        ("bcast in the node (MPI_Bcast)", m.bcast),
        ("flat MPI_Allreduce, per step", m.flat),
        ("ring, per step", m.ring),
        ("hierarchical: the others' wait for their leader, contention", m.wait),
    ]:
        lines.append(f"| {name} | {a * us:.1f} | {b * 1e9:.3f} | {1 / b / 1e9 if b else math.inf:.2f} |")
    lines.append("")
    lines += [
        "## The model against the measurements (P = 2 nodes of 2 ranks)",
        "",
        "| size | " + " | ".join(f"{v} measured / model" for v in ("mpi", "ring", "hierarchical")) + " |",
        "|---:|---:|---:|---:|",
    ]
    worst = 0.0
    for s in m.sizes:
        cells = []
        for v, col in (("mpi", "raw"), ("ring", "ring"), ("hierarchical", "hierarchical")):
            meas, pred = data[col][s], m.predict(v, 2, s)
            worst = max(worst, abs(math.log(meas / pred)))
            cells.append(f"{meas * us:.0f} / {pred * us:.0f} us")
        lines.append(f"| {human(s)} | " + " | ".join(cells) + " |")
    lines += ["", f"Largest misfit: a factor {math.exp(worst):.2f} (measured / model or its inverse).", ""]
    lines += [
        "## Predicted time (us) from 2 to 1024 nodes of 2 ranks, and the choices",
        "",
        "`best`: the model's fastest; `auto`: what mpidist's automatic choice runs (float32;"
        f" hierarchical from {human(HIER_OVER_MPI)}); a `*` marks where they differ.",
        "",
        "| nodes | size | mpi | ring | hierarchical | best | auto |",
        "|---:|---:|---:|---:|---:|---|---|",
    ]
    for p in NODES:
        for s in SIZES:
            t = {a: m.predict(a, p, s) for a in ("mpi", "ring", "hierarchical")}
            best = min(t, key=t.__getitem__)
            a = auto(s)
            mark = "" if a == best or t[a] <= 1.05 * t[best] else " *"
            lines.append(
                f"| {p} | {human(s)} | "
                + " | ".join(f"{t[k] * us:.0f}" for k in ("mpi", "ring", "hierarchical"))
                + f" | {best} | {a}{mark} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", default="benchmarks/results/hierarchical_np4.csv")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    data = load(Path(args.csv))
    text = report(Model(data), data, args.csv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cost_model.md").write_text(text)
    print(text, end="")
    print(f"# wrote {out / 'cost_model.md'}")


if __name__ == "__main__":
    main()
