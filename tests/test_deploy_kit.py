"""The operator's kit for Prometheus and Grafana as shipped: the alert rules (tools/deploy/prometheus/) pass
`promtool check rules` and their own unit tests under `promtool test rules`, every alert is tested firing and quiet,
and each carries `for:`, a severity and a runbook entry that docs/deployment.md has; every series the dashboard
(tools/deploy/grafana/pagedserve.json) and the rules query, and every series vLLM's own example dashboard queries, is
one a real server exports after a short load (a histogram's _bucket/_sum/_count and a counter's _total as such).

One server serves the module: it is started, loaded (completions with n=2, a stream), scraped once and stopped.
The series names in PromQL are read by metric_names(), whose own cases come first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from helpers.metrics_scrape import labels_of, total
from helpers.running_server import start_server, stop_server
from helpers.tiny_tokenizer import make_served_checkpoint

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "tools" / "deploy" / "grafana" / "pagedserve.json"
ALERTS = ROOT / "tools" / "deploy" / "prometheus" / "pagedserve-alerts.yml"
ALERT_TESTS = ROOT / "tools" / "deploy" / "prometheus" / "pagedserve-alerts-test.yml"
RUNBOOK = ROOT / "docs" / "deployment.md"
PROMTOOL_FALLBACK = Path("/usr/bin/promtool")  # Debian's package `prometheus`
DATASOURCE_UID = "${DS_PROMETHEUS}"
MODEL = "tiny"
SERVER_FLAGS = ("--served-model-name", MODEL, "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "128",
                "--standby-workers", "0")
NUM_CHOICES = 4  # the load below: a completion with n=2, a stream, a chat completion
PROMETHEUS_SERIES = {"up"}  # made by Prometheus for each scrape target, not by the server

# What vLLM's example dashboard (examples/observability/prometheus_grafana/grafana.json in vllm-project/vllm)
# queries, in its current version and the one before: a vLLM user's dashboard must work unchanged.
VLLM_DASHBOARD_SERIES = {
    *(f"vllm:{histogram}_{part}" for histogram in ("e2e_request_latency_seconds", "inter_token_latency_seconds",
                                                   "time_per_output_token_seconds", "time_to_first_token_seconds",
                                                   "request_time_per_output_token_seconds")
      for part in ("bucket", "sum", "count")),
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket", "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum", "vllm:request_max_num_generation_tokens_sum",
}
# Names vLLM deprecated: exported for the older dashboard, not queried by ours.
VLLM_DEPRECATED_SERIES = {"vllm:gpu_cache_usage_perc", *(f"vllm:time_per_output_token_seconds_{part}"
                                                         for part in ("bucket", "sum", "count"))}
# The server's own series the dashboard must show (restarts, hangs, recovery, standby, memory, KV audit, steps).
OWN_DASHBOARD_SERIES = {
    "pagedserve:worker_restarts_total", "pagedserve:worker_recovery_first_token_seconds_bucket",
    "pagedserve:standby_worker_ready", "pagedserve:standby_worker_missing", "pagedserve:worker_memory_bytes",
    "pagedserve:memory_available_bytes", "pagedserve:kv_block_audit_failures_total",
    "pagedserve:step_prediction_ratio_bucket", "pagedserve:requests_requeued_total",
    "pagedserve:requests_poisoned_total", "pagedserve:worker_restarts_remaining", "pagedserve:worker_ready",
    "pagedserve:worker_cpu_threads",
}
ALERT_NAMES = {"PagedserveDown", "PagedserveCrashLoop", "PagedserveWorkerHung", "PagedserveWorkerRestartingRepeatedly",
               "PagedserveRestartBudgetLow", "PagedserveNotReady", "PagedserveNoProgress", "PagedserveMemoryNearOOM",
               "PagedserveKVCacheSaturated", "PagedserveStandbyMissing", "PagedserveKVAuditFailures",
               "PagedserveCpuThreadsBackedOff"}
SEVERITIES = {"critical", "warning"}
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model_name": MODEL, "$instance": ".*"}  # values, to parse the queries

# ---------------------------------------------------------------------------------------------- series in PromQL

STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
MATCHERS = re.compile(r"\{[^}]*\}")  # once strings are gone, a label matcher holds no brace
RANGE = re.compile(r"\[[^\]]*\]")  # [5m], [$__rate_interval], a subquery's [1h:1m]
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")  # label lists
VARIABLE = re.compile(r"\$\{?\w+\}?")  # Grafana's $model_name, ${DS_PROMETHEUS}, $__range
IDENTIFIER = re.compile(r"(?<![\w:.$])[a-zA-Z_:][\w:]*")  # not the tail of a number (1e9) or of a name
KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
            "inf", "nan", "le"}
LABEL_VALUES = re.compile(r"\s*label_values\((?:(?P<selector>.*),)?\s*\w+\s*\)\s*", re.DOTALL)  # Grafana's


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression (or a Grafana label_values(selector, label) query) reads."""
    if match := LABEL_VALUES.fullmatch(expr):
        expr = match["selector"] or ""
    for pattern in (STRING, MATCHERS, RANGE, GROUPING, VARIABLE):
        expr = pattern.sub(" ", expr)
    names = set()
    for match in IDENTIFIER.finditer(expr):
        is_call = expr[match.end():].lstrip().startswith("(")  # a function or an aggregation
        if not is_call and match[0].lower() not in KEYWORDS:
            names.add(match[0])
    return names


@pytest.mark.parametrize("expr, names", [
    ('histogram_quantile(0.99, sum by (le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name", '
     'le="+Inf"}[$__rate_interval])))', {"vllm:e2e_request_latency_seconds_bucket"}),
    ("sum(rate(a_sum[5m])) by (le, instance)\n/\nsum without (job) (rate(a_count[5m] offset 1h))", {"a_sum", "a_count"}),
    ('up{job="pagedserve"} == 0', {"up"}),
    ("pagedserve:memory_available_bytes < 2 * 1024 * 1024 * 1024 or x > 1e9 and y < 0x10", {
        "pagedserve:memory_available_bytes", "x", "y"}),
    ("worker_ready == 0 and on(instance) (time() - start_time_seconds) > 900", {"worker_ready", "start_time_seconds"}),
    ('a / ignoring(kind) group_left b{kind="{}"}', {"a", "b"}),
    ('label_values(pagedserve:worker_ready{model_name="$model_name"}, instance)', {"pagedserve:worker_ready"}),
    ("label_values(model_name)", set()),
    ("max_over_time(deriv(waiting[10m])[1h:1m]) > bool Inf", {"waiting"}),
])
def test_metric_names_finds_series_and_nothing_else(expr, names):
    assert metric_names(expr) == names


# ---------------------------------------------------------------------------------------------- the files

def load_dashboard() -> dict:
    with open(DASHBOARD) as file:
        return json.load(file)


def load_rules() -> list[dict]:
    with open(ALERTS) as file:
        groups = yaml.safe_load(file)["groups"]
    assert len(groups) == 1, f"expected one rule group, got {[group['name'] for group in groups]}"
    return groups[0]["rules"]


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, those inside a collapsed row included (rows themselves too)."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", ())


def dashboard_exprs(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every query of the dashboard: panels' targets, annotations, query variables."""
    for panel in panels(dashboard):
        for target in panel.get("targets", ()):
            yield f"panel {panel['title']!r} target {target['refId']}", target["expr"]
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            yield f"annotation {annotation['name']!r}", annotation["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            yield f"variable ${variable['name']}", query["query"] if isinstance(query, dict) else query


def rule_exprs() -> Iterator[tuple[str, str]]:
    for rule in load_rules():
        yield f"rule {rule['alert']} ({rule['labels']['severity']})", rule["expr"]


def missing_series(exprs: Iterator[tuple[str, str]], exported: set[str]) -> dict[str, list[str]]:
    """For each query that reads a series the server does not export: which ones."""
    missing = {}
    for where, expr in exprs:
        names = metric_names(expr)
        assert names, f"{where} reads no series: {expr!r}"
        if unknown := sorted(names - PROMETHEUS_SERIES - exported):
            missing[where] = unknown
    return missing


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# ---------------------------------------------------------------------------------------------- promtool

@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool") or (str(PROMTOOL_FALLBACK) if os.access(PROMTOOL_FALLBACK, os.X_OK) else None)
    if found is None:
        pytest.skip("promtool not found: install Debian's package `prometheus` (apt-get install "
                    "--no-install-recommends prometheus, as tools/test.sh does) or put promtool on PATH")
    return found


def run_promtool(promtool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_rules(promtool):
    result = run_promtool(promtool, "check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(load_rules())} rules found" in result.stdout


def test_the_rules_pass_their_unit_tests(promtool):
    result = run_promtool(promtool, "test", "rules", str(ALERT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_unit_tests_catch_a_changed_threshold(promtool, tmp_path):
    """The unit tests pin the thresholds: a crash loop that needs one restart more fails them."""
    rules = ALERTS.read_text()
    loop = "changes(pagedserve:server_start_time_seconds[30m]) > 2"
    assert loop in rules
    (tmp_path / ALERTS.name).write_text(rules.replace(loop, loop[:-1] + "3"))
    shutil.copy(ALERT_TESTS, tmp_path)
    result = run_promtool(promtool, "test", "rules", str(tmp_path / ALERT_TESTS.name))
    assert result.returncode != 0 and "PagedserveCrashLoop" in result.stdout + result.stderr, result.stdout


def test_the_dashboards_queries_are_valid_promql(promtool, tmp_path):
    """Each query, with Grafana's variables given values, as a recording rule that promtool parses."""
    rules = []
    for index, (where, expr) in enumerate(dashboard_exprs(load_dashboard())):
        if match := LABEL_VALUES.fullmatch(expr):
            expr = match["selector"] or "vector(1)"
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"{where}: a variable this test gives no value: {expr!r}"
        rules.append({"record": f"dashboard:query_{index}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_promtool(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------- the rules

def test_the_rules_hold_the_alerts_an_operator_needs():
    assert {rule["alert"] for rule in load_rules()} == ALERT_NAMES


def test_each_rule_has_a_for_a_severity_annotations_and_a_runbook_entry():
    anchors = {github_anchor(line.lstrip("#")) for line in RUNBOOK.read_text().splitlines() if line.startswith("#")}
    for rule in load_rules():
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))), f"{name}: `for:` is {rule.get('for')!r}"
        assert rule["labels"]["severity"] in SEVERITIES, f"{name}: severity {rule['labels'].get('severity')!r}"
        annotations = rule["annotations"]
        assert annotations.get("summary") and annotations.get("description"), f"{name}: {annotations}"
        assert annotations["runbook_url"] == f"docs/deployment.md#{name.lower()}", annotations["runbook_url"]
        assert name.lower() in anchors, f"docs/deployment.md has no heading for {name}'s runbook entry"


def test_every_alert_is_tested_firing_and_quiet():
    with open(ALERT_TESTS) as file:
        cases = [case for test in yaml.safe_load(file)["tests"] for case in test["alert_rule_test"]]
    fired = {case["alertname"] for case in cases if case["exp_alerts"]}
    quiet = {case["alertname"] for case in cases if not case["exp_alerts"]}
    assert fired == ALERT_NAMES, f"never fired in the tests: {sorted(ALERT_NAMES - fired)}"
    assert quiet == ALERT_NAMES, f"never checked quiet in the tests: {sorted(ALERT_NAMES - quiet)}"


# ---------------------------------------------------------------------------------------------- the dashboard

def test_the_dashboard_takes_its_data_source_and_model_from_variables():
    dashboard = load_dashboard()
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query"
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {sorted(ids)}"
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == DATASOURCE_UID and panel["targets"], panel["title"]
        assert all(target["datasource"]["uid"] == DATASOURCE_UID for target in panel["targets"]), panel["title"]
    for where, expr in dashboard_exprs(dashboard):
        if not where.startswith("variable $model_name"):
            assert 'model_name="$model_name"' in expr, f"{where} does not select the chosen model: {expr!r}"


def test_the_dashboard_shows_vllms_panels_and_the_servers_own():
    shown = set().union(*(metric_names(expr) for _, expr in dashboard_exprs(load_dashboard())))
    assert not (VLLM_DASHBOARD_SERIES - VLLM_DEPRECATED_SERIES) - shown
    assert not OWN_DASHBOARD_SERIES - shown
    assert not shown & VLLM_DEPRECATED_SERIES, "the dashboard reads deprecated names"


# ---------------------------------------------------------------------------------------------- a real server

@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    """The sample names a real server's /metrics holds after a few requests (n=2, a stream, a chat)."""
    tmp = tmp_path_factory.mktemp("server")
    server = start_server(tmp, make_served_checkpoint(tmp), *SERVER_FLAGS)
    try:
        client = server.client()
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, n=2)
        for _ in client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6, stream=True):
            pass
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
        server.wait_for(lambda: total(server.scrape(), "vllm:request_success_total") >= NUM_CHOICES,
                        f"the server counted {NUM_CHOICES} finished choices")
        return {labels_of(key)[0] for key in server.scrape()}
    finally:
        stop_server(server)


def test_every_dashboard_query_reads_series_the_server_exports(exported):
    assert missing_series(dashboard_exprs(load_dashboard()), exported) == {}


def test_every_alert_reads_series_the_server_exports(exported):
    assert missing_series(rule_exprs(), exported) == {}


def test_vllms_dashboard_reads_series_the_server_exports(exported):
    assert sorted(VLLM_DASHBOARD_SERIES - exported) == []
    # A histogram's family name is no sample: a query must name _bucket, _sum or _count.
    assert "vllm:e2e_request_latency_seconds" not in exported and "vllm:request_success" not in exported
