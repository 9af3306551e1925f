{{/* The gateway pod's resources. Each process routes on one core and holds, at its worst, about
75 MB to run, `limits.max_buffered_answer_bytes` of whole answers, the one answer being parsed (up
to about 130 MB) and its keying process (about 120-200 MB): the answer budget plus 512Mi. So the
chart derives from `processes` one core and 512Mi requested and a limit of that budget per process,
and merges `resources` over them key by key: a value set there replaces the derived one, null
removes it, and the rest stay. kvgate.resourcesShortfall notes what falls short. */}}

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
{{- $n := int .Values.processes }}
{{- $given := .Values.resources | default dict }}
{{- $givenRequests := get $given "requests" | default dict }}
{{- $givenLimits := get $given "limits" | default dict }}
{{- $requests := dict "cpu" (toString $n) "memory" (include "kvgate.mebibytes" (mul $n 512)) }}
{{- $limits := dict "memory" (include "kvgate.mebibytes" (mul $n (include "kvgate.processMemoryMi" . | int64))) }}
{{- /* A derived value yields to the given one it would contradict (Kubernetes refuses a request
above its limit): a derived request is lowered to a limit set lower, a derived limit raised to a
request set higher. */}}
{{- range $name, $derived := $requests }}
{{- $limit := get $givenLimits $name }}
{{- if and $limit (not (hasKey $givenRequests $name)) }}
{{- $l := include "kvgate.quantity" $limit }}
{{- if and $l (lt (float64 $l) (float64 (include "kvgate.quantity" $derived))) }}
{{- $_ := set $requests $name $limit }}
{{- end }}
{{- end }}
{{- end }}
{{- range $name, $derived := $limits }}
{{- $request := get $givenRequests $name }}
{{- if and $request (not (hasKey $givenLimits $name)) }}
{{- $r := include "kvgate.quantity" $request }}
{{- if and $r (gt (float64 $r) (float64 (include "kvgate.quantity" $derived))) }}
{{- $_ := set $limits $name $request }}
{{- end }}
{{- end }}
{{- end }}
{{- $out := dict }}
{{- range $section, $derived := dict "requests" $requests "limits" $limits }}
{{- $merged := $derived }}
{{- if hasKey $given $section }}
{{- $merged = deepCopy $derived }}
{{- range $name, $value := get $given $section | default dict }}
{{- if kindIs "invalid" $value }}
{{- $_ := unset $merged $name }}
{{- else }}
{{- $_ := set $merged $name $value }}
{{- end }}
{{- end }}
{{- /* The whole section set to null: nothing derived in it. */}}
{{- if kindIs "invalid" (get $given $section) }}
{{- $merged = dict }}
{{- end }}
{{- end }}
{{- if $merged }}
{{- $_ := set $out $section $merged }}
{{- end }}
{{- end }}
{{- toYaml $out }}
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

{{/* Install-notes lines on resources set below what `processes` needs (empty: none). The derived
values never fall short: what does was set by hand. */}}
{{- define "kvgate.resourcesShortfall" -}}
{{- $n := int .Values.processes }}
{{- $final := include "kvgate.resources" . | fromYaml }}
{{- $requests := get $final "requests" | default dict }}
{{- $limits := get $final "limits" | default dict }}
{{- /* A CPU limit alone is the request too. */}}
{{- $cpu := get $requests "cpu" | default (get $limits "cpu") }}
{{- if not $cpu }}
Warning: resources.requests.cpu is null (and there is no CPU limit): the pod requests no CPU, so its gateway processes, each routing on one core, may get no core of their own and wait for each other on every request. Leave resources.requests.cpu unset to have it derived from processes (docs/deploy.md).
{{- else }}
{{- $cores := include "kvgate.quantity" $cpu }}
{{- if and $cores (lt (float64 $cores) (float64 $n)) }}
Warning: resources.requests.cpu ({{ $cpu }}) is below processes ({{ $n }}): each gateway process routes on one core, and processes sharing fewer cores wait for each other on every request.
{{- end }}
{{- end }}
{{- with get $limits "cpu" }}
{{- $cores := include "kvgate.quantity" . }}
{{- if and $cores (lt (float64 $cores) (float64 $n)) }}
Warning: resources.limits.cpu ({{ . }}) is below processes ({{ $n }}): the processes are throttled to fewer cores than they route on.
{{- end }}
{{- end }}
{{- with get $limits "memory" }}
{{- $bytes := include "kvgate.quantity" . }}
{{- $budget := include "kvgate.processMemoryMi" $ | int64 }}
{{- if and $bytes (lt (float64 $bytes) (mulf (mul $n $budget) 1048576.0)) }}
Warning: resources.limits.memory ({{ . }}) is below {{ $n }} x {{ include "kvgate.mebibytes" $budget }}, the memory each gateway process may hold at its worst (limits.max_buffered_answer_bytes + 512Mi): a pod under load can be OOM-killed. Leave resources.limits.memory unset to have it derived from processes (docs/deploy.md).
{{- end }}
{{- end }}
{{- end }}

{{/* A HorizontalPodAutoscaler targeting CPU (memory) utilization measures it against the pods'
CPU (memory) request: without one it cannot compute any and stops scaling, silently. That holds for
the chart's own targets and for a metric of autoscaling.metrics alike: a `Resource` one, or a
`ContainerResource` one of the gateway's container, whose target is a `Utilization` (an
`AverageValue` needs no request). */}}
{{- define "kvgate.autoscalingNeedsRequests" -}}
{{- $final := include "kvgate.resources" . | fromYaml }}
{{- $requests := get $final "requests" | default dict }}
{{- $limits := get $final "limits" | default dict }}
{{- $needs := list }}
{{- range $name, $target := dict "cpu" .Values.autoscaling.targetCPUUtilizationPercentage "memory" .Values.autoscaling.targetMemoryUtilizationPercentage }}
{{- if $target }}
{{- $key := ternary "targetCPUUtilizationPercentage" "targetMemoryUtilizationPercentage" (eq $name "cpu") }}
{{- $needs = append $needs (dict "name" $name "what" (printf "autoscaling.%s" $key) "instead" (printf "set autoscaling.%s: null and scale on other metrics" $key)) }}
{{- end }}
{{- end }}
{{- range $i, $metric := .Values.autoscaling.metrics | default list }}
{{- $source := dict }}
{{- if eq (toString (get $metric "type")) "Resource" }}
{{- $source = dig "resource" dict $metric }}
{{- else if and (eq (toString (get $metric "type")) "ContainerResource") (eq (toString (dig "containerResource" "container" "" $metric)) "kvgate") }}
{{- $source = dig "containerResource" dict $metric }}
{{- end }}
{{- $name := toString (get $source "name") }}
{{- if and (has $name (list "cpu" "memory")) (eq (toString (dig "target" "type" "" $source)) "Utilization") }}
{{- $needs = append $needs (dict "name" $name "what" (printf "autoscaling.metrics[%d] (%s %s, target.type Utilization)" $i (get $metric "type") $name) "instead" "target an AverageValue of it instead") }}
{{- end }}
{{- end }}
{{- range $needs }}
{{- /* Kubernetes takes a limit set alone as the request. */}}
{{- if not (get $requests .name | default (get $limits .name)) }}
{{- fail (printf "%s needs a %s request, and resources.requests.%s is null: the autoscaler could compute no utilization and would never scale. Leave resources.requests.%s unset (derived from processes) or set it, or %s" .what .name .name .name .instead) }}
{{- end }}
{{- end }}
{{- end }}
