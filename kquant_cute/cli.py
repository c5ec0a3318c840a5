"""``kquant-compile``: prewarm the compile cache for the plans of one MoE layer shape.

This module owns the command line only (arguments, progress, table, JSON, exit status);
what to compile is :mod:`kquant_cute.prewarm`'s job and how entries are stored is
:mod:`kquant_cute.compile_cache`'s.

    kquant-compile                      # the Kimi-K3 TP8 shard for sm_120, capacity 8192
    kquant-compile --sm 90 --sm 120 --experts 8 --hidden 256 --intermediate 256 --topk 2
    kquant-compile --sm 90 --json       # machine-readable records on stdout
    kquant-compile --sm 120 --describe  # also print the planner's describe() per arch
    kquant-compile --sm 90 --pair       # only the decode/prefill pair (MoELayer(banded=False))
    kquant-compile --list               # the cache entries (no compiling)
    kquant-compile --clear [--sm ...]   # empty the cache (then compile, if --sm is given)
    kquant-compile --frozen             # compile nothing: verify the cache is warm

Exit status: 0 when every specialization the plans need (decode, chosen prefill) is
usable; 1 when one of them failed or was rejected, or when something compiled in this run
could not be written to the cache directory; 2 for usage errors (bad flag, invalid
geometry, invalid ``KQUANT_W4A16_PREFILL_BLOCK_M`` / ``KQUANT_W4A16_PREFILL_MIN_M`` /
``KQUANT_COMPILE_CACHE_DIR`` / ``KQUANT_COMPILE_FREEZE``: every KQUANT_* variable is
checked at startup by :mod:`kquant_cute.environment`). Rejected fallback candidates are fine.
A valid ``KQUANT_COMPILE_FREEZE`` is ignored (this tool exists to compile); use ``--frozen``
(exit 1 when a planned specialization is missing or corrupt: every one is listed). A
geometry no kernel implements on a requested arch (e.g. more experts than the route pack's
shared memory holds) is a usage error, exit 2. Needs no GPU: every arch is cross-compiled; `--help` and usage
errors answer without importing torch or cutlass.
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
from typing import TYPE_CHECKING, Any, Optional, TextIO

# The CLI's own start, for the totals line (a shell's time before exec is not ours).
_STARTED = time.perf_counter()

# Only light modules at import time: `--help` and usage errors answer without loading
# torch or cutlass (the planning modules are imported in `_run`).
from .compile_cache import CompileCache, CompileCacheWarning, format_entries
from .compile_cache.cache import ENV_DIR
from .defaults import DEFAULT_CAPACITY, REFERENCE_LAYER
from .environment import ConfigurationError, check_environment
from .kernels.format import HADAMARD_BLOCK
from .planners import known_archs, normalize_arch, resolve_env

if TYPE_CHECKING:
    from .kernels.moe import MoESpec
    from .prewarm import ArchPrewarm, PrewarmEvent, PrewarmRecord

PROG = "kquant-compile"
DEFAULT_SM = "120"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

__all__ = ["main", "build_parser", "format_table"]


class _UsageError(Exception):
    """A problem with the command line or the environment: exit status 2."""


def _positive_int(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


#: Dtype spellings the flags accept -> MoESpec's names; messages use the short ones.
_DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "f16": "float16", "half": "float16", "float16": "float16",
    "fp32": "float32", "f32": "float32", "float": "float32", "float32": "float32",
}
_SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (defaults: the reference geometry, sm_120, 8192 tokens). The
    geometry flags default to None so a flag given explicitly can be told from the default."""
    g = REFERENCE_LAYER
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Compile (cross-compile, no GPU needed) every specialization the W4A16 "
        "trellis MoE planner binds for a layer shape, into the kquant compile cache.",
        epilog="Exit status: 0 ok; 1 a needed specialization (decode or chosen prefill) "
        "failed or could not be persisted, or (--frozen) one is missing; 2 usage / "
        "environment error or a geometry no kernel implements.",
    )
    p.add_argument("--sm", action="append", metavar="SM",
                   help="target SM, repeatable: 90, 100, 120 (also 80, 86, 89; sm_90, sm_90a); "
                   f"default {DEFAULT_SM}")
    geo = p.add_argument_group("layer geometry (default: one TP8 shard of Kimi-K3)")
    for flag, field, what in (("--experts", "num_experts", "experts E"),
                              ("--hidden", "hidden", "hidden size H"),
                              ("--intermediate", "intermediate", "intermediate size I per rank"),
                              ("--topk", "topk", "experts per token"),
                              ("--bits", "bits", "trellis bits per weight K")):
        geo.add_argument(flag, type=_positive_int, default=None, help=f"{what} (default {g[field]})")
    geo.add_argument("--codebook", default=None,
                     help=f"mcg, 3inst, mul1 or sqg_e4m3 (default {g['codebook']})")
    geo.add_argument("--act-dtype", default=None,
                     help=f"bf16 or fp16 (default {_SHORT_DTYPE[g['act_dtype']]})")
    geo.add_argument("--out-dtype", default=None,
                     help=f"fp32, bf16 or fp16 (default {_SHORT_DTYPE[g['out_dtype']]})")
    geo.add_argument("--activation", default=None, help=f"silu or situ (default {g['activation']})")
    geo.add_argument("--profile", default=None, metavar="NAME",
                     help="a QSRT layer profile instead of --bits / --codebook: "
                     "k2_coupled_h512_h128 (Kimi-K3's production profile: sqg_e4m3 K=2, coupled "
                     "transforms), k3x22_k4x2 or k3x22_k4x2_coupled_h512_h128 (mixed records at "
                     "K=3 and K=4: two resident state tables on sm_90 / sm_100, T12 decode on sm_120)")
    geo.add_argument("--per-expert-vectors", action="store_true",
                     help="per-expert hidden-side suh/svh (EXL3) instead of shared ones (Kimi-K3)")
    geo.add_argument("--expert-map", action="store_true", help="with a global->local expert map (EP)")
    geo.add_argument("--stages", type=_positive_int, default=None,
                     help="GEMM cp.async pipeline stages (default: the kernel's)")
    p.add_argument("--capacity", type=_positive_int, default=DEFAULT_CAPACITY,
                   help=f"most tokens per call the plans serve (default {DEFAULT_CAPACITY})")
    p.add_argument("--pair", action="store_true",
                   help="only the decode/prefill pair plan of MoELayer(banded=False); "
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
            if ev.waited:
                what += f" after waiting {ev.waited:.1f} s for another process building it"
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


def _m_label(r: PrewarmRecord) -> str:
    """M as the table and the error lines name it: "48 x 2" for the wide rule's items."""
    return str(r.block_m) + (f" x {r.span}" if r.role.startswith("wide") else "")


def format_table(records: Sequence[PrewarmRecord]) -> str:
    """One row per specialization: arch, M, role, status, regs, smem, spill, seconds, reason."""
    head = ("arch", "M", "role", "status", "regs", "smem B", "spill B", "seconds", "reason")
    rows = [head] + [
        (r.arch, _m_label(r), r.role,
         r.status + (" (built)" if r.cache == "compiled" and not r.ok else "")
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


def _totals(records: Sequence[PrewarmRecord], wall: float, cache: CompileCache,
            since_start: Optional[float] = None) -> str:
    counts = {s: sum(r.status == s for r in records) for s in ("compiled", "cached", "rejected", "failed")}
    builds = sum(r.cache == "compiled" for r in records)
    where = cache.directory or "memory only"
    since_start = time.perf_counter() - _STARTED if since_start is None else since_start
    return (f"totals: {counts['compiled']} compiled, {counts['cached']} cached, "
            f"{counts['rejected']} rejected, {counts['failed']} failed "
            f"(builds this run: {builds}); {wall:.2f} s planning and compiling, "
            f"{since_start:.2f} s wall since {PROG} started (imports included); "
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
def _dtype_field(flag: str, text: Optional[str], default: str, allowed: Sequence[str]) -> str:
    """MoESpec's name of the dtype a flag gives (its default when not given)."""
    if text is None:
        return default
    name = _DTYPE_ALIASES.get(text.strip().lower())
    if name not in allowed:
        raise _UsageError(f"{flag} {text}: not one of "
                          f"{', '.join(_SHORT_DTYPE[a] for a in allowed)}")
    return name


def _profile_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The MoESpec fields --bits / --codebook or a --profile set. The profile table is
    `kquant_cute.qsrt.PROFILES`; a flag given with a profile must agree with it (a flag
    left out never contradicts it, one given always counts, default value or not)."""
    g = REFERENCE_LAYER
    if args.profile is None:
        return {"bits": g["bits"] if args.bits is None else args.bits,
                "codebook": g["codebook"] if args.codebook is None else args.codebook}
    from . import qsrt

    prof = qsrt.PROFILES.get(args.profile)
    if prof is None:
        raise _UsageError(f"--profile {args.profile}: unknown QSRT profile; known: "
                          f"{', '.join(qsrt.PROFILES)}")
    rates = {}
    bits = prof.uniform_bits
    if bits is None:  # mixed record rates: the kernel decodes every K of the rate set
        from .qsrt.layout import RATE_SET

        rates, bits = {"bits_set": RATE_SET}, RATE_SET[-1]
    for flag, value, wanted in (("--bits", args.bits, bits), ("--codebook", args.codebook, qsrt.CODEBOOK)):
        if value is not None and value != wanted:
            raise _UsageError(f"{flag} {value} contradicts --profile {args.profile} "
                              f"({flag} {wanted})")
    if prof.coupled and args.per_expert_vectors:
        raise _UsageError(f"--per-expert-vectors contradicts --profile {args.profile} (coupled "
                          "transforms need shared hidden-side vectors)")
    return {"bits": bits, "codebook": qsrt.CODEBOOK, "coupled": prof.coupled, **rates}


#: MoESpec field -> the flag that sets it (reasons from MoESpec.check name fields).
_FLAG_OF = {"num_experts": "--experts", "hidden": "--hidden", "intermediate": "--intermediate",
            "topk": "--topk", "bits": "--bits", "codebook": "--codebook",
            "act_dtype": "--act-dtype", "out_dtype": "--out-dtype", "activation": "--activation",
            "stages": "--stages"}


def _geometry(args: argparse.Namespace) -> MoESpec:
    from .kernels.moe import ACT_DTYPES, OUT_DTYPES
    from .prewarm import DEFAULT_GEOMETRY

    g = REFERENCE_LAYER
    fields: dict[str, Any] = {
        "act_dtype": _dtype_field("--act-dtype", args.act_dtype, g["act_dtype"], ACT_DTYPES),
        "out_dtype": _dtype_field("--out-dtype", args.out_dtype, g["out_dtype"], OUT_DTYPES),
        "shared_hidden_vectors": not args.per_expert_vectors, "has_expert_map": args.expert_map,
    }
    for field in ("num_experts", "hidden", "intermediate", "topk", "activation", "stages"):
        value = getattr(args, _FLAG_OF[field][2:].replace("-", "_"))
        if value is not None:
            fields[field] = value
    return DEFAULT_GEOMETRY.replace(**fields, **_profile_fields(args))


def _archs(sms: Optional[Sequence[str]]) -> list[str]:
    out: list[str] = []
    for sm in sms or [DEFAULT_SM]:
        try:
            name = normalize_arch(sm)
        except ValueError:
            numbers = ", ".join(a.removeprefix("sm_") for a in known_archs())
            raise _UsageError(f"--sm {sm}: unknown GPU architecture; use one of {numbers} "
                              "(also spelled sm_90 or sm_90a)") from None
        if name not in out:
            out.append(name)
    return out


def _open_cache(args: argparse.Namespace, *, create: bool = True) -> CompileCache:
    try:
        # frozen is explicit: KQUANT_COMPILE_FREEZE is for serving processes, not this tool.
        return CompileCache(args.cache_dir, frozen=args.frozen, create=create)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


_FIELD_RE = re.compile(r"(?<![\w-])(" + "|".join(_FLAG_OF) + r")(?!\w)")
_TUPLE_RE = re.compile(r"\(((?:'[^']*'|\d+)(?:, (?:'[^']*'|\d+))*),?\)")
_QUOTED_RE = re.compile(r"'([^'\s]*)'")


def _flagged(reason: str) -> str:
    """A MoESpec.check reason in command-line words: field names become the flags that set
    them, Python tuples plain lists, quoted values bare."""
    reason = _FIELD_RE.sub(lambda m: _FLAG_OF[m.group(1)], reason)
    reason = _TUPLE_RE.sub(lambda m: m.group(1), reason)
    return _QUOTED_RE.sub(lambda m: m.group(1), reason)


#: Size flags an absurd value of which gets a plain bound: flag -> (MoESpec field, step).
_SIZE_FLAGS = {"--experts": ("num_experts", 1), "--hidden": ("hidden", HADAMARD_BLOCK),
               "--intermediate": ("intermediate", HADAMARD_BLOCK)}


def _largest_valid(base: MoESpec, field: str, step: int) -> Optional[int]:
    """The largest multiple of `step` below `base`'s value of `field` that MoESpec.check
    accepts with every other field as given (None when none is), by bisection: above the
    smallest accepted value (found by doubling from `step`: e.g. the experts must be at
    least top-k), the sizes' checks (shared memory, 32-bit indexing) only grow with it."""
    def ok(v: int) -> bool:
        return base.replace(**{field: v}).check() is None

    lo, hi = step, getattr(base, field)
    while lo < hi and not ok(lo):
        lo *= 2
    if lo >= hi:
        return None
    while hi - lo > step:
        mid = lo + (hi - lo) // (2 * step) * step
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _size_bound(args: argparse.Namespace, base: MoESpec) -> Optional[str]:
    """For a geometry MoESpec.check rejects: the size flag whose value alone is too large
    (the one furthest above its default first), with its largest accepted value."""
    given = [(flag, field, step) for flag, (field, step) in _SIZE_FLAGS.items()
             if getattr(args, field if field != "num_experts" else "experts") is not None]
    given.sort(key=lambda t: -getattr(base, t[1]) / REFERENCE_LAYER[t[1]])
    if base.coupled:  # the coupled latent transform works on blocks of 512 channels
        given = [(f, fd, 512 if fd == "hidden" else st) for f, fd, st in given]
    for flag, field, step in given:
        bound = _largest_valid(base, field, step)
        if bound is None:
            continue
        over = base.replace(**{field: bound + step}).check()
        if over is None:  # the value is rejected for something other than its size
            continue
        return (f"{flag} must be at most {bound:,} with the other flags as given "
                f"({flag} {bound + step:,}: {_flagged(over)})")
    return None


def _check_flags(args: argparse.Namespace, base: MoESpec, archs: Sequence[str]) -> None:
    """The library's checks (MoESpec.check, which owns the Hadamard-block and top-k rules
    too, and MoELayer's capacity rule), with messages that name the flags and echo what
    was typed; raises _UsageError."""
    for arch in archs:
        reason = base.replace(arch=arch).check()
        if reason is not None:
            bound = _size_bound(args, base.replace(arch=arch))
            raise _UsageError(f"invalid geometry for {arch}: {bound or _flagged(reason)}")
    if args.capacity > base.max_tokens():
        raise _UsageError(
            f"--capacity {args.capacity:,} is above {base.max_tokens():,} tokens, the most whose "
            f"scratch indices stay in 32-bit range at --topk {base.topk} and "
            f"max(--hidden, --intermediate) {max(base.hidden, base.intermediate):,}")


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
    # Listing, checking (--frozen) and clearing never create a missing directory. A clear
    # that fails says why in its error; the cache's own warning would say it twice.
    with warnings.catch_warnings(record=args.clear) as opened:
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
        for w in opened or ():
            _show_warning(w.message, w.category, w.filename, w.lineno, err)
        msg = f"removed {removed} entries from {cache.directory or 'memory'}"
        if not args.sm:
            print(json.dumps({"removed": removed, "directory": cache.directory}) if args.json else msg, file=out)
            return EXIT_OK
        print(f"{PROG}: {msg}", file=err)

    archs = _archs(args.sm)
    from .prewarm import needed_failures, prewarm_plans  # the planning modules (cutlass)

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
    if args.frozen:  # a frozen process binds the band sizes too: each missing one counts
        failures += [r for r in records if r.status == "failed" and not r.needed]
    for r in failures:
        print(f"{PROG}: error: {r.arch}: the {r.role} specialization M={_m_label(r)} "
              f"{'failed' if r.status == 'failed' else 'was rejected'}: {r.reason}", file=err)
        status = EXIT_FAILED
    if args.frozen and failures:
        print(f"{PROG}: {len(failures)} specializations are missing or unusable; run "
              f"{PROG} without --frozen (same flags) to compile them", file=err)
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
