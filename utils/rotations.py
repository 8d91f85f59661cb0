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


def rotate_volume(x: np.ndarray, rot, vector_channels=()) -> np.ndarray:
    """Rotate a (C, X, Y, Z) array by ``rot``; channels in ``vector_channels`` (the x, y, z
    components, in that order) are turned as a vector. Returns a new contiguous array."""
    perm, sign = rot
    # Grid: new axis i is old axis perm[i], reversed where the sign is negative.
    y = np.transpose(x, (0, 1 + perm[0], 1 + perm[1], 1 + perm[2]))
    flip_axes = tuple(1 + i for i in range(3) if sign[i] < 0)
    if flip_axes:
        y = np.flip(y, axis=flip_axes)
    y = np.ascontiguousarray(y)
    if len(vector_channels):
        vc = list(vector_channels)
        comps = y[vc].copy()  # (3, X, Y, Z): old components on the rotated grid
        for i in range(3):
            y[vc[i]] = sign[i] * comps[perm[i]]
    return y
