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

{{/* The gateway config file, generated from the values; `.Values.config` keys win. */}}
{{- define "kvgate.gatewayConfig" -}}
{{- $pools := list }}
{{- range $i, $p := .Values.pools }}
{{- if not $p.name }}{{ fail (printf "pools[%d]: name is required" $i) }}{{ end }}
{{- if not $p.models }}{{ fail (printf "pools[%d] (%s): models is required" $i $p.name) }}{{ end }}
{{- $workers := dict }}
{{- if $p.workers.urls }}
{{- $_ := set $workers "urls" $p.workers.urls }}
{{- else if and $p.workers.dns $p.workers.dns.name }}
{{- $dns := $p.workers.dns }}
{{- $_ := set $workers "dns" (dict "name" $dns.name "port" (int $dns.port) "scheme" (default "http" $dns.scheme) "refresh_s" (default 5 $dns.refreshSeconds)) }}
{{- else }}
{{- fail (printf "pools[%d] (%s): set workers.urls or workers.dns.name" $i $p.name) }}
{{- end }}
{{- $pool := dict "name" $p.name "models" $p.models "workers" $workers }}
{{- if $p.kvEventsEndpoint }}
{{- $_ := set $pool "kv_events_endpoint" $p.kvEventsEndpoint }}
{{- end }}
{{- $pools = append $pools $pool }}
{{- end }}
{{- $tenants := list }}
{{- range .Values.tenants }}
{{- $t := dict "name" .name "api_key_hashes" (default list .apiKeyHashes) }}
{{- with .isolation }}{{ $_ := set $t "isolation" . }}{{ end }}
{{- with .maxConcurrent }}{{ $_ := set $t "max_concurrent" . }}{{ end }}
{{- with .rpm }}{{ $_ := set $t "rpm" . }}{{ end }}
{{- with .tpm }}{{ $_ := set $t "tpm" . }}{{ end }}
{{- $tenants = append $tenants $t }}
{{- end }}
{{- $cfg := dict
  "listen" (dict "host" "0.0.0.0" "port" (int .Values.service.port))
  "policy_file" (printf "%s/policy.yaml" (include "kvgate.policyDir" .))
  "policy_reload_s" .Values.policy.reloadIntervalSeconds
  "key_hash_secret_env" .Values.keyHashSecret.env
  "drain_s" .Values.shutdown.drainSeconds
  "log_level" .Values.logLevel
  "pools" $pools
  "tenants" $tenants
}}
{{- toYaml (mergeOverwrite $cfg (deepCopy .Values.config)) }}
{{- end }}
