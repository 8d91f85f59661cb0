import itertools

import numpy as np
import pytest

from datapipe.rotations import ROTATIONS, channel_plan, matrix, rotate_in_place
from loader_harness import rotate_volume


def test_24_distinct_proper_rotations():
    mats = [matrix(r) for r in ROTATIONS]
    for m in mats:
        assert round(np.linalg.det(m)) == 1
        assert np.array_equal(m @ m.T, np.eye(3, dtype=int))
    assert len({m.tobytes() for m in mats}) == 24
    # closed under composition: a group, so uniform sampling stays uniform after composing
    keys = {m.tobytes() for m in mats}
    assert all((a @ b).tobytes() in keys for a, b in itertools.product(mats, mats))
    # and they move a generic volume to 24 different arrays
    x = np.random.default_rng(0).standard_normal((1, 4, 4, 4))
    assert len({rotate_volume(x, r).tobytes() for r in ROTATIONS}) == 24


@pytest.mark.parametrize("k", range(24))
def test_matches_explicit_rotation_of_points_and_vectors(k):
    """y at R p equals x at p for scalars, and R v(p) for vectors (p about the cube centre)."""
    rot = ROTATIONS[k]
    R = matrix(rot)
    L = 5
    rng = np.random.default_rng(k)
    x = rng.standard_normal((4, L, L, L))
    y = rotate_volume(x, rot, vector_channels=(1, 2, 3))
    c = (L - 1) / 2
    for p in itertools.product(range(L), repeat=3):
        q = tuple(int(round(v)) for v in R @ (np.array(p) - c) + c)
        assert y[0][q] == x[0][p]
        np.testing.assert_array_equal(y[1:, q[0], q[1], q[2]], R @ x[1:, p[0], p[1], p[2]])


def _grad(phi):
    """Central differences on a periodic grid, components along axes 0, 1, 2."""
    return np.stack([(np.roll(phi, -1, a) - np.roll(phi, 1, a)) / 2 for a in range(3)])


def test_rotated_gradient_field_is_gradient_of_rotated_potential():
    """A physical vector field (v = grad phi) must stay the gradient of the rotated potential;
    moving the voxels without turning the components breaks it for all but the identity."""
    rng = np.random.default_rng(1)
    phi = rng.standard_normal((8, 8, 8))
    vol = np.concatenate([phi[None], _grad(phi)])
    broken = 0
    for rot in ROTATIONS:
        y = rotate_volume(vol, rot, vector_channels=(1, 2, 3))
        np.testing.assert_allclose(y[1:], _grad(y[0]), atol=1e-12)
        naive = rotate_volume(vol, rot)  # vector channels treated as scalars
        broken += not np.allclose(naive[1:], _grad(naive[0]))
    assert broken == 23


def test_vector_channels_anywhere_in_the_array():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 4, 4, 4))
    rot = ROTATIONS[7]
    a = rotate_volume(x, rot, vector_channels=(2, 3, 4))
    b = rotate_volume(x[[2, 3, 4, 0, 1]], rot, vector_channels=(0, 1, 2))
    np.testing.assert_array_equal(a[[2, 3, 4, 0, 1]], b)


@pytest.mark.parametrize("side,block", [(64, None), (8, None), (21, None), (20, 8), (21, 8),
                                        (30, 8), (24, 8), (7, 2), (16, 4)])
def test_rotate_in_place_equals_rotate_volume(side, block):
    """Every rotation turned where the volume lies (channels filled from ``channel_plan``'s
    sources first, as a reader does) equals the copy through a rotated view, for sides that the
    blocks divide and sides they do not (a middle block of another size)."""
    rng = np.random.default_rng(side)
    x = rng.standard_normal((5, side, side, side)).astype(np.float32)
    for rot in ROTATIONS:
        source, signs = channel_plan(rot, (2, 3, 4), 5)
        a = x[list(source)].copy()
        assert rotate_in_place(a, rot, signs, block) is a
        np.testing.assert_array_equal(a, rotate_volume(x, rot, (2, 3, 4)))
    with pytest.raises(ValueError, match="turns cubes"):
        rotate_in_place(np.zeros((1, 4, 4, 5), np.float32), ROTATIONS[3])


def test_rotate_in_place_makes_no_second_volume():
    """The scratch of an in-place turn is two blocks of at most an eighth of the volume each."""
    import tracemalloc

    x = np.random.default_rng(0).standard_normal((5, 64, 64, 64)).astype(np.float32)
    for rot in ROTATIONS:
        source, signs = channel_plan(rot, (2, 3, 4), 5)
        tracemalloc.start()
        rotate_in_place(x, rot, signs)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak <= x.nbytes / 4 + 64 * 1024, (rot, peak)
