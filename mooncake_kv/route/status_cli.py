"""``mooncake-kv status --router URL``: what a running router says of itself (``/router/status``):
its policy and SLO, each instance's health, load and fitted cost model, the prefill/decode pairs
it never makes (their KV layouts differ), and its decisions by reason (``/metrics``). Exit status
0 when some instance is healthy, 1 when none is, 2 when the router does not answer."""

from __future__ import annotations

import argparse
import json
import re

import httpx


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", metavar="URL", help="a router's base URL (http://host:port): its status instead")


def run(args: argparse.Namespace) -> int:
    base = args.router.rstrip("/")
    try:
        with httpx.Client(base_url=base, timeout=10) as http:
            status = http.get("/router/status").raise_for_status().json()
            metrics = http.get("/metrics").raise_for_status().text
    except httpx.HTTPError as e:
        print(f"mooncake-kv status: the router at {base} does not answer: {e}")
        return 2
    reasons: dict[str, float] = {}
    for m in re.finditer(r'^mooncake_router_decisions_total\{policy="([^"]*)",reason="([^"]*)"\} ([0-9.e+]+)$',
                         metrics, re.MULTILINE):
        reasons[f"{m.group(1)}/{m.group(2)}"] = float(m.group(3))
    status["decisions_by_reason"] = reasons
    if getattr(args, "json", False):
        print(json.dumps(status))
    else:
        print(f"router {base}: policy {status['policy']}, SLO {status['slo_ttft_s']}, a dead instance leaves "
              f"the rotation within {status['leaves_rotation_within_s']:.1f} s")
        for name, inst in status["instances"].items():
            print(f"  {name} {inst['url']}: {'healthy' if inst['healthy'] else 'OUT OF ROTATION'}, "
                  f"{inst['in_flight']} in flight, {inst['observations']} first tokens observed, "
                  f"{inst['model']['per_token_s'] * 1e6:.1f} us/token")
        for m in status.get("layout_mismatches", []):
            print(f"  NEVER PAIRED: prefill {m['prefill']} (TP {m['prefill_tp_size']}) with decode {m['decode']} "
                  f"(TP {m['decode_tp_size']}): {', '.join(m['differs'])}")
        for key, n in sorted(reasons.items()):
            print(f"  decisions {key}: {n:.0f}")
    return 0 if any(i["healthy"] for i in status["instances"].values()) else 1
