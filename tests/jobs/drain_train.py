"""A DDP-style loop for the drain tests (tests/reliability/test_drain_jobs.py): gloo, a
small model, one ``all_reduce`` of the gradients per step.

Environment (all optional):

- ``DRAIN_MODE``: ``cooperate`` (default: ``should_stop()`` every step, then save and
  return); ``plain`` (never imports eventbus; its own SIGTERM handler writes
  ``sigterm_rank<R>`` with its ``time.time()`` and exits 0); ``ignore`` (rank DRAIN_RANK
  subscribes to PREEMPTING, writes ``heard_rank<R>`` and trains on; once its peer is gone
  it sleeps instead of ending: it never stops by itself); ``hang`` (rank DRAIN_RANK spins
  in Python after the ready step: its peers wait in the collective); ``crash`` (rank
  DRAIN_RANK exits 1 after the ready step; the others stop stepping and wait up to 3 s,
  also in their SIGTERM handler as the agent stops the group at once, for the peer's
  ``WORKER_EXIT`` to reach them, writing ``heard_rank<R>.json``); ``slow_restart``
  (``crash`` in attempt 0, and in attempt 1 every rank sleeps 60 s before it starts,
  writing ``restarted_rank<R>``); ``ckpt_crash`` (at step DRAIN_CKPT_AT rank 0 saves for
  DRAIN_SAVE_S and records ``CHECKPOINT_SAVED`` with ``duration_s``, writing
  ``ckpt_done`` with its time; DRAIN_CRASH_AFTER steps later rank DRAIN_RANK writes
  ``crash_rank<R>`` and exits 1); ``plain_segv`` (``plain``, but rank DRAIN_RANK dies of
  a real SIGSEGV in its SIGTERM handler: a host fault during the drain); ``own_usr1``
  (``cooperate``, and its own SIGUSR1 handler writes ``usr1_rank<R>`` and goes on);
- ``DRAIN_BLOCKER``: ``1``: the script also subscribes to PREEMPTING a subscriber that
  blocks for good and one that raises (they must cost nobody else anything);
- ``DRAIN_STEPS`` (default 100000), ``DRAIN_STEP_S`` (default 0.02 compute sleep a step);
- ``DRAIN_READY_AT`` (default 20): each rank writes ``ready_rank<R>`` after that step;
- ``DRAIN_SAVE_S`` (default 0.3): how long the checkpoint's save takes (a sleep before it);
- ``DRAIN_OUT``: the folder of the files above, of ``ckpt_rank<R>.pt`` (the model and the
  step) and ``stopped_rank<R>.json`` (the step it stopped at, the attempt, the step it
  resumed from); a rank that finds its checkpoint there resumes from its step.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    env = os.environ.get
    mode = env("DRAIN_MODE", "cooperate")
    steps, step_s = int(env("DRAIN_STEPS", "100000")), float(env("DRAIN_STEP_S", "0.02"))
    ready_at, save_s = int(env("DRAIN_READY_AT", "20")), float(env("DRAIN_SAVE_S", "0.3"))
    out = Path(env("DRAIN_OUT", "."))
    attempt = int(env("TORCHELASTIC_RESTART_COUNT", "0"))
    bad_rank = int(env("DRAIN_RANK", "1"))
    if mode == "slow_restart" and attempt == 1:
        Path(out, f"restarted_rank{env('RANK')}").write_text(str(time.time()))
        time.sleep(60)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt = out / f"ckpt_rank{rank}.pt"
    if mode in ("plain", "plain_segv"):
        def on_sigterm(signum: int, frame: object) -> None:
            (out / f"sigterm_rank{rank}").write_text(str(time.time()))
            if mode == "plain_segv" and rank == bad_rank:
                import ctypes

                ctypes.string_at(0)  # reads address 0: a real SIGSEGV, in the drain
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_sigterm)
        should_stop = None
    else:
        import eventbus
        import eventbus.preemption

        should_stop = eventbus.preemption.should_stop
        if mode == "own_usr1":  # the script's own SIGUSR1 handler, and should_stop()
            signal.signal(signal.SIGUSR1, lambda signum, frame: (
                out / f"usr1_rank{rank}").write_text(str(time.time())))
        if mode == "ignore" and rank == bad_rank:
            should_stop = None
            eventbus.get_default_bus().subscribe(
                eventbus.EventType.PREEMPTING,
                on_event=lambda e: (out / f"heard_rank{rank}").write_text(str(time.time())))
        if env("DRAIN_BLOCKER") == "1":
            def block(event: object) -> None:
                (out / f"blocked_rank{rank}").write_text(str(time.time()))
                time.sleep(3600)

            def boom(event: object) -> None:
                raise RuntimeError("a subscriber's bug")
            eventbus.get_default_bus().subscribe(eventbus.EventType.PREEMPTING, on_event=block)
            eventbus.get_default_bus().subscribe(eventbus.EventType.PREEMPTING, on_event=boom)
        heard: list[object] = []
        if mode in ("crash", "slow_restart"):
            eventbus.get_default_bus().subscribe(
                eventbus.EventType.WORKER_EXIT,
                on_event=lambda e: heard.append((time.time(), e)))

            def write_heard() -> None:
                deadline = time.monotonic() + 3
                while not heard and time.monotonic() < deadline:
                    time.sleep(0.01)
                if heard:
                    at, event = heard[0]
                    (out / f"heard_rank{rank}.json").write_text(json.dumps({
                        "time": at, "worker_id": event.worker_id,  # type: ignore[attr-defined]
                        "exit_code": event.exit_code,  # type: ignore[attr-defined]
                        "context_rank": event.context.rank,  # type: ignore[attr-defined]
                        "context_pid": event.context.pid}))  # type: ignore[attr-defined]

            def on_sigterm(signum: int, frame: object) -> None:
                # the agent stops the group at once after a failure: what was heard by then
                write_heard()
                sys.exit(0)
            signal.signal(signal.SIGTERM, on_sigterm)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.01)
    start = 0
    if ckpt.exists():
        saved = torch.load(ckpt)
        model.load_state_dict(saved["model"])
        start = int(saved["step"])
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    for step in range(start + 1, steps + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        grads = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])
        time.sleep(step_s)
        try:
            dist.all_reduce(grads)
        except RuntimeError:
            if not (mode == "ignore" and rank == bad_rank):
                raise
            while True:  # the peer is gone: this rank waits, and never stops by itself
                time.sleep(0.1)
        offset = 0
        for p in params:
            p.grad = grads[offset:offset + p.numel()].view_as(p) / dist.get_world_size()
            offset += p.numel()
        optimizer.step()
        if mode == "ckpt_crash":
            ckpt_at = int(env("DRAIN_CKPT_AT", "30"))
            if step == ckpt_at and rank == 0:
                began = time.time()
                time.sleep(save_s)
                torch.save({"model": model.state_dict(), "step": step}, ckpt)
                took = time.time() - began
                eventbus.record(eventbus.EventType.CHECKPOINT_SAVED, path=str(ckpt),
                                step=step, duration_s=took)
                (out / "ckpt_done").write_text(str(time.time()))
            if step == ckpt_at + int(env("DRAIN_CRASH_AFTER", "50")) and rank == bad_rank:
                (out / f"crash_rank{rank}").write_text(str(time.time()))
                sys.exit(1)
        if step == start + ready_at:
            (out / f"ready_rank{rank}").write_text(str(time.time()))
            if rank == bad_rank and mode == "hang":
                while True:
                    pass
            if mode in ("crash", "slow_restart") and attempt == 0:
                if rank == bad_rank:
                    (out / f"crash_rank{rank}").write_text(str(time.time()))
                    sys.exit(1)
                write_heard()
                return
        if should_stop is not None and should_stop(step=step):
            time.sleep(save_s)
            torch.save({"model": model.state_dict(), "step": step}, ckpt)
            (out / f"stopped_rank{rank}.json").write_text(json.dumps({
                "step": step, "resumed_from": start, "time": time.time(),
                "attempt": int(env("TORCHELASTIC_RESTART_COUNT", "0"))}))
            break
    else:
        (out / f"final_rank{rank}.json").write_text(json.dumps({"resumed_from": start,
                                                                "last": steps}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
