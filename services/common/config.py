"""Typed settings shared by every service. Each service subclasses `ServiceSettings`; every
field is also settable as VALORA_<FIELD> (e.g. VALORA_PORT=50051). Parsed once in main()."""

from __future__ import annotations

import json

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# The largest max_new_tokens a request may ask for: the default of the gateway's and the
# workers' limits alike, so a request the gateway accepts is never refused by a worker.
MAX_NEW_TOKENS_LIMIT = 4096
MAX_TOP_LOGPROBS = 20  # alternatives a generated token's log-probability comes with, at most (OpenAI's bound)
# OpenAI's logit_bias bounds: at most this many tokens per request, each bias in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS].
MAX_LOGIT_BIAS_TOKENS = 300
MAX_LOGIT_BIAS = 100.0


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VALORA_", extra="ignore")

    host: str = Field("127.0.0.1", description="Interface the gRPC server binds.")
    port: int = Field(0, description="gRPC port; 0 picks a free one (tests).")
    log_level: str = Field("info", description="structlog level: debug, info, warning, error.")
    log_json: bool = Field(True, description="JSON log lines (false: human-readable console).")
    grace_s: float = Field(5.0, description="Graceful-shutdown grace period in seconds.")
    drain_delay_s: float = Field(
        0.0,
        ge=0,
        description="On SIGTERM, seconds between health NOT_SERVING and refusing new RPCs, so "
        "whoever routes by health (the scheduler, a load balancer) stops sending here first.",
    )
    metrics_port: int = Field(0, description="Prometheus /metrics port; 0 disables it.")
    max_message_bytes: int = Field(64 * 1024 * 1024, description="Largest gRPC message accepted or sent, in bytes.")
    tls_cert: str = Field(
        "",
        description="PEM certificate file of this service; with tls_key the server speaks TLS and outbound "
        "channels present it (client certificate). Empty: plaintext.",
    )
    tls_key: str = Field("", description="PEM private key file of tls_cert.")
    tls_ca: str = Field(
        "",
        description="PEM CA bundle file that peers' certificates must chain to; with tls_cert set the server "
        "requires client certificates (mutual TLS), and outbound channels verify servers against it.",
    )
    keepalive_s: float = Field(
        60.0,
        gt=0,
        description="Seconds between the server's keepalive pings on an idle "
        "connection (a dead peer is noticed within that plus 20 s).",
    )
    max_connection_age_s: float = Field(
        0.0,
        ge=0,
        description="Seconds after which the server asks a client to reconnect (spreading clients over "
        "replicas behind a load balancer; the gateway's Helm default is 300). 0: connections live on.",
    )
    internal_token: str = Field(
        "",
        description="Shared secret of the internal APIs (services/common/internal_auth.py): the store, "
        "scheduler and workers refuse calls without it; every service sends it. Empty: internal APIs open.",
    )
    internal_token_file: str = Field(
        "", description="File holding internal_token (a mounted secret); used when internal_token is empty."
    )
    otlp_endpoint: str = Field(
        "", description="OTLP/gRPC trace collector, e.g. http://otel-collector:4317; empty = no OTLP export."
    )
    trace_console: bool = Field(False, description="Also print finished trace spans to stdout (debugging).")
    trace_sample_ratio: float = Field(
        1.0, ge=0.0, le=1.0, description="Share of new traces sampled; calls inside a trace follow their parent."
    )


def split_list(value: object) -> object:
    """Lists from the environment: JSON (`["a","b"]`) or comma-separated (`a,b`). Use as a
    `mode="before"` field validator on `Annotated[list[...], NoDecode]` fields."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value
