"""Record the calibration module 5 falls back on when a learner's runtime is too busy to calibrate.

Starts module 2's reference server in this process with the settings module 5 uses (the course's tiny model,
``max_batch_size=8, max_prefill_tokens=256``), runs ``course.capacity.calibrate`` in full mode with ``--rounds``
rounds of the notebook's microbenchmarks (merged as ``benchmarks/sim_fidelity.py`` merges its rounds: a machine
whose speed drifts is seen at its average) and the held-out run, until the held-out run's largest error is within
``--within`` (at most ``--tries`` times), and writes the samples and the held-out run to
``course/data/calibration_m5.json`` with a label that says where, when and how they were measured, and whether
the rounds agreed (the noise check). Module 5 refits and replays them (``course.capacity.load_calibration``) and
prints the label wherever it uses them. Run it on as quiet a machine as you have:

    .venv/bin/python benchmarks/record_calibration.py [--rounds 6] [--tries 5] [--within 0.25] [--label "..."]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import course  # noqa: E402
from course import capacity, noise, workload  # noqa: E402
from course.serving import BackgroundServer, create_app  # noqa: E402

SERVER = {"max_batch_size": 8, "max_prefill_tokens": 256}  # module 5's
PROMPTS, OUTPUTS = workload.uniform(32, 160), workload.uniform(16, 40)  # module 5's held-out run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of microbenchmarks merged into one fit")
    parser.add_argument("--within", type=float, default=0.25, help="the largest held-out error accepted")
    parser.add_argument("--label", default=None, help="where and when (default: this machine and today)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / capacity.RECORDED_CALIBRATION))
    args = parser.parse_args()
    cores = os.cpu_count()
    label = args.label or (
        f"recorded on the course's {cores}-core build machine ({platform.machine()}, Python "
        f"{platform.python_version()}) on {datetime.date.today().isoformat()}: module 2's server with the course's "
        f"tiny model, {args.rounds} rounds of microbenchmarks (benchmarks/record_calibration.py)"
    )
    lm = course.load_model()
    server = BackgroundServer(create_app(lm, **SERVER)).start()
    try:
        for attempt in range(1, args.tries + 1):
            found = capacity.calibrate(
                server.url, SERVER, PROMPTS, OUTPUTS, quick=False, recorded=None, rounds=args.rounds
            )
            print(f"try {attempt}: {found.noise}")
            print(found.describe())
            if found.margin <= args.within:
                n = found.noise
                load = "unknown" if n.load is None else f"{n.load:.2f} per core"
                quiet = (
                    "the rounds agreed (noise check passed)"
                    if n.ok
                    else (
                        f"the machine was shared: the rounds' widest spread {n.widest_spread:.0%} of the median, load "
                        f"average {load}"
                    )
                )
                full = f"{label}; largest held-out error {found.worst[0]} {found.worst[1]:+.0%}; {quiet}"
                capacity.save_calibration(found, args.out, full, SERVER)
                print(f"wrote {args.out} (load per core {noise.load_per_core()}): {full}")
                return
        raise SystemExit(f"no calibration within {args.within:.0%} in {args.tries} tries: rerun on a quieter machine")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
