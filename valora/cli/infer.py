"""`valora infer`: send one request."""

from __future__ import annotations

from pathlib import Path

import typer

from valora.cli.common import ADDRESS, API_KEY, HOME, app, console, gateway_address
from valora.client import ValoraClient


@app.command()
def infer(
    prompt: str = typer.Option("", "--prompt", "-p"),
    image: list[Path] = typer.Option([], "--image", "-i", exists=True, dir_okay=False),
    adapter: str = typer.Option(None, help="adapters/{a}, adapters/{a}/versions/{v} or adapters/{a}@{alias}"),
    task: str = typer.Option(None, help="tasks/{t}"),
    label: bool = typer.Option(False, help="Answer with the task head's label."),
    max_new_tokens: int = typer.Option(0),
    temperature: float = typer.Option(0.0),
    stream: bool = typer.Option(False),
    home: Path = HOME,
    address: str = ADDRESS,
    api_key: str = API_KEY,
):
    """Send one request."""
    with ValoraClient(gateway_address(home, address), api_key=api_key) as client:
        if stream:
            for part in client.infer_stream(
                prompt, image, adapter=adapter, task=task, max_new_tokens=max_new_tokens, temperature=temperature
            ):
                if isinstance(part, str):
                    console.print(part, end="")
                else:
                    console.print()
                    result = part
        else:
            result = client.infer(
                prompt,
                image,
                adapter=adapter,
                task=task,
                label=label,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
            )
            console.print(result.label if label else result.text)
    console.print(
        f"[dim]mode={result.mode} adapter={result.adapter_version or '-'} worker={result.worker} "
        f"tokens={result.output_tokens} ttft={result.first_token_ms:.1f}ms total={result.total_ms:.1f}ms"
    )
