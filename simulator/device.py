"""The virtual device: streams and events on the virtual clock, costs from a CostProfile.

Why: the pipeline launches exactly the messages it launches on real hardware; here a launch
computes its duration from the cost model and its result from a `Responder` (the
simulator's stand-in for the worker: sampled tokens, accepted lengths), and completes at the
modelled time. Streams run their work in order; with `serialize_streams` (a CPU worker
process) every stream shares one queue, otherwise streams run concurrently and only
`wait_event` orders them, like CUDA streams.
"""
from __future__ import annotations

from typing import Any, Protocol

from specsched.scheduler.protocols import DeviceError
from specsched.scheduler.step_trace import device_span_name
from specsched.simulator.costs import CostProfile
from specsched.simulator.vtime import VirtualClock


class Responder(Protocol):
    def respond(self, op: str, batch: Any, start_ns: int) -> tuple[Any, list[tuple[str, int]]]:
        """(result, [(substage name, duration ns), ...]) for a launch starting at start_ns."""
        ...


class VirtualEvent:
    def __init__(self, op: str, stream: str, start_ns: int, end_ns: int, result: Any,
                 device: "VirtualDevice", error: str | None = None):
        self.op = op
        self.stream = stream
        self.start_ns = start_ns
        self.end_ns = end_ns
        self._result = result
        self._device = device
        self._error = error

    def query(self) -> bool:
        return self._device.clock.now_ns() >= self.end_ns

    def synchronize(self, timeout_s: float | None = None) -> Any:
        if not self.query():
            raise RuntimeError("synchronize() on a virtual event before its time; await wait()")
        return self._outcome()

    async def wait(self) -> Any:
        dev = self._device
        clock = dev.clock
        wakeup, stand_in = dev.wakeup(self.op)
        delay = self.end_ns + wakeup - clock.now_ns()
        if delay > 0:
            if stand_in:
                dev.note_stand_in("wake-up", self.op)
            await clock.sleep_ns(delay)
        if self._error:
            raise DeviceError(self.op, self._error)
        return self._result

    def _outcome(self) -> Any:
        if self._error:
            raise DeviceError(self.op, self._error)
        return self._result


class VirtualStream:
    def __init__(self, device: "VirtualDevice", name: str):
        self.device = device
        self.name = name
        self.busy_until_ns = 0
        self._after_ns = 0  # wait_event dependencies

    def launch(self, op: str, batch: Any) -> VirtualEvent:
        dev = self.device
        profile = dev.profile
        now = dev.clock.now_ns()
        lead, lead_stand_in = dev.op_latency(op)
        ready = now + lead
        shape = getattr(batch, "shape", None)
        attrs = shape.view() if shape is not None else {}
        name = device_span_name(op, attrs)
        # launched while the queue is busy, an op starts the device's per-op gap after the
        # op ahead of it; launched onto an idle device, its launch lead after the launch (how
        # the two are fitted: gaps from queued ops, leads from launches onto an idle device)
        busy = dev.busy_until_ns if profile.serialize_streams else self.busy_until_ns
        if busy > now:
            gap, gap_stand_in = dev.queue_gap(name)
            queue_free = busy + gap
        else:
            queue_free, gap_stand_in = 0, False
        start = max(ready, queue_free, self._after_ns)
        if start == ready and lead_stand_in:
            dev.note_stand_in("launch lead", op)
        elif start == queue_free and gap_stand_in:
            dev.note_stand_in("queue gap", name)
        error = None
        try:
            result, subs = dev.responder.respond(op, batch, start)
        except Exception as e:  # noqa: BLE001 - surfaces at the waiter, like real devices
            result, subs, error = None, [], str(e)
        if not subs:
            subs = [(name, int(profile.device_ns(name, attrs, dev._models)))]
        t = start
        stamps = []
        for sub, dur in subs:
            dev.check_cost_model(sub)
            stamps.append((sub, t, t + int(dur)))
            t += int(dur)
        if len(stamps) > 1 and hasattr(result, "substages"):
            # the result is new and nobody holds it yet: its stamps are set in place
            # (dataclasses.replace would cost more than the rest of the launch)
            object.__setattr__(result, "substages", tuple(stamps))
        self.busy_until_ns = t
        if t > dev.busy_until_ns:
            dev.busy_until_ns = t
        self._after_ns = 0
        dev.num_launches += 1
        return VirtualEvent(op, self.name, start, t, result, dev, error)

    def wait_event(self, event: VirtualEvent) -> None:
        self._after_ns = max(self._after_ns, event.end_ns)


class VirtualDevice:
    kind = "virtual"
    needs_plans = False  # launches are timed from their shape; no attention metadata needed
    warm_first_launch = True  # an op's first launch is priced as any other (no one-off costs)

    def __init__(self, profile: CostProfile, responder: Responder, name: str = "virtual",
                 clock: VirtualClock | None = None):
        self.profile = profile
        self.responder = responder
        self.clock = clock if clock is not None else VirtualClock()
        self.name = name
        self.busy_until_ns = 0
        self.num_launches = 0
        self._streams: dict[str, VirtualStream] = {}
        # what the profile priced with a stand-in, "latency: op" -> times (see `stand_ins`)
        self.stand_in_counts: dict[str, int] = {}
        self._priced_as: dict[str, str | None] = {}  # op -> its stand-in count key, if priced as another
        self._leads: dict[str, tuple[int, bool]] = {}
        self._gaps: dict[str, tuple[int, bool]] = {}
        self._wakeups: dict[str, tuple[int, bool]] = {}
        self._models: dict = {}  # op span name -> the model that prices it (`CostProfile.device_ns`)

    def note_stand_in(self, latency: str, key: str) -> None:
        k = f"{latency}: {key}"
        self.stand_in_counts[k] = self.stand_in_counts.get(k, 0) + 1

    def check_cost_model(self, name: str) -> None:
        """Count a device op priced by another op's model (a trace without that op)."""
        try:
            key = self._priced_as[name]
        except KeyError:
            alt = self.profile.priced_as(name)
            key = self._priced_as[name] = f"{name} (priced as {alt})" if alt is not None and alt != name else None
        if key is not None:
            self.note_stand_in("cost model", key)

    # The profile's latencies by op, looked up once: every launch asks (the profile does not
    # change during a run).
    def op_latency(self, op: str) -> tuple[int, bool]:
        """(launch lead ns, whether it is a stand-in) of launch op `op`."""
        try:
            return self._leads[op]
        except KeyError:
            p = self.profile
            out = self._leads[op] = (int(p.launch_lead_for(op)), p.stand_in("launch lead", op))
            return out

    def queue_gap(self, name: str) -> tuple[int, bool]:
        """(device idle ns before op `name` queued behind another, whether it is a stand-in)."""
        try:
            return self._gaps[name]
        except KeyError:
            p = self.profile
            out = self._gaps[name] = (int(p.gap_ns(name)), p.stand_in("queue gap", name))
            return out

    def wakeup(self, op: str) -> tuple[int, bool]:
        """(wake-up ns after op `op`'s end, whether it is a stand-in)."""
        try:
            return self._wakeups[op]
        except KeyError:
            p = self.profile
            out = self._wakeups[op] = (int(p.wakeup_for(op)), p.stand_in("wake-up", op))
            return out

    def stand_ins(self, min_share: float = 0.05) -> dict[str, int]:
        """The stand-ins that priced at least `min_share` of the launches (and 3 or more):
        where a prediction rests on latencies or costs its traces never showed."""
        floor = max(3, min_share * self.num_launches)
        return {k: n for k, n in sorted(self.stand_in_counts.items()) if n >= floor}

    def stream(self, name: str) -> VirtualStream:
        if name not in self._streams:
            self._streams[name] = VirtualStream(self, name)
        return self._streams[name]

    def close(self) -> None:
        # streams and device refer to each other: dropping the streams frees a finished
        # replay's device (and what its events hold) without a garbage collection
        self._streams.clear()
