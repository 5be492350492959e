"""Prometheus text pages (a server's ``GET /metrics``) as snapshots the course can read.

A snapshot is every sample of one page; two snapshots of the same server give what its counters counted
between them. vLLM's server and the course's own export the same page format, so the lab
(:mod:`course.vllm_lab`), the calibration against a live server (:mod:`course.capacity`) and the serving
tests all read pages here.
"""

from __future__ import annotations

Snapshot = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Snapshot:
    """Every sample of a Prometheus text page: ``{(sample name, sorted label pairs): value}``.

    Uses ``prometheus_client``'s own parser, so the format is read as Prometheus reads it.
    """
    from prometheus_client.parser import text_string_to_metric_families

    samples: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return samples


def metric_value(snapshot: Snapshot, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0.0 when it has none).

    Raises KeyError when the snapshot has no sample of that name at all (a typo, or a metric this
    server does not export), so a misspelt name is not read as zero.
    """
    found = [
        value
        for (sample, pairs), value in snapshot.items()
        if sample == name and all(dict(pairs).get(k) == v for k, v in labels.items())
    ]
    if not any(sample == name for sample, _ in snapshot):
        known = sorted({sample for sample, _ in snapshot if sample.startswith(name.split("_")[0])})[:8]
        raise KeyError(f"no metric {name!r} in this snapshot (some that are: {known})")
    return float(sum(found))


def counter_delta(before: Snapshot, after: Snapshot, name: str, **labels: str) -> float:
    """How much counter ``name`` grew between two snapshots of the same server.

    Counters only grow while the server lives; a smaller value means the server restarted between
    the snapshots, and the difference would be meaningless: that is a ValueError.
    """
    grown = metric_value(after, name, **labels) - metric_value(before, name, **labels)
    if grown < 0:
        raise ValueError(f"{name} went down ({grown:+g}): the snapshots are not of one server's lifetime")
    return grown
