"""What if the simulator's model of vLLM changed? Replays kept vLLM runs under one change and tallies them.

``benchmarks/sim_fidelity.py --keep DIR`` keeps a live run (its calibration rounds, the run, the run sent
again); ``--replay DIR ...`` fits and simulates them again and tallies them against issue 45's bar. This
script does the same with one change to the fitted model, so that an idea about what the simulator misses
can be tried on every kept run in a minute before it is built and measured live:

* ``--decode-spread-scale K``: the decode steps' spread (from the calibration waves' gaps) times K (0: none).
* ``--arrival-core-ms MS``: a request's front-end work takes MS ms of the engine's core from the steps (at most
  its fitted ``before_engine``), while the request still waits all of ``before_engine`` before the engine sees it.
  The host timeline (``benchmarks/host_timeline.py``) measured vLLM's API server spending about 1.5 ms of CPU
  per arrival, against 2.6-5.5 ms fitted as the front end's time before the engine.
* ``--step-scale K``: every decode step's line (its intercept, per-token and per-KV-token terms) times K.
* ``--step-scale-from run``: K = the run's measured mean ITL over the simulated one (twice, since K moves the
  simulated queue): an upper bound on what a better decode line could do, since it reads the run it predicts.
* ``--step-scale-from first-part``: K from the run's first part alone; the errors are then those of the other
  parts, against the same parts sent again. Whether a step scale measured under load carries to the rest of
  the run. ``--later-parts`` judges any change (none too) on those parts alone, for the comparison.

    .venv/bin/python benchmarks/sim_fidelity_whatif.py [change] --replay DIR [DIR ...]

The fit is the one ``sim_fidelity.py --engine vllm --front-end queue --where-the-run-lives`` makes; none of these
changes is in the simulator. Findings: benchmarks/RESULTS.md, "What the simulator would need to predict vLLM".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_fidelity  # noqa: E402  (benchmarks/ is not a package)

from course import metrics  # noqa: E402
from course.sim import ServerCost, simulate  # noqa: E402
from course.sim.frontend import FrontDoor  # noqa: E402
from course.trace import load_traces  # noqa: E402
from course.workload import from_traces  # noqa: E402

FIT = ["--engine", "vllm", "--front-end", "queue", "--where-the-run-lives"]


@dataclasses.dataclass(frozen=True)
class Change:
    """One change to the fitted model (none by default: the simulator as it is)."""

    decode_spread_scale: float = 1.0
    arrival_core: float | None = None  # seconds of the core an arrival's front-end work takes from the steps
    step_scale: float = 1.0

    def apply(self, cost: ServerCost) -> ServerCost:
        step = cost.step
        spread = tuple(max(q * self.decode_spread_scale, -1.0) for q in step.spread)
        k = self.step_scale
        return ServerCost(dataclasses.replace(step, a=step.a * k, c=step.c * k, d=step.d * k, spread=spread),
                          cost.front_end)  # fmt: skip


@contextlib.contextmanager
def arrival_core(seconds: float | None) -> Iterator[None]:
    """While inside: each arrival's front-end work takes ``seconds`` of the core from the steps (at most its
    ``before_engine``) instead of all of it; the request's wait for the front end is unchanged."""
    if seconds is None:
        yield
        return
    original = FrontDoor.stretch

    def stretch(door: FrontDoor, start: float, end: float, arrival_times) -> float:
        full = door.seconds  # the front door's work per request: only its stretch of the steps is changed
        door.seconds = min(seconds, full)
        try:
            return original(door, start, end, arrival_times)
        finally:
            door.seconds = full

    FrontDoor.stretch = stretch
    try:
        yield
    finally:
        FrontDoor.stretch = original


def simulated_run(folder: Path, change: Change) -> tuple[list, list]:
    """The kept run's measured traces and the changed model's simulated ones (as a client sees them)."""
    args = sim_fidelity.parse_args(["--replay", str(folder), *FIT])
    config = sim_fidelity.sim_config(args)
    with contextlib.redirect_stdout(io.StringIO()):
        rounds, measured, facts = sim_fidelity.replayed(folder, sim_fidelity.kept_rounds(folder))
    samples = sim_fidelity.merge_rounds(rounds)
    replay = from_traces(measured, name="the measured run")
    with arrival_core(change.arrival_core):
        cost, _ = sim_fidelity.run_cost(args, "queue", samples, facts, replay, config, change.apply)
        simulated = cost.delivered(simulate(replay, config, cost).traces)
    return measured, simulated


def judged(folder: Path, change: Change, scale_from: str | None, later_parts: bool = False) -> sim_fidelity.Verdict:
    """One kept run under ``change``, the step scale first read from the run (``scale_from``) where asked; judged
    on the parts after the first alone when ``later_parts`` (always with ``scale_from="first-part"``)."""
    measured, simulated = simulated_run(folder, change)
    later_parts = later_parts or scale_from == "first-part"
    first = len(load_traces(folder / "run_part1.json")) if later_parts else 0
    if scale_from is not None:
        read = first if scale_from == "first-part" else len(measured)
        scale = change.step_scale
        for _ in range(2):  # the scale moves the simulated queue, so once more from where it landed
            scale *= metrics.summarize(measured[:read]).itl["mean"] / metrics.summarize(simulated[:read]).itl["mean"]
            measured, simulated = simulated_run(folder, dataclasses.replace(change, step_scale=scale))
        print(
            f"  {folder}: decode steps x {scale:.3f} (from {'the first part' if read < len(measured) else 'the run'})"
        )
    again = [
        t for path in sorted(folder.glob("repeat_part*.json"))[1 if later_parts else 0 :] for t in load_traces(path)
    ]
    repeat = sim_fidelity.percentiles_ms(again) if again else None
    real, model = metrics.summarize(measured[first:]), metrics.summarize(simulated[first:])
    return sim_fidelity.verdict_of(str(folder), real, model, repeat)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replay", metavar="DIR", nargs="+", required=True, help="folders kept by sim_fidelity.py")
    parser.add_argument("--decode-spread-scale", type=float, default=1.0, metavar="K")
    parser.add_argument("--arrival-core-ms", type=float, metavar="MS")
    parser.add_argument("--step-scale", type=float, default=1.0, metavar="K")
    parser.add_argument("--step-scale-from", choices=("run", "first-part"))
    parser.add_argument("--later-parts", action="store_true", help="judge the parts after the first alone")
    args = parser.parse_args(argv)
    if args.decode_spread_scale < 0 or args.step_scale <= 0 or (args.arrival_core_ms or 0) < 0:
        parser.error("scales must be positive (the spread's may be 0) and --arrival-core-ms at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    change = Change(args.decode_spread_scale, None if args.arrival_core_ms is None else args.arrival_core_ms / 1e3,
                    args.step_scale)  # fmt: skip
    print(f"the fit of sim_fidelity.py {' '.join(FIT)}, changed: {change}"
          f"{f'; decode steps scaled from {args.step_scale_from}' if args.step_scale_from else ''}")  # fmt: skip
    verdicts = [judged(Path(folder), change, args.step_scale_from, args.later_parts) for folder in args.replay]
    sim_fidelity.print_tally(verdicts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
