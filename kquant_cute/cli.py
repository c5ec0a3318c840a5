"""``kquant-compile``: prewarm the compile cache for the plans of one MoE layer shape.

This module owns the command line only (arguments, progress, table, JSON, exit status);
what to compile is :mod:`kquant_cute.prewarm`'s job and how entries are stored is
:mod:`kquant_cute.compile_cache`'s.

    kquant-compile                      # the Kimi-K3 TP8 shard for sm_120, capacity 8192
    kquant-compile --sm 90 --sm 120 --experts 8 --hidden 256 --intermediate 256 --topk 2
    kquant-compile --sm 90 --json       # machine-readable records on stdout
    kquant-compile --sm 120 --describe  # also print the planner's describe() per arch
    kquant-compile --sm 90 --pair       # only the seed's plan pair (MoELayer(banded=False))
    kquant-compile --list               # the cache entries (no compiling)
    kquant-compile --clear [--sm ...]   # empty the cache (then compile, if --sm is given)
    kquant-compile --frozen             # compile nothing: verify the cache is warm

Exit status: 0 when every specialization the plans need (decode, chosen prefill) is
usable; 1 when one of them failed or was rejected, or when something compiled in this run
could not be written to the cache directory; 2 for usage errors (bad flag, invalid
geometry, invalid ``KQUANT_W4A16_PREFILL_BLOCK_M`` / ``KQUANT_W4A16_PREFILL_MIN_M`` /
``KQUANT_COMPILE_CACHE_DIR`` / ``KQUANT_COMPILE_FREEZE``: every KQUANT_* variable is
checked at startup by :mod:`kquant_cute.environment`). Rejected fallback candidates are fine.
A valid ``KQUANT_COMPILE_FREEZE`` is ignored (this tool exists to compile); use ``--frozen``.
Needs no GPU: every arch is cross-compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any, Optional, TextIO

from . import trellis as fmt
from .compile_cache import CompileCache, CompileCacheWarning, format_entries
from .compile_cache.cache import ENV_DIR
from .environment import ConfigurationError, check_environment
from .kernels.moe import MoESpec
from .planners import arch_limits, normalize_arch, resolve_env
from .prewarm import (
    DEFAULT_CAPACITY,
    DEFAULT_GEOMETRY,
    ArchPrewarm,
    PrewarmEvent,
    PrewarmRecord,
    needed_failures,
    prewarm_plans,
)

PROG = "kquant-compile"
DEFAULT_SM = "120"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

_DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "f16": "float16", "half": "float16", "float16": "float16",
    "fp32": "float32", "f32": "float32", "float": "float32", "float32": "float32",
}

__all__ = ["main", "build_parser", "format_table"]


class _UsageError(Exception):
    """A problem with the command line or the environment: exit status 2."""


def _dtype(text: str) -> str:
    return _DTYPE_ALIASES.get(text.strip().lower(), text)


def _positive_int(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (defaults: the BRIEF's Kimi-K3 TP8 shard, sm_120, 8192 tokens)."""
    g = DEFAULT_GEOMETRY
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Compile (cross-compile, no GPU needed) every specialization the W4A16 "
        "trellis MoE planner binds for a layer shape, into the kquant compile cache.",
        epilog="Exit status: 0 ok; 1 a needed specialization (decode or chosen prefill) "
        "failed or could not be persisted; 2 usage / environment error.",
    )
    p.add_argument("--sm", action="append", metavar="SM",
                   help="target SM, repeatable: 90, 100, 120 (also 80/86/89, sm_90a...); "
                   f"default {DEFAULT_SM}")
    geo = p.add_argument_group("layer geometry (default: Kimi-K3 TP8 shard)")
    geo.add_argument("--experts", type=_positive_int, default=g.num_experts, help=f"experts E (default {g.num_experts})")
    geo.add_argument("--hidden", type=_positive_int, default=g.hidden, help=f"hidden size H (default {g.hidden})")
    geo.add_argument("--intermediate", type=_positive_int, default=g.intermediate,
                     help=f"intermediate size I per rank (default {g.intermediate})")
    geo.add_argument("--topk", type=_positive_int, default=g.topk, help=f"experts per token (default {g.topk})")
    geo.add_argument("--bits", type=_positive_int, default=g.bits, help=f"trellis bits per weight K (default {g.bits})")
    geo.add_argument("--codebook", default=g.codebook, help=f"mcg, 3inst, mul1 or sqg_e4m3 (default {g.codebook})")
    geo.add_argument("--act-dtype", type=_dtype, default=g.act_dtype, help=f"bf16 or fp16 (default {g.act_dtype})")
    geo.add_argument("--out-dtype", type=_dtype, default=g.out_dtype,
                     help=f"fp32, bf16 or fp16 (default {g.out_dtype})")
    geo.add_argument("--activation", default=g.activation, help=f"silu or situ (default {g.activation})")
    geo.add_argument("--profile", default=None, metavar="NAME",
                     help="a QSRT layer profile instead of --bits / --codebook: "
                     "k2_coupled_h512_h128 (Kimi-K3's production profile: sqg_e4m3 K=2, coupled "
                     "transforms), k3x22_k4x2 or k3x22_k4x2_coupled_h512_h128 (mixed records at "
                     "K=3 and K=4: two resident state tables, sm_90 / sm_100 only)")
    geo.add_argument("--per-expert-vectors", action="store_true",
                     help="per-expert hidden-side suh/svh (EXL3) instead of shared ones (Kimi-K3)")
    geo.add_argument("--expert-map", action="store_true", help="with a global->local expert map (EP)")
    geo.add_argument("--stages", type=_positive_int, default=g.stages,
                     help=f"GEMM cp.async pipeline stages (default {g.stages})")
    p.add_argument("--capacity", type=_positive_int, default=DEFAULT_CAPACITY,
                   help=f"most tokens per call the plans serve (default {DEFAULT_CAPACITY})")
    p.add_argument("--pair", action="store_true",
                   help="only the seed's plan pair of MoELayer(banded=False) (decode + prefill M); "
                   "default: MoELayer's default plan (banded, also every accepted M between "
                   "the two, except for sqg_e4m3)")
    p.add_argument("--cache-dir", help="cache directory (overrides KQUANT_COMPILE_CACHE_DIR)")
    p.add_argument("--json", action="store_true",
                   help="print the records (or --list entries) as JSON on stdout")
    p.add_argument("--describe", action="store_true", help="print the planner's describe() per arch")
    p.add_argument("--list", action="store_true", help="list the cache entries and exit (no compiling)")
    p.add_argument("--clear", action="store_true",
                   help="delete every cache entry; then compile only if --sm is given")
    p.add_argument("--frozen", action="store_true",
                   help="compile nothing: a missing needed specialization fails (cache check)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    return p


# -- progress ---------------------------------------------------------------------------
class _Progress:
    """Plain-text progress on a stream: carriage-return updates on a TTY, else one line per spec."""

    WIDTH = 24

    def __init__(self, stream: TextIO, *, tty: Optional[bool] = None) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self._last = 0
        self._open = False

    def _bar(self, done: int, bound: int) -> str:
        filled = min(self.WIDTH, self.WIDTH * done // max(bound, 1))
        return "[" + "#" * filled + "-" * (self.WIDTH - filled) + "]"

    def __call__(self, ev: PrewarmEvent) -> None:
        # The bound is an upper bound: the fallback walk stops at the first accepted M.
        count = f"specialization {ev.index} of at most {ev.bound}:"
        if ev.kind == "start":
            if self.tty:
                self._write(f"{self._bar(ev.index - 1, ev.bound)} {count} {ev.arch} M={ev.block_m} "
                            f"compiling or loading... ({ev.elapsed:.1f} s)")
            return
        if ev.error is not None:
            what = f"failed: {ev.error}"
        else:
            what = {"disk": "cached (disk)", "memory": "cached (memory)"}.get(ev.answer or "", ev.answer)
        line = f"{count} {ev.arch} M={ev.block_m}: {what} ({ev.seconds:.2f} s)"
        if self.tty:
            self._write(f"{self._bar(ev.index, ev.bound)} {line}")
        else:
            self.stream.write(f"{PROG}: {line}\n")
            self.stream.flush()

    def _write(self, text: str) -> None:
        pad = " " * max(0, self._last - len(text))
        self.stream.write("\r" + text + pad)
        self.stream.flush()
        self._last = len(text)
        self._open = True

    def finish(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


# -- output -----------------------------------------------------------------------------
REASON_WIDTH = 160  # the table clips reasons; --json has them whole


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _num(v: Optional[int]) -> str:
    return "-" if v is None else f"{v:,}"


def format_table(records: Sequence[PrewarmRecord]) -> str:
    """One row per specialization: arch, M, role, status, regs, smem, spill, seconds, reason."""
    head = ("arch", "M", "role", "status", "regs", "smem B", "spill B", "seconds", "reason")
    rows = [head] + [
        (r.arch, str(r.block_m), r.role, r.status + (" (built)" if r.cache == "compiled" and not r.ok else "")
         + (" (unmeasured)" if r.measured is False else ""),
         _num(r.registers), _num(r.shared_bytes), _num(r.spill_bytes), f"{r.seconds:.2f}",
         _clip(r.reason or "", REASON_WIDTH))
        for r in records
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    right = {1, 4, 5, 6, 7}
    lines = []
    for row in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells + [row[-1]]).rstrip())
    return "\n".join(lines)


_IMPORTED_AT = time.time()


def process_wall_seconds() -> float:
    """Wall seconds since this process started (Linux: /proc; elsewhere: since this module
    was imported, which misses only the interpreter's own start-up)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time() - _IMPORTED_AT


def _totals(records: Sequence[PrewarmRecord], wall: float, cache: CompileCache,
            process: Optional[float] = None) -> str:
    counts = {s: sum(r.status == s for r in records) for s in ("compiled", "cached", "rejected", "failed")}
    builds = sum(r.cache == "compiled" for r in records)
    where = cache.directory or "memory only"
    process = process_wall_seconds() if process is None else process
    return (f"totals: {counts['compiled']} compiled, {counts['cached']} cached, "
            f"{counts['rejected']} rejected, {counts['failed']} failed "
            f"(builds this run: {builds}); {wall:.2f} s planning and compiling, "
            f"{process:.2f} s wall since the process started (imports included); "
            f"cache {where} ({cache.disk_mode})")


def _spec_text(spec: dict[str, Any]) -> Optional[str]:
    """A fused-forward spec in a ``--list`` line (None for another kernel's: its JSON)."""
    if "block_m" not in spec:
        return None
    return (f"M={spec['block_m']:<2} E={spec.get('num_experts')} H={spec.get('hidden')} "
            f"I={spec.get('intermediate')} top{spec.get('topk')} K{spec.get('bits')} "
            f"{spec.get('codebook')} {spec.get('act_dtype')}->{spec.get('out_dtype')} "
            f"{spec.get('activation')}{' shared' if spec.get('shared_hidden_vectors') else ' perexp'}"
            f"{' map' if spec.get('has_expert_map') else ''}")


# -- main -------------------------------------------------------------------------------
def _profile_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The MoESpec fields a `--profile` sets (none without one). The profile table is
    `kquant_cute.qsrt.PROFILES`; a flag that contradicts the profile is a usage error."""
    if args.profile is None:
        return {"bits": args.bits, "codebook": args.codebook}
    from . import qsrt

    prof = qsrt.PROFILES.get(args.profile)
    if prof is None:
        raise _UsageError(f"--profile {args.profile}: unknown QSRT profile; known: "
                          f"{', '.join(qsrt.PROFILES)}")
    rates = {}
    bits = prof.uniform_bits
    if bits is None:  # mixed record rates: the kernel decodes every K of the rate set
        from .qsrt_mixed import RATE_SET

        rates, bits = {"bits_set": RATE_SET}, RATE_SET[-1]
    g = DEFAULT_GEOMETRY
    for flag, value, default, wanted in (("--bits", args.bits, g.bits, bits),
                                         ("--codebook", args.codebook, g.codebook, "sqg_e4m3")):
        if value not in (default, wanted):
            raise _UsageError(f"{flag} {value} contradicts --profile {args.profile} "
                              f"({flag} {wanted})")
    if prof.coupled and args.per_expert_vectors:
        raise _UsageError(f"--per-expert-vectors contradicts --profile {args.profile} (coupled "
                          "transforms need shared hidden-side vectors)")
    return {"bits": bits, "codebook": "sqg_e4m3", "coupled": prof.coupled, **rates}


def _geometry(args: argparse.Namespace) -> MoESpec:
    return DEFAULT_GEOMETRY.replace(
        num_experts=args.experts, hidden=args.hidden, intermediate=args.intermediate,
        topk=args.topk, act_dtype=args.act_dtype,
        out_dtype=args.out_dtype, activation=args.activation,
        shared_hidden_vectors=not args.per_expert_vectors, has_expert_map=args.expert_map,
        stages=args.stages, **_profile_fields(args),
    )


def _archs(sms: Optional[Sequence[str]]) -> list[str]:
    out: list[str] = []
    for sm in sms or [DEFAULT_SM]:
        try:
            name = normalize_arch(sm)
        except ValueError as exc:
            raise _UsageError(f"--sm {sm}: {exc}") from None
        if name not in out:
            out.append(name)
    return out


def _open_cache(args: argparse.Namespace, *, create: bool = True) -> CompileCache:
    try:
        # frozen is explicit: KQUANT_COMPILE_FREEZE is for serving processes, not this tool.
        return CompileCache(args.cache_dir, frozen=args.frozen, create=create)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


#: MoESpec field -> the flag that sets it (reasons from MoESpec.check name fields).
_FLAG_OF = {"num_experts": "--experts", "hidden": "--hidden", "intermediate": "--intermediate",
            "topk": "--topk", "bits": "--bits", "codebook": "--codebook",
            "act_dtype": "--act-dtype", "out_dtype": "--out-dtype", "activation": "--activation",
            "stages": "--stages"}
_FIELD_RE = re.compile(r"(?<![\w-])(" + "|".join(_FLAG_OF) + r")(?!\w)")


def _flagged(reason: str) -> str:
    """A MoESpec.check reason with its field names replaced by the flags that set them."""
    return _FIELD_RE.sub(lambda m: _FLAG_OF[m.group(1)], reason)


def _check_flags(args: argparse.Namespace, base: MoESpec, archs: Sequence[str]) -> None:
    """The library's checks (MoESpec.check, MoELayer's capacity and top-k rules), with
    messages that name the flags; raises _UsageError."""
    for flag, value in (("--hidden", args.hidden), ("--intermediate", args.intermediate)):
        if value % fmt.HADAMARD_BLOCK:
            raise _UsageError(f"invalid geometry: {flag} {value} is not a positive multiple of "
                              f"{fmt.HADAMARD_BLOCK} (the Hadamard block)")
    if not args.expert_map and args.topk > args.experts:
        raise _UsageError(f"invalid geometry: --topk {args.topk} is above --experts {args.experts} "
                          "(a token routes to top-k distinct experts; with --expert-map the ids "
                          "are global and may outnumber the local experts)")
    for arch in archs:
        reason = base.replace(arch=arch).check(smem_limit=arch_limits(arch).smem_per_block_optin)
        if reason is not None:
            raise _UsageError(f"invalid geometry for {arch}: {_flagged(reason)}")
    if args.capacity > base.max_tokens():
        raise _UsageError(
            f"--capacity {args.capacity:,} is above {base.max_tokens():,} tokens, the most whose "
            f"scratch indices stay in 32-bit range at --topk {args.topk} and "
            f"max(--hidden, --intermediate) {max(args.hidden, args.intermediate):,}")


def _check_env(args: argparse.Namespace) -> None:
    env = dict(os.environ)
    if args.cache_dir is not None:
        env.pop(ENV_DIR, None)  # --cache-dir overrides it
    try:
        check_environment(env)
    except ConfigurationError as exc:
        raise _UsageError(str(exc)) from None


def _run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.list and (args.sm or args.clear or args.describe or args.frozen):
        raise _UsageError("--list only lists; do not combine it with --sm, --clear, --describe or --frozen")
    if args.clear and args.frozen:
        raise _UsageError("--clear and --frozen contradict each other")
    _check_env(args)
    # Listing, checking (--frozen) and clearing never create a missing directory.
    cache = _open_cache(args, create=not (args.list or args.frozen or (args.clear and not args.sm)))
    if args.list:
        entries = cache.entries()
        text = format_entries(entries, cache.directory, _spec_text)
        print(json.dumps(entries, indent=1, sort_keys=True) if args.json else text, file=out)
        return EXIT_OK
    if args.clear:
        try:
            removed = cache.clear()
        except OSError as exc:
            print(f"{PROG}: error: {exc.strerror or exc}", file=err)
            return EXIT_FAILED
        msg = f"removed {removed} entries from {cache.directory or 'memory'}"
        if not args.sm:
            print(json.dumps({"removed": removed, "directory": cache.directory}) if args.json else msg, file=out)
            return EXIT_OK
        print(f"{PROG}: {msg}", file=err)

    archs = _archs(args.sm)
    try:
        env = resolve_env()
    except ValueError as exc:
        raise _UsageError(f"invalid plan environment: {exc}") from None
    base = _geometry(args)
    _check_flags(args, base, archs)

    progress = None if args.quiet else _Progress(err)
    t0 = time.perf_counter()
    try:
        results: list[ArchPrewarm] = prewarm_plans(base, archs=archs, capacity=args.capacity,
                                                   env=env, cache=cache, progress=progress,
                                                   banded=False if args.pair else None)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None
    finally:
        if progress is not None:
            progress.finish()
    wall = time.perf_counter() - t0
    records = [r for res in results for r in res.records]

    text_out = err if args.json else out
    if args.describe:
        print("\n".join(res.describe() for res in results), file=text_out)
    if args.json:
        print(json.dumps([r.as_dict() for r in records], indent=1), file=out)
    else:
        print(format_table(records), file=out)
    print(_totals(records, wall, cache), file=text_out)

    unmeasured = [r for r in records if r.measured is False]
    if unmeasured:
        print(f"{PROG}: warning: registers and spills of {len(unmeasured)} specializations were "
              "not measured (cuobjdump not found: install nvidia-cuda-cuobjdump or set "
              "CUDA_HOME); their geometry is unchecked", file=err)
    status = EXIT_OK
    failures = needed_failures(records)
    for r in failures:
        print(f"{PROG}: error: {r.arch}: the {r.role} specialization M={r.block_m} "
              f"{'failed' if r.status == 'failed' else 'was rejected'}: {r.reason}", file=err)
        status = EXIT_FAILED
    for res in results:
        if res.error and not any(r.arch == res.arch for r in failures):
            print(f"{PROG}: error: {res.arch}: {res.error}", file=err)
            status = EXIT_FAILED
    built = sum(r.cache == "compiled" for r in records)
    if built and cache.disk_mode != "rw":
        print(f"{PROG}: error: {built} specializations were compiled but not persisted "
              f"(cache {cache.directory or 'memory only'} is {cache.disk_mode}); "
              "pass --cache-dir with a writable directory", file=err)
        status = EXIT_FAILED
    return status


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``kquant-compile``; returns the exit status (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    out, err = sys.stdout, sys.stderr
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", CompileCacheWarning)
            warnings.showwarning = _show_warning  # restored by catch_warnings
            return _run(args, out, err)
    except _UsageError as exc:
        print(f"{PROG}: error: {exc}", file=err)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=err)
        return 130


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Optional[TextIO] = None, line: Optional[str] = None) -> None:
    print(f"{PROG}: warning: {message}", file=sys.stderr if file is None else file)


if __name__ == "__main__":
    sys.exit(main())
