"""``python -m kquant_cute.compile_cache``: list, summarise or clear the disk compile cache.

This module owns only the small maintenance CLI; compiling is the job of ``kquant-compile``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .cache import CompileCache
from .listing import format_entries


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(prog="python -m kquant_cute.compile_cache", description=__doc__)
    parser.add_argument("--dir", help="cache directory (default: KQUANT_COMPILE_CACHE_DIR or ~/.cache/kquant_cute)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--list", action="store_true", help="list entries (default)")
    what.add_argument("--info", action="store_true", help="print the cache summary")
    what.add_argument("--clear", action="store_true", help="delete every entry")
    parser.add_argument("--verify", action="store_true", help="with --list: check payload checksums")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)

    # Listing and clearing never create a missing directory.
    cache = CompileCache(args.dir, frozen=False, create=False)
    if args.clear:
        try:
            removed = cache.clear()
        except OSError as exc:
            print(f"error: {exc.strerror or exc}", file=sys.stderr)
            return 1
        print(json.dumps({"removed": removed}) if args.json else f"removed {removed} entries from {cache.directory}")
        return 0
    if args.info:
        info = cache.cache_info().as_dict()
        if args.json:
            print(json.dumps(info, indent=1))
        else:
            for k in ("directory", "disk_mode", "degraded_reason", "disk_entries", "disk_bytes"):
                print(f"{k:16} {info[k]}")
        return 0
    rows = cache.entries(verify=args.verify)
    if args.json:
        print(json.dumps(rows, indent=1, sort_keys=True))
        return 0
    print(format_entries(rows, cache.directory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
