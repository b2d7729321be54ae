"""A small proxy for one prefill and one decode vLLM server sharing KV through the tiered store.

For each ``POST /v1/completions`` (or ``/v1/chat/completions``) it

1. sends the request to the prefill server with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}``: the prefill server computes the prompt's KV and
   its connector saves it to the store;
2. sends the original request to the decode server with the ``kv_transfer_params`` the prefill server
   returned: the decode server's connector waits for those chunks in the store, loads them instead of
   recomputing the prefix, and generates the answer, which goes back to the client (streamed through
   if the client asked for a stream).

Standard library only. Run::

    python examples/vllm_disagg/proxy.py --port 8000 \
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import json
import logging
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger("vllm_disagg.proxy")

FORWARDED_PATHS = ("/v1/completions", "/v1/chat/completions")


def post_json(url: str, body: dict[str, Any], timeout_s: float) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: one token, no stream, and ask the prefill server to hand the KV on."""
    out = dict(body, stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    out.pop("stream_options", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


class ProxyHandler(BaseHTTPRequestHandler):
    prefill_url = ""
    decode_url = ""
    timeout_s = 600.0

    def log_message(self, fmt: str, *args: Any) -> None:
        logger.info("%s " + fmt, self.address_string(), *args)

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802  (http.server's naming)
        if self.path == "/health":
            self._reply(200, {"status": "ok"})
        else:
            self._reply(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path not in FORWARDED_PATHS:
            self._reply(404, {"error": f"no route {self.path}"})
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        status, prefilled = post_json(self.prefill_url + self.path, prefill_request(body), self.timeout_s)
        if status != 200:
            self._reply(status, prefilled)
            return
        decode_body = dict(body, kv_transfer_params=prefilled.get("kv_transfer_params"))
        req = urllib.request.Request(self.decode_url + self.path, data=json.dumps(decode_body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            resp = urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as e:
            self._reply(e.code, json.loads(e.read() or b"{}"))
            return
        with resp:
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.headers.get("Content-Type", "application/json"))
            self.send_header("Connection", "close")
            self.end_headers()
            while chunk := resp.read1(65536):
                self.wfile.write(chunk)
                self.wfile.flush()
        self.close_connection = True


def make_server(port: int, prefill_url: str, decode_url: str, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    handler = type("Handler", (ProxyHandler,), {"prefill_url": prefill_url.rstrip("/"),
                                                "decode_url": decode_url.rstrip("/")})
    return ThreadingHTTPServer((host, port), handler)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", required=True, help="base URL of the prefill (kv_producer) server")
    ap.add_argument("--decode", required=True, help="base URL of the decode (kv_consumer) server")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = make_server(args.port, args.prefill, args.decode, args.host)
    logger.info("proxy on %s:%d -> prefill %s, decode %s", args.host, args.port, args.prefill, args.decode)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
