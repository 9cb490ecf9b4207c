"""`perdure ft lighthouse [--bind HOST:PORT] [--min-replicas N]`: run a TorchFT lighthouse in the foreground.

Replica groups of a fault-tolerant job (`--ft.enabled true --ft.replica_id I --ft.group_size G --ft.lighthouse
http://HOST:PORT`) meet there. Needs the `ft` extra (`pip install 'perdure[ft]'`). See docs/fault-tolerance.md.
"""

from __future__ import annotations

import argparse

from perdure.ft import lighthouse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `ft` (and `ft lighthouse`) to the `perdure` command's subparsers."""
    parser = subparsers.add_parser("ft", help="TorchFT replica groups: run the lighthouse", description=__doc__)
    commands = parser.add_subparsers(dest="ft_command", required=True)
    serve = commands.add_parser(
        "lighthouse", help="run a lighthouse in the foreground (Ctrl-C stops it)", description=lighthouse.__doc__
    )
    serve.add_argument(
        "--bind", default=lighthouse.DEFAULT_BIND, help=f"address to listen on (default: {lighthouse.DEFAULT_BIND})"
    )
    serve.add_argument(
        "--min-replicas", type=int, default=1, help="groups needed for a new quorum to form (default: 1)"
    )
    serve.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=lighthouse.DEFAULT_HEARTBEAT_TIMEOUT_MS,
        help="a group silent this long is left out of the next quorum (default: %(default)s)",
    )
    serve.add_argument(
        "--join-timeout-ms",
        type=int,
        default=lighthouse.DEFAULT_JOIN_TIMEOUT_MS,
        help="how long a new quorum waits for groups that heartbeat but have not joined yet (default: %(default)s)",
    )
    serve.add_argument(
        "--quorum-tick-ms",
        type=int,
        default=lighthouse.DEFAULT_QUORUM_TICK_MS,
        help="how often a forming quorum is checked (default: %(default)s)",
    )
    serve.set_defaults(handler=cmd_lighthouse)
    return parser


def cmd_lighthouse(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM."""
    lighthouse.serve(
        args.bind,
        announce=lambda line: print(line, flush=True),
        min_replicas=args.min_replicas,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
    )
    return 0
