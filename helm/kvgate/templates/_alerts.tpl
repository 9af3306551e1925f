{{/* PromQL label matchers of this release's gateway series: prometheusRule.selector, or the
namespace and the job the chart's ServiceMonitor (the metrics Service's name) or PodMonitor
(<namespace>/<name>) gives its targets. */}}
{{- define "kvgate.alertSelector" -}}
{{- if .Values.prometheusRule.selector }}
{{- .Values.prometheusRule.selector }}
{{- else if .Values.serviceMonitor.enabled }}
{{- printf "namespace=%q, job=%q" .Release.Namespace (include "kvgate.metricsServiceName" .) }}
{{- else if .Values.podMonitor.enabled }}
{{- printf "namespace=%q, job=%q" .Release.Namespace (printf "%s/%s" .Release.Namespace (include "kvgate.fullname" .)) }}
{{- else }}
{{- fail "prometheusRule: set prometheusRule.selector (PromQL label matchers of this release's gateway series, e.g. namespace=\"llm\", job=\"kvgate\") when neither serviceMonitor nor podMonitor is enabled" }}
{{- end }}
{{- end }}

{{/* The alerts (docs/deploy.md, "Alerts"), each on metrics of gateway/metrics/catalogue.py. */}}
{{- define "kvgate.alertRules" -}}
{{- $s := include "kvgate.alertSelector" . }}
{{- $p := .Values.prometheusRule }}
- alert: KvgateTargetDown
  expr: up{ {{- $s -}} } == 0
  for: 5m
  labels: {severity: warning}
  annotations:
    summary: {{ `Prometheus cannot scrape gateway {{ $labels.pod }} ({{ $labels.instance }})` | quote }}
    description: "Its metrics port does not answer, so the other alerts do not see it: check the pod's status, events and restarts, and that a NetworkPolicy lets Prometheus reach the metrics port (networkPolicy.metricsFrom)."
{{- if .Values.sync.enabled }}
- alert: KvgateSyncDisconnected
  expr: min by (namespace, pod) (kvgate_sync_connected{ {{- $s -}} }) == 0
  for: 5m
  labels: {severity: warning}
  annotations:
    summary: {{ `Gateway {{ $labels.pod }} is not connected to its sync broker` | quote }}
    description: "It routes on its own knowledge only (peers' dispatches and load unseen): check the broker pod or sync.url, and the NetworkPolicies between them."
{{- end }}
- alert: KvgateNoHealthyWorker
  expr: max by (namespace, pool) (kvgate_worker_healthy{ {{- $s -}} }) == 0 or max by (namespace, pool) (kvgate_discovery_workers{ {{- $s -}} }) == 0
  for: 2m
  labels: {severity: critical}
  annotations:
    summary: {{ `Pool {{ $labels.pool }} has no routable worker` | quote }}
    description: "Every request for the pool's models fails or waits in its queue: check the workers (health checks, circuit breakers) and the pool's discovery."
- alert: KvgateWorkerBreakerOpen
  expr: max by (namespace, pool, worker) (min_over_time(kvgate_worker_breaker_state{ {{- $s -}} }[{{ $p.breakerOpenFor }}])) >= 1
  for: 1m
  labels: {severity: warning}
  annotations:
    summary: {{ printf "Worker {{ $labels.worker }} of pool {{ $labels.pool }}: circuit breaker not closed for %s" $p.breakerOpenFor | quote }}
    description: "Its trial requests keep failing, so the gateway routes around it: check the worker's logs and health, or remove it from the pool."
- alert: KvgateClientConnectionLimit
  expr: sum by (namespace, pod) (rate(kvgate_client_refusals_total{ {{- $s -}}, reason="connection_limit"}[5m])) > 0
  for: 10m
  labels: {severity: warning}
  annotations:
    summary: {{ `Gateway {{ $labels.pod }} closes new client connections at its limit` | quote }}
    description: "limits.max_client_connections (per process) is reached, idle keep-alive connections included: add replicas or processes, raise the limit, or shorten limits.keepalive_timeout_s."
- alert: KvgateQueueRefusals
  expr: sum by (namespace, pool, reason) (rate(kvgate_queue_refusals_total{ {{- $s -}} }[5m])) > 0
  for: 10m
  labels: {severity: warning}
  annotations:
    summary: {{ `Pool {{ $labels.pool }} turns requests away ({{ $labels.reason }})` | quote }}
    description: "Its workers' slots are full for longer than the queue holds: add workers, or review max_in_flight_per_worker, the pool's queue bounds and timeout, and tenant quotas (tenant_full)."
- alert: KvgateDiscoveryErrors
  expr: sum by (namespace, pool, reason) (rate(kvgate_discovery_errors_total{ {{- $s -}} }[5m])) > 0
  for: 10m
  labels: {severity: warning}
  annotations:
    summary: {{ `Worker discovery of pool {{ $labels.pool }} fails ({{ $labels.reason }})` | quote }}
    description: "The pool keeps its last known workers and misses changes: check the DNS name, or the API server, the Role and the service account of Kubernetes discovery."
- alert: KvgateKvEventsStale
  expr: max by (namespace, pod, worker) (kvgate_kv_events_last_batch_age_seconds{ {{- $s -}} }) > {{ int $p.kvEventsStaleSeconds }} and on (namespace, pod, worker) max by (namespace, pod, worker) (kvgate_worker_in_flight{ {{- $s -}} }) > 0
  for: 5m
  labels: {severity: warning}
  annotations:
    summary: {{ printf "No KV-event batch from busy worker {{ $labels.worker }} for %d s" (int $p.kvEventsStaleSeconds) | quote }}
    description: "The prefix index stops following the worker's cache while it serves requests: check the worker's --kv-events-config, the pool's kvEventsEndpoint and the network path to it."
- alert: KvgateAnswerBudgetRefusals
  expr: sum by (namespace, pod) (rate(kvgate_answer_budget_refusals_total{ {{- $s -}} }[5m])) > 0
  for: 5m
  labels: {severity: warning}
  annotations:
    summary: {{ `Gateway {{ $labels.pod }} cuts whole answers off at its memory budget` | quote }}
    description: "Clients get 503 gateway_overloaded: raise limits.max_buffered_answer_bytes together with the memory limit, add replicas, or have clients stream."
- alert: KvgatePolicyReloadFailing
  expr: max by (namespace, pod) (kvgate_policy_reload_failing{ {{- $s -}} }) == 1
  for: 5m
  labels: {severity: warning}
  annotations:
    summary: {{ `Gateway {{ $labels.pod }} refuses its policy file` | quote }}
    description: "It routes with the policy it had before the last change of the file: its log line 'policy reload rejected' (or GET /admin/status) names the field; fix the file (a ConfigMap change is picked up within policy_reload_interval_s)."
{{- end }}
