"""Print a bench/results/generation-*.json file as markdown tables (one per setup).

python bench/generation_report.py bench/results/generation-2026-11-29.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def label(r: dict) -> str:
    """A row's strategy, with the fusion order's rule (and label, when it has one) for greedy fusion."""
    order = r.get("fusion_order")
    if not order:
        return r["strategy"]
    return f"{r['strategy']} ({order.get('label', order['rule'])} order)"


def render(rows: list[dict]) -> str:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        setup = r.get("setup") or {}
        key = (
            f"base {setup.get('base_model', '?')}"
            + (" (pretrained)" if setup.get("base_pretraining") else "")
            + (
                f", r={setup.get('rank', '?')}, lr {setup.get('lr', '?')} ({setup.get('lr_rule', '?')}), "
                f"margin {setup.get('margin', '?')}"
            )
            + (f", seed {setup['seed']}" if "seed" in setup else "")  # seeds apart: their thresholds differ
        )
        groups.setdefault(key, []).append(r)
    out = []
    for key, rs in groups.items():
        tasks = list(rs[0]["tasks"])
        out.append(f"### {key}\n")
        out.append("| strategy | adapters | " + " | ".join(tasks) + " | all >= threshold | min margin |")
        out.append("|---|---|" + "---|" * len(tasks) + "---|---|")
        for r in rs:
            cells = [f"{r['tasks'][t]['accuracy']:.3f}" for t in tasks]
            margin = min(r["tasks"][t]["accuracy"] - r["tasks"][t]["threshold"] for t in tasks)
            out.append(
                f"| {label(r)} | {r['n_adapters']} | "
                + " | ".join(cells)
                + f" | {'yes' if margin >= 0 else 'no'} | {margin:+.3f} |"
            )
        out.append("| threshold | | " + " | ".join(f"{rs[0]['tasks'][t]['threshold']:.3f}" for t in tasks) + " | | |")
        out.append("")
        for r in rs:
            if r["strategy"] != "greedy-fusion":
                continue
            packs = {}
            for t in r.get("fusion_order", {}).get("order", tasks):
                packs.setdefault(r["tasks"][t]["adapter"], []).append(t)
            out.append(f"{label(r)} packing: " + "; ".join(f"{a}: {', '.join(ts)}" for a, ts in packs.items()))
            probe = r.get("fusion_order", {}).get("probe")
            if probe:
                out.append(f"(probes: {probe['trainings']} trainings in {probe['seconds']:.0f} s)")
            out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(json.loads(Path(sys.argv[1]).read_text())))
