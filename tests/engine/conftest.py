"""The engine tests' workers fork from a forkserver that imported torch once, as a daemon's
do once it runs one (cuvild/intake/forks.py); a spawned worker is what a restored daemon
starts (tests/serve/test_waiting.py; tests/engine/test_warm.py `spawned`)."""

from __future__ import annotations

import pytest

from cuvild.intake import forks


@pytest.fixture(scope="session", autouse=True)
def forkserver() -> None:
    forks.start()
