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
{{- end }}

{{- define "kvgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvgate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvgate.keyHashSecretName" -}}
{{- default (printf "%s-key-hash" (include "kvgate.fullname" .)) .Values.keyHashSecret.existingSecret }}
{{- end }}

{{- define "kvgate.terminationGracePeriodSeconds" -}}
{{- if kindIs "invalid" .Values.shutdown.terminationGracePeriodSeconds }}
{{- add .Values.shutdown.preStopSleepSeconds .Values.shutdown.drainSeconds 5 }}
{{- else }}
{{- .Values.shutdown.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/* Mount points: the gateway config and the policy file come from separate ConfigMaps. */}}
{{- define "kvgate.configDir" -}}/etc/kvgate/config{{- end }}
{{- define "kvgate.policyDir" -}}/etc/kvgate/policy{{- end }}

{{/* The gateway config file (schema: gateway/config.py), generated from the values; `.Values.config` keys win. */}}
{{- define "kvgate.gatewayConfig" -}}
{{- $pools := list }}
{{- range $i, $p := .Values.pools }}
{{- if not $p.name }}{{ fail (printf "pools[%d]: name is required" $i) }}{{ end }}
{{- if not $p.models }}{{ fail (printf "pools[%d] (%s): models is required" $i $p.name) }}{{ end }}
{{- $pool := dict "name" $p.name "models" $p.models }}
{{- $w := default dict $p.workers }}
{{- if $w.urls }}
{{- $_ := set $pool "workers" $w.urls }}
{{- else if and $w.dns $w.dns.name }}
{{- $_ := set $pool "dns" (dict "name" $w.dns.name "port" (int (default 8000 $w.dns.port)) "scheme" (default "http" $w.dns.scheme) "refresh_s" (default 5 $w.dns.refreshSeconds)) }}
{{- else }}
{{- fail (printf "pools[%d] (%s): set workers.urls or workers.dns.name" $i $p.name) }}
{{- end }}
{{- with $p.kvEventsEndpoint }}{{ $_ := set $pool "kv_events_endpoint" . }}{{ end }}
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
{{- $tenants = append $tenants $tenant }}
{{- end }}
{{- if not $tenants }}{{ fail "tenants: at least one tenant is required (API keys are configured as hashes: `kvgate serve --hash-key`)" }}{{ end }}
{{- $cfg := dict
  "listen" (dict "host" "0.0.0.0" "port" (int .Values.service.port))
  "metrics" (dict "listen" (dict "host" "0.0.0.0" "port" (int .Values.metrics.port)))
  "drain" (dict "deadline_s" .Values.shutdown.drainSeconds "shutdown_delay_s" .Values.shutdown.shutdownDelaySeconds)
  "secrets" (dict "key_hash_secret_env" .Values.keyHashSecret.env)
  "policy_file" (printf "%s/policy.yaml" (include "kvgate.policyDir" .))
  "log_level" .Values.logLevel
  "pools" $pools
  "tenants" $tenants
}}
{{- toYaml (mergeOverwrite $cfg (deepCopy .Values.config)) }}
{{- end }}
