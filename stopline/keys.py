"""``stopline keys add|list|revoke|path``: manage the API keys file (docs/http.md#api-keys).

``add`` makes a key, prints it once on stdout and appends its entry (its hash,
never the key) to the file. A running server reads the file again on SIGHUP.
Without ``--file`` (or STOPLINE_API_KEYS_FILE), the file is ``keys.jsonl`` in
the user's config folder, which ``path`` prints.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import platformdirs

from .auth import KeyFileError, Quota, add_key, read_keys_file, revoke_key
from .protocol.vocabulary import QuotaLimit
from .settings import flag_from_environment


def default_keys_file() -> Path:
    """The keys file when none is named: keys.jsonl in the user's config folder
    (``~/.config/stopline`` on Linux, or ``$XDG_CONFIG_HOME/stopline``)."""
    return Path(platformdirs.user_config_dir("stopline")) / "keys.jsonl"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is too small: give at least 1")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stopline keys", description=__doc__)
    commands = p.add_subparsers(dest="command", required=True)
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument(
        "--file",
        default=flag_from_environment("api_keys_file") or str(default_keys_file()),
        help="the keys file, as given to --api-keys-file "
        f"(default: $STOPLINE_API_KEYS_FILE, else {default_keys_file()})",
    )
    add = commands.add_parser("add", parents=[where], help="make a key for NAME, print it once, append its entry")
    add.add_argument("name", metavar="NAME", help="the user the key stands for: user_id in logs and Redis")
    add.add_argument("--id", help="the key's id in logs and metrics (default: NAME-<8 hex digits>)")
    for limit in QuotaLimit:
        add.add_argument(f"--{limit.replace('_', '-')}", dest=str(limit), type=_positive, help="default: no limit")
    add.add_argument(
        "--priority", type=int, default=0, help="the priority of the key's requests that name none (lower first)"
    )
    commands.add_parser("list", parents=[where], help="the keys' ids, users and limits")
    revoke = commands.add_parser("revoke", parents=[where], help="remove a key's entry; send SIGHUP to servers")
    revoke.add_argument("key_id", metavar="ID")
    commands.add_parser(
        "path",
        parents=[where],
        help='print the keys file\'s path, for --api-keys-file "$(stopline keys path)"',
    )
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.command == "path":
        print(args.file)
        return 0
    try:
        if args.command == "add":
            quota = Quota(**{str(limit): getattr(args, limit) for limit in QuotaLimit})
            # The config folder may not exist yet; it holds secrets' hashes, so only its owner reads it.
            Path(args.file).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            key, entry = add_key(args.file, args.name, quota, args.id, args.priority)
            print(key)
            print(
                f"key {entry.key_id} for user {entry.user!r} added to {args.file}. The key is shown only "
                f"this once; start a server with --api-keys-file {shlex.quote(args.file)} "
                "(running servers take it on SIGHUP).",
                file=sys.stderr,
            )
        elif args.command == "list":
            for entry in read_keys_file(args.file):
                limits = ", ".join(f"{name}={value}" for name, value in entry.quota.as_dict().items()) or "no limits"
                if entry.priority:
                    limits += f", priority={entry.priority}"
                print(f"{entry.key_id}\t{entry.user}\t{limits}")
        elif not revoke_key(args.file, args.key_id):
            print(f"stopline keys: {args.file} has no key {args.key_id!r}", file=sys.stderr)
            return 1
        else:
            print(f"key {args.key_id} removed from {args.file}; send SIGHUP to running servers.", file=sys.stderr)
    except (KeyFileError, OSError) as exc:
        print(f"stopline keys: {exc}", file=sys.stderr)
        return 2
    return 0
