"""The 24 proper rotations of a cube, applied to (C, X, Y, Z) volumes with vector channels.

A rotation here is a signed permutation matrix R with det(R) = +1: new axis i is old axis
``perm[i]`` times ``sign[i]``. Rotating a field f by R gives f'(x) = f(R^-1 x): the grid moves.
A vector field also turns: v'(x) = R v(R^-1 x), so its components are permuted and sign-flipped
exactly like the axes. Moving the voxels without turning the vectors (what a plain "rotate the
array" augmentation does) gives a sample that no physical simulation could produce.
"""
from __future__ import annotations

import itertools

import numpy as np


def _det(perm, sign) -> int:
    m = np.zeros((3, 3), dtype=int)
    for i, (p, s) in enumerate(zip(perm, sign)):
        m[i, p] = s
    return int(round(np.linalg.det(m)))


def matrix(rot) -> np.ndarray:
    """3x3 integer matrix R of a (perm, sign) rotation: (R v)_i = sign_i v_perm[i]."""
    perm, sign = rot
    m = np.zeros((3, 3), dtype=int)
    for i, (p, s) in enumerate(zip(perm, sign)):
        m[i, p] = s
    return m


# All 48 signed permutations, of which the 24 with det +1 are rotations (the others mirror).
ROTATIONS: tuple = tuple(
    (perm, sign)
    for perm in itertools.permutations(range(3))
    for sign in itertools.product((1, -1), repeat=3)
    if _det(perm, sign) == 1
)
assert len(ROTATIONS) == 24


def rotated_grid(x: np.ndarray, rot) -> np.ndarray:
    """The grid of a (C, X, Y, Z) array turned by ``rot``, as a view (no copy): new axis i is
    old axis perm[i], reversed where sign[i] is negative. Vector channels are not turned."""
    perm, sign = rot
    y = x.transpose(0, 1 + perm[0], 1 + perm[1], 1 + perm[2])
    return y[(slice(None),) + tuple(slice(None, None, -1) if s < 0 else slice(None) for s in sign)]


def rotate_into(x: np.ndarray, rot, vector_channels, out: np.ndarray) -> np.ndarray:
    """Rotate a (C, X, Y, Z) array by ``rot`` into ``out`` (the rotated shape, not overlapping ``x``),
    one pass: every channel is copied once from the rotated view; channels in
    ``vector_channels`` (the x, y, z components, in that order) are turned as a vector, new
    component i being sign[i] times old component perm[i]."""
    perm, sign = rot
    v = rotated_grid(x, rot)
    vc = list(vector_channels)
    for c in range(x.shape[0]):
        if c not in vc:
            np.copyto(out[c], v[c])
            continue
        i = vc.index(c)
        src = v[vc[perm[i]]]
        if sign[i] < 0:
            np.negative(src, out=out[c])
        else:
            np.copyto(out[c], src)
    return out


def rotate_volume(x: np.ndarray, rot, vector_channels=()) -> np.ndarray:
    """Rotate a (C, X, Y, Z) array by ``rot`` (see ``rotate_into``); returns a new contiguous
    array."""
    out = np.empty(rotated_grid(x, rot).shape, dtype=x.dtype)
    return rotate_into(x, rot, vector_channels, out)
