"""``python -m mpidist.tools.trace DIR``: line up the ranks' flight recorders and say who diverged.

Reads every ``rank<r>.json`` that :func:`mpidist._core.recorder.dump` wrote in DIR, lines
each group's collectives up by sequence number, and reports the first divergence (a member
that never issued it, or different ops, dtypes or roots) and the ops in flight on each rank
(docs/reliability.md, section 3). Exit status: 0 no divergence, 1 divergence, 2 no dump.

Usage: ``python -m mpidist.tools.trace DIR [--last N]`` (N rows per group before the
divergence, default 6; ``--last 0`` shows every row).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Optional

__all__ = ["load", "analyse", "render", "main"]


def load(directory: str) -> dict[int, dict]:
    """Every rank's dump in ``directory``: {rank: document}. Raises FileNotFoundError if none."""
    docs = {}
    for path in glob.glob(os.path.join(directory, "rank*.json")):
        if not re.fullmatch(r"rank\d+\.json", os.path.basename(path)):
            continue
        with open(path) as f:
            doc = json.load(f)
        docs[int(doc["rank"])] = doc
    if not docs:
        raise FileNotFoundError(f"no flight recorder dumps (rank<r>.json) in {directory}")
    return dict(sorted(docs.items()))


def _groups(docs: dict[int, dict]) -> dict[str, dict]:
    """{group key: {"name", "ranks", "issued": {rank: n}, "seqs": {rank: {seq: entry}}}}."""
    out: dict[str, dict] = {}
    for rank, doc in docs.items():
        for g in doc.get("groups", []):
            info = out.setdefault(g["key"], {"name": g["name"], "ranks": g["ranks"], "issued": {}, "seqs": {}})
            info["issued"][rank] = g["issued"]
        for e in doc["entries"]:
            if e["p2p"]:
                continue
            info = out.setdefault(
                e["group_key"], {"name": e["group"], "ranks": e["group_ranks"], "issued": {}, "seqs": {}}
            )
            info["seqs"].setdefault(rank, {})[e["seq"]] = e
    for info in out.values():
        for rank, seqs in info["seqs"].items():  # a dump without a groups table (none expected)
            info["issued"].setdefault(rank, max(seqs) + 1)
    return out


def _call(e: dict) -> str:
    """What a collective entry says about the call, for comparing ranks."""
    root = f", root {e['root']}" if e.get("root", -1) >= 0 else ""
    return f"{e['op']}({e['dtype'] or '-'}{root})"


def _latest(doc: dict) -> str:
    if not doc["entries"]:
        return "no op recorded"
    e = doc["entries"][-1]
    return f"{e['op']} #{e['seq']} on group {e['group']!r} ({e['state']})"


def analyse(docs: dict[int, dict]) -> list[dict]:
    """The first divergence of each group: [{"group", "name", "seq", "kind", "ranks", "text"}].

    ``kind`` is "not arrived" (``ranks`` never issued ``seq``) or "mismatch" (``ranks`` are
    the minority that called something else).
    """
    found = []
    for key, info in _groups(docs).items():
        members = [r for r in info["ranks"] if r in docs]
        if len(members) < 2:
            continue
        issued = info["issued"]
        # sequence numbers some member recorded, from the oldest every member still holds
        starts = [min(info["seqs"][r]) for r in members if info["seqs"].get(r)]
        top = max(issued.get(r, 0) for r in members)
        for seq in range(max(starts, default=0), top):
            absent = [r for r in members if issued.get(r, 0) <= seq]
            calls: dict[str, list] = {}
            for r in members:
                e = info["seqs"].get(r, {}).get(seq)
                if e is not None:
                    calls.setdefault(_call(e), []).append(r)
            if absent:
                late = "; ".join(
                    f"rank {r} issued {issued.get(r, 0)} collectives on this group, latest op: {_latest(docs[r])}"
                    for r in absent
                )
                kind, ranks, what = (
                    "not arrived",
                    absent,
                    f"rank(s) {absent} had not arrived ({late}); the others called {', '.join(calls) or '?'}",
                )
            elif len(calls) > 1:
                ranked = sorted(calls.items(), key=lambda kv: (-len(kv[1]), kv[1]))
                kind, ranks = "mismatch", sorted(r for _, rs in ranked[1:] for r in rs)
                what = "mismatched collectives: " + "; ".join(f"rank(s) {rs} called {c}" for c, rs in ranked)
            else:
                continue
            text = f"group {info['name']!r} (ranks {info['ranks']}) sequence number {seq}: {what}"
            found.append({"group": key, "name": info["name"], "seq": seq, "kind": kind, "ranks": ranks, "text": text})
            break
    return found


def _cell(e: Optional[dict]) -> str:
    if e is None:
        return "-"
    shapes = e["shapes"]
    shape = "" if shapes is None else f" {tuple(shapes) if shapes and not isinstance(shapes[0], list) else shapes}"
    return f"{_call(e)}{shape} {e['state']}"


def render(docs: dict[int, dict], found: list[dict], last: int = 6) -> str:
    """The report: the dumps, each group's table around its divergence, ops in flight, verdict."""
    lines = [f"flight recorder dumps of {len(docs)} rank(s): {list(docs)}"]
    for rank, doc in docs.items():
        lines.append(
            f"  rank {rank}: pid {doc['pid']} on {doc['host']}, {len(doc['entries'])} entries, "
            f"written because: {doc['reason']}"
        )
    by_group = {f["group"]: f for f in found}
    for key, info in _groups(docs).items():
        members = [r for r in info["ranks"] if r in docs]
        top = max([info["issued"].get(r, 0) for r in members] or [0])
        stop = by_group[key]["seq"] + 1 if key in by_group else top
        first = 0 if last <= 0 else max(0, stop - last)
        lines.append(
            f"group {info['name']!r} (key {key}, ranks {info['ranks']}): collectives issued per rank "
            f"{ {r: info['issued'].get(r, 0) for r in members} }"
        )
        width = 2 + max([len(_cell(e)) for r in members for e in info["seqs"].get(r, {}).values()] or [8])
        lines.append("  seq   " + "".join(f"{'rank ' + str(r):<{width}}" for r in members))
        for seq in range(first, stop):
            row = [_cell(info["seqs"].get(r, {}).get(seq)) for r in members]
            mark = "  <== diverges here" if key in by_group and seq == by_group[key]["seq"] else ""
            lines.append(f"  {seq:<5} " + "".join(f"{c:<{width}}" for c in row) + mark)
    flight = [
        f"  rank {rank}: {e['op']} #{e['seq']} on group {e['group']!r}"
        f"{' with rank ' + str(e['peer']) if e['p2p'] and e.get('peer', -1) >= 0 else ''} ({e['state']})"
        for rank, doc in docs.items()
        for e in doc["entries"]
        if e["state"] in ("started", "timed out", "scheduled")
    ]
    lines.append("in flight when dumped:" if flight else "in flight when dumped: nothing")
    lines.extend(flight)
    if found:
        lines.append("DIVERGENCE:")
        lines.extend(f"  {f['text']}" for f in found)
        first = found[0]
        lines.append(
            f"verdict: rank(s) {first['ranks']} diverged first, on group {first['name']!r} at "
            f"sequence number {first['seq']} ({first['kind']})"
        )
    else:
        lines.append("verdict: no divergence found: every rank issued the same collectives in the same order")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit status (0 no divergence, 1 divergence, 2 no dumps)."""
    p = argparse.ArgumentParser(prog="python -m mpidist.tools.trace", description=__doc__.split("\n\n")[0])
    p.add_argument("directory", help="the directory the ranks dumped into (MPIDIST_TRACE_DIR)")
    p.add_argument("--last", type=int, default=6, help="rows per group before the divergence (0: all)")
    args = p.parse_args(argv)
    try:
        docs = load(args.directory)
    except (FileNotFoundError, NotADirectoryError) as exc:
        print(f"python -m mpidist.tools.trace: {exc}", file=sys.stderr)
        return 2
    found = analyse(docs)
    print(render(docs, found, args.last))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
