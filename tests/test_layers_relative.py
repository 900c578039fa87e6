"""Relative offsets, table resizing and q·r logits against literal per-position formulas."""
import pytest
import torch

from timm_attnconv.layers import gather_relative, rel_logits_2d, relative_offsets, table_for_length


def test_offsets_are_key_minus_query():
    off = relative_offsets(4, torch.device('cpu'))
    assert off[1, 3] == 2 and off[3, 0] == -3 and off.diagonal().eq(0).all()


def test_shorter_grid_takes_central_offsets_exactly():
    table = torch.randn(2 * 16 - 1, 5)
    for length in (1, 7, 16):
        gathered = gather_relative(table, length)
        for q in range(length):
            for k in range(length):
                assert torch.equal(gathered[q, k], table[k - q + 15])


def test_a_traced_gather_takes_the_same_offsets():
    # under tracing (the legacy ONNX exporter) the gather is an index tensor instead of the table's reversed windows
    table = torch.randn(2 * 6 - 1, 5)
    traced = torch.jit.trace(lambda t: gather_relative(t, 4), (table,))
    assert torch.equal(traced(table), gather_relative(table, 4))


def test_longer_grid_interpolates_with_aligned_ends_or_refuses():
    table = torch.randn(2 * 4 - 1, 3)
    resized = table_for_length(table, 7)
    assert resized.shape == (13, 3)
    torch.testing.assert_close(resized[[0, 6, 12]], table[[0, 3, 6]])  # offsets -max, 0, +max keep their values
    torch.testing.assert_close(resized[1], (table[0] + table[1]) / 2)
    with pytest.raises(ValueError, match='up to 4 tokens but the input has 7'):
        table_for_length(table, 7, resize=False)


def test_rel_logits_match_a_per_position_loop_on_a_non_square_grid():
    batch, heads, height, width, dim = 2, 3, 5, 7, 4
    q_rows, q_cols = torch.randn(batch, heads, height, width, dim), torch.randn(batch, heads, height, width, dim)
    t_rows, t_cols = torch.randn(2 * height - 1, dim), torch.randn(2 * width - 1, dim)
    rows, cols = rel_logits_2d(q_rows, q_cols, t_rows, t_cols)
    assert rows.shape == (batch, heads, height, width, height) and cols.shape == (batch, heads, height, width, width)
    for b in range(batch):
        for h in range(heads):
            for i in range(height):
                for j in range(width):
                    for k in range(height):
                        expected = q_rows[b, h, i, j] @ t_rows[k - i + height - 1]
                        torch.testing.assert_close(rows[b, h, i, j, k], expected)
                    for col in range(width):
                        expected = q_cols[b, h, i, j] @ t_cols[col - j + width - 1]
                        torch.testing.assert_close(cols[b, h, i, j, col], expected)
