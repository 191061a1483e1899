"""Byte formatting, parsing and CUDA rounding: exact values."""

from __future__ import annotations

import pytest

from nbmem.core.units import format_bytes, parse_bytes, round_allocation


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (8 * 1024**2, "8.00 MiB"),  # 8 * 1048576
        (int(1.5 * 1024**3), "1.50 GiB"),
        (80 * 1024**3, "80.0 GiB"),
        (300 * 1024**3, "300 GiB"),
        (-4 * 1024**2, "-4.00 MiB"),
        (None, "n/a"),
    ],
)
def test_format_bytes(nbytes, text):
    assert format_bytes(nbytes) == text


def test_format_bytes_signed_marks_growth_only():
    assert format_bytes(4 * 1024**2, signed=True) == "+4.00 MiB"
    assert format_bytes(-512, signed=True) == "-512 B"
    assert format_bytes(0, signed=True) == "0 B"


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("2GiB", 2 * 1024**3),
        ("2 GiB", 2 * 1024**3),
        ("2gib", 2 * 1024**3),
        ("2G", 2 * 1024**3),
        ("1.5 GB", 1_500_000_000),
        ("512MiB", 512 * 1024**2),
        ("16KB", 16_000),
        ("4096", 4096),
        ("4096B", 4096),
        (4096, 4096),
        (".5KiB", 512),
    ],
)
def test_parse_bytes(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("bad", ["lots", "2 GiBs", "-1GiB", "", "1e9", "GiB"])
def test_parse_bytes_rejects_with_the_accepted_forms(bad):
    with pytest.raises(ValueError, match="e.g. '16GiB'"):
        parse_bytes(bad)


def test_parse_bytes_rejects_negative_and_bool():
    with pytest.raises(ValueError, match="negative"):
        parse_bytes(-5)
    with pytest.raises(ValueError):
        parse_bytes(True)


@pytest.mark.parametrize(("request_bytes", "allocated"), [(0, 0), (1, 512), (4, 512), (512, 512), (513, 1024), (4000, 4096)])
def test_round_allocation_matches_cuda_block_size(request_bytes, allocated):
    assert round_allocation(request_bytes) == allocated
