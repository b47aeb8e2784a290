"""bench.reading_cost's line counting on a crafted source with every kind of line."""

from __future__ import annotations

from bench.reading_cost import count_source

SOURCE = '''"""Module docstring,
on two lines."""

# a comment line
import os  # a trailing comment is a code line

TEMPLATE = """a string that is
not a docstring"""


class Box:
    """One-line class docstring."""

    def size(self) -> int:
        """Function docstring

        with a blank line inside."""
        "a second string statement is not a docstring"
        return 1

    async def wait(self) -> None:
        # comment inside a body
        x = f"{os.sep}"
'''


def test_counts_docstrings_and_comments_as_prose_and_strings_as_code() -> None:
    count = count_source(SOURCE)
    # 23 lines, 7 blank (one inside the function docstring)
    assert count.files == 1
    assert count.nonblank == 16
    # module docstring 2, comment 1, class docstring 1, function docstring 2, comment 1
    assert count.prose == 7
    # import, the two lines of TEMPLATE, class, def, the second string, return, async def, x = ...
    assert count.code == 9
    assert count.trailing == 1


def test_empty_file() -> None:
    count = count_source("")
    assert (count.nonblank, count.prose, count.code, count.trailing) == (0, 0, 0, 0)
