"""`valora status`: the workers, their mode and the adapters they hold."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from valora.cli.common import ADDRESS, ADMIN_KEY, HOME, app, console, gateway_address
from valora.client import ValoraClient
from valora_protos.v1 import types_pb2


def _mode_name(mode: int) -> str:
    """An InferenceMode as a user reads it (merged, unmerged, mixture, ...), not its number."""
    return types_pb2.InferenceMode.Name(mode).removeprefix("INFERENCE_MODE_").lower()


@app.command()
def status(home: Path = HOME, address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """Workers, their mode and the adapters they hold."""
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        s = client.cluster_status()
    table = Table(title=f"workers (queued: {s.queued_requests})")
    for col in ("worker", "healthy", "mode", "merged", "resident", "running", "decode step ms", "prefill step ms"):
        table.add_column(col)
    for w in s.workers:
        table.add_row(
            w.address,
            str(w.healthy),
            _mode_name(w.mode),
            w.merged_adapter or "-",
            ", ".join(w.resident_adapters) or "-",
            f"{w.running_requests}/{w.max_batch_size}",
            f"{w.decode_step_ms_p50:.1f}" if w.decode_step_ms_p50 else "-",
            f"{w.prefill_step_ms_p50:.1f}" if w.prefill_step_ms_p50 else "-",
        )
    console.print(table)
