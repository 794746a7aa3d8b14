"""apply_token_bitmask_ref against a per-element loop over the definition."""

import pytest
import torch

from nanoinfer.structured.bitmask_ref import apply_token_bitmask_ref, unpack_bitmask


def random_bitmask(rows, words, generator):
    return torch.randint(-(2**31), 2**31, (rows, words), dtype=torch.int64, generator=generator).to(
        torch.int32
    )


def expected(logits, bitmask, row_indices):
    """The definition, one element at a time."""
    out = logits.clone()
    rows = range(bitmask.shape[0]) if row_indices is None else row_indices
    for mask_row, logits_row in enumerate(rows):
        for token in range(logits.shape[1]):
            word = token // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[mask_row, word]) >> (token % 32)) & 1
            if not allowed:
                out[logits_row, token] = float("-inf")
    return out


@pytest.mark.parametrize(
    "batch, vocab, words, row_indices",
    [
        (3, 100, 4, None),  # vocab not a multiple of 32
        (2, 64, 2, None),
        (4, 70, 2, [3, 0]),  # fewer words than the vocabulary needs: the rest disallowed
        (5, 40, 4, [1, 3, 4]),  # more words than needed: extra bits ignored
        (3, 90, 3, [2, 2, 0]),  # a row listed twice gets both masks
        (2, 33, 2, []),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_the_definition(batch, vocab, words, row_indices, dtype):
    generator = torch.Generator().manual_seed(batch * vocab + words)
    logits = torch.randn(batch, vocab, generator=generator).to(dtype)
    rows = batch if row_indices is None else len(row_indices)
    bitmask = random_bitmask(rows, words, generator)
    want = expected(logits, bitmask, row_indices)
    apply_token_bitmask_ref(logits, bitmask, row_indices)
    assert torch.equal(logits, want)


def test_all_set_and_all_clear():
    logits = torch.randn(2, 50)
    original = logits.clone()
    bitmask = torch.tensor([[-1, -1], [0, 0]], dtype=torch.int32)
    apply_token_bitmask_ref(logits, bitmask)
    assert torch.equal(logits[0], original[0])
    assert torch.isneginf(logits[1]).all()


def test_row_indices_as_a_tensor_and_untouched_rows():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 80, generator=generator)
    original = logits.clone()
    bitmask = random_bitmask(2, 3, generator)
    apply_token_bitmask_ref(logits, bitmask, torch.tensor([4, 1]))
    assert torch.equal(logits, expected(original, bitmask, [4, 1]))
    for row in (0, 2, 3, 5):
        assert torch.equal(logits[row], original[row])


def test_unpack_bitmask_bit_order():
    bitmask = torch.tensor([[0b101, -(2**31)]], dtype=torch.int32)  # tokens 0, 2 and 63
    assert unpack_bitmask(bitmask, 66)[0].nonzero().flatten().tolist() == [0, 2, 63]


@pytest.mark.parametrize(
    "logits, bitmask, row_indices, message",
    [
        (torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int32), None, "floating-point"),
        (torch.zeros(8), torch.zeros(1, 1, dtype=torch.int32), None, "2-D floating-point"),
        (torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.int64), None, "int32"),
        (torch.zeros(2, 8), torch.zeros(3, 1, dtype=torch.int32), None, "one row per logits row"),
        (torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.int32), [0], "one logits row per bitmask row"),
        (torch.zeros(2, 8), torch.zeros(1, 1, dtype=torch.int32), [2], r"row_indices must be in \[0, 2\)"),
        (torch.zeros(2, 8), torch.zeros(1, 1, dtype=torch.int32), [-1], r"row_indices must be in \[0, 2\)"),
    ],
)
def test_bad_arguments_are_rejected(logits, bitmask, row_indices, message):
    with pytest.raises(ValueError, match=message):
        apply_token_bitmask_ref(logits, bitmask, row_indices)
