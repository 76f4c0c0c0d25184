"""Step-0 draws in blocks of rows (dspipe.model.initial: `blocks`, `write_blocks`): the blocks are the whole draw,
bitwise, and a shard written from them equals the whole draw cut, so a tp rank (or any build) never makes the whole
tensor. Small BLOCK values force many blocks, odd row widths and short tails."""

import pytest
import torch

from dspipe.model import initial
from dspipe.model.initial import _generator, _normal, write_blocks

SHAPES = [(50, 37), (64, 16), (33, 1), (1000, 3), (7, 5), (129, 24)]


@pytest.fixture(params=[16, 48, 100, 1 << 22])
def block(request, monkeypatch):
    monkeypatch.setattr(initial, "BLOCK", request.param)
    return request.param


def whole_and_draw(shape):
    return _normal(_generator(3, 2), shape, 0.02)(), _normal(_generator(3, 2), shape, 0.02)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_blocks_are_the_whole_draw_and_consume_the_generator_as_it(shape, block):
    whole = _generator(3, 2)
    expected = _normal(whole, shape, 0.02)()
    gen = _generator(3, 2)
    blocks = list(_normal(gen, shape, 0.02).blocks())
    assert [start for start, _ in blocks] == [sum(b.shape[0] for _, b in blocks[:i]) for i in range(len(blocks))]
    assert torch.equal(torch.cat([b for _, b in blocks]), expected)
    assert torch.equal(gen.get_state(), whole.get_state())
    if block == 48 and shape in ((1000, 3), (50, 37), (129, 24)):
        assert len(blocks) > 2  # the small block sizes really split the draw


@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_shard_and_a_column_shard_written_from_blocks_equal_the_whole_draw_cut(shape, block):
    rows = [(1, 3), (shape[0] // 2, shape[0] - 1)]
    expected, draw = whole_and_draw(shape)
    got = torch.empty(sum(b - a for a, b in rows), shape[1])
    write_blocks(got, draw, rows=rows)
    assert torch.equal(got, torch.cat([expected[a:b] for a, b in rows]))
    cols = (0, max(1, shape[1] // 2))
    expected, draw = whole_and_draw(shape)
    got = torch.empty(shape[0], cols[1] - cols[0])
    write_blocks(got, draw, cut=lambda full: full[:, cols[0] : cols[1]])
    assert torch.equal(got, expected[:, cols[0] : cols[1]])


def test_a_whole_parameter_in_bf16_gets_the_whole_draw_rounded(block):
    expected, draw = whole_and_draw((90, 40))
    got = torch.empty(90, 40, dtype=torch.bfloat16)
    write_blocks(got, draw)
    assert torch.equal(got, expected.to(torch.bfloat16))


@pytest.mark.parametrize("shape", SHAPES + [(12,)])
def test_a_zero3_partition_read_from_blocks_is_the_flat_whole_draws_range(shape, block):
    from dspipe.runtime.build import _drawn_range

    expected, draw = whole_and_draw(shape)
    n = expected.numel()
    for start, stop in ((0, n), (n // 3, n // 3 + max(1, n // 4)), (n - 1, n)):
        _, draw = whole_and_draw(shape)
        assert torch.equal(_drawn_range(draw)(start, stop), expected.reshape(-1)[start:stop])


def test_a_bias_shard_is_the_whole_draw_cut():
    from dspipe.model.initial import _constant

    got = torch.empty(3)
    write_blocks(got, _constant((8,), 0.5), cut=lambda full: full[2:5], rows=[(2, 5)])
    assert torch.equal(got, torch.full((3,), 0.5))
