"""The human-readable listing of a cache directory's entries (``--list`` of both CLIs).

Owns one line per entry from :meth:`CompileCache.entries` metadata: key prefix, kernel name,
arch, what the entry is (the caller's summary of its spec, else the spec as compact JSON),
measured resources, payload size, build time and creation time; ``CORRUPT`` for entries
that fail validation. It knows no spec fields: the kernel-aware summary is the caller's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

SpecText = Callable[[Mapping[str, Any]], Optional[str]]


def _num(v: Optional[int]) -> str:
    return "-" if v is None else f"{v:,}"


def format_entries(entries: Sequence[Mapping[str, Any]], directory: Optional[str],
                   spec_text: Optional[SpecText] = None) -> str:
    """One header line (``"<dir>: N entries"``, noting a missing directory), then one line
    per entry. ``spec_text(spec)`` may summarise a spec (None: the compact JSON instead)."""
    head = f"{directory}: {len(entries)} entries"
    if directory is not None and not os.path.lexists(directory):
        head += " (the directory does not exist)"
    lines = [head]
    for m in entries:
        key = str(m.get("key", ""))[:16]
        if m.get("status") != "ok":
            lines.append(f"  {key}  CORRUPT  {m.get('error', '')}")
            continue
        spec = m.get("spec") or {}
        extra = m.get("extra") or {}
        size = (m.get("payload") or {}).get("size", 0)
        what = (spec_text(spec) if spec_text is not None else None) or json.dumps(
            spec, sort_keys=True, separators=(",", ":"))
        lines.append(
            f"  {key}  {m.get('name')}  {m.get('arch'):<8} {what}  regs={_num(extra.get('registers'))} "
            f"smem={_num(extra.get('shared_bytes'))} spill={_num(extra.get('spill_bytes'))}  "
            f"{size / 1024:.0f} KiB  built in {m.get('compile_seconds', 0):.2f} s  {m.get('created_utc', '')}"
        )
    return "\n".join(lines)
