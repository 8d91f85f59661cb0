"""The 24 proper rotations of a cube, applied to (C, X, Y, Z) volumes with vector channels.

A rotation is a signed permutation matrix R with det(R) = +1: new axis i is old axis ``perm[i]``
times ``sign[i]``. A field turns as f'(x) = f(R^-1 x); a vector field also as v'(x) = R v(R^-1 x),
its components permuted and sign-flipped like the axes (moving the voxels alone gives a sample no
simulation could produce). ``rotate_into`` copies a volume through a rotated view into another
buffer; ``rotate_in_place`` turns one where it lies, block by block, through two block-sized
scratch buffers instead of a second copy of the volume.
"""
from __future__ import annotations

import functools
import itertools

import numpy as np


def matrix(rot) -> np.ndarray:
    """3x3 integer matrix R of a (perm, sign) rotation: (R v)_i = sign_i v_perm[i]."""
    perm, sign = rot
    m = np.zeros((3, 3), dtype=int)
    m[range(3), perm] = sign
    return m


# All 48 signed permutations, of which the 24 with det +1 are rotations (the others mirror).
ROTATIONS: tuple = tuple(
    (perm, sign)
    for perm in itertools.permutations(range(3))
    for sign in itertools.product((1, -1), repeat=3)
    if round(np.linalg.det(matrix((perm, sign)))) == 1
)
assert len(ROTATIONS) == 24


def rotated_grid(x: np.ndarray, rot) -> np.ndarray:
    """The grid of a (C, X, Y, Z) array turned by ``rot``, as a view (no copy): new axis i is
    old axis perm[i], reversed where sign[i] is negative. Vector channels are not turned."""
    perm, sign = rot
    y = x.transpose(0, 1 + perm[0], 1 + perm[1], 1 + perm[2])
    return y[(slice(None),) + tuple(slice(None, None, -1) if s < 0 else slice(None) for s in sign)]


def rotate_into(x: np.ndarray, rot, vector_channels, out: np.ndarray) -> np.ndarray:
    """Rotate a (C, X, Y, Z) array by ``rot`` into ``out`` (not overlapping ``x``), each channel
    copied once from the rotated view; ``vector_channels`` (x, y, z) turned as a vector."""
    v = rotated_grid(x, rot)
    source, signs = channel_plan(rot, tuple(vector_channels), x.shape[0])
    for c, (src, s) in enumerate(zip(source, signs)):
        if s < 0:
            np.negative(v[src], out=out[c])
        else:
            np.copyto(out[c], v[src])
    return out


@functools.lru_cache(maxsize=None)
def channel_plan(rot, vector_channels: tuple, n_channels: int):
    """How turning a (C, ...) array by ``rot`` moves its channels: output channel c is input
    channel ``source[c]`` times ``signs[c]`` (new vector component i is sign[i] times old component
    perm[i]). Returns ``(source, signs)``: a tuple of ints, a float32 (C,) array."""
    perm, sign = rot
    source, signs = list(range(n_channels)), np.ones(n_channels, np.float32)
    for i, c in enumerate(vector_channels):
        source[c], signs[c] = vector_channels[perm[i]], sign[i]
    signs.flags.writeable = False  # shared by every caller of the cache
    return tuple(source), signs


def _blocks(side: int, block: int) -> tuple:
    """Ranges partitioning ``range(side)`` into blocks of ``block`` (the middle one up to twice
    that), symmetric under reversal, so that every rotation maps blocks onto blocks."""
    q, r = divmod(side, block)
    if q == 0:
        return ((0, side),)
    half = [block] * (q // 2)
    sizes = half + ([block + r] if q % 2 else [r] if r else []) + half
    edges = np.cumsum([0] + sizes)
    return tuple((int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]))


def _blocking(perm, side: int) -> tuple:
    """(the grid axes cut into blocks, the block size) for a permutation of the axes, each block
    at most an eighth of the cube. Measured on 64^3 crops: slabs of 8 for flips alone; cubes of
    32 otherwise, but of 16 where the last (contiguous) axis comes from the first, whose reads
    then stride across the block."""
    if perm == (0, 1, 2):
        return (0,), max(1, min(8, side // 8))
    return (0, 1, 2), max(1, min(16 if perm[2] == 0 else 32, side // 2))


@functools.lru_cache(maxsize=None)
def _block_cycles(side: int, rot, block: int | None) -> tuple:
    """The cycles in which ``rot`` moves the blocks of a cube: in cycle (B0, B1, ..., Bm-1) the
    turned block B0 is the content of B1 turned, B1 that of B2, ..., Bm-1 that of B0. Blocks as
    tuples of three slices. ``block``: the block size (None: ``_blocking``'s)."""
    perm, sign = rot
    cut, size = _blocking(perm, side)
    block = block or size
    ranges = [_blocks(side, block) if k in cut else ((0, side),) for k in range(3)]
    counts = [len(r) for r in ranges]

    def source(p):  # the block whose turned content lands on block p
        q = [0, 0, 0]
        for m in range(3):
            q[perm[m]] = p[m] if sign[m] > 0 else counts[perm[m]] - 1 - p[m]
        return tuple(q)

    seen, cycles = set(), []
    for q in itertools.product(*(range(n) for n in counts)):
        cycle = []
        while q not in seen:  # the blocks' moves are a permutation: back to the first, then out
            seen.add(q)
            cycle.append(q)
            q = source(q)
        if cycle:
            cycles.append(tuple(tuple(slice(*ranges[k][i]) for k, i in enumerate(b))
                                for b in cycle))
    return tuple(cycles)


def rotate_in_place(a: np.ndarray, rot, signs=None, block: int | None = None) -> np.ndarray:
    """Turn the grid of a (C, S, S, S) array by ``rot`` where it lies, and multiply channel c by
    ``signs[c]`` (``channel_plan``; None: all 1); channels are not permuted (fill them from
    ``channel_plan``'s sources first). Each cycle of the blocks the rotation moves onto one another
    (``block`` voxels wide, by default ``_blocking``'s) is turned through two scratch blocks."""
    c, side = a.shape[0], a.shape[1]
    if a.shape[1:] != (side, side, side):
        raise ValueError(f"rotate_in_place turns cubes (C, S, S, S), not {a.shape}")
    if rot != ROTATIONS[0]:
        cycles = _block_cycles(side, rot, block)
        big = max(int(np.prod([s.stop - s.start for s in b])) for cyc in cycles for b in cyc)
        scratch = np.empty((1 + any(len(cyc) > 1 for cyc in cycles), c * big), a.dtype)
        whole = (slice(None),)

        def copied(i, src):  # src copied into scratch i (contiguous, of its shape)
            out = scratch[i, : src.size].reshape(src.shape)
            np.copyto(out, src)
            return out

        for cycle in cycles:
            saved = copied(0, a[whole + cycle[0]])
            for dst, src in zip(cycle[:-1], cycle[1:]):
                np.copyto(a[whole + dst], rotated_grid(copied(1, a[whole + src]), rot))
            np.copyto(a[whole + cycle[-1]], rotated_grid(saved, rot))
    if signs is not None:
        for ch in np.flatnonzero(np.asarray(signs) < 0):  # contiguous channels: one cheap pass
            np.negative(a[ch], out=a[ch])
    return a
