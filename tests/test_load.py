"""The restore's last stage (restore/load.py) on one real rank: a version's pieces written in
place into the protected arrays, whatever their kind, strides or cut, in one transfer or in
slabs of checkpoint.chunk_mib; then the registered state. Through Checkpointer.restart()."""

import numpy as np
import pytest
from single_rank import App, opened


class Arrays:
    """Arrays whose restore takes each path of load.py: a C-contiguous array cut along its
    first axis (received in place), one cut along another axis (gathered in slabs), a
    block that is the interior of an array with halo cells (a view with strides), a
    per-rank array in Fortran order, and registered state."""

    def __init__(self):
        self.rows = np.zeros(40)
        self.cube = np.zeros((3, 5, 8), dtype=np.float32)
        self.grid = np.zeros((8, 10))  # a halo of 1 around a 6 x 8 block
        self.local = np.zeros((3, 4), dtype=np.int32, order="F")
        self.state = {"step": 0}

    def attach(self, ckpt):
        ckpt.protect("rows", self.rows)
        ckpt.protect("cube", self.cube)
        ckpt.protect("interior", self.grid[1:-1, 1:-1], global_shape=(6, 8), offset=(slice(0, 6), slice(0, 8)))
        ckpt.protect("local", self.local, replicated=False)
        ckpt.register_state("loop", lambda: dict(self.state), self.state.update)

    def fill(self, seed):
        rng = np.random.default_rng(seed)
        self.rows[...] = rng.standard_normal(self.rows.shape)
        self.cube[...] = rng.standard_normal(self.cube.shape)
        self.grid[1:-1, 1:-1] = rng.standard_normal((6, 8))
        self.local[...] = rng.integers(-1000, 1000, self.local.shape)
        self.state.update(step=seed, name=f"v{seed}")

    def saved(self):
        return (self.rows.tobytes(), self.cube.tobytes(), self.grid[1:-1, 1:-1].tobytes(), self.local.tobytes("A"),
                dict(self.state))


@pytest.mark.parametrize("chunk_mib", ["8", "0.0001"])  # one slab per tensor, or many of about 100 bytes
def test_every_kind_of_array_is_written_back_in_place_byte_for_byte(tmp_path, chunk_mib):
    settings = (f"checkpoint.chunk_mib={chunk_mib}",)
    written = Arrays()
    with opened(tmp_path, *settings) as ckpt:
        written.attach(ckpt)
        ckpt.restart()
        written.fill(7)
        ckpt.checkpoint(7)
    back = Arrays()
    back.grid[0, :] = back.grid[-1, :] = -1.0  # the halo is the application's, not the version's
    kept = (back.rows, back.cube, back.grid, back.local)
    with opened(tmp_path, *settings) as ckpt:
        back.attach(ckpt)
        assert ckpt.restart() == 7
        layout = {tl.name: tl for tl in ckpt.layout.tensors}
    assert layout["cube"].axis != 0  # this cut takes the slab path, the rows' the one in place
    assert back.saved() == written.saved()
    assert all(a is b for a, b in zip((back.rows, back.cube, back.grid, back.local), kept))
    assert (back.grid[0, :] == -1.0).all() and (back.grid[-1, :] == -1.0).all()
    assert back.local.flags.f_contiguous


def test_the_state_comes_back_last_over_what_the_application_set(tmp_path):
    app = App()
    with opened(tmp_path) as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        app.step(3)
        ckpt.checkpoint(3)
    saved = app.state()
    back = App()
    back.loop.update(step=99, extra="the application's own")  # keys the version lacks are kept
    with opened(tmp_path) as ckpt:
        back.attach(ckpt)
        ckpt.restart()
    assert back.state()[:3] == saved[:3]
    assert back.loop["step"] == 3 and back.loop["seen"] == saved[3]["seen"]
    assert back.loop["extra"] == "the application's own"
