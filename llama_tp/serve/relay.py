"""The engine's metrics, counted where the server's are: in the HTTP process.

Rank 0's EngineMetrics updates a MetricsRelay as it would the ServerMetrics, in the engine's
process; the updates go with the next message to the HTTP process (channel.py), which applies them
to its own ServerMetrics (apply_updates), so that /metrics reads one registry.
"""

from .metrics import ServerMetrics

# A metric's name (ServerMetrics' attribute), its label values, the method (inc, set, observe) and its argument
Update = tuple[str, tuple[str, ...], str, float]


class MetricsRelay:
    """Stands in for ServerMetrics: each metric's inc, set and observe are recorded, not counted."""

    def __init__(self) -> None:
        self.updates: list[Update] = []

    def __getattr__(self, name: str) -> "RelayedMetric":
        return RelayedMetric(self.updates, name, ())

    def take(self) -> list[Update]:
        """The updates since the last take, oldest first."""
        updates, self.updates = self.updates, []
        return updates


class RelayedMetric:
    def __init__(self, updates: list[Update], name: str, label_values: tuple[str, ...]):
        self._updates, self._name, self._label_values = updates, name, label_values

    def labels(self, *values: str) -> "RelayedMetric":
        return RelayedMetric(self._updates, self._name, values)

    def inc(self, amount: float = 1.0) -> None:
        self._updates.append((self._name, self._label_values, "inc", amount))

    def set(self, value: float) -> None:
        self._updates.append((self._name, self._label_values, "set", value))

    def observe(self, value: float) -> None:
        self._updates.append((self._name, self._label_values, "observe", value))


def apply_updates(metrics: ServerMetrics, updates: list[Update]) -> None:
    """Count a relay's updates in metrics, in order."""
    for name, label_values, method, argument in updates:
        metric = getattr(metrics, name)
        getattr(metric.labels(*label_values) if label_values else metric, method)(argument)
