"""The Markdown report: machine, versions, one table per area, the target ratios."""

from __future__ import annotations

from typing import Any

__all__ = ["render"]

_ME = "eventbus record()"


def _ns(value: float) -> str:
    return f"{value:,.0f}"


def _floor(target: dict[str, Any], key: str) -> str:
    if key not in target:
        return ""
    value = target[key]
    return f"{value:.3f}" + (" (over the limit)" if value > target["limit"] else "")


def _num(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _dispatch(result: dict[str, Any]) -> list[str]:
    from benchmarks.bench_dispatch import SUBSCRIBER_COUNTS

    table: dict[str, dict[int, float]] = result["ns"]
    counts = list(SUBSCRIBER_COUNTS)
    out = ["## Dispatch: ns per call",
           "",
           f"Median of {result['repeats']} interleaved rounds; every receiver is a no-op of "
           "the matching signature. `eventbus record()` is `bus.record(EventType.WORKER_EXIT, "
           "worker_id=0, exit_code=0, data=d)` as users write it; `hoisted type` takes the "
           "member from a local name instead (on Python 3.11 the `EventType.WORKER_EXIT` "
           "lookup alone costs about two direct calls: `enum.EnumType.__getattr__` sends "
           "every attribute read on an enum class through a slow hook; 3.12 dropped it). "
           "torch's `record()` has no subscribers. `eventbus.record(), default bus` is "
           "the default bus's `record`. Every `eventbus` row runs the compiled path "
           "(eventbus/_speedups.c) where it is built, except `pure-Python path`: the same "
           "`record()` on a bus set back to the Python method, what an install without a "
           "C compiler (or `EVENTBUS_PURE_PYTHON=1`) runs.",
           ""]
    rows = []
    for name, by_count in table.items():
        rows.append([name, *(_ns(by_count[c]) if c in by_count else "" for c in counts)])
    out += _table(["path", *(f"{c} subs" for c in counts)], rows)
    out += ["", "### Ratios: `record()` / peer, same run (below 1: `record()` is faster)", "",
            "torch's `record()` has no subscribers: `record()` at each count is compared "
            "with its one figure.", ""]
    mine = table[_ME]
    rows = []
    for name, by_count in table.items():
        if name.startswith("eventbus"):
            continue
        single = by_count.get(0) if len(by_count) == 1 else None
        cells = []
        for c in counts:
            peer = by_count.get(c, single)
            cells.append(f"{mine[c] / peer:.2f}" if peer else "")
        rows.append([name, *cells])
    out += _table(["peer", *(f"{c} subs" for c in counts)], rows)
    out += ["", "### Targets", "",
            "`floor` is the ratio that `bus.record(EventType.WORKER_EXIT, worker_id=0, "
            "exit_code=0, data=d)` could reach if eventbus cost nothing at all: the "
            "interpreter's own cost of the call as written (the enum attribute read and "
            "the cheapest call taking those arguments, a function binding them to its "
            "parameters; timed in the same rounds) plus the peer's delivery "
            "(the direct call row at that count), over the peer. A target below its floor "
            "cannot be met on this interpreter; the ratio is stated either way. "
            "`floor with a snapshot` adds what any event that is a snapshot costs, however "
            "it is built: a new object with its attributes, the read-only copy of `data` "
            "and a timestamp (the "
            "last step of the breakdown below); at 0 subscribers `record()` builds no event "
            "and both floors are one.", ""]
    out += _table(["target", "ratio", "limit", "met", "floor (interpreter)",
                   "floor with a snapshot"],
                  [[t["target"], f"{t['ratio']:.3f}", f"{t['limit']:.2f}",
                    "yes" if t["met"] else "**no**",
                    _floor(t, "floor"), _floor(t, "floor_snapshot")]
                   for t in result["targets"]])
    cuda = result.get("cuda")
    if cuda is not None:
        out += ["", "### CUDA: does recording a CUDA tensor synchronise?", ""]
        if cuda.get("measured"):
            out += _table(["figure", "value"],
                          [[k, _num(v)] for k, v in cuda.items() if k != "measured"])
        else:
            out += [f"Not measured in this run: {cuda.get('why')}. The snapshot of a CUDA "
                    "tensor is a device copy by construction (eventbus/snapshot.py); run "
                    "`make bench` on a CUDA machine to time it."]
    out += ["", "### Where `record()` spends its time", "",
            "Each step timed on its own (ns per statement, timing loop included).", ""]
    out += _table(["step", "ns"], [[k, _ns(v)] for k, v in result["breakdown"].items()])
    return out


def _sinks(result: dict[str, Any]) -> list[str]:
    out = ["## Sinks: METRIC events per second, and the cost on the agent's thread", "",
           f"Median of {result['rounds']} rounds of {result['batch']:,} `METRIC` events "
           "(MLflow: a fifth as many) handed to the sink as the bus does, then flushed: "
           "`events/s` is what the backend sustains (local TensorBoard folder, OTLP/HTTP "
           "receiver on 127.0.0.1, MLflow file store), `enqueue ns/event` what `record()` "
           "and the agent's monitor thread pay per event, the backend's thread running "
           "alongside (see benchmarks/bench_sinks.py).", ""]
    rows = [[name, _num(row["events/s"]), _ns(row["enqueue ns/event"]),
             _num(int(row["dropped"]))] for name, row in result["rows"].items()]
    out += _table(["sink", "events/s", "enqueue ns/event", "dropped"], rows)
    return out


def _logging(result: dict[str, Any]) -> list[str]:
    out = ["## Logging: ns per event", "",
           f"Median of {result['repeats']} interleaved rounds, same format, both to "
           "`os.devnull`.", ""]
    rows = []
    for name, row in result["rows"].items():
        rows.append([name, _ns(row["ns"]), f"{row['vs plain line']:.2f}",
                     _ns(row["handler only"]) if "handler only" in row else "",
                     f"{row['handler only vs plain line']:.2f}"
                     if "handler only" in row else ""])
    out += _table(["path", "ns", "vs plain line", "handler only (ns)",
                   "handler only vs plain line"], rows)
    if result.get("targets"):
        out += ["", "### Targets", ""]
        out += _table(["target", "ratio", "limit", "met"],
                      [[t["target"], f"{t['ratio']:.3f}", f"{t['limit']:.2f}",
                        "yes" if t["met"] else "**no**"] for t in result["targets"]])
    return out


def _generic(result: dict[str, Any]) -> list[str]:
    out: list[str] = []
    rows = result.get("rows")
    if isinstance(rows, list) and rows and isinstance(rows[0], dict):
        header = list(rows[0])
        if len(header) <= 8:
            out += _table(header, [[_num(r.get(h, "")) for h in header] for r in rows])
        else:  # many figures per row: one line per figure reads better
            first = header[0]
            out += _table([first, *(_num(r[first]) for r in rows)],
                          [[h, *(_num(r.get(h, "")) for r in rows)] for h in header[1:]])
        out.append("")
    scalars = {k: v for k, v in result.items() if k != "rows"}
    if scalars:
        out += _table(["figure", "value"], [[k, _num(v)] for k, v in scalars.items()])
    return out


def _store(result: dict[str, Any]) -> list[str]:
    out = ["## Worker -> agent through a real TCPStore", "",
           "`benchmarks/bench_store.py`: one `eventbus run --standalone` job per producer "
           "count, each worker flooding `METRIC` events, then timing its own `record()` with "
           "and without the forwarder (see the module's docstring). The third row paces "
           "each worker at a steady rate instead of flooding; the fourth repeats the "
           "4-worker flood with each worker's heap frozen first (`gc.freeze()`): the "
           "difference is what the workers' full collections of torch's heap cost during a "
           "flood. The last holds the agent's receiver until every worker has pushed its "
           "whole flood into the store: its `events/s at agent` is what the agent's one "
           "thread receives with the machine to itself, where the flooding rows share it "
           "with the workers.", ""]
    targets = result.get("targets", [])
    out += _generic({k: v for k, v in result.items() if k != "targets"})
    if targets:
        out += ["", "### Targets", ""]
        out += _table(["target", "measured", "limit", "met"],
                      [[t["target"], _num(t["value"]), _num(t["limit"]),
                        "yes" if t["met"] else "**no**"] for t in targets])
    return out


def _ui(result: dict[str, Any]) -> list[str]:
    out = ["## The job view (`--ui`): the agent's cost per event", "",
           f"`benchmarks/bench_ui.py`: median of {result['rounds']} interleaved rounds of "
           f"{result['events per round']:,} pre-built events of a 64-rank job published on a "
           "private bus: a no-op subscriber alone (`--ui off`), plus the job view's state "
           "(`--ui on`: the bus appends each event to its pending deque, its folder thread "
           "folds them), plus 50 pages reading the stream, and plus a queued sink for "
           "scale. `ns/event` is the publishing thread's CPU time, `wall ns/event` its wall "
           "time (the folder's and the pages' threads hold the interpreter part of it). The "
           "fold's own cost per event, on the view's thread, is stated below.", ""]
    return out + _generic(result)


def _import(result: dict[str, Any]) -> list[str]:
    out = ["## Import time", "",
           f"`benchmarks/bench_import.py`: median of {result['rounds']} fresh interpreters "
           "(`.pyc` warm), each timing `import blinker, attrs` and then `import eventbus, "
           "eventbus.publishers, eventbus.subscribers` on top in the same process. "
           "eventbus imports both, so their time is the floor (ratio 1). The table lists "
           "this project's costliest modules by self time (`-X importtime`, one more run).", ""]
    return out + _generic(result)


def _memory(result: dict[str, Any]) -> list[str]:
    out = ["## Memory: a sink that never drains", "",
           "One subprocess per size; `eventbus.subscribers.queued.QueuedSink` with its default "
           "bounds in front of a sink that blocks forever.", ""]
    out += _generic(result)
    return out


def _preemption(result: dict[str, Any]) -> list[str]:
    ab = result["ab"]
    out = ["## Preemption: `should_stop()` per step", "",
           "`benchmarks/bench_preemption.py`: `eventbus.preemption.should_stop()` (median of "
           f"{result['repeats']} interleaved rounds, CPU time of the thread) against the "
           f"median wall time of {result['steps']:,} single steps of a small DDP model "
           f"({result['step ms']:.3f} ms: a one-rank `gloo` process group, "
           "`DistributedDataParallel` of a 64-64-10 MLP, batch 32, forward, backward and "
           "SGD, one intra-op thread).", ""]
    out += _table(["case", "ns per call", "% of a step"],
                  [[r["case"], f"{r['ns']:,.1f}", f"{r['% of a step']:.4f}"]
                   for r in result["rows"]])
    verdict = "met" if result["met"] else "**not met**"
    out += ["", f"Target: `should_stop()` without a drain <= {result['target percent']:g}% "
            f"of a step; measured {result['percent']:.4f}%: {verdict}.", "",
            f"Step-loop A/B ({ab['rounds']} interleaved rounds of {ab['steps per round']:,} "
            f"steps each way): {ab['plain step ms']:.3f} ms per step without, "
            f"{ab['checked step ms']:.3f} ms with one `should_stop()` per step, ratio of "
            f"medians {ab['ratio']:.3f} (paired rounds p25..p75 {ab['paired p25']:.3f}.."
            f"{ab['paired p75']:.3f}). The step's own noise is far larger than the call, so "
            "the A/B can only show no visible difference; the per-call share above is the "
            "figure."]
    return out


def _scale(result: dict[str, Any]) -> list[str]:
    hour = result["hour"]
    out = ["## Scale: the agent of group rank 0 at 1,024 to 8,192 ranks", "",
           "`benchmarks/bench_scale.py` (docs/scale.md reads these figures): per size, one "
           "agent process with a real `TCPStore` master, the real store transport "
           "(`StoreTransport.after_rendezvous` as group rank 0: the worker receiver with its "
           "doorbell, the job receiver polling one queue per other node with pipelined pops), a "
           "real bus with the "
           "job view's `JobState` (folder thread running) and the health watches' observer "
           "subscribed, and a simulator process (`benchmarks/scale_job.py`) pushing what "
           "every other node's job forwarder (50 ms flush) and rank 0's own 8 workers (20 ms "
           "flush, doorbell) push: one `WORKER_PROGRESS` per rank per beat interval, spread "
           "over the interval, its `data` as the progress watch sends it (`pgs` listing the world "
           "group's members, `compute_s`, `wait_s`, `intervals`, `step_time_s`, `sources`), "
           "each push the real encoder's output (checked byte for byte). Measured over a "
           f"{result['window s']:g} s window ({result['bare window s']:g} s without the "
           f"member list) after a {result['warm-up s']:g} s warm-up, or less where the "
           f"agent fell more than {result['behind s']:g} s of beats behind (`stopped "
           "behind`: the store keeps that backlog in the agent's memory). `% of a core` "
           "is CPU time of the agent's threads by role "
           "(`/proc/self/task/<tid>/schedstat`): receiving is both receivers' threads and "
           "the doorbell's (decoding, validating, publishing, the subscribers' share "
           "included), folding the view's folder thread, store server the `TCPStore`'s own "
           "native thread. `us/beat` is that CPU per beat that reached "
           "the bus in the window, and `at the job's beat rate` what it comes to at one beat "
           "per rank per `beat interval s` (1 s up to 2,048 ranks, then ranks / 2,048 s, as "
           "the agent sets it for the job's size; once a second with the member list, as "
           "the workers beat before): where the agent fell behind (its threads given less "
           "than they need on the shared cores), that is the cost of keeping up. Latency "
           "is from the beat's timestamp to its arrival on the agent's bus, a beat not arrived "
           f"{result['late s']:g} s after the window counting as infinitely late. After "
           "the window, in the calling thread's CPU time (the collections it triggers "
           "included): the culprit verdict (`Judge.overdue` + `Judge.verdict` over a "
           "fresh stall watch holding every rank's decoded beat at a stall, one culprit on "
           "another node), the straggler check "
           "(`StragglerWatch.check` over the live watch; where the agent fell behind it "
           "knew only `ranks in the stall watch`), and `/api/state` "
           "(`dumps(state.snapshot())`). The simulator shares the cores with the agent.", ""]
    for title, key, growth in (
            ("Beats as the workers send them now: a group's members only when they change "
             "and every 30 s (measured with `ranks: []` in each beat)", "bare rows",
             "bare growth"),
            ("Beats as they were sent before: the world group's member list in each",
             "rows", "growth")):
        rows = result[key]
        out += [f"### {title}", ""]
        table = [{"ranks": f"{r['ranks']:,}", **{k: v for k, v in r.items()
                                                 if k not in ("ranks", "members", "diagnosis")}}
                 for r in rows]
        out += _generic({"rows": table})
        out += ["", f"The verdict at {rows[-1]['ranks']:,} ranks: \"{rows[-1]['diagnosis']}\"",
                "", "How each cost grows: `grows as ranks^` is the exponent of the power law "
                "fitted over the sizes where the figure is finite (1: linear, 2: quadratic).",
                ""]
        if result[growth]:
            header = list(result[growth][0])
            out += _table(header, [[_num(g.get(h, "")) for h in header]
                                   for g in result[growth]])
        out.append("")
    out += [f"### Memory over {hour['simulated s'] // 60} simulated minutes", "",
            f"{hour['ranks']} ranks (whole nodes spread over a {hour['world']:,}-rank job, the "
            "world group's member list in each beat) folded at accelerated time: each "
            "simulated second, every sampled node's push decoded by the real receiver "
            "(`StoreReceiver.handle_value`, no store), published on a bus with the job view "
            "and the watches (their clocks driven by the simulated time), and folded; "
            f"{hour['events']:,} events in {hour['cpu s']:.0f} s of CPU. Resident memory "
            "and the interpreter's allocated blocks after a full collection, every five "
            "simulated minutes.", ""]
    out += _generic({"rows": hour["readings"]})
    out += ["", "### Targets", "",
            "Receiving + folding is the larger of the measured share and the share at the "
            "job's beat rate.", ""]
    out += _table(["target", "measured", "limit", "met"],
                  [[t["target"], _num(t["value"]), _num(t["limit"]),
                    "yes" if t["met"] else "**no**"] for t in result["targets"]])
    calm = result.get("calibration: sum(range(1000)) us (idle core ~8-10)")
    if calm is not None:
        out += ["", f"Calibration before the hour: `sum(range(1000))` took {calm} us "
                "(~8-10 on an idle core of this class)."]
    load = result.get("load average (1 min) at the start and the end")
    if load:
        out += ["", f"Load average (1 min) of the machine at the start and the end of the "
                f"run: {load[0]:.2f} and {load[1]:.2f} (other processes share its cores: "
                "latency and falling behind move with them, CPU time per beat much less)."]
    return out


def _health(result: dict[str, Any]) -> list[str]:
    worker = result["worker"]
    first = result["first_record"]
    total, target = worker["total_ms_per_s"], worker["target_ms_per_s"]
    out = ["## Job health: what the watch costs a worker, and the agent", "",
           "`benchmarks/bench_health.py`. A worker's side is measured as CPU time, which "
           "wall-clock noise cannot hide: each thread's own, read from "
           "`/proc/self/task/<tid>/schedstat` inside rank 0 of the tight 2-rank gloo loop "
           f"(benchmarks/health_loop.py, ~{1e3 / worker['steps_per_s']:.1f} ms a step here, "
           "the worst case: the most collectives a second to sample) under `eventbus run "
           "--stall-timeout 60` with the progress watch on (all three sources), over "
           f"{worker['steps']:,} steps after a warm-up; medians of {worker['runs']} jobs.", ""]
    rows = [[name, f"{ms:.3f}"] for name, ms in worker["threads_ms_per_s"].items()]
    rows.append(["**eventbus's threads, in all**", f"**{total:.3f}**"])
    rows.append(["the worst job's sum", f"{worker['worst_total_ms_per_s']:.3f}"])
    rows.append(["the training thread, for scale", f"{worker['training_thread_ms_per_s']:.0f}"])
    out += _table(["thread", "ms of CPU per s of wall"], rows)
    verdict = "met" if worker["worst_total_ms_per_s"] <= target else "**not met**"
    out += ["", f"Target: <= {target:g} ms of CPU a second for eventbus's threads; "
            f"median {total:.2f}, worst job {worker['worst_total_ms_per_s']:.2f}: {verdict}. "
            f"The watch ticked {worker['ticks_per_s']:.1f} times a second and beat "
            f"{worker['beats_per_s']:.2f} times; the store forwarder woke "
            f"{worker['forwarder_wakeups_per_s']:.2f} times a second (once per heartbeat: "
            "it sleeps while its queue is empty).", "",
            "A worker whose script records before it imports torch (the bootstrap and a real "
            "TCPStore, nothing else):", ""]
    out += _table(["figure", "value"], [
        ["the first `record()`", f"{first['first_record_ms']:.2f} ms"],
        ["torch imported by it", _num(first["torch_imported_by_it"])],
        ["the script's own `import torch` after it (the wait spared)",
         f"{first['import_torch_ms']:,.0f} ms"],
        ["events pushed to the store", _num(first["pushed"])],
        [f"the forwarder's wake-ups over {first['idle_s']:g} s with nothing queued "
         "(target 0)", _num(first["idle_wakeups"])],
    ])
    out += ["", "The agent's side: `Bus.publish` of a stream of 8 ranks' `METRIC`s as the "
            "store receiver hands them over, with and without the stall and straggler "
            "watches; the monitor's checks; the culprit analysis of 64 simulated ranks.", ""]
    agent = [[name, _ns(ns)] for name, ns in result["agent_ns"].items()]
    agent.append(["agent cost per event (the difference)", _ns(result["per_event_ns"])])
    out += _table(["case", "ns"], agent)
    out += [""]
    out += _table(["figure", "value"], [
        [f"share of a core, {result['load']}", f"{result['core_share_8_workers'] * 100:.2f} %"],
        *[[f"culprit analysis, 64 ranks, {name}", f"{ms:.3f} ms"]
          for name, ms in result["culprit_ms"].items()],
    ])
    return out


def _recovery(result: dict[str, Any]) -> list[str]:
    out = ["## Recovery: from a failure to the next attempt's first step", "",
           "`benchmarks/bench_recovery.py`: benchmarks/recovery_job.py (2 gloo ranks, a DDP "
           "MLP, a checkpoint every 20 steps, 0.1 s a step; rank 1 of attempt 0 dies 6 s "
           "after the first step (late) or 1 s after it (early)) under torchrun with its "
           "store not shared and `eventbus run --max-restarts 1` (default options: warm "
           "spares on), and steps/s of benchmarks/health_loop.py over the 3,000 steps after "
           "its first step, all interleaved, "
           f"{result['rounds']} rounds each. Seconds from the crash to each mark of attempt "
           "1 on the script's own clock (the slower rank's), medians of the restarts that "
           "worked.", ""]
    return out + _generic({k: v for k, v in result.items() if k != "rounds"})


def render(results: dict[str, Any], *, machine: dict[str, str], versions: dict[str, str],
           when: str, quick: bool, seconds: dict[str, float]) -> str:
    """The whole report as Markdown."""
    out = ["# Benchmark results", ""]
    if quick:
        out += ["**Smoke run (`--quick`): tiny repeat counts, the figures mean nothing.**", ""]
    out += [f"Written by `make bench` (`python -m benchmarks`) on {when}, in "
            f"{sum(seconds.values()):.0f} s. All timings of one area come from one process "
            "with the cases interleaved round by round, timed in CPU time of the benchmark "
            "thread, and reported as medians; compare the ratios, not the absolute times, "
            "which move with the machine and its load.", ""]
    out += _table(["machine", ""], [[k, v] for k, v in machine.items()])
    out += [""]
    out += _table(["package", "version"], [[k, v] for k, v in versions.items()])
    sections = {"dispatch": _dispatch, "import": _import, "logging": _logging,
                "store": _store, "memory": _memory, "sinks": _sinks, "ui": _ui,
                "preemption": _preemption, "scale": _scale,
                "health": _health, "recovery": _recovery}
    for area, result in results.items():
        out.append("")
        out += sections[area](result)
    return "\n".join(out) + "\n"
