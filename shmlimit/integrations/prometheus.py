"""A ``prometheus_client`` collector for the limiters of this machine (``pip install 'shmlimit[prometheus]'``).

    from prometheus_client import REGISTRY
    from shmlimit.integrations.prometheus import ShmlimitCollector

    REGISTRY.register(ShmlimitCollector())          # every limiter of the machine
    REGISTRY.register(ShmlimitCollector(["api"]))   # or only these

Each scrape reads the segments with ``shmlimit.inspect``: the scraping process
never joins a limiter (no process slot, no filler thread, nothing written).
The metrics are those of ``shmlimit metrics`` (see ``shmlimit.cli.metrics``).
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shmlimit.cli.metrics import families

__all__ = ["ShmlimitCollector"]


class ShmlimitCollector(Collector):
    """Collects the shmlimit metrics of ``names`` (every limiter of the machine when None) at each scrape."""

    def __init__(self, names: Optional[Sequence[str]] = None) -> None:
        self.names = None if names is None else list(names)

    def collect(self) -> Iterator[Metric]:
        for fam in families(self.names):
            labelnames = [k for k, _ in fam.samples[0][0]] if fam.samples else ["limiter"]
            metric: Metric
            if fam.type == "counter":
                metric = CounterMetricFamily(fam.name, fam.help, labels=labelnames)
            else:
                metric = GaugeMetricFamily(fam.name, fam.help, labels=labelnames)
            for labels, value in fam.samples:
                metric.add_metric([v for _, v in labels], value)
            yield metric

    def describe(self) -> Iterator[Metric]:
        # No description at registration: describing would read every segment (and collect() is
        # what registries call otherwise, at registration time).
        return iter(())

    def __repr__(self) -> str:
        return f"<shmlimit.integrations.prometheus.ShmlimitCollector names={self.names!r}>"
