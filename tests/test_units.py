import pytest

from kvbench.errors import KvbenchError
from kvbench.units import (
    format_bytes,
    format_size,
    gbps,
    parse_fraction,
    parse_size,
    parse_sizes,
)


@pytest.mark.parametrize(("text", "expected"), [
    ("4096", 4096), ("1K", 1024), ("4k", 4096), ("1.5M", 3 << 19), ("256MiB", 256 << 20),
    ("2G", 2 << 30), ("1 KB", 1024), ("7B", 7),
])
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "0", "0K", "-4K", "4Q", "K", "1.3", "abc", "4KK"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(KvbenchError):
        parse_size(text)


def test_parse_sizes_forms() -> None:
    powers_of_4 = [1 << 10 << 2 * i for i in range(10)]
    assert powers_of_4[-1] == 256 << 20
    assert parse_sizes("1K,4K,...,256M") == powers_of_4
    assert parse_sizes("1K..256M") == powers_of_4
    assert parse_sizes("1K..8K:x2") == [1024, 2048, 4096, 8192]
    assert parse_sizes("64,1K, 3M") == [64, 1024, 3 << 20]


@pytest.mark.parametrize("text", ["1K,...,4M", "1K,4K,...", "1K,3K,...,20K", "2K,3K,...,9K",
                                  "1K..3K", "4K..1K", "1K..4K:x1", ""])
def test_parse_sizes_rejects(text: str) -> None:
    with pytest.raises(KvbenchError):
        parse_sizes(text)


def test_formats() -> None:
    assert format_size(256 << 20) == "256M"
    assert format_size(1000) == "1000"
    assert format_bytes(5596960 * 1024) == "5.34 GiB"
    assert gbps(2e9, 1.0) == 2.0  # decimal GB/s


@pytest.mark.parametrize(("text", "expected"), [("5%", 0.05), ("0.05", 0.05), ("12.5%", 0.125)])
def test_parse_fraction(text: str, expected: float) -> None:
    assert parse_fraction(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["five", "5", "-1%", "nan", ""])
def test_parse_fraction_rejects(text: str) -> None:
    with pytest.raises(KvbenchError):
        parse_fraction(text)
