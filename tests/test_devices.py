"""GPU presets and --capacity parsing: exact bytes, name matching, error messages."""

from __future__ import annotations

import re

import pytest

from nbmem.core.devices import PRESETS, DevicePreset, parse_capacity, preset

GIB = 2**30
MIB = 2**20

WANTED = [
    "T4",
    "L4",
    "A10",
    "A10G",
    "V100-16GB",
    "V100-32GB",
    "RTX-3090",
    "RTX-4090",
    "A100-40GB",
    "A100-80GB",
    "H100-80GB",
    "H200",
]


def test_every_wanted_preset_is_there():
    assert set(WANTED) <= set(PRESETS)


@pytest.mark.parametrize(
    ("name", "nbytes"),
    [
        ("T4", 15843721216),  # deviceQuery: "15110 MBytes (15843721216 bytes)"
        ("A100-40GB", 42298834944),  # deviceQuery: "40339 MBytes (42298834944 bytes)"
        ("RTX-4090", 25383256719),  # OOM "23.64 GiB": round(23.64 * 2**30) = 25383256719
        ("H100-80GB", 84943715697),  # OOM "79.11 GiB": round(79.11 * 2**30) = 84943715697
        ("RTX-3090", 25447681229),  # OOM "23.70 GiB": round(23.70 * 2**30) = 25447681229
        ("H200", 150109945856),  # total_memory=143156MB: 143156 * 2**20 = 150109945856
        ("A10G", 23684186112),  # total_memory=22587MB: 22587 * 2**20 = 23684186112
        ("L4", 24_000_000_000),  # nominal 24 GB read as 24 * 10**9 bytes
        ("RX-9070-XT", 17093969838),  # ROCm's OOM "15.92 GiB": round(15.92 * 2**30) = 17093969838
        ("Mac-16GB", 19466939269),  # MPS's OOM "max allowed: 18.13 GB": round(18.13 * 2**30) = 19466939269
        ("Mac-64GB", 87617332838),  # "max allowed: 81.60 GB": round(81.60 * 2**30) = 87617332838
    ],
)
def test_capacity_matches_the_sourced_figure(name, nbytes):
    assert PRESETS[name].capacity == nbytes


def test_mac_presets_are_mps_limits_and_follow_the_working_set_rule():
    # Metal's recommended working set (2/3 of the memory up to 32 GB, 3/4 above) times the default ratio 1.7,
    # printed as PyTorch's MPS out-of-memory message prints it
    for size, share in ((8, 2 / 3), (16, 2 / 3), (32, 2 / 3), (64, 3 / 4), (128, 3 / 4)):
        found = PRESETS[f"Mac-{size}GB"]
        assert found.backend == "mps"
        assert f"{found.capacity / GIB:.2f}" == f"{size * share * 1.7:.2f}"
    assert str(PRESETS["Mac-16GB"]) == (
        'Mac-16GB: 18.1 GiB, the limit PyTorch puts on MPS ("max allowed", at the default high watermark ratio 1.7; '
        "16 GB unified memory)"
    )
    assert preset("mac 16gb").name == "Mac-16GB" and preset("RX 9070 XT").backend == "cuda"


def test_oom_figures_print_back_as_quoted():
    # PyTorch's OOM message prints total / 2**30 with two decimals.
    assert f"{PRESETS['T4'].capacity / GIB:.2f}" == "14.76"
    assert f"{PRESETS['A100-40GB'].capacity / GIB:.2f}" == "39.39"
    assert f"{PRESETS['V100-16GB'].capacity / GIB:.2f}" == "15.78"
    assert f"{PRESETS['A100-80GB'].capacity / GIB:.2f}" == "79.25"


@pytest.mark.parametrize(
    ("typed", "name"),
    [
        ("rtx 4090", "RTX-4090"),
        ("A100_40gb", "A100-40GB"),
        ("t4", "T4"),
        ("Tesla T4", "T4"),
        ("NVIDIA GeForce RTX 3090", "RTX-3090"),
        ("h100-80gb", "H100-80GB"),
        ("v100 32GB", "V100-32GB"),
        ("a10g", "A10G"),
        ("A10", "A10"),
    ],
)
def test_names_match_ignoring_case_dashes_underscores_spaces(typed, name):
    assert preset(typed).name == name


def test_unknown_name_suggests_and_lists_all():
    with pytest.raises(ValueError) as caught:
        preset("A100")
    message = str(caught.value)
    assert "Did you mean 'A100-40GB', 'A100-80GB'" in message
    for name in PRESETS:
        assert name in message


def test_unknown_name_without_close_match_still_lists_all():
    with pytest.raises(ValueError, match="Known presets: T4, L4") as caught:
        preset("quantum")
    assert "Did you mean" not in str(caught.value)


def test_parse_capacity_sizes():
    assert parse_capacity("16GiB") == (17179869184, "16GiB")  # 16 * 2**30
    assert parse_capacity(" 1.5 GB ") == (1_500_000_000, "1.5 GB")  # decimal GB: 1.5 * 10**9
    assert parse_capacity("512 MiB") == (512 * MIB, "512 MiB")  # 536870912
    assert parse_capacity(4 * MIB) == (4 * MIB, "4.00 MiB")  # bare bytes are labelled in binary units
    assert parse_capacity("1048576") == (MIB, "1.00 MiB")  # the least a bare number may be


def test_parse_capacity_presets():
    assert parse_capacity("T4") == (15843721216, "T4")
    assert parse_capacity("a100-80gb") == (PRESETS["A100-80GB"].capacity, "A100-80GB")
    assert parse_capacity("rtx 4090") == (25383256719, "RTX-4090")


@pytest.mark.parametrize("bad", ["16 GiBs", "GPU", "-1GB", "1e9", "", "sixteen gigs", True])
def test_malformed_capacity_lists_both_forms(bad):
    with pytest.raises(ValueError) as caught:
        parse_capacity(bad)
    message = str(caught.value)
    assert "'16GiB'" in message and "'512 MiB'" in message and "'1.5GB'" in message
    for name in PRESETS:
        assert name in message


def test_malformed_capacity_suggests_a_preset():
    with pytest.raises(ValueError, match=r"Did you mean 'H100-80GB'"):
        parse_capacity("H100")


@pytest.mark.parametrize("bad", [0, "0", "0GiB", -5])
def test_zero_or_negative_capacity_is_refused(bad):
    with pytest.raises(ValueError, match="more than 0 bytes"):
        parse_capacity(bad)


@pytest.mark.parametrize("entry", list(PRESETS.values()), ids=list(PRESETS))
def test_every_preset_is_sourced_and_sane(entry: DevicePreset):
    assert entry.source.strip()
    assert entry.source_kind in ("reported", "nominal")
    if entry.source_kind == "reported":
        # a URL, or a citation that quotes the output it took the figure from
        assert entry.source.startswith("https://") or "total_memory=" in entry.source
    assert entry.nominal.strip()
    # Above 1 GiB and at most 192 GiB, and never above the nominal size read as GiB
    # (NVIDIA's "80 GB" HBM parts carry 80 GiB, of which PyTorch sees ~79).
    assert GIB < entry.capacity <= 192 * GIB
    nominal_gb = float(re.match(r"(\d+(?:\.\d+)?) GB", entry.nominal).group(1))
    # (MPS's limit is the working set times 1.7: above the memory, reached by swapping; at most 1.7 x 3/4 of it)
    assert entry.capacity <= nominal_gb * GIB * (1.7 * 3 / 4 if entry.backend == "mps" else 1) + GIB // 100


def test_preset_names_are_canonical_and_unique():
    for name, entry in PRESETS.items():
        assert entry.name == name
        assert preset(name) is entry


def test_presets_are_read_only():
    with pytest.raises(TypeError):
        PRESETS["T4"] = PRESETS["L4"]  # type: ignore[index]


def test_str_says_where_the_figure_comes_from():
    assert str(PRESETS["T4"]) == "T4: 14.8 GiB as PyTorch reports it (nominal 16 GB GDDR6)"
    assert "no reported total" in str(PRESETS["L4"])


def test_a_fraction_without_a_unit_is_refused_not_rounded_to_bytes():
    """--capacity 1.5 read as 1.5 bytes, shown as '2 B' (a review): a number without a unit is whole bytes."""
    from nbmem.core.devices import parse_capacity

    with pytest.raises(ValueError, match=r"bytes are whole; give a unit, e.g. '1.5GiB'"):
        parse_capacity("1.5")
    assert parse_capacity("1.5GiB") == (1536 * 2**20, "1.5GiB")
    assert parse_capacity(16e9)[0] == 16_000_000_000  # a float from code is a size, as before


@pytest.mark.parametrize("value, fix", [
    ("4090", "Did you mean 'RTX-4090'? Give a GPU preset, or a size with its unit such as '24GiB'"),
    ("3090", "Did you mean 'RTX-3090'? Give a GPU preset, or a size with its unit such as '24GiB'"),
    (16, "Give a size with its unit, e.g. '16GiB' or '16GB', or a GPU preset"),
    (4090, "Did you mean 'RTX-4090'? Give a GPU preset, or a size with its unit such as '24GiB'"),
    ("80", "Give a size with its unit, e.g. '80GiB' or '80GB', or a GPU preset")])
def test_a_gpus_number_or_a_size_without_its_unit_is_refused_not_read_as_bytes(value, fix):
    """device="4090" estimated against 4,090 bytes: "does NOT fit: 160 MiB of 3.99 KiB", and max_batch_size
    answered 0 (a newcomer's walk through the docs). A bare number under 1 MiB is refused, saying what to write."""
    from nbmem.core.devices import parse_capacity

    with pytest.raises(ValueError) as caught:
        parse_capacity(value)
    assert parse_capacity(65536) == (65536, "64.0 KiB")  # an int from code may be a tiny test device
    assert str(caught.value).startswith(f"a capacity of {value!r} without a unit would be {int(value)} bytes, surely "
                                        f"not meant. {fix} (presets: T4, ")
