"""The job view at scale: ``/api/state``'s paging and compact rank entries, a job of 8,192
ranks (tests/ui_fixture.py: 12 heartbeats each, one rank stalled) served by the real
``eventbus view`` and drawn in headless Chromium, and a live one beating 8,192 heartbeats
a second with a page open (both slow).

The large job's timings (the state ready, ``/api/state``'s size and time, the page's time
to usable measured in the page with ``performance.now()``) are printed (``pytest -s``),
not asserted: only bounds generous enough for a loaded CI machine are.
docs/seeing-the-job.md ("A large job") describes what is checked here.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from eventbus.app.ui import UIServer
from eventbus.app.ui.ranks import COMPACT_ABOVE
from eventbus.app.ui.ranks import COMPACT_KEYS
from eventbus.app.ui.ranks import RANK_STATES
from eventbus.app.ui.server import STREAM_COST_FACTOR
from eventbus.app.ui.state import JobState
from eventbus.context import JobContext
from eventbus.events import Event
from eventbus.events import WorkerProgress
from eventbus.events import WorkerStalled
from eventbus.events import WorkerStart
from tests.browser import Chromium
from tests.browser import chromium_or_skip
from tests.test_ui import _get
from tests.test_ui import _start_view
from tests.test_ui import _stop
from tests.ui_fixture import LARGE_RANKS
from tests.ui_fixture import write_large_job

CONTRACT = ("rank", "state", "step", "last_event_age_s")
#: PERFORMANCE.md's bound on /api/state at 8,192 ranks
MAX_STATE_BYTES = 2_000_000
STALLED = 4242


def _event(kind: str, t: float, *, rank: int | None = None, **fields: Any) -> Event:
    return Event.from_dict({"type": kind, "timestamp": t, **fields, "data": {},
                            "context": {"rank": rank, "restart_count": 0, "group_rank": 0,
                                        "world_size": 300, "hostname": "h", "pid": 1}})


def _job(ranks: int) -> JobState:
    """``ranks`` ranks beating; rank 7 stalled, rank 8 slow, rank 9 failed."""
    state = JobState(live=False, clock=lambda: 1010.0)  # ages the same in every snapshot
    t = 1000.0
    state(_event("AGENT_START", t, max_restarts=1, nproc_per_node=8))
    for rank in range(ranks):
        state(_event("WORKER_START", t + 1, worker_id=rank, worker_pid=100 + rank))
    for rank in range(ranks):
        state(_event("WORKER_PROGRESS", t + 2, rank=rank, worker_id=rank, step=5,
                     collectives=10, idle_s=0.5))
    state(_event("WORKER_STALLED", t + 3, worker_id=7, silent_s=40.0, timeout_s=30.0))
    state(_event("WORKER_SLOW", t + 3, worker_id=8, factor=2.0, step=4))
    state(_event("WORKER_EXIT", t + 4, worker_id=9, exit_code=1, message="boom"))
    return state


def test_a_small_jobs_ranks_are_full_and_a_large_jobs_compact() -> None:
    """Up to COMPACT_ABOVE ranks every entry has every key (the page and the contract as
    before); above, the default entries are the contract's four keys plus the others
    that differ from their defaults, each the same value as in the full entry."""
    small = _job(COMPACT_ABOVE).snapshot()
    assert small["ranks_detail"] == "full" and small["ranks_total"] == COMPACT_ABOVE
    assert len(small["ranks"]) == COMPACT_ABOVE
    assert all("where" in r and "pid" in r for r in small["ranks"])
    state = _job(COMPACT_ABOVE + 44)
    snap = state.snapshot()
    full = state.snapshot(detail="full")
    assert snap["ranks_detail"] == "compact" and full["ranks_detail"] == "full"
    assert snap["ranks_total"] == snap["ranks_matched"] == COMPACT_ABOVE + 44
    assert snap["next_offset"] is None
    assert [r["rank"] for r in snap["ranks"]] == list(range(COMPACT_ABOVE + 44))
    assert snap["states"] == full["states"] and snap["states"]["stalled"] == 1
    for compact, whole in zip(snap["ranks"], full["ranks"], strict=True):
        assert set(CONTRACT) <= set(compact) <= set(CONTRACT) | set(COMPACT_KEYS)
        assert compact == {key: whole[key] for key in compact}
        for key in set(COMPACT_KEYS) - set(compact):
            assert whole[key] in (None, 0, False), (key, whole)
    assert snap["ranks"][7]["state"] == "stalled"
    assert snap["ranks"][9] == {**snap["ranks"][9], "state": "failed", "exit_code": 1}


def test_selection_and_pages_of_ranks() -> None:
    """``ranks`` ranges, ``states``, ``offset`` and ``limit``: the matching ranks in rank
    order, full entries, ranks_matched and next_offset; the counts are the whole job's."""
    state = _job(300)
    stalled = state.snapshot(states=["stalled"])
    assert [(r["rank"], r["state"]) for r in stalled["ranks"]] == [(7, "stalled")]
    assert stalled["ranks_detail"] == "full" and stalled["ranks"][0]["pid"] == 107
    assert stalled["ranks_matched"] == 1 and stalled["ranks_total"] == 300
    assert stalled["states"]["running"] == 297
    some = state.snapshot(ranks=[(20, 29), (25, 34), (299, 400), (5, 5)])
    assert [r["rank"] for r in some["ranks"]] == [5, *range(20, 35), 299]
    unhealthy = state.snapshot(ranks=[(0, 99)], states=["slow", "failed", "stalled"])
    assert [r["rank"] for r in unhealthy["ranks"]] == [7, 8, 9]
    first = state.snapshot(limit=128)
    assert [r["rank"] for r in first["ranks"]] == list(range(128))
    assert first["next_offset"] == 128 and first["ranks_matched"] == 300
    last = state.snapshot(offset=256, limit=128)
    assert [r["rank"] for r in last["ranks"]] == list(range(256, 300))
    assert last["next_offset"] is None
    assert state.snapshot(limit=0)["ranks"] == []
    assert state.snapshot(offset=1000)["ranks"] == []
    with pytest.raises(ValueError, match="detail"):
        state.snapshot(detail="some")


def test_api_state_pages_and_refuses_what_it_cannot_read() -> None:
    """The query parameters of /api/state (docs/seeing-the-job.md): the default is the
    shared snapshot, a selection a snapshot of its own; a bad value is a 400 naming it."""
    server = UIServer(_job(300), "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{server.port}/api/state"
    try:
        snap = json.loads(_get(base)[1])
        assert snap["ranks_detail"] == "compact" and len(snap["ranks"]) == 300
        assert "recent" not in json.loads(_get(base + "?state=stalled")[1])
        found = json.loads(_get(base + "?ranks=7,100-101&state=stalled,running")[1])
        assert [r["rank"] for r in found["ranks"]] == [7, 100, 101]
        assert found["ranks_detail"] == "full"
        paged = json.loads(_get(base + "?offset=290&limit=5&detail=compact")[1])
        assert [r["rank"] for r in paged["ranks"]] == list(range(290, 295))
        assert paged["next_offset"] == 295 and paged["ranks_detail"] == "compact"
        whole = json.loads(_get(base + "?ranks=all")[1])
        assert whole["ranks_detail"] == "full" and len(whole["ranks"]) == 300
        for query in ("ranks=x", "ranks=9-3", "ranks=,", "state=asleep", "offset=-1",
                      "limit=1e3", "detail=all", "ranks=" + ",".join(["1"] * 1100)):
            status, body, _ = _get(f"{base}?{query}")
            assert status == 400 and body.startswith(b"eventbus job view: "), (query, body)
        assert _get(base + "?recent=3")[0] == 200
    finally:
        server.close(timeout=1.0)
    assert set(RANK_STATES) >= {"running", "stalled"}


# -- 8,192 ranks --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def large_view(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, float]]:
    """``eventbus view`` of the 8,192-rank job's file: its address, and how long after
    its start the address came (the file read and folded, the state ready)."""
    path = tmp_path_factory.mktemp("large") / "large.jsonl"
    began = time.monotonic()
    written = write_large_job(path, time.time(), stalled=STALLED)
    print(f"\n[8,192 ranks] {written} events written in {time.monotonic() - began:.2f} s "
          f"({path.stat().st_size / 1e6:.1f} MB)")
    began = time.monotonic()
    proc, url = _start_view(path)
    ready = time.monotonic() - began
    print(f"[8,192 ranks] eventbus view: the state ready (address printed) after {ready:.2f} s")
    try:
        yield url, ready
    finally:
        assert _stop(proc) == 0


@pytest.mark.slow  # an 8,192-rank file written and read: ~10 s on 2 loaded cores
def test_api_state_of_8192_ranks_is_compact_and_pages(large_view: tuple[str, float]) -> None:
    """The default /api/state lists every rank (the contract) within 2 MB; the stalled
    rank is found by ?state=stalled with its whole entry; pages add up to the job."""
    url, _ = large_view
    times = []
    for _ in range(3):
        began = time.monotonic()
        status, body, headers = _get(url + "api/state")
        times.append(time.monotonic() - began)
        assert status == 200 and headers["Content-Type"] == "application/json"
    snap = json.loads(body)
    print(f"[8,192 ranks] /api/state: {len(body):,} bytes, served in "
          f"{', '.join(f'{t * 1000:.0f}' for t in times)} ms")
    assert len(body) <= MAX_STATE_BYTES
    assert snap["ranks_total"] == LARGE_RANKS and snap["ranks_detail"] == "compact"
    assert [r["rank"] for r in snap["ranks"]] == list(range(LARGE_RANKS))
    assert all(set(CONTRACT) <= set(r) for r in snap["ranks"])
    assert snap["states"]["stalled"] == 1 and snap["states"]["running"] == LARGE_RANKS - 1
    assert snap["ranks"][STALLED]["state"] == "stalled"
    assert snap["events"] == LARGE_RANKS * 13 - 6 + 2
    began = time.monotonic()
    stalled = json.loads(_get(url + "api/state?state=stalled")[1])
    print(f"[8,192 ranks] /api/state?state=stalled in "
          f"{(time.monotonic() - began) * 1000:.0f} ms")
    assert [(r["rank"], r["host"]) for r in stalled["ranks"]] == [(STALLED, "node-530")]
    assert stalled["ranks"][0]["where"] == "train.py:64 in sync_grads"
    seen: list[int] = []
    offset: int | None = 0
    while offset is not None:
        page = json.loads(_get(f"{url}api/state?offset={offset}&limit=3000")[1])
        assert page["ranks_matched"] == LARGE_RANKS
        seen.extend(r["rank"] for r in page["ranks"])
        offset = page["next_offset"]
    assert seen == list(range(LARGE_RANKS))


#: in the page: when it drew its ranks and how many grid cells and tiles it has
_DRAWN_JS = """JSON.stringify({
  drawn: (performance.getEntriesByName('eventbus:ranks-drawn')[0] || {}).startTime,
  cells: document.querySelectorAll('#grid-window [data-rank]').length,
  tiles: document.querySelectorAll('#attention [data-rank]').length,
  stalled: Array.from(document.querySelectorAll('[data-state="stalled"]'))
    .map(e => e.dataset.rank),
  elements: document.getElementsByTagName('*').length})"""

#: set the rank filter to `%s` and say how long the page took and what the grid shows
_FILTER_JS = """(() => {
  const began = performance.now();
  const input = document.getElementById('rank-filter');
  input.value = %s;
  input.dispatchEvent(new Event('input'));
  const cells = Array.from(document.querySelectorAll('#grid-window [data-rank]'));
  return JSON.stringify({ms: performance.now() - began,
                         ranks: cells.map(e => [e.dataset.rank, e.dataset.state])});
})()"""


@pytest.mark.slow  # an 8,192-rank file written and read, and Chromium: ~15 s
def test_browser_draws_8192_ranks_and_finds_the_stalled_one(
        large_view: tuple[str, float]) -> None:
    """In headless Chromium the page draws the grid (only its rows in view have
    elements), the stalled rank is an element with data-state="stalled" without any
    scrolling, and the rank filter narrows the grid. The time to usable is measured in
    the page and printed; the bound asserted (20 s) is for a loaded CI machine."""
    browser_path = chromium_or_skip()
    url, ready = large_view
    with Chromium(browser_path, width=1400, height=900) as browser:
        began = time.monotonic()
        browser.goto(url)
        browser.wait_for("document.querySelector('[data-state=\"stalled\"]') !== null && "
                         "document.querySelectorAll('#grid-window [data-rank]').length > 0",
                         timeout=20)
        wall = time.monotonic() - began
        drawn = json.loads(browser.evaluate(_DRAWN_JS))
        print(f"[8,192 ranks] page usable {drawn['drawn']:.0f} ms after navigation start "
              f"(in-page performance.now(); {wall:.2f} s wall from the test), "
              f"{drawn['cells']} grid cells, {drawn['elements']} elements in all")
        assert drawn["stalled"][0] == str(STALLED)
        assert drawn["tiles"] == 1
        assert 0 < drawn["cells"] < 2000  # the rows in view, not 8,192
        assert browser.evaluate("document.body.dataset.ranks") == "grid"
        assert browser.evaluate("document.getElementById('world').textContent") == "8192"
        found = json.loads(browser.evaluate(_FILTER_JS % json.dumps("4240-4244")))
        print(f"[8,192 ranks] the rank filter answered in {found['ms']:.1f} ms")
        assert found["ranks"] == [["4240", "running"], ["4241", "running"],
                                  ["4242", "stalled"], ["4243", "running"],
                                  ["4244", "running"]]
        found = json.loads(browser.evaluate(_FILTER_JS % json.dumps("stalled")))
        assert found["ranks"] == [[str(STALLED), "stalled"]]
        found = json.loads(browser.evaluate(_FILTER_JS % json.dumps("")))
        assert len(found["ranks"]) == drawn["cells"]
        # scrolled to the end, the grid draws the last ranks
        browser.evaluate("document.getElementById('rank-grid').scrollTop = 1e9; 1")
        browser.wait_for("document.querySelector('#grid-window [data-rank=\"8191\"]') "
                         "!== null", timeout=10)
    print(f"[8,192 ranks] summary: state ready {ready:.2f} s, page usable "
          f"{drawn['drawn'] / 1000:.2f} s after navigation")


# -- 8,192 heartbeats a second, live --------------------------------------------------------


@pytest.mark.slow  # 8 s of heartbeats with a page open: ~15 s
def test_a_live_job_of_8192_ranks_beating_once_a_second_with_a_page_open() -> None:
    """A JobState fed as the agent of group rank 0 feeds it (the bus's append) with 8,192
    heartbeats a second, served with a page open in Chromium: every heartbeat is folded,
    none overflows, the page keeps getting new states and keeps the stalled rank. The
    view's share of a core, its rebuild pace and the page's answers are printed."""
    browser_path = chromium_or_skip()
    now = time.time()
    state = JobState(live=True)
    app = state._eventbus_direct()
    agents = [JobContext(group_rank=n, world_size=LARGE_RANKS, hostname=f"node-{n}",
                         pid=900 + n, restart_count=0) for n in range(LARGE_RANKS // 8)]
    for rank in range(LARGE_RANKS):
        app(WorkerStart(worker_id=rank, worker_pid=10_000 + rank, timestamp=now, data={},
                        context=agents[rank // 8]))
    app(WorkerStalled(worker_id=STALLED, silent_s=40.0, timeout_s=30.0, timestamp=now,
                      data={}, context=agents[STALLED // 8]))
    beats = [[WorkerProgress(worker_id=rank, step=10 * n, collectives=100 + n, idle_s=0.1,
                             timestamp=now, data={"where": "train.py:64"},
                             context=JobContext(rank=rank, group_rank=rank // 8,
                                                world_size=LARGE_RANKS, restart_count=0,
                                                hostname=f"node-{rank // 8}",
                                                pid=10_000 + rank))
              for rank in range(LARGE_RANKS) if rank != STALLED] for n in range(2)]
    server = UIServer(state, "127.0.0.1", 0).start()
    stop = threading.Event()
    published = [0]

    def publish() -> None:  # a second's heartbeats in 8 slices, as they would arrive
        due = time.monotonic()
        for second in itertools.count():
            beat = beats[second % 2]
            for first in range(0, len(beat), 1024):
                for event in beat[first:first + 1024]:
                    app(event)
                published[0] += len(beat[first:first + 1024])
                due += 1 / 8
                if stop.wait(max(0.0, due - time.monotonic())):
                    return

    publisher = threading.Thread(target=publish, daemon=True)
    try:
        with Chromium(browser_path, width=1400, height=900) as browser:
            browser.goto(server.url())
            browser.wait_for("document.querySelector('[data-state=\"stalled\"]') !== null",
                             timeout=20)
            first = int(browser.evaluate("document.body.dataset.version"))
            cpu, began = time.process_time(), time.monotonic()
            publisher.start()
            answers = []
            while time.monotonic() - began < 8.0:
                asked = time.monotonic()
                browser.evaluate("1")
                answers.append(time.monotonic() - asked)
                time.sleep(0.2)
            stop.set()
            publisher.join(5)
            wall, cpu = time.monotonic() - began, time.process_time() - cpu
            browser.wait_for(f"Number(document.body.dataset.version) > {first}", timeout=10)
            assert browser.evaluate(
                "document.querySelector('[data-state=\"stalled\"]').dataset.rank") == "4242"
        state.fold()
        snap = state.snapshot()
        assert snap["events"] == LARGE_RANKS + 1 + published[0]
        assert "view_overflowed" not in snap["drops"] and "view_failed" not in snap["drops"]
        assert snap["states"]["stalled"] == 1
        every = max(server.poll_interval, STREAM_COST_FACTOR * server._snap_cost)
        median = sorted(answers)[len(answers) // 2]
        print(f"\n[8,192 ranks live] {published[0] / wall:,.0f} heartbeats/s for {wall:.1f} s: "
              f"this process {cpu / wall:.0%} of a core (the view's threads, the publisher's "
              f"appends, the test's own); the shared state rebuilt every >= {every:.2f} s "
              f"({server._snap_cost * 1000:.0f} ms of CPU); the page answered within "
              f"{max(answers) * 1000:.0f} ms (median {median * 1000:.0f})")
    finally:
        stop.set()
        server.close(timeout=1.0)


def test_a_ranks_row_names_only_the_summarys_attributes() -> None:
    """ui/ranks.py copies a rank's summary (ui/rank_book.py's) by attribute name: each it
    names exists, so a renamed attribute fails here, not in a snapshot."""
    from eventbus.app.ui.rank_book import Rank
    from eventbus.app.ui.ranks import ROW_FIELDS

    assert set(ROW_FIELDS) <= set(Rank.__slots__)
