"""valora: multi-LoRA serving for vision applications — the client SDK and the CLI. The generated API
stubs are their own package, valora_protos; the server code the CLI runs is reached through
entry points (valora/server_code.py)."""
