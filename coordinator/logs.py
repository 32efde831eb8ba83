"""The coordinator's log formats: text for people (the default), or one JSON object per line for log pipelines.
Either way one record is one line: text from callers (hostnames, reasons, key names) is escaped
(``ifrt.safe_text``) in text, and JSON escapes every control and non-ASCII character."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

from ifrt.safe_text import SafeFormatter

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FIELDS = ("event", "process_id", "host", "host_address", "generation", "fingerprint", "incarnation", "reason")
"""What key log calls add with ``extra={...}``, copied into the JSON object when present."""


class JsonFormatter(logging.Formatter):
    """``{"time": "2025-01-02T03:04:05.678Z", "level": "INFO", "logger": ..., "message": ..., "cluster_id": ...,
    "event": "registered", "process_id": 2, "host": "node-c", ...}``, one line per record."""

    def __init__(self, cluster_id: str) -> None:
        super().__init__()
        self.cluster_id = cluster_id

    def format(self, record: logging.LogRecord) -> str:
        at = datetime.fromtimestamp(record.created, UTC)
        line: dict[str, object] = {
            "time": at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "cluster_id": self.cluster_id,
        }
        for field in FIELDS:
            value = getattr(record, field, None)
            if value is not None:
                line[field] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(level: str, log_format: str, cluster_id: str) -> None:
    """Sends the process's logs to stderr as ``text`` or ``json`` lines."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(cluster_id) if log_format == "json" else SafeFormatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
