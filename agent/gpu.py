"""GPU health through NVML (``nvidia-ml-py``): per device utilisation, memory, temperature, power, ECC
errors and XID events; "unavailable" as data where there is no driver or no GPU (CONVENTIONS.md 7)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from agent.collectors import Metrics, _describe, unavailable

log = logging.getLogger(__name__)


def _load_pynvml() -> ModuleType:
    import pynvml  # nvidia-ml-py; imported lazily so a node without it still runs

    return pynvml


#: XID errors remembered per GPU (the newest; the count covers all of them).
XID_RECENT = 8
#: Most XID events taken from NVML per collection (the rest wait for the next one).
XID_DRAIN_MAX = 256


class GpuCollector:
    """Per-GPU utilisation, memory, temperature, power, ECC and XID errors through NVML.

    ``nvml`` is the pynvml module or a fake with the same functions. When NVML cannot start (no
    driver, no GPU) the collector reports why, and tries again at most every ``retry_s``.

    XID errors (the driver's reports of a GPU fault: 48 double-bit ECC, 79 fallen off the bus, ...)
    are NVML *events*: the collector registers every GPU that supports them for
    ``nvmlEventTypeXidCriticalError`` once, and drains the event set without waiting at each
    collection. Per device: ``xid_errors`` (count since the agent started), ``last_xid`` and
    ``recent_xids`` (newest last); ``None`` with ``xid_reason`` where XID events are unsupported or
    could not be registered (a container without the rights, say).
    """

    name = "gpus"

    def __init__(
        self,
        nvml: ModuleType | Any | None = None,
        clock: Callable[[], float] = time.monotonic,
        retry_s: float = 60.0,
    ) -> None:
        self._nvml = nvml
        self._clock = clock
        self._retry_s = retry_s
        self._ready = False
        self._failure: str | None = None
        self._failed_at = float("-inf")
        self._events: Any = None  # the NVML event set XIDs arrive on (None: none registered)
        self._xid_reason: dict[int, str] = {}  # device index -> why it has no XID events
        self._xids: dict[int, list[int]] = {}  # device index -> recent XID codes
        self._xid_count: dict[int, int] = {}
        self._xid_registered = False

    def _init(self) -> str | None:
        """Start NVML if needed; the reason it is unavailable, or None."""
        if self._ready:
            return None
        if self._failure is not None and self._clock() - self._failed_at < self._retry_s:
            return self._failure
        try:
            if self._nvml is None:
                self._nvml = _load_pynvml()
            self._nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - ImportError, NVMLError_*, OSError: all mean "no NVML"
            self._failure = f"NVML unavailable: {_describe(exc)}"
            self._failed_at = self._clock()
            return self._failure
        self._ready = True
        self._failure = None
        return None

    def collect(self) -> Metrics:
        reason = self._init()
        if reason is not None:
            return unavailable(reason)
        nv: Any = self._nvml
        try:
            count = nv.nvmlDeviceGetCount()
        except Exception as exc:  # noqa: BLE001 - reported as data
            return unavailable(f"nvmlDeviceGetCount failed: {_describe(exc)}")
        if count == 0:
            return unavailable("no GPU on this node")
        if not self._xid_registered:
            self._register_xid(count)
        self._drain_xid()
        devices = []
        for i in range(count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
            except Exception as exc:  # noqa: BLE001 - a lost GPU is reported, not raised
                devices.append({"index": i, **unavailable(_describe(exc)), **self._xid_metrics(i)})
                continue
            devices.append({"index": i, "available": True, **self._device(h), **self._xid_metrics(i)})
        return {"available": True, "count": count, "devices": devices}

    # -- XID errors -------------------------------------------------------------------------------
    def _register_xid(self, count: int) -> None:
        """Register every GPU that supports XID events on one event set (once)."""
        nv: Any = self._nvml
        self._xid_registered = True
        xid_type = getattr(nv, "nvmlEventTypeXidCriticalError", None)
        if xid_type is None or not hasattr(nv, "nvmlEventSetCreate"):
            self._xid_reason = dict.fromkeys(range(count), "this NVML binding has no XID events")
            return
        try:
            self._events = nv.nvmlEventSetCreate()
        except Exception as exc:  # noqa: BLE001 - reported as data
            self._xid_reason = dict.fromkeys(range(count), f"nvmlEventSetCreate failed: {_describe(exc)}")
            return
        for i in range(count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                if not nv.nvmlDeviceGetSupportedEventTypes(h) & xid_type:
                    self._xid_reason[i] = "XID events not supported by this GPU"
                    continue
                nv.nvmlDeviceRegisterEvents(h, xid_type, self._events)
            except Exception as exc:  # noqa: BLE001 - no rights, not supported: reported as data
                self._xid_reason[i] = f"cannot register XID events: {_describe(exc)}"
                continue
            self._xids[i], self._xid_count[i] = [], 0

    def _drain_xid(self) -> None:
        """Take the XID events NVML holds, without waiting."""
        if self._events is None or not self._xids:
            return
        nv: Any = self._nvml
        wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        timeout_error = getattr(nv, "NVMLError_Timeout", None)
        for _ in range(XID_DRAIN_MAX):
            try:
                ev = wait(self._events, 0)
            except Exception as exc:  # noqa: BLE001 - a timeout means "no event"; anything else is logged
                if timeout_error is None or not isinstance(exc, timeout_error):
                    log.warning("reading NVML XID events failed: %s", _describe(exc))
                return
            try:
                index = int(nv.nvmlDeviceGetIndex(ev.device))
            except Exception:  # noqa: BLE001, S112 - a device that vanished: keep the event on no GPU
                continue
            if index not in self._xids:
                continue
            xid = int(ev.eventData)
            log.warning("GPU %d reported XID %d", index, xid)
            self._xid_count[index] += 1
            self._xids[index] = [*self._xids[index], xid][-XID_RECENT:]

    def _xid_metrics(self, index: int) -> Metrics:
        if index in self._xids:
            recent = self._xids[index]
            return {"xid_errors": self._xid_count[index], "last_xid": recent[-1] if recent else None,
                    "recent_xids": list(recent)}
        return {"xid_errors": None, "last_xid": None, "recent_xids": None,
                "xid_reason": self._xid_reason.get(index, "not registered")}

    def _device(self, h: Any) -> Metrics:
        nv: Any = self._nvml
        m: Metrics = {}

        def probe(key: str, fn: Callable[[], Any]) -> None:
            # A metric the GPU does not support (NVMLError_NotSupported) is None, not an error.
            try:
                m[key] = fn()
            except Exception:  # noqa: BLE001
                m[key] = None

        probe("name", lambda: _text(nv.nvmlDeviceGetName(h)))
        probe("uuid", lambda: _text(nv.nvmlDeviceGetUUID(h)))
        probe("util_percent", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu)
        probe("mem_util_percent", lambda: nv.nvmlDeviceGetUtilizationRates(h).memory)
        probe("memory_used_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).used)
        probe("memory_total_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).total)
        probe("temperature_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        probe("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
        probe(
            "ecc_uncorrected_volatile",
            lambda: nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
            ),
        )
        return m


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


# --------------------------------------------------------------------------------------------------
# Running them
# --------------------------------------------------------------------------------------------------
