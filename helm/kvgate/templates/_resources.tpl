{{/* The gateway pod's resources. Each process routes on one core and holds, at its worst, about
75 MB to run, `limits.max_buffered_answer_bytes` of whole answers, the one answer being parsed (up
to about 130 MB) and its keying process (about 120-200 MB): the answer budget plus 512Mi. Left
empty, `resources` is derived from `processes` (one core, 512Mi and a limit of that budget per
process); set by hand it is used as given, and kvgate.resourcesShortfall notes what falls short. */}}

{{/* Mebibytes as a quantity: Gi when whole. */}}
{{- define "kvgate.mebibytes" -}}
{{- $mi := int64 . }}
{{- if eq (mod $mi 1024) 0 }}{{ div $mi 1024 }}Gi{{ else }}{{ $mi }}Mi{{ end }}
{{- end }}

{{/* One process's memory budget, in mebibytes. */}}
{{- define "kvgate.processMemoryMi" -}}
{{- $answers := dig "limits" "max_buffered_answer_bytes" 536870912 (.Values.config | default dict) }}
{{- add (ceil (divf (float64 $answers) 1048576.0)) 512 }}
{{- end }}

{{- define "kvgate.resources" -}}
{{- if .Values.resources }}
{{- toYaml .Values.resources }}
{{- else }}
{{- $n := int .Values.processes }}
requests:
  cpu: {{ $n | quote }}
  memory: {{ include "kvgate.mebibytes" (mul $n 512) }}
limits:
  memory: {{ include "kvgate.mebibytes" (mul $n (include "kvgate.processMemoryMi" . | int64)) }}
{{- end }}
{{- end }}

{{/* A Kubernetes quantity as a number (cores, or bytes); empty when it is not one this reads. */}}
{{- define "kvgate.quantity" -}}
{{- $q := toString . }}
{{- $pattern := "^([0-9]+(?:\\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)(m|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)?$" }}
{{- if regexMatch $pattern $q }}
{{- $units := dict "" 1.0 "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 }}
{{- mulf (float64 (regexReplaceAll $pattern $q "${1}")) (get $units (regexReplaceAll $pattern $q "${2}")) }}
{{- end }}
{{- end }}

{{/* Install-notes lines on resources set by hand below what `processes` needs (empty: none). */}}
{{- define "kvgate.resourcesShortfall" -}}
{{- with .Values.resources }}
{{- $n := int $.Values.processes }}
{{- $requests := .requests | default dict }}
{{- $limits := .limits | default dict }}
{{- /* A CPU limit alone is the request too. */}}
{{- $cpu := get $requests "cpu" | default (get $limits "cpu") | default "0" }}
{{- $cores := include "kvgate.quantity" $cpu }}
{{- if and $cores (lt (float64 $cores) (float64 $n)) }}
Warning: resources.requests.cpu ({{ $cpu }}) is below processes ({{ $n }}): each gateway process routes on one core, and processes sharing fewer cores wait for each other on every request.
{{- end }}
{{- with get $limits "memory" }}
{{- $bytes := include "kvgate.quantity" . }}
{{- $budget := include "kvgate.processMemoryMi" $ | int64 }}
{{- if and $bytes (lt (float64 $bytes) (mulf (mul $n $budget) 1048576.0)) }}
Warning: resources.limits.memory ({{ . }}) is below {{ $n }} x {{ include "kvgate.mebibytes" $budget }}, the memory each gateway process may hold at its worst (limits.max_buffered_answer_bytes + 512Mi): a pod under load can be OOM-killed. Leave resources empty to have them derived from processes (docs/deploy.md).
{{- end }}
{{- end }}
{{- end }}
{{- end }}
