"""Print a bench/results/generation-*.json file as markdown tables (one per setup).

python bench/generation_report.py bench/results/generation-2026-11-29.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


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
        )
        groups.setdefault(key, []).append(r)
    out = []
    for key, rs in groups.items():
        tasks = list(rs[0]["tasks"])
        out.append(f"### {key}\n")
        out.append("| strategy | adapters | " + " | ".join(tasks) + " | all >= threshold |")
        out.append("|---|---|" + "---|" * len(tasks) + "---|")
        for r in rs:
            cells = [f"{r['tasks'][t]['accuracy']:.3f}" for t in tasks]
            ok = all(r["tasks"][t]["accuracy"] >= r["tasks"][t]["threshold"] for t in tasks)
            out.append(
                f"| {r['strategy']} | {r['n_adapters']} | " + " | ".join(cells) + f" | {'yes' if ok else 'no'} |"
            )
        out.append("| threshold | | " + " | ".join(f"{rs[0]['tasks'][t]['threshold']:.3f}" for t in tasks) + " | |")
        greedy = next((r for r in rs if r["strategy"] == "greedy-fusion"), None)
        if greedy:
            packs = {}
            for t in tasks:
                packs.setdefault(greedy["tasks"][t]["adapter"], []).append(t)
            out.append("\ngreedy packing: " + "; ".join(f"{a}: {', '.join(ts)}" for a, ts in packs.items()))
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(json.loads(Path(sys.argv[1]).read_text())))
