"""A ``prometheus_client`` collector for the limiters of this machine (``pip install 'shmlimit[prometheus]'``).

    from prometheus_client import REGISTRY
    from shmlimit.integrations.prometheus import ShmlimitCollector

    REGISTRY.register(ShmlimitCollector())          # this user's (and root's) limiters
    REGISTRY.register(ShmlimitCollector(["api"]))   # or only these

Each scrape reads the segments with ``shmlimit.inspect``: the scraping process
never joins a limiter (no process slot, no filler thread, nothing written).
The metrics are those of ``shmlimit metrics`` (see ``shmlimit.cli.metrics``), and so is
the choice of segments: those owned by this process's user, root or ``trusted_uids``
(every owner with ``all_users=True``), at most ``max_segments`` of them; the rest are
counted in ``shmlimit_omitted_segments``.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Sequence

from shmlimit.cli.metrics import MAX_SEGMENTS, families, select, validate_names
from shmlimit.errors import MissingExtraError
from shmlimit.shm.segment import validate_trusted_uids

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as e:  # without the prometheus extra: say what installs it
    raise MissingExtraError(__name__, "prometheus", e) from e

__all__ = ["ShmlimitCollector"]

#: The prometheus_client family of each metric type ``shmlimit metrics`` writes.
_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


class ShmlimitCollector(Collector):
    """Collects the shmlimit metrics of ``names`` (every trusted limiter of the machine when None) at each scrape."""

    def __init__(
        self,
        names: Optional[Sequence[str]] = None,
        *,
        trusted_uids: Iterable[int] = (),
        all_users: bool = False,
        max_segments: int = MAX_SEGMENTS,
    ) -> None:
        self.names = validate_names(names)
        self.scope = dict(
            trusted_uids=validate_trusted_uids(trusted_uids),
            all_users=all_users,
            max_segments=max_segments,
        )
        select([], **self.scope)  # type: ignore[arg-type]  # a bad option raises now, not at every scrape

    def collect(self) -> Iterator[Metric]:
        for fam in families(self.names, **self.scope):  # type: ignore[arg-type]
            labelnames = [k for k, _ in fam.samples[0][0]] if fam.samples else ["limiter"]
            metric = _FAMILIES[fam.type](fam.name, fam.help, labels=labelnames)
            for labels, value in fam.samples:
                metric.add_metric([v for _, v in labels], value)
            yield metric

    def describe(self) -> Iterator[Metric]:
        # No description at registration: describing would read every segment (and collect() is
        # what registries call otherwise, at registration time).
        return iter(())

    def __repr__(self) -> str:
        return f"<shmlimit.integrations.prometheus.ShmlimitCollector names={self.names!r}>"
