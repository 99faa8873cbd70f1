"""The cuvil.v1 Control service: the daemon's control plane over gRPC."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import grpc

import cuvild
from partitioner.profile import DeviceProfile
from protos import cuvil_pb2, cuvil_pb2_grpc
from runtimes.profiles import ProfileResult, ProfilingError

log = logging.getLogger(__name__)


def profile_to_pb(dev: DeviceProfile) -> cuvil_pb2.DeviceProfile:
    return cuvil_pb2.DeviceProfile(
        id=dev.id, kind=dev.kind, name=dev.name, emulated=dev.emulated,
        memory_gb=dev.memory_gb, peak_gflops=dev.peak_gflops, mem_bw_gbs=dev.mem_bw_gbs,
        link_bw_gbs=dev.link_bw_gbs, link_latency_us=dev.link_latency_us,
        launch_us=dev.launch_us, runtimes=dev.runtimes, cores=dev.cores, features=dev.features,
    )


class ControlService(cuvil_pb2_grpc.ControlServicer):
    """Answers status and profiling requests from the daemon's current state."""

    def __init__(self, profiles: Callable[[], ProfileResult],
                 reprofile: Callable[[], ProfileResult], config_path: str) -> None:
        self._profiles = profiles
        self._reprofile = reprofile
        self._config_path = config_path
        self._started = time.monotonic()
        self._refresh_lock = threading.Lock()

    def GetStatus(self, request: cuvil_pb2.GetStatusRequest,
                  context: grpc.ServicerContext) -> cuvil_pb2.GetStatusResponse:
        result = self._profiles()
        return cuvil_pb2.GetStatusResponse(
            version=cuvild.__version__,
            uptime_s=time.monotonic() - self._started,
            devices=[profile_to_pb(d) for d in result.devices],
            models=[],
            profile_source=result.source,
            profile_seconds=result.seconds,
            fingerprint=result.fingerprint,
            config_path=self._config_path,
            pid=os.getpid(),
        )

    def ProfileDevices(self, request: cuvil_pb2.ProfileDevicesRequest,
                       context: grpc.ServicerContext) -> cuvil_pb2.ProfileDevicesResponse:
        if request.refresh:
            # One measurement at a time: two would disturb each other's numbers.
            if not self._refresh_lock.acquire(blocking=False):
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              "a device profiling run is already in progress; try again shortly")
            try:
                result = self._reprofile()
            except ProfilingError as e:
                context.abort(grpc.StatusCode.INTERNAL, str(e))
            finally:
                self._refresh_lock.release()
        else:
            result = self._profiles()
        return cuvil_pb2.ProfileDevicesResponse(
            devices=[profile_to_pb(d) for d in result.devices],
            profile_source=result.source,
            profile_seconds=result.seconds,
            fingerprint=result.fingerprint,
        )
