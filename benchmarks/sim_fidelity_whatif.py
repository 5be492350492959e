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
* ``--step-scale-from each-part``: each part simulated on its own, with the K that puts its mean ITL on that part's:
  the machine's speed during each part (a part lasts seconds), read from the part itself. A bound on what a
  calibration that knew the speed of every stretch of the run could do; ``--scale-noise SIGMA`` multiplies each
  part's K by a log-normal factor (``exp`` of a normal draw of spread SIGMA, ``--seed``): how well such a
  calibration would have to know that speed.
* ``--rounds-beside-each-part``: no scale; each part simulated on its own with the model fitted to the two
  calibration rounds either side of it (the round before the part and the one after), not to all of them: what
  the calibration taken nearest each part knows of the machine's speed then.

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

import numpy as np

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


def simulated_run(
    folder: Path, change: Change, part: list | None = None, beside: int | None = None
) -> tuple[list, list]:
    """The kept run's measured traces and the changed model's simulated ones (as a client sees them); of ``part``
    alone (some of the run's traces: one of its parts) where given, with the model fitted where the whole run lives.
    ``beside``: fitted to the calibration rounds either side of the run's part of that number (1 for the first:
    the rounds before and after it) instead of all of them."""
    args = sim_fidelity.parse_args(["--replay", str(folder), *FIT])
    config = sim_fidelity.sim_config(args)
    with contextlib.redirect_stdout(io.StringIO()):
        rounds, measured, facts = sim_fidelity.replayed(folder, sim_fidelity.kept_rounds(folder))
    if beside is not None:
        rounds = rounds[beside - 1 : beside + 1]
    samples = sim_fidelity.merge_rounds(rounds)
    replay = from_traces(measured, name="the measured run")
    with arrival_core(change.arrival_core):
        cost, _ = sim_fidelity.run_cost(args, "queue", samples, facts, replay, config, change.apply)
        if part is not None:
            measured, replay = part, from_traces(part, name="one part of the measured run")
        simulated = cost.delivered(simulate(replay, config, cost).traces)
    return measured, simulated


def scaled_to(
    folder: Path, change: Change, part: list | None = None, read: int | None = None
) -> tuple[float, list, list]:
    """The step scale that puts the simulated mean ITL of the first ``read`` requests (all by default) on the
    measured one, of ``part`` where given (else of the whole run), found twice since the scale moves the simulated
    queue; with that scale's measured and simulated traces."""
    scale = change.step_scale
    measured, simulated = simulated_run(folder, change, part)
    read = read or len(measured)
    for _ in range(2):
        scale *= metrics.summarize(measured[:read]).itl["mean"] / metrics.summarize(simulated[:read]).itl["mean"]
        measured, simulated = simulated_run(folder, dataclasses.replace(change, step_scale=scale), part)
    return scale, measured, simulated


def each_part(
    folder: Path, change: Change, noise: float, rng: np.random.Generator, beside: bool = False
) -> tuple[list, list, list[float]]:
    """The run's parts, each simulated on its own with the step scale read from that part (:func:`scaled_to`) times
    ``exp`` of a normal draw of spread ``noise``: the measured traces and the simulated ones, part after part, and
    each part's scale. With ``beside``, each part is instead fitted to the two calibration rounds either side of it,
    unscaled (no scales): what a calibration taken at the part's time knows of the machine's speed then."""
    paths = sorted(folder.glob("run_part*.json"))
    rounds = sim_fidelity.kept_rounds(folder)
    if beside and len(paths) + 1 != rounds:
        raise SystemExit(f"{folder}: {len(paths)} parts between {rounds} calibration rounds; fitting each part to "
                         "the rounds beside it needs a round before and after every part")  # fmt: skip
    measured, simulated, scales = [], [], []
    for number, path in enumerate(paths, start=1):
        if beside:
            real, model = simulated_run(folder, change, load_traces(path), number)
            measured, simulated = measured + real, simulated + model
            continue
        scale, real, model = scaled_to(folder, change, load_traces(path))
        if noise > 0:
            scale *= float(np.exp(rng.normal(0.0, noise)))
            real, model = simulated_run(folder, dataclasses.replace(change, step_scale=scale), real)
        measured, simulated = measured + real, simulated + model
        scales.append(scale)
    if scales:
        said = ", ".join(f"{scale:.3f}" for scale in scales)
        print(f"  {folder}: decode steps x {said} (from each part{f', noise {noise:g}' if noise else ''})")
    return measured, simulated, scales


def judged(folder: Path, change: Change, scale_from: str | None, later_parts: bool = False, noise: float = 0.0,
           rng: np.random.Generator | None = None) -> sim_fidelity.Verdict:  # fmt: skip
    """One kept run under ``change``, the step scale first read from the run (``scale_from``: ``"run"``,
    ``"first-part"`` or ``"each-part"``, there with ``noise``, drawn from ``rng``) where asked, or each part fitted to
    the calibration rounds beside it (``"rounds-beside"``); judged on the parts after the first alone when
    ``later_parts`` (always with ``scale_from="first-part"``)."""
    later_parts = later_parts or scale_from == "first-part"
    first = len(load_traces(folder / "run_part1.json")) if later_parts else 0
    if scale_from in ("each-part", "rounds-beside"):
        rng = rng or np.random.default_rng(0)
        measured, simulated, _ = each_part(folder, change, noise, rng, beside=scale_from == "rounds-beside")
    elif scale_from is not None:
        scale, measured, simulated = scaled_to(folder, change, read=first or None)
        print(f"  {folder}: decode steps x {scale:.3f} (from {'the first part' if first else 'the run'})")
    else:
        measured, simulated = simulated_run(folder, change)
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
    parser.add_argument("--step-scale-from", choices=("run", "first-part", "each-part"))
    parser.add_argument("--rounds-beside-each-part", action="store_true",
                        help="each part fitted to the calibration rounds before and after it, not to all")  # fmt: skip
    parser.add_argument("--later-parts", action="store_true", help="judge the parts after the first alone")
    parser.add_argument(
        "--scale-noise",
        type=float,
        default=0.0,
        metavar="SIGMA",
        help="with --step-scale-from each-part: each part's scale times exp(normal(0, SIGMA))",
    )
    parser.add_argument("--seed", type=int, default=0, help="the --scale-noise draws")
    args = parser.parse_args(argv)
    if args.decode_spread_scale < 0 or args.step_scale <= 0 or (args.arrival_core_ms or 0) < 0:
        parser.error("scales must be positive (the spread's may be 0) and --arrival-core-ms at least 0")
    if args.scale_noise < 0 or (args.scale_noise and args.step_scale_from != "each-part"):
        parser.error("--scale-noise is a spread (at least 0) of the scale read from each part: "
                     "give it with --step-scale-from each-part")  # fmt: skip
    if args.rounds_beside_each_part and args.step_scale_from:
        parser.error("--rounds-beside-each-part fits each part without a scale; leave out --step-scale-from")
    if args.later_parts and (args.rounds_beside_each_part or args.step_scale_from == "each-part"):
        parser.error("each part simulated on its own is judged on the whole run; leave out --later-parts")
    if args.rounds_beside_each_part:
        args.step_scale_from = "rounds-beside"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    change = Change(args.decode_spread_scale, None if args.arrival_core_ms is None else args.arrival_core_ms / 1e3,
                    args.step_scale)  # fmt: skip
    how = {None: "", "rounds-beside": "; each part fitted to the calibration rounds beside it"}.get(
        args.step_scale_from, f"; decode steps scaled from {args.step_scale_from}"
    )
    print(f"the fit of sim_fidelity.py {' '.join(FIT)}, changed: {change}{how}")
    rng = np.random.default_rng(args.seed)
    verdicts = [judged(Path(folder), change, args.step_scale_from, args.later_parts, args.scale_noise, rng)
                for folder in args.replay]  # fmt: skip
    sim_fidelity.print_tally(verdicts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
