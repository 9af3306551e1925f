{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The gateway pods' labels: no chart or app version, so that a chart bump alone restarts no pod. */}}
{{- define "kvgate.podLabels" -}}
{{ include "kvgate.selectorLabels" . }}
app.kubernetes.io/component: gateway
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The name of a resource the release puts in `namespace` (a dict: ctx, namespace, suffix):
`<fullname>-<suffix>` in the release's own namespace; elsewhere prefixed with the release's
namespace and a dot, so that releases of the same name in different namespaces never share it
(namespace and release names have no dots, so the prefix cannot be confused). */}}
{{- define "kvgate.crossNamespaceName" -}}
{{- $ctx := .ctx }}
{{- $name := printf "%s-%s" (include "kvgate.fullname" $ctx) .suffix }}
{{- if eq .namespace $ctx.Release.Namespace }}
{{- $name }}
{{- else }}
{{- printf "%s.%s" $ctx.Release.Namespace $name }}
{{- end }}
{{- end }}

{{- define "kvgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvgate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The gateway image. A repository without a registry or namespace (no `/`) would be pulled from
Docker Hub's library, where there is no kvgate: refused unless image.local says the nodes have it. */}}
{{- define "kvgate.image" -}}
{{- with .Values.image }}
{{- if not (or (contains "/" .repository) .local) }}
{{- fail (printf "image.repository %q names no registry: the nodes would pull docker.io/library/%s, which does not exist. Push the image built by `make image` to a registry the cluster pulls from and set image.repository to its full name (e.g. registry.example.com/llm/kvgate), or set image.local=true for an image loaded into the nodes (kind load docker-image, minikube image load)" .repository .repository) }}
{{- end }}
{{- if .digest }}
{{- printf "%s@%s" .repository .digest }}
{{- else }}
{{- printf "%s:%s" .repository (.tag | default $.Chart.AppVersion) }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvgate.keyHashSecretName" -}}
{{- default (printf "%s-key-hash" (include "kvgate.fullname" .)) .Values.keyHashSecret.existingSecret }}
{{- end }}

{{/* The drain deadline the gateway runs with: `config.drain.deadline_s` wins over
shutdown.drainSeconds, as every key of `config` does (kvgate.gatewayConfig). */}}
{{- define "kvgate.drainDeadlineSeconds" -}}
{{- $deadline := dig "drain" "deadline_s" .Values.shutdown.drainSeconds (.Values.config | default dict) }}
{{- int (ceil (float64 $deadline)) }}
{{- end }}

{{/* preStop + the drain deadline + the gateway's exit margin (10 s) + 5 s by default; an explicit
value below preStop + deadline + 10 would let the kubelet kill a pod still draining. The gateway
counts its deadline from SIGTERM and its shutdown delay inside it (gateway/server.py): a delay of
the deadline or more leaves no drain at all (it stops listening at the deadline and ends whatever
is in flight then), so it is refused; a load balancer slow to stop sending is waited for by the
preStop sleep, which comes before SIGTERM and which the grace period adds. */}}
{{- define "kvgate.terminationGracePeriodSeconds" -}}
{{- $drain := dig "drain" dict (.Values.config | default dict) | default dict }}
{{- $deadline := get $drain "deadline_s" | default .Values.shutdown.drainSeconds }}
{{- $delay := .Values.shutdown.shutdownDelaySeconds }}
{{- if hasKey $drain "shutdown_delay_s" }}{{ $delay = get $drain "shutdown_delay_s" }}{{ end }}
{{- if ge (float64 $delay) (float64 $deadline) }}
{{- fail (printf "shutdown.shutdownDelaySeconds (%v, or config.drain.shutdown_delay_s) must be below the drain deadline (%v, shutdown.drainSeconds or config.drain.deadline_s), both counted from SIGTERM: the gateway would stop listening only at the deadline and end every request still in flight at once. For a load balancer that takes longer to stop sending, raise shutdown.preStopSleepSeconds (it comes before SIGTERM, and the grace period adds it)" $delay $deadline) }}
{{- end }}
{{- $needed := add .Values.shutdown.preStopSleepSeconds (include "kvgate.drainDeadlineSeconds" . | int) 10 }}
{{- if kindIs "invalid" .Values.shutdown.terminationGracePeriodSeconds }}
{{- add $needed 5 }}
{{- else }}
{{- $grace := .Values.shutdown.terminationGracePeriodSeconds | int }}
{{- if lt $grace $needed }}
{{- fail (printf "shutdown.terminationGracePeriodSeconds (%d) must be at least preStopSleepSeconds + the drain deadline + 10 (%d): the kubelet would kill pods still draining" $grace $needed) }}
{{- end }}
{{- $grace }}
{{- end }}
{{- end }}

{{/* The container port name of process i's /metrics: metrics, metrics-1, metrics-2, ... */}}
{{- define "kvgate.metricsPortName" -}}
{{- if eq (int .) 0 }}metrics{{ else }}metrics-{{ . }}{{ end }}
{{- end }}

{{/* Mount points: the gateway config and the policy file come from separate ConfigMaps. */}}
{{- define "kvgate.configDir" -}}/etc/kvgate/config{{- end }}
{{- define "kvgate.policyDir" -}}/etc/kvgate/policy{{- end }}
{{- /* Pool i's worker API key (pools[i].workerApiKeySecret) is the file <dir>/<i>/api-key. */}}
{{- define "kvgate.workerKeysDir" -}}/etc/kvgate/worker-keys{{- end }}
{{- /* The key-hash secret is the file <dir>/<keyHashSecret.key>. */}}
{{- define "kvgate.keyHashDir" -}}/etc/kvgate/key-hash{{- end }}

{{- define "kvgate.configSecretName" -}}
{{- default (printf "%s-config" (include "kvgate.fullname" .)) .Values.configSecret.existingSecret }}
{{- end }}

{{/* Namespaces whose worker pods the gateway watches: each Kubernetes pool's (default: the
release's), and kubernetesDiscovery.namespaces (for pools the chart cannot see: a gateway.yaml of
one's own, pools set through `config`). */}}
{{- define "kvgate.discoveryNamespaces" -}}
{{- $namespaces := list }}
{{- range .Values.pools }}
{{- with (default dict .workers).kubernetes }}
{{- $namespaces = append $namespaces (default $.Release.Namespace .namespace) }}
{{- end }}
{{- end }}
{{- range .Values.kubernetesDiscovery.namespaces }}
{{- $namespaces = append $namespaces . }}
{{- end }}
{{- $namespaces | uniq | toJson }}
{{- end }}

{{/* The gateway config file (schema: gateway/config/), generated from the values; `.Values.config` keys win. */}}
{{- define "kvgate.gatewayConfig" -}}
{{- $pools := list }}
{{- range $i, $p := .Values.pools }}
{{- if not $p.name }}{{ fail (printf "pools[%d]: name is required" $i) }}{{ end }}
{{- if not $p.models }}{{ fail (printf "pools[%d] (%s): models is required" $i $p.name) }}{{ end }}
{{- $pool := dict "name" $p.name "models" $p.models }}
{{- $w := default dict $p.workers }}
{{- $static := or $w.urls $w.prefillUrls $w.decodeUrls }}
{{- /* `pd: {}` turns disaggregation on with the gateway's defaults. */}}
{{- $pd := and (hasKey $p "pd") (kindIs "map" $p.pd) }}
{{- $sources := 0 }}
{{- if $static }}{{ $sources = add1 $sources }}{{ end }}
{{- if $w.dns }}{{ $sources = add1 $sources }}{{ end }}
{{- if $w.kubernetes }}{{ $sources = add1 $sources }}{{ end }}
{{- if ne $sources 1 }}
{{- fail (printf "pools[%d] (%s): set exactly one of workers.urls (or prefillUrls/decodeUrls), workers.dns.name or workers.kubernetes" $i $p.name) }}
{{- end }}
{{- if and (or $w.prefillUrls $w.decodeUrls) (not $pd) }}
{{- fail (printf "pools[%d] (%s): workers.prefillUrls and workers.decodeUrls need the pool's pd block (at least pd.protocol)" $i $p.name) }}
{{- end }}
{{- /* pd.mode holder_prefill keeps every worker mixed: discovery need not know roles. */}}
{{- $holder := and $pd (eq (default "pairs" $p.pd.mode) "holder_prefill") }}
{{- $roles := and $pd (not $holder) }}
{{- if and $holder (or $w.prefillUrls $w.decodeUrls (and $w.kubernetes $w.kubernetes.roleLabel)) }}
{{- fail (printf "pools[%d] (%s): pd.mode holder_prefill takes mixed workers only: use workers.urls, dns or kubernetes without roleLabel" $i $p.name) }}
{{- end }}
{{- if and $roles $w.dns }}
{{- fail (printf "pools[%d] (%s): pd: DNS discovery knows no roles; list workers.prefillUrls and workers.decodeUrls, or use workers.kubernetes with roleLabel" $i $p.name) }}
{{- end }}
{{- if and $roles $w.kubernetes (not $w.kubernetes.roleLabel) }}
{{- fail (printf "pools[%d] (%s): pd: workers.kubernetes.roleLabel is required (the pod label whose value is prefill or decode)" $i $p.name) }}
{{- end }}
{{- if $static }}
{{- with $w.urls }}{{ $_ := set $pool "workers" . }}{{ end }}
{{- with $w.prefillUrls }}{{ $_ := set $pool "prefill_workers" . }}{{ end }}
{{- with $w.decodeUrls }}{{ $_ := set $pool "decode_workers" . }}{{ end }}
{{- else if $w.dns }}
{{- if not $w.dns.name }}{{ fail (printf "pools[%d] (%s): workers.dns.name is required" $i $p.name) }}{{ end }}
{{- $dns := dict "name" $w.dns.name "port" (int (default 8000 $w.dns.port)) "scheme" (default "http" $w.dns.scheme) "refresh_s" (default 5 $w.dns.refreshSeconds) }}
{{- /* Unset: the gateway's own defaults (2 answers of no addresses in a row, over 10 s). */}}
{{- with $w.dns.emptyAfter }}{{ $_ := set $dns "empty_after" (int .) }}{{ end }}
{{- if hasKey $w.dns "emptyAfterSeconds" }}{{ $_ := set $dns "empty_after_s" $w.dns.emptyAfterSeconds }}{{ end }}
{{- $_ := set $pool "dns" $dns }}
{{- else }}
{{- if not $.Values.kubernetesDiscovery.enabled }}
{{- fail (printf "pools[%d] (%s): workers.kubernetes needs kubernetesDiscovery.enabled=true (service-account token and RBAC)" $i $p.name) }}
{{- end }}
{{- $k := $w.kubernetes }}
{{- if not $k.selector }}{{ fail (printf "pools[%d] (%s): workers.kubernetes.selector is required" $i $p.name) }}{{ end }}
{{- /* The pool's `kubernetes` block of the gateway config; `extra` passes further keys through. */}}
{{- /* A port number, or the name of the pods' container port (a string, schema-checked). */}}
{{- $port := ternary $k.port (int $k.port) (kindIs "string" $k.port) }}
{{- $block := dict "namespace" (default $.Release.Namespace $k.namespace) "selector" $k.selector "port" $port "scheme" (default "http" $k.scheme) }}
{{- with $k.roleLabel }}{{ $_ := set $block "role_label" . }}{{ end }}
{{- $_ := set $pool "kubernetes" (mergeOverwrite $block (deepCopy (default dict $k.extra))) }}
{{- end }}
{{- with $p.kvEventsEndpoint }}{{ $_ := set $pool "kv_events_endpoint" . }}{{ end }}
{{- if $pd }}{{ $_ := set $pool "pd" (include "kvgate.pdBlock" $p.pd | fromYaml) }}{{ end }}
{{- with $p.workerApiKeySecret }}{{ if .name }}
{{- $_ := set $pool "worker_api_key_file" (printf "%s/%d/api-key" (include "kvgate.workerKeysDir" $) $i) }}
{{- end }}{{ end }}
{{- with $p.extra }}{{ $pool = mergeOverwrite $pool (deepCopy .) }}{{ end }}
{{- $pools = append $pools $pool }}
{{- end }}
{{- $tenants := list }}
{{- range $i, $t := .Values.tenants }}
{{- if not $t.name }}{{ fail (printf "tenants[%d]: name is required" $i) }}{{ end }}
{{- if not $t.apiKeyHashes }}{{ fail (printf "tenants[%d] (%s): apiKeyHashes is required (make one with `kvgate serve --hash-key`)" $i $t.name) }}{{ end }}
{{- $quotas := dict }}
{{- with $t.maxConcurrent }}{{ $_ := set $quotas "max_concurrent" . }}{{ end }}
{{- with $t.rpm }}{{ $_ := set $quotas "rpm" . }}{{ end }}
{{- with $t.tpm }}{{ $_ := set $quotas "tpm" . }}{{ end }}
{{- $tenant := dict "name" $t.name "api_key_hashes" $t.apiKeyHashes "isolation" (default "strict" $t.isolation) "quotas" $quotas }}
{{- with $t.weight }}{{ $_ := set $tenant "weight" . }}{{ end }}
{{- with $t.enginePriority }}{{ $_ := set $tenant "engine_priority" . }}{{ end }}
{{- $tenants = append $tenants $tenant }}
{{- end }}
{{- if not $tenants }}{{ fail "tenants: at least one tenant is required (API keys are configured as hashes: `kvgate serve --hash-key`)" }}{{ end }}
{{- $cfg := dict
  "listen" (dict "host" "0.0.0.0" "port" (int .Values.service.port))
  "metrics" (dict "listen" (dict "host" "0.0.0.0" "port" (int .Values.metrics.port)))
  "drain" (dict "deadline_s" .Values.shutdown.drainSeconds "shutdown_delay_s" .Values.shutdown.shutdownDelaySeconds)
  "secrets" (dict "key_hash_secret_file" (printf "%s/%s" (include "kvgate.keyHashDir" .) .Values.keyHashSecret.key))
  "policy_file" (printf "%s/policy.yaml" (include "kvgate.policyDir" .))
  "log_level" .Values.logLevel
  "pools" $pools
  "tenants" $tenants
}}
{{- if .Values.tracing.enabled }}{{ $_ := set $cfg "tracing" (dict "enabled" true) }}{{ end }}
{{- if .Values.sync.enabled }}{{ $_ := set $cfg "sync" (include "kvgate.syncBlock" . | fromYaml) }}{{ end }}
{{- $cfg = mergeOverwrite $cfg (deepCopy .Values.config) }}
{{- include "kvgate.checkUniqueNames" (dict "config" $cfg "key" "pools" "what" "pool") }}
{{- include "kvgate.checkUniqueNames" (dict "config" $cfg "key" "tenants" "what" "tenant") }}
{{- include "kvgate.checkOneOwner" (dict "config" $cfg "key" "pools" "field" "models" "what" "model %q") }}
{{- include "kvgate.checkOneOwner" (dict "config" $cfg "key" "tenants" "field" "api_key_hashes" "what" "an API key hash") }}
{{- include "kvgate.checkQuotasShared" (dict "ctx" . "config" $cfg) }}
{{- include "kvgate.checkSyncTimeouts" $cfg }}
{{- include "kvgate.checkSyncAuth" $cfg }}
{{- toYaml $cfg }}
{{- end }}

{{/* The gateway's defaults of the sync timings the chart checks (gateway/config/sync.py,
SyncConfig; a test keeps them equal). */}}
{{- define "kvgate.syncTimingDefaults" -}}
{{- dict "load_refresh_s" 1.0 "peer_timeout_s" 5.0 | toJson }}
{{- end }}

{{/* A config whose sync.peer_timeout_s is not above its sync.load_refresh_s, which the gateway
refuses at start (a peer heard from every load_refresh_s must not be forgotten in between): refused
at install instead of crashlooping the pods. Each comes from sync.peerTimeoutS / sync.loadRefreshS
or config.sync (which wins); unset or null, the gateway's default. The gateway checks its sync
block whether or not sync is on, so this does too. */}}
{{- define "kvgate.checkSyncTimeouts" -}}
{{- with .sync }}
{{- $defaults := include "kvgate.syncTimingDefaults" . | fromJson }}
{{- $timing := dict }}
{{- range $key, $default := $defaults }}
{{- $value := get $.sync $key }}
{{- if or (not (hasKey $.sync $key)) (kindIs "invalid" $value) }}{{ $value = $default }}{{ end }}
{{- $_ := set $timing $key (float64 $value) }}
{{- end }}
{{- if le $timing.peer_timeout_s $timing.load_refresh_s }}
{{- fail (printf "sync.peerTimeoutS (%v) must be longer than sync.loadRefreshS (%v), as the gateway refuses to start otherwise (its sync.peer_timeout_s and sync.load_refresh_s; config.sync wins over both; unset or null: the gateway's %v and %v s): a gateway publishes its load every loadRefreshS, and its peers forget it after peerTimeoutS of silence" $timing.peer_timeout_s $timing.load_refresh_s $defaults.peer_timeout_s $defaults.load_refresh_s) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The sync block's credentials as the gateway takes them (gateway/config/sync.py, SyncAuthConfig
and SyncConfig): the chart's `auth` (from sync.auth) merged with config.sync.auth can end up with a
token from a file and from the environment, a user without a password, or a user and a token, and a
sentinel_auth goes with a redis+sentinel:// url only; each is refused at start, so at install. */}}
{{- define "kvgate.checkSyncAuth" -}}
{{- with .sync }}
{{- $url := toString (get . "url" | default "") }}
{{- if and (get . "sentinel_auth") (not (regexMatch "^\\s*rediss?\\+sentinel://" $url)) }}
{{- fail (printf "config.sync.sentinel_auth is the sentinels' own password: it goes with a redis+sentinel:// (or rediss+sentinel://) sync.url, not %q (the gateway refuses it at start; the broker's own credentials go in sync.auth)" $url) }}
{{- end }}
{{- range $block := list "auth" "sentinel_auth" }}
{{- with get $.sync $block }}
{{- $where := printf "the gateway config's sync.%s (the chart's from sync.auth, with config.sync.%s merged over it)" $block $block }}
{{- $token := or .token_file .token_env }}
{{- $password := or .password_file .password_env }}
{{- if and .token_file .token_env }}
{{- fail (printf "%s has both token_file (%s) and token_env (%s); the gateway takes one: with the chart's token (sync.auth.token or existingSecret, read from a file) leave config.sync.%s.token_env out" $where .token_file .token_env $block) }}
{{- end }}
{{- if and .password_file .password_env }}
{{- fail (printf "%s has both password_file and password_env; the gateway takes one" $where) }}
{{- end }}
{{- if and .user (not $password) }}
{{- fail (printf "%s has a user and no password (password_file or password_env); the gateway refuses the config" $where) }}
{{- end }}
{{- if and $password (not .user) }}
{{- fail (printf "%s has a password and no user; the gateway refuses the config (a password alone is a token: token_file or token_env)" $where) }}
{{- end }}
{{- if and .user $token }}
{{- fail (printf "%s has a user and a token; the gateway takes one of the two (sync.auth.user makes the chart's secret that user's password)" $where) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* A name given twice among the config's pools or tenants (dict: config, key, what), which the
gateway refuses at start: refused at install instead of crashlooping the pods. */}}
{{- define "kvgate.checkUniqueNames" -}}
{{- $seen := dict }}
{{- range (get .config .key | default list) }}
{{- $name := toString .name }}
{{- if hasKey $seen $name }}
{{- fail (printf "%s: %q names two %ss; names must be unique (the gateway refuses the config)" $.key $name $.what) }}
{{- end }}
{{- $_ := set $seen $name true }}
{{- end }}
{{- end }}

{{/* An entry of a list field given to two of the config's pools or tenants (dict: config, key,
field, what: the entry's words, `%q` for the entry itself): a model served by two pools, an API
key hash of two tenants, which the gateway refuses at start. A hash is not printed. */}}
{{- define "kvgate.checkOneOwner" -}}
{{- $owners := dict }}
{{- range (get .config .key | default list) }}
{{- $owner := toString .name }}
{{- range (get . $.field | default list) }}
{{- $entry := toString . }}
{{- if and (hasKey $owners $entry) (ne (get $owners $entry) $owner) }}
{{- $words := contains "%q" $.what | ternary (printf $.what $entry) $.what }}
{{- fail (printf "%s: %s is in both %q and %q; each must have one (the gateway refuses the config)" $.key $words (get $owners $entry) $owner) }}
{{- end }}
{{- $_ := set $owners $entry $owner }}
{{- end }}
{{- end }}
{{- end }}

{{/* Up to how many gateway pods the release may run: the autoscaler's maximum, else replicaCount. */}}
{{- define "kvgate.maxReplicas" -}}
{{- if .Values.autoscaling.enabled }}{{ int .Values.autoscaling.maxReplicas }}{{ else }}{{ int .Values.replicaCount }}{{ end }}
{{- end }}

{{/* A tenant's quotas hold for the release only while its gateways share their charges through
sync (docs/sync.md, "Quotas"): without it each gateway enforces the whole quota, N times the rpm
over N replicas. Refused for the config the chart renders (dict: ctx, config); a config of one's
own gets a note instead (NOTES.txt). */}}
{{- define "kvgate.checkQuotasShared" -}}
{{- $replicas := include "kvgate.maxReplicas" .ctx | int }}
{{- $shared := dig "sync" "url" "" .config }}
{{- if and (gt $replicas 1) (not $shared) }}
{{- range .config.tenants }}
{{- $q := .quotas | default dict }}
{{- if or $q.max_concurrent $q.rpm $q.tpm }}
{{- fail (printf "tenant %s has quotas (maxConcurrent, rpm, tpm) but sync is off with up to %d gateway replicas: each would enforce the whole quota on its own, %d times it over the release (docs/sync.md, \"Quotas\"). Set sync.enabled=true (the chart runs a small NATS), run one replica (replicaCount: 1, or autoscaling.maxReplicas: 1), or drop the quotas" .name $replicas $replicas) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* A pool's `pd` block of the gateway config from its camelCase values; unset keys keep the gateway's defaults. */}}
{{- define "kvgate.pdBlock" -}}
{{- $pd := dict "protocol" (default "vllm" .protocol) }}
{{- with .transfer }}
{{- $transfer := dict }}
{{- if not (kindIs "invalid" .setupSeconds) }}{{ $_ := set $transfer "setup_s" .setupSeconds }}{{ end }}
{{- with .bytesPerToken }}{{ $_ := set $transfer "bytes_per_token" (int64 .) }}{{ end }}
{{- with .bandwidthBytesPerSecond }}{{ $_ := set $transfer "bandwidth_bytes_per_s" (float64 .) }}{{ end }}
{{- $_ := set $pd "transfer" $transfer }}
{{- end }}
{{- if not (kindIs "invalid" .conditional) }}{{ $_ := set $pd "conditional" .conditional }}{{ end }}
{{- if not (kindIs "invalid" .interferenceWeight) }}{{ $_ := set $pd "interference_weight" .interferenceWeight }}{{ end }}
{{- with .mode }}{{ $_ := set $pd "mode" . }}{{ end }}
{{- if not (kindIs "invalid" .holderShare) }}{{ $_ := set $pd "holder_share" .holderShare }}{{ end }}
{{- with .bootstrapPort }}{{ $_ := set $pd "bootstrap_port" (int .) }}{{ end }}
{{- with .bootstrapPorts }}{{ $_ := set $pd "bootstrap_ports" . }}{{ end }}
{{- toYaml $pd }}
{{- end }}

{{/* The headless Service the ServiceMonitor scrapes through (also its targets' job label), room
left for the suffix as for the broker's name. */}}
{{- define "kvgate.metricsServiceName" -}}
{{- printf "%s-metrics" (include "kvgate.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{/* Replica sync: the chart's own broker runs when sync is on and names no url. */}}
{{- define "kvgate.natsName" -}}
{{- /* Room for the suffix, so that a long name never makes it the gateway's own. */}}
{{- printf "%s-nats" (include "kvgate.fullname" . | trunc 58 | trimSuffix "-") }}
{{- end }}

{{- define "kvgate.runsNats" -}}
{{- if and .Values.sync.enabled (not .Values.sync.url) }}true{{ end }}
{{- end }}

{{/* The Secret with the token the gateways present to the sync broker (and the chart's broker
requires): the operator's, else the chart's; empty when they present none (an external sync.url
given no token). The chart's Secret of a given token (sync.auth.token) and of a generated one have
different names: the generated one is immutable (sync-token-secret.yaml), so that switching from
it to a given token creates a Secret rather than rewriting it. */}}
{{- define "kvgate.syncTokenSecretName" -}}
{{- $auth := .Values.sync.auth }}
{{- if .Values.sync.enabled }}
{{- if $auth.existingSecret }}{{ $auth.existingSecret }}
{{- else if $auth.token }}{{ include "kvgate.syncTokenGivenName" . }}
{{- else if include "kvgate.runsNats" . }}{{ include "kvgate.syncTokenGeneratedName" . }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvgate.syncTokenGeneratedName" -}}
{{- printf "%s-sync-token" (include "kvgate.fullname" .) }}
{{- end }}

{{- define "kvgate.syncTokenGivenName" -}}
{{- printf "%s-sync-token-given" (include "kvgate.fullname" .) }}
{{- end }}

{{/* Whether the chart generates the sync token (no existingSecret, no token, its own broker). */}}
{{- define "kvgate.syncTokenGenerated" -}}
{{- $auth := .Values.sync.auth }}
{{- if and .Values.sync.enabled (not $auth.existingSecret) (not $auth.token) (include "kvgate.runsNats" .) }}true{{ end }}
{{- end }}

{{- define "kvgate.syncTokenDir" -}}/etc/kvgate/sync-token{{- end }}

{{/* Where the chart's broker reads the sync token from (its config names the variable). */}}
{{- define "kvgate.syncTokenEnv" -}}
- name: KVGATE_SYNC_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "kvgate.syncTokenSecretName" . }}
      key: {{ .Values.sync.auth.tokenKey }}
{{- end }}

{{/* Not the gateway's name label: the gateway's Service, PodDisruptionBudget and NetworkPolicy must not select the broker. */}}
{{- define "kvgate.natsSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-nats" (include "kvgate.name" . | trunc 58 | trimSuffix "-") }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: sync-broker
{{- end }}

{{- define "kvgate.natsLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvgate.natsSelectorLabels" . }}
app.kubernetes.io/version: {{ .Values.sync.nats.image.tag | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/part-of: {{ include "kvgate.name" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Without the chart's version either: a chart bump alone does not recreate the broker. */}}
{{- define "kvgate.natsPodLabels" -}}
{{ include "kvgate.natsSelectorLabels" . }}
app.kubernetes.io/part-of: {{ include "kvgate.name" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The broker container's resources: sync.nats.resources, a request above its limit lowered to
it (Kubernetes refuses the pod otherwise; a limit set alone below the default request is the
request too, as Kubernetes takes a limit alone). */}}
{{- define "kvgate.natsResources" -}}
{{- $given := .Values.sync.nats.resources | default dict }}
{{- $requests := deepCopy (get $given "requests" | default dict) }}
{{- $limits := get $given "limits" | default dict }}
{{- range $name, $limit := $limits }}
{{- $request := get $requests $name }}
{{- if and $limit $request }}
{{- $l := include "kvgate.quantity" $limit }}
{{- $r := include "kvgate.quantity" $request }}
{{- if and $l $r (gt (float64 $r) (float64 $l)) }}
{{- $_ := set $requests $name $limit }}
{{- end }}
{{- end }}
{{- end }}
{{- $out := dict }}
{{- with $requests }}{{ $_ := set $out "requests" . }}{{ end }}
{{- with $limits }}{{ $_ := set $out "limits" . }}{{ end }}
{{- toYaml $out }}
{{- end }}

{{/* GOMEMLIMIT for the broker (bytes, which the Go runtime takes without a unit): 90% of its
memory limit, what NATS advises for nats-server in a container; empty without a limit this
reads. The argument is the container's resources. */}}
{{- define "kvgate.natsMemoryLimitBytes" -}}
{{- with dig "limits" "memory" "" . }}
{{- with include "kvgate.quantity" . }}
{{- mulf (float64 .) 0.9 | floor | int64 }}
{{- end }}
{{- end }}
{{- end }}

{{/* The broker's nats-server.conf: core NATS only (no JetStream, nothing stored).
max_payload: a sync batch may reach 8 MiB (the codec's bound, gateway/sync/codec.py); below that the
gateways cut smaller batches to the server's limit, and only a holding too large for one message is
dropped. max_pending, the bytes the server holds for a client that reads slowly before it closes the
connection as a slow consumer (losing all of them), takes 8 of the largest messages, as the
gateway's own client holds 8 received; nats-server refuses to start with max_payload above it. */}}
{{- define "kvgate.natsConfig" -}}
{{- with .Values.sync.nats -}}
{{- if eq (int .port) (int .monitorPort) }}
{{- fail (printf "sync.nats.port and sync.nats.monitorPort are both %d: nats-server listens for clients and for monitoring (the probes) on two ports, and would not start" (int .port)) }}
{{- end }}
{{- if lt (int64 .maxPendingBytes) (mul 8 (int64 .maxPayloadBytes)) }}
{{- fail (printf "sync.nats.maxPendingBytes (%d) must be at least 8 x sync.nats.maxPayloadBytes (%d): the broker closes a gateway's connection as a slow consumer once more waits for it, losing every batch it held, and nats-server refuses to start with max_payload above max_pending" (int64 .maxPendingBytes) (mul 8 (int64 .maxPayloadBytes))) }}
{{- end -}}
port: {{ .port }}
http_port: {{ .monitorPort }}
# The largest sync batch is 8 MiB (gateway/sync/codec.py); the server's default is 1 MiB.
max_payload: {{ int64 .maxPayloadBytes }}
# A gateway reading slowly is closed as a slow consumer past this many bytes waiting for it.
max_pending: {{ int64 .maxPendingBytes }}
{{- end }}
# Only clients presenting the release's token (from the environment, never this file).
authorization {
  token: $KVGATE_SYNC_TOKEN
}
{{- end }}

{{/* The broker's URL. Credentials in it are refused (the gateway refuses them at start, and the
install notes would print them): in any comma-separated part, an `@` before the first `/`, `?` or
`#` after the scheme. */}}
{{- define "kvgate.syncUrl" -}}
{{- if .Values.sync.url }}
{{- range splitList "," .Values.sync.url }}
{{- if regexMatch "^\\s*([A-Za-z][A-Za-z0-9+.-]*://)?[^/?#]*@" . }}
{{- fail "sync.url: credentials in the URL (user:password@) are refused by the gateway and would be printed in the install notes; give scheme://host:port only and put the broker's secret in sync.auth (existingSecret or token; user for an ACL user)" }}
{{- end }}
{{- end }}
{{- if and (hasPrefix "redis" .Values.sync.url) (contains "," .Values.sync.url) (not (regexMatch "^rediss?\\+(sentinel://[^/]*/[^,]*|cluster://[^/]*)$" .Values.sync.url)) }}
{{- fail "sync.url: one redis:// or rediss:// URL (separate Redis/Valkey servers do not share pub/sub; name the Service in front of the primary, its sentinels: redis+sentinel://h1:26379,h2:26379/NAME, or the nodes of one Redis Cluster: redis+cluster://h1:6379,h2:6379)" }}
{{- end }}
{{- .Values.sync.url }}
{{- else }}
{{- printf "nats://%s.%s.svc:%d" (include "kvgate.natsName" .) .Release.Namespace (int .Values.sync.nats.port) }}
{{- end }}
{{- end }}

{{/* The broker's URL as the install notes show it: each part's scheme://host:port, without path
or query (a sentinel URL's primary name, or a query some client would read a secret from). */}}
{{- define "kvgate.syncUrlShown" -}}
{{- $shown := list }}
{{- range splitList "," (include "kvgate.syncUrl" .) }}
{{- $shown = append $shown (regexReplaceAll "^((?:[A-Za-z][A-Za-z0-9+.-]*://)?[^/?#]*).*$" (trim .) "${1}") }}
{{- end }}
{{- join "," $shown }}
{{- end }}

{{/* The gateway config's `sync` block; tuning keys left null keep the gateway's defaults. */}}
{{- define "kvgate.syncBlock" -}}
{{- $s := .Values.sync }}
{{- $prefix := default (printf "kvgate.%s.%s" .Release.Namespace .Release.Name) $s.subjectPrefix }}
{{- $block := dict "url" (include "kvgate.syncUrl" .) "subject_prefix" $prefix }}
{{- if include "kvgate.syncTokenSecretName" . }}
{{- $secretFile := printf "%s/%s" (include "kvgate.syncTokenDir" .) .Values.sync.auth.tokenKey }}
{{- if .Values.sync.auth.user }}
{{- if include "kvgate.runsNats" . }}{{ fail "sync.auth.user is for an external sync.url: the chart's NATS takes a token" }}{{ end }}
{{- $_ := set $block "auth" (dict "user" .Values.sync.auth.user "password_file" $secretFile) }}
{{- else }}
{{- $_ := set $block "auth" (dict "token_file" $secretFile) }}
{{- end }}
{{- end }}
{{- range $key, $name := dict "batchMaxItems" "batch_max_items" "queueMaxItems" "queue_max_items" }}
{{- with index $s $key }}{{ $_ := set $block $name (int64 .) }}{{ end }}
{{- end }}
{{- range $key, $name := dict "batchIntervalS" "batch_interval_s" "loadRefreshS" "load_refresh_s" "peerTimeoutS" "peer_timeout_s" "connectTimeoutS" "connect_timeout_s" }}
{{- with index $s $key }}{{ $_ := set $block $name . }}{{ end }}
{{- end }}
{{- toYaml $block }}
{{- end }}

{{/* The standard OpenTelemetry SDK variables: exporter, sampler and the pod's resource attributes. */}}
{{- define "kvgate.tracingEnv" -}}
{{- with .Values.tracing }}
- name: OTEL_SERVICE_NAME
  value: {{ .serviceName | quote }}
{{- with .otlp.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .otlp.protocol | quote }}
{{- if .otlp.headersSecret.name }}
- name: OTEL_EXPORTER_OTLP_HEADERS
  valueFrom:
    secretKeyRef:
      name: {{ .otlp.headersSecret.name }}
      key: {{ .otlp.headersSecret.key }}
{{- end }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .samplerArg | quote }}
- name: KVGATE_POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: KVGATE_POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- $attributes := list "k8s.namespace.name=$(KVGATE_POD_NAMESPACE)" "k8s.pod.name=$(KVGATE_POD_NAME)" }}
{{- range $key, $value := .resourceAttributes }}
{{- $attributes = append $attributes (printf "%s=%s" $key $value) }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attributes | quote }}
{{- end }}
{{- end }}

{{/* `kvgate serve --watchdog-s` for processes above 1: watchdogSeconds, else just under the time the
liveness probe takes to restart the pod over a hang of process 0 (docs/deploy.md). */}}
{{- define "kvgate.watchdogSeconds" -}}
{{- $set := .Values.watchdogSeconds }}
{{- if kindIs "invalid" $set }}
{{- with .Values.probes.liveness }}{{ max 2 (sub (add (mul (sub (int .failureThreshold) 1) (int .periodSeconds)) (int .timeoutSeconds)) 1) }}{{ end }}
{{- else }}
{{- if and (ne (float64 $set) 0.0) (lt (float64 $set) 2.0) }}
{{- fail "watchdogSeconds: 0 (off) or at least 2" }}
{{- end }}
{{- $set }}
{{- end }}
{{- end }}

{{/* The first path segments the client API is served under (gateway/routes.py, gateway/surface.py):
the paths to give an Ingress when the admin API is on, instead of `/` (a test keeps the list equal
to the gateway's routes). */}}
{{- define "kvgate.clientPathPrefixes" -}}
{{- list "/v1" "/v2" "/invocations" "/inference" "/generate" "/generative_scoring" "/encode" "/pooling" "/classify" "/score" "/rerank" "/tokenize" "/detokenize" "/health" "/health_generate" "/ping" "/version" | toJson }}
{{- end }}

{{/* Whether the chart's gateway config turns the admin API on (config.admin.api_key_hash): it is
served on the client port, so a route of `/` in front of the Service takes `/admin` out too. */}}
{{- define "kvgate.adminOn" -}}
{{- if dig "admin" "api_key_hash" "" (.Values.config | default dict) }}true{{ end }}
{{- end }}

{{/* Whether an Ingress path (dict path, pathType) takes `/admin` without naming it: `/` as a
prefix (ImplementationSpecific counts as one: ingress-nginx treats it so). */}}
{{- define "kvgate.ingressPathTakesAdmin" -}}
{{- if and (eq (trimSuffix "/" (.path | default "")) "") (ne (default "Prefix" .pathType) "Exact") }}true{{ end }}
{{- end }}

{{/* Whether HTTPRoute matches take `/admin` without naming it: no matches, a match without a
path (both mean PathPrefix `/`), or PathPrefix `/`. */}}
{{- define "kvgate.routeMatchesTakeAdmin" -}}
{{- $takes := not . }}
{{- range . }}
{{- $path := .path | default dict }}
{{- if and (eq (default "PathPrefix" $path.type) "PathPrefix") (eq (trimSuffix "/" ($path.value | default "/")) "") }}{{ $takes = true }}{{ end }}
{{- end }}
{{- if $takes }}true{{ end }}
{{- end }}
