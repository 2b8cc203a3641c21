import pytest

from kvbench.errors import KvbenchError
from kvbench.units import (
    dtype_name,
    format_bytes,
    format_seconds,
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


# --- the exact figures and messages (issue 30: each pinned by hand) ---

@pytest.mark.parametrize(("text", "message"), [
    ("4Q", "cannot parse size '4Q' (examples: 4096, 4K, 1.5M, 256MiB)"),
    ("1.3", "size '1.3' is not a whole number of bytes"),
    ("0K", "size '0K' must be greater than zero"),
])
def test_parse_size_messages(text: str, message: str) -> None:
    with pytest.raises(KvbenchError) as e:
        parse_size(text)
    assert str(e.value) == message


def test_parse_size_one_byte() -> None:
    assert parse_size("1") == 1


@pytest.mark.parametrize(("text", "expected"), [
    ("4K..4K", [4096]),  # one size: the run ends where it starts
    ("512,1K,4K,...,16K", [512, 1024, 4096, 16384]),  # sizes before the run are kept
    ("4K,1K,2K,...,8K", [4096, 1024, 2048, 4096, 8192]),  # only the last two set the ratio
    ("1K,3K,...,27K", [1024, 3072, 9216, 27648]),
])
def test_parse_sizes_exact(text: str, expected: list[int]) -> None:
    sizes = parse_sizes(text)
    assert sizes == expected
    assert all(type(s) is int for s in sizes)


@pytest.mark.parametrize(("text", "message"), [
    ("", "empty size list"),
    ("1K..4K:x1", "bad step 'x1' in '1K..4K:x1' (expected x2, x4, ...)"),
    ("4K..1K", "'4K..1K': the last size is smaller than the first"),
    ("1K..3K", "'1K..3K': 3K is not reached from 1K"),
    ("1K,...,4M", "'...' in '1K,...,4M' needs two sizes before it and one after it"),
    ("512,2K,3K,...,9K", "'512,2K,3K,...,9K': the two sizes before '...' must grow by a "
                         "whole factor"),
    ("1K,1K,...,4K", "'1K,1K,...,4K': the two sizes before '...' must grow by a whole factor"),
    ("1K,3K,...,20K", "'1K,3K,...,20K': 20K is not reached from 1K"),
    ("1K..2K..4K", "cannot parse size '2K..4K' (examples: 4096, 4K, 1.5M, 256MiB)"),
])
def test_parse_sizes_messages(text: str, message: str) -> None:
    with pytest.raises(KvbenchError) as e:
        parse_sizes(text)
    assert str(e.value) == message


@pytest.mark.parametrize(("n", "text"), [
    (1 << 40, "1T"), (3 << 30, "3G"), (5 << 20, "5M"), (7 << 10, "7K"), (1 << 10, "1K"),
    (1 << 30, "1G"), (1 << 20, "1M"), ((1 << 40) + (1 << 30), "1025G"), (1536, "1536"),
    (1023, "1023"), ((1 << 41) + (1 << 20), "2097153M"), ((2 << 30) + (1 << 10), "2097153K"),
])
def test_format_size_exact(n: int, text: str) -> None:
    assert format_size(n) == text


@pytest.mark.parametrize(("n", "text"), [
    (1 << 40, "1 TiB"), (3 << 39, "1.5 TiB"), (1 << 30, "1 GiB"), (3 << 29, "1.5 GiB"),
    (1 << 20, "1 MiB"), (5 << 19, "2.5 MiB"), (1 << 10, "1 KiB"), (512 << 10, "512 KiB"),
    (1023, "1023 B"), (100.7, "100 B"), ((1 << 40) - (1 << 30), "1.02e+03 GiB"),
])
def test_format_bytes_exact(n: float, text: str) -> None:
    assert format_bytes(n) == text


def test_gbps_is_bytes_over_seconds_decimal() -> None:
    assert gbps(3e9, 2.0) == 1.5
    assert gbps(1e9, 0.5) == 2.0
    assert gbps(1, 0.0) == float("inf")  # no time measured: no finite rate


@pytest.mark.parametrize(("seconds", "text"), [
    (2.0, "2 s"), (1.0, "1 s"), (0.0456, "45.6 ms"), (1e-3, "1 ms"), (-0.002, "-2 ms"),
    (1.23e-6, "1.23 us"), (1e-6, "1 us"), (5e-9, "5 ns"), (0.0, "0 ns"),
])
def test_format_seconds(seconds: float, text: str) -> None:
    assert format_seconds(seconds) == text


@pytest.mark.parametrize(("text", "expected"), [("0", 0.0), ("0.5", 0.5), ("150%", 1.5),
                                                ("0.999", 0.999)])
def test_parse_fraction_edges(text: str, expected: float) -> None:
    assert parse_fraction(text) == expected


@pytest.mark.parametrize("text", ["1", "1.5"])
def test_parse_fraction_rejects_whole_numbers(text: str) -> None:
    with pytest.raises(KvbenchError) as e:
        parse_fraction(text)
    assert str(e.value) == f"threshold '{text}' out of range (use a percentage like 5% or 0.05)"


def test_parse_fraction_message_names_the_quantity() -> None:
    with pytest.raises(KvbenchError) as e:
        parse_fraction("five")
    assert str(e.value) == "cannot parse threshold 'five' (examples: 5%, 0.05)"
    with pytest.raises(KvbenchError) as e:
        parse_fraction("x", what="--noise")
    assert str(e.value) == "cannot parse --noise 'x' (examples: 5%, 0.05)"


@pytest.mark.parametrize(("text", "name"), [
    ("fp32", "float32"), (" BF16 ", "bfloat16"), ("float16", "float16"), ("fp16", "float16"),
])
def test_dtype_name(text: str, name: str) -> None:
    assert dtype_name(text) == name


def test_dtype_name_rejects() -> None:
    with pytest.raises(KvbenchError) as e:
        dtype_name("int8")
    assert str(e.value) == ("--dtype 'int8': one of float32, fp32, bfloat16, bf16, float16, "
                            "fp16")
