"""Deadlines for the trainer's collectives under FSDP: a rank that never arrives is named.

Design decision: FSDP's all-gathers and reduce-scatters run inside the model's hooks, too many
and too hidden to bracket one by one, and a stuck collective cannot be cancelled. So each
trainer process is always in one named phase of its step (`stall.COLLECTIVE_PHASES`: step plan,
train step, step end, weight push, checkpoint save), held as a fatal `collective` stage of its
own stall watch with the phase's deadline. Entering a phase also writes the rank's heartbeat
(`<output_dir>/ranks/rank<r>.json`: pid, host, phase, step). When a phase passes its deadline
the report reads every rank's heartbeat and process state: a rank that is dead, stopped
(SIGSTOP), or not in this phase of this step is named in `missing_ranks` with its stack when it
can still dump one, and the process exits at once (`STALL_EXIT_CODE`). A rank that died makes
the collective fail at once instead (gloo: connection reset); `raise_if_rank_missing` turns
that error into the same report. The process group's own timeout (`ddp_timeout`, set by the
config from `stall.process_group_timeout`) lies past every phase deadline, so the report
comes first on NCCL too.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from grpo_agent import stall
from grpo_agent.train import fsdp

EXIT_WAIT_S = 2.0

def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if fsdp.world_size() > 1 else 0


def role(of_rank: int | None = None) -> str:
    """The stall-watch role of a trainer rank: `trainer` for rank 0, `trainer-rank<r>` else."""
    r = rank() if of_rank is None else of_rank
    return "trainer" if r == 0 else f"trainer-rank{r}"


def rank_watch(config: Any, context=None) -> stall.StallWatch:
    """This trainer process's started stall watch (rank r > 0 reports to its own file)."""
    r = rank()
    name = stall.REPORT_NAME if r == 0 else f"stall_report-rank{r}.json"
    return stall.StallWatch(config, role(r), context=context, report_name=name).start()


def process_state(pid: int) -> str:
    """`running`, `stopped` (SIGSTOP or traced), `dead`, from this host's /proc."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "dead"
    except PermissionError:
        pass
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return "running"
    return {"T": "stopped", "t": "stopped", "Z": "dead", "X": "dead"}.get(fields[0], "running")


class RankPhases:
    """The collective phase this rank is in (a no-op with one process)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.world_size = fsdp.world_size()
        self.rank = rank()
        self.folder = Path(config.output_dir) / "ranks"
        self.current: tuple[str, dict[str, Any]] | None = None
        self._since = 0.0  # when this rank entered the current phase (monotonic)
        self._held = contextlib.ExitStack()

    def enter(self, phase: str, **detail: Any) -> None:
        """Leave the current phase and enter `phase` (its deadline starts now)."""
        if self.world_size == 1:
            return
        self._held.close()
        self.current, self._since = (phase, detail), time.monotonic()
        self._write_heartbeat(phase, detail)
        self._held.enter_context(stall.stage(
            "collective", stall.collective_deadline(self.config, phase), grace_s=0.0,
            report_extra=self.missing_report, phase=phase, rank=self.rank, **detail))

    @contextlib.contextmanager
    def during(self, phase: str, **detail: Any):
        """`phase` for the block, then back to the phase it interrupted."""
        before = self.current
        self.enter(phase, **detail)
        yield
        if before is not None:
            self.enter(before[0], **before[1])
        else:
            self.leave()

    def leave(self) -> None:
        self._held.close()
        self.current = None

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order (one small collective, under the current phase's
        deadline): how the ranks agree on an outcome only one of them saw (`sampler.recovery`)."""
        if self.world_size == 1:
            return [value]
        import torch.distributed as dist

        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def raise_if_rank_missing(self, error: BaseException) -> None:
        """For an error out of a collective phase: when another rank is dead or stopped (a
        collective then fails at once), write the stall report naming it and raise
        `StageStalled` from `error`. A rank merely elsewhere does not explain an error (this
        rank may have failed on its own while the others went ahead): the error stands."""
        watch = stall.active()
        if self.world_size == 1 or self.current is None or watch is None:
            return
        phase, detail = self.current
        for _ in range(int(EXIT_WAIT_S / 0.1)):  # a rank that just died may still be exiting
            report = self.missing_report(gone_only=True)
            if report["missing_ranks"]:
                break
            time.sleep(0.1)
        if not report["missing_ranks"]:
            return
        deadline = stall.collective_deadline(self.config, phase)
        watch.report_stall("collective", {"phase": phase, "rank": self.rank, **detail},
                           deadline, self._since, error=repr(error), **report)
        raise stall.StageStalled(
            f"STALL in the {watch.role}: collective phase {phase!r} failed because rank(s) "
            f"{report['missing_ranks']} left the run; see {watch.output_dir / watch.report_name}."
        ) from error

    # ------------------------------------------------------------------ heartbeats and report

    def _write_heartbeat(self, phase: str, detail: dict[str, Any]) -> None:
        beat = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                "phase": phase, **detail, "time": time.time()}
        with contextlib.suppress(OSError):
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"rank{self.rank}.json"
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(beat, default=str))
            tmp.replace(path)

    def rank_states(self) -> list[dict[str, Any]]:
        """Every other rank's last heartbeat, its process state and whether it is missing."""
        mine = self.current
        states = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            try:
                beat = json.loads((self.folder / f"rank{r}.json").read_text())
            except (OSError, ValueError):
                states.append({"rank": r, "state": "no heartbeat", "missing": True})
                continue
            here = beat.get("host") == socket.gethostname()
            state = process_state(int(beat["pid"])) if here else "on another host"
            at = (beat.get("phase"), {k: v for k, v in beat.items()
                                      if k not in ("rank", "pid", "host", "phase", "time")})
            beat.update(state=state, since_s=round(time.time() - beat.pop("time", time.time()), 1),
                        missing=state in ("dead", "stopped") or (mine is not None and at != mine))
            states.append(beat)
        return states

    def missing_report(self, gone_only: bool = False) -> dict[str, Any]:
        """What a collective stall report adds: the ranks, the missing ones (with `gone_only`,
        only the dead or stopped) and their stacks."""
        states = self.rank_states()
        missing = [s["rank"] for s in states
                   if s["missing"] and (not gone_only or s["state"] in ("dead", "stopped"))]
        watch = stall.active()
        live = {role(s["rank"]): int(s["pid"]) for s in states
                if s["rank"] in missing and s.get("state") == "running"}
        stacks = watch.stacks_of(live) if watch is not None and live else {}
        for s in states:
            if s["rank"] in missing and s.get("state") == "stopped":
                stacks[role(s["rank"])] = "(stopped: SIGSTOP or a debugger; it cannot dump its stack)"
        return {"ranks": states, "missing_ranks": missing, "missing_rank_stacks": stacks}
