"""Byte sizes as people write them (gpumemd --host-capacity, gpumemctl) and as tools print them."""

from __future__ import annotations

import pytest

from gpumem_shared.units import format_size, parse, parse_size

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


def test_parse_binary_units() -> None:
    assert parse_size("8GiB") == 8 * GiB
    assert parse_size("512MiB") == 512 * MiB
    assert parse_size("4KiB") == 4 * KiB
    assert parse_size("2TiB") == 2 * TiB
    assert parse_size("1PiB") == 1024 * TiB


def test_parse_iec_units_without_the_b() -> None:
    assert parse_size("8Gi") == 8 * GiB
    assert parse_size("512Mi") == 512 * MiB
    assert parse_size("4Ki") == 4 * KiB
    assert parse_size("3Ti") == 3 * TiB


def test_parse_decimal_units_are_powers_of_ten() -> None:
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("1G") == 1_000_000_000
    assert parse_size("3k") == 3000
    assert parse_size("2MB") == 2_000_000
    assert parse_size("1TB") == 10**12
    assert parse_size("2K") == 2000
    assert parse_size("1PB") == 10**15


def test_parse_plain_bytes_case_and_whitespace() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("4096b") == 4096
    assert parse_size("0") == 0
    assert parse_size("  8 gib ") == 8 * GiB
    assert parse_size("1.5GiB") == 3 * 512 * MiB


def test_parse_accepts_fractions_that_come_to_whole_bytes() -> None:
    assert parse_size("0.5KiB") == 512
    assert parse_size("1.25Mi") == 1310720
    assert parse_size("2.000000001GB") == 2_000_000_001


@pytest.mark.parametrize("text", ["1.0001KiB", "0.5", "1.5b", "0.0000000001GB"])
def test_parse_refuses_fractional_bytes(text: str) -> None:
    with pytest.raises(ValueError, match="whole number of bytes"):
        parse_size(text)


def test_nearest_multiples_are_written_in_the_unit_typed() -> None:
    assert parse("3MiB").nearest_multiples(2 * MiB) == "2MiB or 4MiB"
    assert parse("1025Mi").nearest_multiples(2 * MiB) == "1024Mi or 1026Mi"
    assert parse("1.25GiB").nearest_multiples(3 * MiB) == "1.248046875GiB or 1.2509765625GiB"
    assert parse("3000kB").nearest_multiples(2 * MiB) == "2097.152kB or 4194.304kB"
    assert parse("3145728").nearest_multiples(2 * MiB) == "2097152 or 4194304"


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "8XB", "8 Gi B", "1.2.3", ".5GiB", "1e9", "8GiBs", "eight"])
def test_parse_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


def test_format_picks_the_largest_unit_that_fits() -> None:
    assert format_size(0) == "0 B"
    assert format_size(1023) == "1023 B"
    assert format_size(1024) == "1 KiB"
    assert format_size(8 * GiB) == "8 GiB"
    assert format_size(3 * TiB) == "3 TiB"
    assert format_size(2048 * TiB) == "2048 TiB"  # no unit above TiB


def test_format_fractions_show_two_decimals() -> None:
    assert format_size(1536) == "1.50 KiB"
    assert format_size(GiB + 6 * MiB) == "1.01 GiB"
    assert format_size(GiB - 1) == "1024.00 MiB"  # 1023.999... rounds up in the display only


def test_format_negative_sizes() -> None:
    assert format_size(-2 * MiB) == "-2 MiB"
    assert format_size(-100) == "-100 B"


@pytest.mark.parametrize("n", [0, 1, 1023, 4 * KiB, 1536, 512 * MiB, 3 * GiB, 5 * TiB])
def test_exact_sizes_round_trip(n: int) -> None:
    assert parse_size(format_size(n)) == n


def test_an_si_size_reads_as_the_iec_one_it_likely_meant() -> None:
    assert str(parse("8G").as_iec()) == "8GiB"
    assert str(parse("512MB").as_iec()) == "512MiB"
    assert str(parse("3k").as_iec()) == "3KiB"
    assert parse("8GiB").as_iec() is None and parse("4096").as_iec() is None


def test_the_readmes_iec_size_examples_suit_a_granular_flag() -> None:
    """docs/running.md offers IEC examples before saying granular flags want them: each must
    be a multiple of the 2 MiB granularity (its 1.5GB was refused by every such flag)."""
    import re

    from conftest import ROOT

    text = " ".join((ROOT / "docs" / "running.md").read_text().split())
    sentence = re.search(r"Sizes take IEC units \(([^)]*)\)", text)
    assert sentence is not None, "docs/running.md's sentence on size units moved"
    examples = re.findall(r"`([^`]+)`", sentence.group(1))
    assert examples and all(parse_size(e) % (2 * MiB) == 0 for e in examples), examples
