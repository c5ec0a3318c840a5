"""``python -m kquant_cute.compile_cache``: list, summarise or clear the disk compile cache.

This module owns only the small maintenance CLI; compiling is the job of ``kquant-compile``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .cache import CompileCache


def _fmt_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


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
    print(f"{cache.directory}: {len(rows)} entries")
    for m in rows:
        if m["status"] != "ok":
            print(f"  {m['key'][:16]}  CORRUPT  {m.get('error', '')}")
            continue
        extra = m.get("extra") or {}
        res = " ".join(f"{k}={extra[k]}" for k in ("registers", "shared_bytes", "spill_bytes") if k in extra)
        spec = json.dumps(m.get("spec"), sort_keys=True, separators=(",", ":"))
        print(
            f"  {m['key'][:16]}  {m.get('name')}  {m.get('arch')}  {_fmt_bytes(m['payload']['size'])}"
            f"  {m.get('compile_seconds', 0):.2f}s  {m.get('created_utc', '')}  {res}  {spec}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
