"""``mooncake-kv``: the console script. Subcommands live in their own modules.

Subcommand modules are imported only when chosen, so ``mooncake-kv demo`` never imports vLLM
or SGLang.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> (module, help). Each module exposes add_arguments(parser) and run(args) -> int.
_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("mooncake_kv.demo", "write, offload, evict, read back and promote a stream of KV chunks"),
    "replay": ("mooncake_kv.replay.cli", "replay a request trace through the store and report hit ratios"),
    "inspect": ("mooncake_kv.inspect_cli", "what an SSD tier directory holds; --verify checks every record"),
    "serve": ("mooncake_kv.node_cli", "run the node service (one store per node) in the foreground"),
    "status": ("mooncake_kv.node_cli", "whether the node service answers; its tiers, usage and clients"),
    "stop": ("mooncake_kv.node_cli", "stop the node service as SIGTERM does"),
    "index": ("mooncake_kv.index.cli", "what each engine and node service caches, from their KV events, over HTTP"),
    "route": ("mooncake_kv.route.cli", "the Conductor: a cache-aware router in front of vLLM instances"),
    "simulate": ("mooncake_kv.route.simulate_cli", "the router's decisions at cluster scale (simulate route)"),
}
_BENCHES: dict[str, tuple[str, str]] = {
    "store": ("mooncake_kv.bench.store", "DRAM and SSD tier throughput against memcpy and raw O_DIRECT"),
    "vllm": ("mooncake_kv.bench.vllm", "TTFT with a full external hit versus recompute on vLLM (CPU build)"),
    "sglang": ("mooncake_kv.bench.sglang", "HiCache backend throughput against SGLang's file backend"),
    "node": ("mooncake_kv.bench.node", "node service put/get and lookups against the embedded store and memcpy"),
    "serve": ("mooncake_kv.bench.serve", "TTFT and hit ratio of vllm serve on the conversation trace, with and without the tiers"),
    "index": ("mooncake_kv.bench.index", "KV events through the publisher into the index; a prompt query through "
              "the index against the store's own lookup"),
    "route": ("mooncake_kv.bench.route", "the router's policies on two vLLM instances whose nodes share a "
              "rate-limited link (root: a network namespace and tc)"),
    "pd": ("mooncake_kv.bench.pd", "prefill and decode on two nodes over a rate-limited link: the decode side's "
           "wait, pulled against pushed (root: a network namespace and tc)"),
    "pool": ("mooncake_kv.bench.pool", "remote get/put through the pool (two node services, Redis) against the "
             "raw socket and Mooncake Store; directory lookups"),
}


def _module(name: str):  # noqa: ANN202
    return importlib.import_module(name)


def _add_lazy(sub: argparse._SubParsersAction, name: str, module: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.set_defaults(_module=module)
    # Arguments are added on demand in main(): importing every module here would import the engines.


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mooncake-kv", description="Tiered KV-cache store for vLLM and SGLang")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in _COMMANDS.items():
        _add_lazy(sub, name, module, help_text)
    bench = sub.add_parser("bench", help="benchmarks (each prints one JSON object as its last line with --json)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in _BENCHES.items():
        _add_lazy(bench_sub, name, module, help_text)
    return parser


def _names_a_command(argv: list[str]) -> bool:
    """Whether ``argv`` names a subcommand that has its own arguments (``bench`` needs its name too)."""
    words = [a for a in argv if not a.startswith("-")]
    if not words:
        return False
    if words[0] == "bench":
        return len(words) > 1 and words[1] in _BENCHES
    return words[0] in _COMMANDS


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # First pass finds the subcommand (without --help, which would print the subcommand's help
    # before its module added the arguments); the chosen module then adds its own arguments.
    helps = {"-h", "--help"}
    first = [a for a in argv if a not in helps]
    if len(first) < len(argv) and not _names_a_command(first):
        parser.parse_args(argv)  # top-level or ``bench`` help: prints it and exits
    args, _ = parser.parse_known_args(first)
    module = _module(args._module)
    chosen = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    sub = chosen[args.command]
    if args.command == "bench":
        sub = sub._subparsers._group_actions[0].choices[args.bench]  # type: ignore[union-attr]
    module.add_arguments(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
