"""structlog setup: one JSON object per line on stderr, with the request id bound per RPC."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(service: str, level: str = "info", json: bool = True) -> None:
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)
