"""valora: multi-LoRA serving for vision applications — client SDK, CLI and generated API stubs."""
