"""QSRT tensor-parallel rank extents: which atom rows of a layer one rank owns.

The single owner of how every QSRT profile is split over tensor-parallel ranks:

* ``k2_coupled_h512_h128`` (uniform K=2, coupled): a rank holds whole post-activation H128
  blocks (4 atoms) and never crosses the half boundary (atom ``atom_slots / 2``: the halves
  carry different input vectors). Even ``tp_size``: each half's blocks are split
  quotient/remainder among ``tp_size / 2`` ranks (Kimi-K3 TP8: 12 atoms = 384 channels each,
  TP12: 8 = 256). ``tp_size == 9``: the published TP9 plan (five ranks split half 0, four
  split half 1; which rank owns which extent rotates with the layer), padded to the widest
  rank (384 channels);
* ``k3x22_k4x2`` (uncoupled H308): quotient/remainder atom partition, accepted only when every
  rank holds whole record pairs (a split pair would split a record's H128 block);
* ``k3x22_k4x2_coupled_h512_h128``: TP12, rank ``r`` owning pair ``(r + layer - 1) mod 12``.

Sources: docs/formats.md (b12x ``qsrt_sharding.py``, pedapudi/qsrt, the vLLM fork).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import format as fmt
from . import layout
from .format import ATOM_CHANNELS, ATOMS_PER_POST_BLOCK, TP9, Geometry, QSRTFormatError

__all__ = ["RankExtent", "rank_extent"]


@dataclass(frozen=True)
class RankExtent:
    """The atom rows one tensor-parallel rank owns: ``[first_atom, first_atom + atom_count)``.

    ``padded_atoms`` >= ``atom_count`` is the local width the weights are built at (TP9's
    256-channel ranks pad to 384); padded channels have zero vectors, so they add nothing.
    """

    tp_size: int
    tp_rank: int
    first_atom: int
    atom_count: int
    padded_atoms: int

    @property
    def channels(self) -> int:
        return self.atom_count * ATOM_CHANNELS

    @property
    def padded_channels(self) -> int:
        return self.padded_atoms * ATOM_CHANNELS


def _split(blocks: int, ranks: int, index: int) -> tuple[int, int]:
    q, r = divmod(blocks, ranks)
    return index * q + min(index, r), q + int(index < r)


def _raw_extent(geometry: Geometry, layer: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first_atom, atom_count) of a coupled rank: whole post-H128 blocks inside one half."""
    half_blocks = geometry.half_slot // ATOMS_PER_POST_BLOCK
    if tp_size == TP9:
        owner = (tp_rank - (layer - 1)) % TP9
        half, index, ranks = (0, owner, 5) if owner < 5 else (1, owner - 5, 4)
    else:
        ranks = tp_size // 2
        half, index = divmod(tp_rank, ranks)
    if half_blocks < ranks:
        raise QSRTFormatError(
            f"tp_size {tp_size}: a half of {geometry.half_slot} atoms has {half_blocks} "
            f"H128 blocks, fewer than its {ranks} ranks")
    first_block, count = _split(half_blocks, ranks, index)
    return (half * geometry.half_slot + first_block * ATOMS_PER_POST_BLOCK,
            count * ATOMS_PER_POST_BLOCK)


def _mixed_extent(profile: str, atom_slots: int, layer: int, tp_size: int,
                  tp_rank: int) -> tuple[int, int]:
    if profile == fmt.H308_COUPLED:
        if tp_size != layout.PAIRS:
            raise QSRTFormatError(
                f"tp_size {tp_size} is not supported for {profile!r}: its variable-stride "
                f"pairs are served one per rank at TP{layout.PAIRS}")
        pair = (tp_rank + layer - 1) % layout.PAIRS
        return layout.ATOMS_PER_PAIR * pair, layout.ATOMS_PER_PAIR
    first, count = _split(atom_slots, tp_size, tp_rank)
    per_pair = layout.ATOMS_PER_PAIR
    if first % per_pair or count % per_pair or count == 0:
        ok = [n for n in range(1, layout.PAIRS + 1) if layout.PAIRS % n == 0]
        raise QSRTFormatError(
            f"tp_size {tp_size} is not supported for {profile!r}: rank {tp_rank} would own "
            f"atoms [{first}, {first + count}), which splits a record pair ({per_pair} atoms) "
            f"and so a record's H128 block; sizes that keep whole pairs: {ok}")
    return first, count


def rank_extent(
    profile: str,
    geometry: Geometry,
    layer: int,
    tp_size: int,
    tp_rank: int,
    *,
    pad: bool = True,
) -> RankExtent:
    """The atoms tensor-parallel rank ``tp_rank`` of ``tp_size`` owns in layer ``layer``
    (the split of each profile: see the module docstring). With ``pad`` every rank is built
    at the widest rank's width. Coupled K=2: odd sizes other than 9 (including 1: the whole
    layer crosses the half boundary) are refused.

    Raises:
        QSRTFormatError: unsupported profile or tp_size, rank out of range, or a geometry too
            narrow for the requested split.
    """
    prof = fmt.supported(fmt.profile(profile))
    fmt.check_layer_index(layer)
    fmt.check_tp(tp_size, tp_rank)
    if prof.uniform_bits is None:
        first, count = _mixed_extent(prof.name, geometry.atom_slots, layer, tp_size, tp_rank)
        return RankExtent(tp_size, tp_rank, first, count, count)
    if prof.coupled and not (tp_size == TP9 or tp_size % 2 == 0):
        why = ("the whole layer crosses the half boundary at atom "
               f"{geometry.half_slot} (gate.suh / up.suh halves)" if tp_size == 1
               else "only even sizes and the TP9 plan split the two halves")
        raise QSRTFormatError(
            f"tp_size {tp_size} is not supported for coupled profile {prof.name!r}: {why}")
    first, count = _raw_extent(geometry, layer, tp_size, tp_rank)
    padded = count
    if pad:
        padded = max(_raw_extent(geometry, layer, tp_size, r)[1] for r in range(tp_size))
    return RankExtent(tp_size, tp_rank, first, count, padded)
