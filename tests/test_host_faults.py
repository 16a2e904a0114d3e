"""The host-fault rule (eventbus_app/launcher/hosts/faults.py) as a table: each row a failure the
agent can see, and the kind it counts as against the host (None: the script's, or nobody's).

The rows that must stay None matter most: a false host fault evicts a healthy node and
marks it bad for every later job."""

from __future__ import annotations

import pytest

import eventbus
from eventbus.app.launcher.hosts import faults
from eventbus.app.launcher.hosts.faults import Failure
from eventbus.app.launcher.hosts.faults import host_fault

SEGFAULT_TRACE = "Signal 11 (SIGSEGV) received by PID 4242"
NCCL_SYSTEM = ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
               "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version "
               "2.21.5\nncclSystemError: System call (e.g. socket, malloc) or external library "
               "call failed or device error.\nLast error:\nNET/IB : Got completion from peer "
               "10.0.0.7<52810> with status=12 opcode=0 len=0 vendor err 129 (Recv)")
ECC = ("RuntimeError: CUDA error: uncorrectable ECC error encountered\nCUDA kernel errors "
       "might be asynchronously reported at some other API call")
XID = "RuntimeError: CUDA error: unspecified launch failure\nNVRM: Xid (PCI:0000:3b:00): 79"
CUDA_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 1; "
            "79.15 GiB total capacity)")
DEVICE_ASSERT = ("RuntimeError: CUDA error: device-side assert triggered\nCompile with "
                 "`TORCH_USE_CUDA_DSA` to enable device-side assertions.")
WATCHDOG = ("[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=812, "
            "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600042 "
            "milliseconds before timing out.")
VALUE_ERROR = 'Traceback (most recent call last):\n  File "train.py", line 9\nValueError: bad lr'

ROWS: list[tuple[str, Failure, str | None]] = [
    # signals the hardware or the kernel sends
    ("SIGSEGV", Failure(exit_code=-11, message=SEGFAULT_TRACE), "signal"),
    ("SIGBUS", Failure(exit_code=-7), "signal"),
    ("SIGILL", Failure(exit_code=-4), "signal"),
    ("SIGSEGV through a shell (139)", Failure(exit_code=139), "signal"),
    ("OOM killer's SIGKILL", Failure(exit_code=-9, oom_kills=1), "oom"),
    ("SIGKILL, no OOM kill seen (a person's kill -9)", Failure(exit_code=-9), None),
    ("SIGKILL the agent sent at a stop", Failure(exit_code=-9, by_agent=True, oom_kills=1),
     None),
    ("SIGTERM the agent sent", Failure(exit_code=-15, by_agent=True), None),
    ("SIGTERM from outside", Failure(exit_code=-15), None),
    ("SIGABRT (an abort: the script's or a library's)", Failure(exit_code=-6), None),
    # messages
    ("NCCL system error, NIC", Failure(exit_code=1, message=NCCL_SYSTEM), "nccl"),
    ("ECC", Failure(exit_code=1, message=ECC), "ecc"),
    ("a launch failure with an Xid", Failure(exit_code=1, message=XID), "cuda"),
    ("GPU fallen off the bus", Failure(exit_code=1, message="GPU has fallen off the bus"),
     "cuda"),
    ("NCCL error on a node whose failure came second", Failure(
        exit_code=1, message=NCCL_SYSTEM, first=False), None),
    ("an Xid next to a watchdog timeout", Failure(exit_code=1, message=WATCHDOG + "\n" + XID),
     "cuda"),
    # the script's
    ("a Python exception", Failure(exit_code=1, message=VALUE_ERROR), None),
    ("CUDA out of memory (torch.OutOfMemoryError)", Failure(exit_code=1, message=CUDA_OOM),
     None),
    ("a device-side assert", Failure(exit_code=1, message=DEVICE_ASSERT), None),
    ("a collective timeout: a victim", Failure(exit_code=1, message=WATCHDOG), None),
    ("exit 2, no message", Failure(exit_code=2), None),
    ("exit 0", Failure(exit_code=0), None),
    # stalls
    ("the culprit blocked on a lock", Failure(stalled=True, culprit=True,
                                              waiting_on="blocked"), "hang"),
    ("the culprit spinning", Failure(stalled=True, culprit=True, waiting_on="spinning"), "hang"),
    ("the culprit unresponsive", Failure(stalled=True, culprit=True,
                                         waiting_on="unresponsive"), "hang"),
    ("a victim waiting in a collective", Failure(stalled=True, waiting_on="collective"), None),
    ("a culprit inside a mismatched collective", Failure(
        stalled=True, culprit=True, waiting_on="collective"), None),
    ("a rank waiting for data", Failure(stalled=True, culprit=True, waiting_on="data"), None),
    ("a stall with no culprit named", Failure(stalled=True, waiting_on="blocked"), None),
    # stragglers
    ("slow twice", Failure(slow_streak=2), None),
    ("slow three times in a row", Failure(slow_streak=3), "straggler"),
    # a reactor's say-so wins
    ("a reactor's mark on a Python exception", Failure(
        exit_code=1, message=VALUE_ERROR, marked="reactor"), "reactor"),
    ("a reactor's mark naming a kind", Failure(exit_code=1, marked="ecc"), "ecc"),
]


@pytest.mark.parametrize(("failure", "kind"), [(f, k) for _, f, k in ROWS],
                         ids=[name for name, _, _ in ROWS])
def test_the_host_fault_table(failure: Failure, kind: str | None) -> None:
    assert host_fault(failure) == kind


def test_every_kind_has_a_row() -> None:
    assert {k for _, _, k in ROWS} - {None} == set(faults.KINDS)


def test_a_reactor_marks_the_event_it_was_given_once() -> None:
    event = eventbus.WorkerExit(worker_id=3, exit_code=1)
    other = eventbus.WorkerExit(worker_id=4, exit_code=1)
    faults.mark_host_fault(event)
    assert faults.take_mark(other) is None
    assert faults.take_mark(event) == "reactor"
    assert faults.take_mark(event) is None
    with pytest.raises(ValueError, match="kind must be one of signal, oom"):
        faults.mark_host_fault(event, "disk")


def test_the_reason_says_each_kind_with_its_count() -> None:
    assert faults.kinds_said({"signal": 2, "nccl": 1, "hang": 0}) == "2 signal, nccl"
