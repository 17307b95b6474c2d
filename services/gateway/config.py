"""Gateway settings (env VALORA_<FIELD>; lists as `a,b` or a JSON list)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from services.common.config import MAX_NEW_TOKENS_LIMIT, ServiceSettings, split_list


class GatewaySettings(ServiceSettings):
    scheduler_address: str = Field("127.0.0.1:50052", description="SchedulerService address (host:port).")
    adapter_store_address: str = Field(
        "127.0.0.1:50053", description="Adapter store address (AdapterStoreService + registry AdminService)."
    )
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Keys accepted for inference. No keys at all (here and admin_keys) = auth off.",
    )
    admin_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="Keys accepted for admin RPCs (and inference)."
    )

    max_images: int = Field(8, ge=0, description="Images per request.")
    max_image_bytes: int = Field(10 * 1024 * 1024, gt=0, description="Encoded size of one image, in bytes.")
    max_image_pixels: int = Field(
        4096 * 4096, gt=0, description="width*height of one image, read from its header before decoding."
    )
    max_request_pixels: int = Field(
        64 << 20,
        gt=0,
        description="width*height summed over all images and video frames of one request, read "
        "from their headers before any is decoded (64 Mi: four 4096x4096 images, or 64 frames of 1024x1024).",
    )
    max_prompt_chars: int = Field(
        32768,
        gt=0,
        description="Prompt length in characters (code points); a prompt of token ids may hold as many tokens.",
    )
    max_stop_sequences: int = Field(8, ge=0, description="Entries of params.stop.")
    max_new_tokens_limit: int = Field(
        MAX_NEW_TOKENS_LIMIT,
        gt=0,
        description="Largest params.max_new_tokens "
        "accepted (keep it at most the workers' VALORA_MAX_NEW_TOKENS_LIMIT).",
    )
    default_max_new_tokens: int = Field(256, gt=0, description="params.max_new_tokens when the client sends 0.")
    default_deadline_s: float = Field(60.0, gt=0, description="Deadline of a request whose client set none.")
    max_deadline_s: float = Field(600.0, gt=0, description="Longest deadline honoured; longer ones are cut to it.")
    admin_deadline_s: float = Field(300.0, gt=0, description="Default deadline of admin calls (uploads are long).")
    resolve_cache_s: float = Field(
        2.0,
        ge=0,
        description="Seconds a resolved adapter/task reference (READY versions only) is reused "
        "without asking the adapter store; an alias moved or a version deleted elsewhere shows within this time "
        "(this gateway's own admin calls clear it at once). 0: the store is asked for every request.",
    )

    resolve_stale_s: float = Field(
        300.0,
        ge=0,
        description="Seconds past resolve_cache_s that a resolved reference still serves requests "
        "while the adapter store is unreachable (UNAVAILABLE or no answer within 2 s); 0: the store outage fails them.",
    )
    http_keepalive_s: float = Field(15.0, gt=0, description="Seconds an idle HTTP keep-alive connection stays open.")
    http_header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Seconds a new HTTP connection has to send a whole "
        "request head before it is closed (idle and slowloris sockets).",
    )
    image_url_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Hosts remote image URLs may come from (`example.com`, `*.example.com`); "
        "none: only data: URLs (services/gateway/image_urls.py has the rules).",
    )
    image_url_timeout_s: float = Field(10.0, gt=0, description="Seconds one remote image's whole fetch may take.")
    image_url_allow_http: bool = Field(False, description="Fetch http:// image URLs too (else https:// only).")
    image_url_allow_private: bool = Field(
        False, description="Fetch from hosts that resolve to private, loopback or link-local addresses."
    )
    http_max_connections: int = Field(
        1024,
        ge=0,
        description="Open HTTP connections at most; one more is answered 503 with Retry-After and "
        "closed before anything is read (0: no cap).",
    )
    http_enabled: bool = Field(True, description="Serve the OpenAI-compatible HTTP API next to gRPC.")
    http_port: int = Field(0, ge=0, description="Port of the OpenAI-compatible HTTP API; 0 picks a free one.")
    served_model_name: str = Field(
        "valora-base", description="The base model's name in the HTTP API (`model`, /v1/models)."
    )

    @field_validator("api_keys", "admin_keys", "image_url_hosts", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        return split_list(value)

    @model_validator(mode="after")
    def _check(self) -> "GatewaySettings":
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ValueError("default_max_new_tokens exceeds max_new_tokens_limit")
        if self.default_deadline_s > self.max_deadline_s:
            raise ValueError("default_deadline_s exceeds max_deadline_s")
        return self

    def deadline_s(self, client_remaining_s: float | None, default_s: float | None = None) -> float:
        """The downstream timeout: the client's, else the default, never past the cap."""
        if client_remaining_s is None:
            client_remaining_s = default_s or self.default_deadline_s
        return max(0.0, min(client_remaining_s, self.max_deadline_s))
