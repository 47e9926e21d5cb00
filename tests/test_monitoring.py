"""The compose file's optional "monitoring" profile (Prometheus + Grafana), checked without
containers (no image can be pulled here): the default profile is what it was (coordinator and
nodes; tests/test_compose.py runs it), the monitoring services come only with the profile,
Prometheus scrapes the ports the coordinator and the nodes serve /metrics on, and Grafana is
provisioned with that Prometheus and a dashboard. Every metric name a panel queries is one a real
node or coordinator exports: tests/test_swarm_training.py scrapes both and checks
`queried_metric_names()` against them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
MONITORING = DOCKER / "monitoring"
DASHBOARDS = MONITORING / "grafana" / "dashboards"
METRIC = re.compile(r"\b(?:swarmtrain|process)_[a-z0-9_]+\b")

pytestmark = pytest.mark.timeout(60)


def compose() -> dict:
    return yaml.safe_load((DOCKER / "docker-compose.yml").read_text())


def queries() -> list[str]:
    """Every PromQL expression the provisioned dashboards query."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            out += [t["expr"] for t in panel["targets"]]
    return out


def queried_metric_names() -> set[str]:
    """The metric (sample) names those expressions name."""
    return {name for expr in queries() for name in METRIC.findall(expr)}


def test_the_default_profile_is_unchanged_and_monitoring_comes_only_with_its_profile():
    services = compose()["services"]
    assert {name for name, s in services.items() if "profiles" not in s} == {"coordinator", "node"}
    assert {name: s["profiles"] for name, s in services.items() if "profiles" in s} == {"prometheus": ["monitoring"], "grafana": ["monitoring"]}
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            assert (DOCKER / volume.split(":")[0]).exists(), f"{name} mounts {volume}, which is not in docker/"
    tool = next((t for t in (["podman-compose"], ["docker-compose"]) if shutil.which(t[0])), None)
    if tool is None:
        return
    for profile, expected in (([], {"coordinator", "node"}), (["--profile", "monitoring"], {"coordinator", "node", "prometheus", "grafana"})):
        r = subprocess.run([*tool, "-f", str(DOCKER / "docker-compose.yml"), *profile, "config"], capture_output=True, text=True, timeout=50, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        assert set(yaml.safe_load(r.stdout)["services"]) == expected, (profile, r.stdout)


def test_prometheus_scrapes_the_ports_the_coordinator_and_the_nodes_serve_metrics_on():
    services, config = compose()["services"], yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    node_http = services["node"]["environment"]["SWARMTRAIN_HTTP"]
    assert node_http.startswith("0.0.0.0:")  # reachable from the Prometheus container
    (sd,) = jobs["node"]["dns_sd_configs"]
    assert sd["names"] == ["node"] and sd["type"] == "A" and str(sd["port"]) == node_http.rpartition(":")[2]
    coordinator_http = re.search(r'"--http", f"0\.0\.0\.0:\{env\(\'HTTP_PORT\', \'(\d+)\'\)\}"', (DOCKER / "entrypoint.py").read_text()).group(1)
    assert jobs["coordinator"]["static_configs"] == [{"targets": [f"coordinator:{coordinator_http}"]}]
    assert services["coordinator"]["ports"] == [f"${{COORDINATOR_HTTP_PORT:-8080}}:{coordinator_http}"]


def test_grafana_is_provisioned_with_that_prometheus_and_a_dashboard_of_the_swarm():
    services = compose()["services"]
    (source,) = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == f"http://prometheus:{services['prometheus']['ports'][0].rpartition(':')[2]}"
    (provider,) = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/swarmtrain.yml").read_text())["providers"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert mounts["./monitoring/grafana/dashboards"] == provider["options"]["path"]
    dashboard = json.loads((DASHBOARDS / "swarmtrain.json").read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Loss", "Tokens per second", "Bytes per second by plane", "Members by role", "Rounds by outcome", "Resident memory"} <= titles
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert panel["targets"] and all(METRIC.search(t["expr"]) for t in panel["targets"]), panel["title"]
    assert {"swarmtrain_node_bytes_total", "swarmtrain_node_rounds_total", "swarmtrain_members", "process_resident_memory_bytes"} <= queried_metric_names()
