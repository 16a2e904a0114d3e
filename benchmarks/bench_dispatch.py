"""``record()`` against a direct call and the signal libraries, at 0, 1 and 10 subscribers.

Every peer delivers the same payload, ``worker_id=0, exit_code=0, data=d``, to no-op
receivers of the matching signature. eventbus additionally validates the fields and builds
an immutable event (the others pass the arguments along as they are); torch's own
``torch.distributed.elastic.events.record()`` builds its ``Event`` and serialises it to
JSON even for the "null" destination, and has no subscribers.

``record()`` is timed as users write it, ``bus.record(EventType.WORKER_EXIT, ...)``, on a
private bus per subscriber count. On Python 3.11 the ``EventType.WORKER_EXIT`` lookup alone
costs more than a direct call: ``enum.EnumType`` defines ``__getattr__``, which sends
every attribute read on an enum class through a slow Python-level hook (3.12 removed it).
The ``hoisted`` rows take the member from a local name, as a loop that records the same
type many times may; the targets are judged on the rows as written.
"""

from __future__ import annotations

import time
import types
from typing import Any

from benchmarks._timing import Case
from benchmarks._timing import measure

__all__ = ["PURE_ROW", "SUBSCRIBER_COUNTS", "TARGETS", "run"]

SUBSCRIBER_COUNTS = (0, 1, 10)

#: the row of the hand-inlined eventbus.record that the bound method replaced
PURE_ROW = "eventbus record(), pure-Python path"

#: the dispatch targets (the raised ones of PERFORMANCE.md, the snapshot of data included):
#: (what, eventbus row, its count, peer row, peer count, limit on eventbus / peer)
TARGETS = [
    ("record() at 0 subscribers <= 2x a direct call", "eventbus record()", 0,
     "direct call", 0, 2.0),
    ("record() at 1 subscriber <= 0.4x blinker send", "eventbus record()", 1,
     "blinker Signal.send", 1, 0.4),
    ("record() at 10 subscribers <= 0.8x psygnal emit_fast", "eventbus record()", 10,
     "psygnal emit_fast", 10, 0.8),
    ("record() at 1 subscriber >= 20x faster than torch record()", "eventbus record()", 1,
     "torch events.record()", 0, 1 / 20),
]

#: what the interpreter charges for ``bus.record(EventType.WORKER_EXIT, **fields)`` before
#: any eventbus code runs: the enum attribute read, and the cheapest call that takes those
#: arguments (a function binding them to its parameters: no dict is built, as a compiled
#: callee builds none). The floor of a target at 1 or 10 subscribers adds the delivery, the
#: "direct call" row at that count.
FLOOR_STEPS = ("EventType.WORKER_EXIT lookup", "call binding the arguments")
#: what any event that is a snapshot costs on top, however it is built: a new object with
#: its attributes, the read-only copy of ``data`` (a dict subclass) and a timestamp; the
#: second floor adds it
SNAPSHOT_STEP = "bare snapshot event (object, read-only data copy, timestamp)"


def _noop_event(event: Any) -> None:
    pass


def _noop_kwargs(worker_id: int, exit_code: int, data: dict[str, Any]) -> None:
    pass


def _noop_blinker(sender: Any, **kwargs: Any) -> None:
    pass


def _cases() -> dict[tuple[str, int], Case]:
    import blinker
    import psygnal
    import pyee
    from torch.distributed.elastic.events import api as torch_event_api
    from torch.distributed.elastic.events import record as torch_record

    import eventbus
    from eventbus import EventType

    data = {"epoch": 10, "loss": 0.01}
    payload = "worker_id=0, exit_code=0, data=d"
    cases: dict[tuple[str, int], Case] = {}

    def add(row: str, subs: int, stmt: str, **namespace: Any) -> None:
        cases[(row, subs)] = Case(f"{row} [{subs}]", stmt, {"d": data, **namespace})

    for n in SUBSCRIBER_COUNTS:
        # the limit: the receivers called directly, in a loop once there are several
        handlers = tuple(_make_noop(_noop_kwargs) for _ in range(max(n, 1)))
        if n <= 1:
            add("direct call", n, f"h({payload})", h=handlers[0])
        else:
            add("direct call", n, f"for h in hs: h({payload})", hs=handlers)

        bus = eventbus.Bus(f"bench{n}")
        for _ in range(n):
            bus.subscribe(EventType.WORKER_EXIT, on_event=_make_noop(_noop_event))
        add("eventbus record()", n, f"bus.record(EventType.WORKER_EXIT, {payload})",
            bus=bus, EventType=EventType)
        add("eventbus record(), hoisted type", n, f"bus.record(W, {payload})",
            bus=bus, W=EventType.WORKER_EXIT)
        # The same bus's record() without the compiled path (eventbus/_speedups.c): what
        # an install without a C compiler, or EVENTBUS_PURE_PYTHON=1, runs.
        pure = eventbus.Bus(f"bench{n}-pure")
        pure.record = types.MethodType(eventbus.Bus.record, pure)  # type: ignore[method-assign]
        for _ in range(n):
            pure.subscribe(EventType.WORKER_EXIT, on_event=_make_noop(_noop_event))
        add(PURE_ROW, n, f"bus.record(EventType.WORKER_EXIT, {payload})",
            bus=pure, EventType=EventType)

        signal = blinker.Signal()
        for _ in range(n):
            signal.connect(_make_noop(_noop_blinker), weak=False)
        add("blinker Signal.send", n, f"signal.send(None, {payload})", signal=signal)

        class Emitter:
            worker_exit = psygnal.Signal(int, int, dict)

        emitter = Emitter()
        for _ in range(n):
            emitter.worker_exit.connect(_make_noop(_noop_kwargs))
        add("psygnal emit_fast", n, "sig.emit_fast(0, 0, d)", sig=emitter.worker_exit)
        add("psygnal emit", n, "sig.emit(0, 0, d)", sig=emitter.worker_exit)

        ee = pyee.EventEmitter()
        for _ in range(n):
            ee.on("worker_exit", _make_noop(_noop_kwargs))
        add("pyee emit", n, f"ee.emit('worker_exit', {payload})", ee=ee)

    # The default bus through the module-level function, nobody subscribed (the usual
    # state of a worker without the launcher).
    add("eventbus.record(), default bus", 0,
        f"record(EventType.WORKER_EXIT, {payload})",
        record=eventbus.record, EventType=EventType)
    add("torch events.record()", 0,
        "record(Event(name='WORKER_EXIT', source=WORKER, "
        "metadata={'worker_id': 0, 'exit_code': 0, **d}), 'null')",
        record=torch_record, Event=torch_event_api.Event,
        WORKER=torch_event_api.EventSource.WORKER)
    return cases


def _make_noop(template: Any) -> Any:
    """A distinct copy of a no-op receiver: real subscribers are distinct functions, and
    some libraries de-duplicate connections of the same callable."""
    return types.FunctionType(template.__code__, template.__globals__, template.__name__)


def _breakdown_cases() -> list[Case]:
    """Where a record() at one subscriber spends its time, step by step."""
    import eventbus
    from eventbus import EventType
    from eventbus import WorkerExit
    from eventbus.events import Event

    def collect(event_type: Any, /, **fields: Any) -> None:
        pass

    def take(event_type: Any, /, worker_id: int, exit_code: int, data: Any) -> None:
        pass

    WorkerExit(worker_id=0, exit_code=0)  # its code is generated on first use: now

    ns = {"d": {"epoch": 10, "loss": 0.01}, "EventType": EventType,
          "W": EventType.WORKER_EXIT, "collect": collect, "take": take,
          "check": WorkerExit._check,
          "build": WorkerExit._build, "eventbus": eventbus,
          # the parts of any snapshot event, with nothing of eventbus's around them
          "new": object.__new__, "cls": WorkerExit, "now": time.time,
          "frozen": type(WorkerExit(worker_id=0, exit_code=0, data={}).data),
          "set_dict": Event.__dict__["__dict__"].__set__,
          }
    return [
        Case("empty statement (timing loop)", "pass", ns),
        Case("EventType.WORKER_EXIT lookup", "EventType.WORKER_EXIT", ns),
        Case("call binding the arguments", "take(W, worker_id=0, exit_code=0, data=d)", ns),
        Case("call collecting **fields", "collect(W, worker_id=0, exit_code=0, data=d)", ns),
        Case("dict of the fields", "{'worker_id': 0, 'exit_code': 0, 'data': d}", ns),
        Case("validate (dict + _check)", "check({'worker_id': 0, 'exit_code': 0, 'data': d})",
             ns),
        Case("validate + build (dict + _build)",
             "build({'worker_id': 0, 'exit_code': 0, 'data': d})", ns),
        Case(SNAPSHOT_STEP, "x = new(cls); set_dict(x, {'worker_id': 0, 'exit_code': 0, "
                            "'data': frozen(d), 'timestamp': now()})", ns),
    ]


def cuda_check(*, quick: bool = False) -> dict[str, Any]:
    """Does recording a CUDA tensor synchronise the device? (issue 14)

    Queue a long burst of GPU work, then time ``record()`` of a CUDA tensor while the GPU
    is still busy: a synchronising ``record()`` would wait for the whole burst, a snapshot
    that only queues a device copy returns in microseconds. Also the wall time of a loop
    of GPU work with and without a ``record()`` per step. Without a GPU: not measured.
    """
    try:
        import torch
    except ImportError:
        return {"measured": False, "why": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"measured": False, "why": "no CUDA device on this machine"}
    import time

    import eventbus
    from eventbus import EventType

    bus = eventbus.Bus("bench-cuda")
    bus.subscribe(EventType.METRIC, on_event=lambda event: None)
    x = torch.randn(2048, 2048, device="cuda")
    acc = torch.zeros(1024, device="cuda")
    burst = 5 if quick else 40

    def busy() -> None:
        for _ in range(burst):
            x.matmul(x)

    torch.cuda.synchronize()
    t = time.perf_counter()
    busy()
    torch.cuda.synchronize()
    burst_s = time.perf_counter() - t
    busy()
    t = time.perf_counter()
    bus.record(EventType.METRIC, step=0, data={"acc": acc})
    record_s = time.perf_counter() - t
    torch.cuda.synchronize()

    def loop(with_record: bool) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(burst):
            x.matmul(x)
            acc.add_(1)
            if with_record:
                bus.record(EventType.METRIC, step=i, data={"acc": acc})
        torch.cuda.synchronize()
        return time.perf_counter() - t

    loop(True)
    plain = min(loop(False) for _ in range(3))
    recorded = min(loop(True) for _ in range(3))
    return {"measured": True, "device": torch.cuda.get_device_name(),
            "queued GPU work (ms)": burst_s * 1e3,
            "record() of a CUDA tensor while it runs (ms)": record_s * 1e3,
            "synchronised": record_s > burst_s / 2,
            "loop with record() / without": recorded / plain}


def run(*, quick: bool = False) -> dict[str, Any]:
    """Median ns per call of every peer at every subscriber count, and the target ratios."""
    # Many short rounds: on a shared machine a burst of noise then spoils a few samples
    # of every case rather than all samples of one.
    repeats = 3 if quick else 61
    target_s = 0.0005 if quick else 0.003
    cases = _cases()
    steps = _breakdown_cases()
    # One measurement: the floor's steps run in the same rounds as the rows they bound.
    ns = measure([*cases.values(), *steps], repeats=repeats, target_s=target_s)
    table: dict[str, dict[int, float]] = {}
    for (row, subs), case in cases.items():
        table.setdefault(row, {})[subs] = ns[case.name]
    breakdown = {case.name: ns[case.name] for case in steps}
    empty = breakdown["empty statement (timing loop)"]
    floor_ns = sum(breakdown[step] - empty for step in FLOOR_STEPS)
    snapshot_ns = floor_ns + breakdown[SNAPSHOT_STEP] - empty
    targets = []
    for what, row, subs, peer, peer_subs, limit in TARGETS:
        ratio = table[row][subs] / table[peer][peer_subs]
        delivery = table["direct call"][subs] if subs else 0.0
        floor = (floor_ns + delivery) / table[peer][peer_subs]
        # at 0 subscribers record() builds no event: the snapshot's floor is the first one
        snapshot = (snapshot_ns + delivery) / table[peer][peer_subs] if subs else floor
        targets.append({"target": what, "ratio": ratio, "limit": limit,
                        "met": ratio <= limit, "floor": floor, "floor_snapshot": snapshot})
    return {"ns": table, "targets": targets, "breakdown": breakdown, "repeats": repeats,
            "cuda": cuda_check(quick=quick)}
