"""Engine ranks registering params as pieces of global tensors, updated
from one whole-tensor checkpoint: each rank reads only its slices."""

import numpy as np
import pytest
from safetensors.numpy import save_file

from weight_manager import Manager, Piece, WeightManagerError

GLOBALS = {
    "o": (6, 8),        # column-split (TP) along dim 1
    "q": (8, 5),        # fused into qkv, each row-split by TP
    "k": (4, 5),
    "v": (4, 5),
    "w": (4, 3, 5),     # stacked experts; each rank holds two
}


def checkpoint(tmp_path, step):
    rng = np.random.default_rng(step)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in GLOBALS.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "version.yaml").write_text(f"step: {step}\n")
    return tensors


def engine_rank(m, rank, allocate):
    """A TP=2 rank: returns {param name: array}."""
    layout = {
        "o.tp": ((6, 4), [Piece.narrow("o", GLOBALS["o"], 1, 4 * rank, 4)]),
        "qkv.tp": ((8, 5), [Piece.narrow("q", GLOBALS["q"], 0, 4 * rank, 4),
                            Piece.narrow("k", GLOBALS["k"], 0, 2 * rank, 2, at=(4, 0)),
                            Piece.narrow("v", GLOBALS["v"], 0, 2 * rank, 2, at=(6, 0))]),
        "experts": ((2, 3, 5), [Piece.narrow("w", GLOBALS["w"], 0, 2 * rank, 2)]),
    }
    out = {}
    for name, (shape, pieces) in layout.items():
        if allocate:
            out[name] = m.allocate(name, np.float32, shape, pieces=pieces)
        else:
            out[name] = np.zeros(shape, np.float32)
            m.register(name, out[name], pieces=pieces)
    return out


def expected(t, rank):
    return {
        "o.tp": t["o"][:, 4 * rank:4 * rank + 4],
        "qkv.tp": np.concatenate([t["q"][4 * rank:4 * rank + 4], t["k"][2 * rank:2 * rank + 2],
                                  t["v"][2 * rank:2 * rank + 2]]),
        "experts": t["w"][2 * rank:2 * rank + 2],
    }


@pytest.mark.parametrize("allocate", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_tp_ranks_slice_one_checkpoint(tmp_path, allocate, in_place):
    for step in (1, 2):
        t = checkpoint(tmp_path, step)
        if step == 1:
            # Two engine ranks as two managers (one process; ranks only pick the slices here).
            managers = [Manager(model_dir=str(tmp_path)) for _ in range(2)]
            params = [engine_rank(m, r, allocate) for r, m in enumerate(managers)]
        for r, m in enumerate(managers):
            stats = m.update(in_place=in_place)
            assert stats.version == str(step)
            want = expected(t, r)
            assert stats.bytes == sum(a.nbytes for a in want.values()), "each rank moves only its bytes"
            for name, arr in params[r].items():
                np.testing.assert_array_equal(arr, want[name], err_msg=f"rank {r} {name} step {step}")
    for m in managers:
        m.close()


def test_bad_pieces_are_refused_naming_the_param(tmp_path):
    checkpoint(tmp_path, 1)
    with Manager(model_dir=str(tmp_path)) as m:
        with pytest.raises(WeightManagerError, match=r"param 'p': its pieces hold 20 of its 40 elements"):
            m.register("p", np.zeros((8, 5), np.float32), pieces=[Piece.narrow("q", (8, 5), 0, 0, 4)])
        with pytest.raises(WeightManagerError, match=r"pieces 0 and 1 both hold"):
            m.register("p", np.zeros((8, 5), np.float32),
                       pieces=[Piece.narrow("q", (8, 5), 0, 0, 5), Piece.narrow("q", (8, 5), 0, 0, 3, at=(4, 0))])
        # The same rows of one tensor twice in a param (each placed once):
        # refused at registration, naming the tensor's shared box.
        with pytest.raises(WeightManagerError,
                           match=r"param 'p': pieces 0 and 1 both hold \[2:4, 0:5\] of tensor 'q'"):
            m.register("p", np.zeros((4, 5), np.float32),
                       pieces=[Piece.narrow("q", (8, 5), 0, 2, 2), Piece.narrow("q", (8, 5), 0, 2, 2, at=(2, 0))])
        # Registers fine; the plan finds the piece outside its tensor.
        m.register("o.bad", np.zeros((6, 4), np.float32), pieces=[Piece.narrow("o", (6, 12), 1, 8, 4)])
        with pytest.raises(WeightManagerError, match=r"param 'o.bad': piece 0 \('o' \[0:6, 8:12\]\): outside"):
            m.update(skip_unknown=True)
        # A partial tensor cannot be checked against a whole-tensor checksum yet.
