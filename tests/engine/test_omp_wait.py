"""OpenMP's waits in the workers (cuvild/workers/worker.py): passive where two devices'
workers share cores, a short spin where none do; a spawned worker reads them as it imports
torch (checked in a fresh interpreter: the policy is read when OpenMP's library loads)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cuvild.workers.worker import OMP_PASSIVE, OMP_SHORT_SPIN, OMP_WAIT_ENV, shares_cores
from partitioner.profile import DeviceProfile


def device(id_: str, kind: str = "cpu", cores: list[int] | None = None,
           emulated: bool = False) -> DeviceProfile:
    return DeviceProfile(id=id_, kind=kind, cores=cores or [], emulated=emulated)


def test_cores_shared_by_two_host_devices_are_found() -> None:
    assert not shares_cores([device("cpu0", cores=[0])])
    assert not shares_cores([device("cpu0", cores=[0]), device("npu0", "npu", [1], True)])
    assert shares_cores([device("cpu0", cores=[0, 1]), device("npu0", "npu", [1], True)])
    assert shares_cores([device("cpu0"), device("npu0", "npu", [0], True)])  # (all cores)
    # a GPU's worker drives the GPU; a real NPU computes on its own silicon
    assert not shares_cores([device("cpu0"), device("gpu0", "gpu"), device("npu0", "npu")])


@pytest.mark.parametrize("wait", ["spin", "passive"])
def test_a_worker_process_sets_the_waits_before_torch(wait: str) -> None:
    code = ("import os; import cuvild.workers.omp_env; "
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, OMP_WAIT_ENV: wait},
                         capture_output=True, text=True, check=True).stdout.split()
    want = OMP_SHORT_SPIN if wait == "spin" else OMP_PASSIVE
    assert out == [want.get("OMP_WAIT_POLICY", "None"), want.get("GOMP_SPINCOUNT", "None")]
