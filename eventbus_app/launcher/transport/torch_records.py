"""Torch's own records of the agent (torchelastic's ``events.record``), routed to the
agent's bus through the torchelastic bridge without doubling the lifecycle the agent
publishes itself."""

from __future__ import annotations

from eventbus.bus import ALL
from eventbus.bus import Bus
from eventbus.events import AgentExit
from eventbus.events import Event
from eventbus.events import Rendezvous
from eventbus.events import TorchelasticRecord
from eventbus.events import WorkerExit
from eventbus.events import WorkerStart
from eventbus.publishers.torchelastic import install_torchelastic_bridge
from eventbus.publishers.torchelastic import uninstall_torchelastic_bridge

__all__ = [
    "TORCH_RECORDS_DESTINATION",
    "TorchRecordsRelay",
    "route_torch_records",
    "unroute_torch_records",
]

#: the torchelastic events destination the agent's own torch records go to
TORCH_RECORDS_DESTINATION = "eventbus-agent"


class TorchRecordsRelay:
    """Torch's own records of this agent, bridged, -> the agent's bus, never doubling it.

    ``eventbus.publishers.install_torchelastic_bridge`` turns torch's records into typed events on a
    private bus; this relay republishes them on the agent's bus. The agent publishes the
    typed lifecycle itself, as it happens, so torch's records of the same moments
    (``torchelastic.worker.status.START``, the end-of-run ``SUCCEEDED``/``FAILED``/
    ``TERMINATED`` per worker, the ``RENDEZVOUS`` duration, the agent's ``FAILED``) become
    ``TORCHELASTIC`` events named as torch names them, with the bridge's typed reading in
    ``data``: nothing of torch's is lost and nothing is published twice as a typed event.
    """

    def __init__(self) -> None:
        self.target: Bus | None = None
        self.relayed = 0

    def __call__(self, event: Event) -> None:
        target = self.target
        if target is None:
            return
        if isinstance(event, _AGENT_OWNED):
            data = dict(event.data)
            name = str(data.pop("torchelastic_name", None) or event.type)
            data["bridged_as"] = str(event.type)
            for key, value in event.fields().items():
                if value is not None:
                    data.setdefault(key, value)
            event = TorchelasticRecord(name=name, source=str(data.get("source", "torchelastic")),
                                       data=data, timestamp=event.timestamp,
                                       context=event.context)
        self.relayed += 1
        target.publish(event)


_AGENT_OWNED = (WorkerStart, WorkerExit, Rendezvous, AgentExit)
_relay = TorchRecordsRelay()
_relay_bus = Bus("torchelastic-records")
_relay_bus.subscribe(ALL, on_event=_relay)


def route_torch_records(bus: Bus) -> str:
    """Install the torchelastic bridge for the agent's records; returns its destination."""
    install_torchelastic_bridge(TORCH_RECORDS_DESTINATION, bus=_relay_bus)
    _relay.target = bus
    return TORCH_RECORDS_DESTINATION


def unroute_torch_records() -> None:
    """Give torch its event registry back (launch_agent's last records included)."""
    uninstall_torchelastic_bridge(TORCH_RECORDS_DESTINATION)
    _relay.target = None
