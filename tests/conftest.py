# SPDX-License-Identifier: Apache-2.0
"""What holds for every test of the repository.

- Shared helpers live in ``tests/helpers/`` and are imported as ``helpers.<module>``: pytest puts
  this directory (the root conftest's, which is no package) on ``sys.path``.
- Every test carries exactly one hardware mark, ``cpu`` or ``cuda`` (``multi_gpu`` tests are
  ``cuda`` too). The CI levels select tests by these marks (``-m "core_model and cpu"``,
  ``-m "core_model and cuda"``), so a test without one would run in no level, and one with both
  in two. Collection fails and names every such test.
"""

from __future__ import annotations

import pytest

HARDWARE_MARKS = ("cpu", "cuda")


def hardware_marks(item: pytest.Item) -> list[str]:
    """The hardware marks of a collected test (module, class and function marks together)."""
    return [name for name in HARDWARE_MARKS if item.get_closest_marker(name) is not None]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    bad = [
        f"{item.nodeid} ({', '.join(marks) or 'none'})"
        for item in items
        if len(marks := hardware_marks(item)) != 1
    ]
    if bad:
        raise pytest.UsageError(
            f"every test needs exactly one of the marks {', '.join(HARDWARE_MARKS)}; "
            "these have another count:\n  " + "\n  ".join(bad)
        )
