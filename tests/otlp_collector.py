"""A local OTLP/HTTP collector for the export tests: it keeps every request posted to it."""
from __future__ import annotations

import http.server
import threading

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)


class Collector(http.server.BaseHTTPRequestHandler):
    """Answers protobuf; `received`: (path, content type, body) of each POST."""

    received: list[tuple[str, str, bytes]] = []

    def do_POST(self):  # noqa: N802 - http.server API
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, self.headers.get("Content-Type"), body))
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


class JsonCollector(Collector):
    """Answers OTLP/JSON."""

    def do_POST(self):  # noqa: N802 - http.server API
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, self.headers.get("Content-Type"), body))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


def serve(handler: type[Collector]) -> tuple[http.server.ThreadingHTTPServer, str]:
    """The collector running on a free loopback port, its traces URL; `handler.received` starts empty."""
    handler.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1/traces"


def span_names(handler: type[Collector]) -> list[str]:
    """The names of the spans posted to a protobuf collector."""
    return [span.name for _, _, body in handler.received
            for rs in ExportTraceServiceRequest.FromString(body).resource_spans
            for ss in rs.scope_spans for span in ss.spans]
