"""Logging for every process: the level name on every line, and with
`--log-format json` one JSON object per line (python-json-logger) carrying the
trace_id and span_id of the current OpenTelemetry span, when there is one, so that a
log line leads to its trace in Jaeger."""

import logging
import sys

from opentelemetry import trace
from pythonjsonlogger.json import JsonFormatter

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
JSON_FIELDS = ["asctime", "levelname", "name", "message"]


class TraceContext(logging.Filter):
    """Adds trace_id and span_id (hex, as Jaeger shows them) of the current span."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            record.trace_id = format(context.trace_id, "032x")
            record.span_id = format(context.span_id, "016x")
        return True


def configure(level: str, log_format: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(JSON_FIELDS, rename_fields={"levelname": "level"}))
        handler.addFilter(TraceContext())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
