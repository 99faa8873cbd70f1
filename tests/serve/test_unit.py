"""The systemd unit is one systemd accepts (`systemd-analyze verify`), where systemd is."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "configs" / "cuvild.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (Debian: apt install systemd)")
def test_the_unit_verifies(tmp_path):
    # verify checks that ExecStart exists: point it at this checkout's cuvild.
    cuvild = Path(sys.executable).parent / "cuvild"
    unit = tmp_path / "cuvild.service"
    unit.write_text(UNIT.read_text().replace("/opt/cuvild/.venv/bin/cuvild", str(cuvild)))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cuvild.service" not in result.stderr, result.stderr  # no warning about the unit


def test_the_unit_sets_the_limits_cuvild_relies_on():
    text = UNIT.read_text()
    assert "LimitNOFILE=" in text and "LimitMEMLOCK=infinity" in text
