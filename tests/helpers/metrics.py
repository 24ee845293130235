"""A Prometheus /metrics page, read into {series with its labels: value}."""

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        sample.name + str(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    }  # fmt: skip
