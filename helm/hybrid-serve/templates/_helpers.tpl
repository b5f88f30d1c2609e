{{/* Names. RayService names are kept short: KubeRay derives RayCluster, pod and Service names from them. */}}
{{- define "hybrid-serve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "hybrid-serve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The OpenAI Service (KubeRay's serve Service, named by us). */}}
{{- define "hybrid-serve.serviceName" -}}
{{- printf "%s-openai" (include "hybrid-serve.fullname" .) -}}
{{- end -}}

{{/* The Secret holding the API keys file (auth.existingSecret or the one the chart generates). */}}
{{- define "hybrid-serve.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "hybrid-serve.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "hybrid-serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hybrid-serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "hybrid-serve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "hybrid-serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "hybrid-serve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* GPUs per engine replica: one per tensor-parallel rank (ep reuses the tp ranks), or 0 on CPU
(mirrors AppArgs.gpus_per_replica). */}}
{{- define "hybrid-serve.gpusPerReplica" -}}
{{- if eq .Values.engine.device "cpu" -}}0{{- else -}}{{ int .Values.engine.tp }}{{- end -}}
{{- end -}}

{{/* GPUs per worker pod: a replica fits one pod unless it needs more than workers.maxGpusPerPod. */}}
{{- define "hybrid-serve.gpusPerPod" -}}
{{- $g := int (include "hybrid-serve.gpusPerReplica" .) -}}
{{- $max := int .Values.workers.maxGpusPerPod -}}
{{- if gt $g $max -}}{{ $max }}{{- else -}}{{ $g }}{{- end -}}
{{- end -}}

{{- define "hybrid-serve.podsPerReplica" -}}
{{- $g := int (include "hybrid-serve.gpusPerReplica" .) -}}
{{- $per := int (include "hybrid-serve.gpusPerPod" .) -}}
{{- if eq $g 0 -}}1{{- else -}}{{ div $g $per }}{{- end -}}
{{- end -}}

{{/* Cross-field checks the JSON schema cannot express. Each message names the field and its value. */}}
{{- define "hybrid-serve.validate" -}}
{{- $e := .Values.engine -}}
{{- if .Values.model.mambaGroups -}}
{{- if ne (mod (int .Values.model.mambaGroups) (int $e.tp)) 0 -}}
{{- fail (printf "engine.tp=%d does not divide model.mambaGroups=%d: mamba groups are split across TP ranks" (int $e.tp) (int .Values.model.mambaGroups)) -}}
{{- end -}}
{{- end -}}
{{- if and (eq $e.mambaCacheStrategy "no_buffer") (ne (int $e.pageSize) 1) -}}
{{- fail (printf "engine.mambaCacheStrategy=no_buffer needs engine.pageSize=1, got engine.pageSize=%d" (int $e.pageSize)) -}}
{{- end -}}
{{- if and $e.autoscaling.enabled (gt (int $e.autoscaling.minReplicas) (int $e.autoscaling.maxReplicas)) -}}
{{- fail (printf "engine.autoscaling.minReplicas=%d is greater than engine.autoscaling.maxReplicas=%d" (int $e.autoscaling.minReplicas) (int $e.autoscaling.maxReplicas)) -}}
{{- end -}}
{{- if and (ne (int $e.ep) 1) (ne (int $e.ep) (int $e.tp)) -}}
{{- fail (printf "engine.ep=%d must be 1 or equal to engine.tp=%d: experts are spread over the tp ranks (GPUs per replica = engine.tp)" (int $e.ep) (int $e.tp)) -}}
{{- end -}}
{{- $g := int (include "hybrid-serve.gpusPerReplica" .) -}}
{{- $max := int .Values.workers.maxGpusPerPod -}}
{{- if gt $g $max -}}
{{- fail (printf "engine.tp=%d GPUs per replica exceeds workers.maxGpusPerPod=%d: a replica's ranks are processes of one pod" $g $max) -}}
{{- end -}}
{{- if and .Values.weights.enabled (not (hasPrefix .Values.weights.mountPath .Values.model.path)) -}}
{{- fail (printf "model.path=%q is not under weights.mountPath=%q" .Values.model.path .Values.weights.mountPath) -}}
{{- end -}}
{{- end -}}

{{/* Arguments of service.deployments.app:build_app (schema: service/deployments/args.py AppArgs).
Every engine.* key that is not a deployment key is an EngineConfig setting: its snake_case name is the
argument (pageSize -> page_size); null keeps the engine's default. Whole numbers are written as integers. */}}
{{- define "hybrid-serve.appArgs" -}}
{{- $e := .Values.engine -}}
{{- $deploymentKeys := list "replicas" "autoscaling" "maxOngoingRequests" "cpusPerReplica" "reasoningParser" "toolCallParser" -}}
{{- $args := dict "model_path" .Values.model.path "replicas" (int $e.replicas) -}}
{{- range $k, $v := $e -}}
{{- if and (not (has $k $deploymentKeys)) (not (kindIs "invalid" $v)) -}}
{{- if and (kindIs "float64" $v) (eq $v (floor $v)) }}{{ $v = int64 $v }}{{ end -}}
{{- $_ := set $args (snakecase $k) $v -}}
{{- end -}}
{{- end -}}
{{- $_ := set $args "max_ongoing_requests" (int $e.maxOngoingRequests) -}}
{{- $_ := set $args "cpus_per_replica" $e.cpusPerReplica -}}
{{- $_ := set $args "route_prefix" .Values.serve.routePrefix -}}
{{- if .Values.model.servedModelName }}{{ $_ := set $args "served_model_name" .Values.model.servedModelName }}{{ end -}}
{{- if $e.reasoningParser }}{{ $_ := set $args "reasoning_parser" $e.reasoningParser }}{{ end -}}
{{- if $e.toolCallParser }}{{ $_ := set $args "tool_call_parser" $e.toolCallParser }}{{ end -}}
{{- if $e.autoscaling.enabled -}}
{{- $_ := set $args "min_replicas" (int $e.autoscaling.minReplicas) -}}
{{- $_ := set $args "max_replicas" (int $e.autoscaling.maxReplicas) -}}
{{- $_ := set $args "target_ongoing_requests" $e.autoscaling.targetOngoingRequests -}}
{{- end -}}
{{- $r := .Values.router -}}
{{- $_ := set $args "router" (dict "kind" $r.kind "w_prefix" $r.wPrefix "w_load" $r.wLoad "max_load_imbalance" (int $r.maxLoadImbalance) "index_capacity_blocks" (int $r.indexCapacityBlocks)) -}}
{{- if .Values.auth.enabled }}{{ $_ := set $args "api_keys_file" (printf "%s/%s" (trimSuffix "/" .Values.auth.mountPath) .Values.auth.secretKey) }}{{ end -}}
{{- $limits := dict -}}
{{- range $k, $v := .Values.limits }}{{ $_ := set $limits (snakecase $k) (ternary nil (int $v) (kindIs "invalid" $v)) }}{{ end -}}
{{- $_ := set $args "limits" $limits -}}
{{- $c := .Values.canary -}}
{{- $_ := set $args "canary" (dict "enabled" $c.enabled "interval_s" $c.intervalSeconds "audit_sample_rate" $c.auditSampleRate) -}}
{{- toYaml $args -}}
{{- end -}}

{{/* serveConfigV2 (schema: ray.serve.schema.ServeDeploySchema). */}}
{{- define "hybrid-serve.serveConfig" -}}
{{- $app := dict "name" .Values.serve.applicationName "route_prefix" .Values.serve.routePrefix "import_path" "service.deployments.app:build_app" "args" (include "hybrid-serve.appArgs" . | fromYaml) -}}
{{- $cfg := dict "proxy_location" "EveryNode" "http_options" (dict "host" "0.0.0.0" "port" (int .Values.serve.port)) -}}
{{- $_ := set $cfg "logging_config" (dict "encoding" .Values.serve.logEncoding "log_level" .Values.serve.logLevel) -}}
{{- $_ := set $cfg "applications" (list $app) -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* KubeRay's own health probes (ray-operator pod.go), written out so the timings are explicit. */}}
{{- define "hybrid-serve.wget" -}}
{{- printf "wget --tries 1 -T %d -q -O- http://localhost:%d/%s | grep success" (int .timeout) (int .port) .path -}}
{{- end -}}

{{- define "hybrid-serve.probes" -}}
{{- $root := .root -}}
{{- $r := $root.Values.probes.readiness -}}
{{- $l := $root.Values.probes.liveness -}}
{{- $raylet := include "hybrid-serve.wget" (dict "timeout" $r.timeoutSeconds "port" 52365 "path" "api/local_raylet_healthz") -}}
{{- $gcs := include "hybrid-serve.wget" (dict "timeout" $r.timeoutSeconds "port" 8265 "path" "api/gcs_healthz") -}}
{{- $proxy := include "hybrid-serve.wget" (dict "timeout" $r.timeoutSeconds "port" $root.Values.serve.port "path" "-/healthz") -}}
{{- $readyCmd := ternary (printf "%s && %s" $raylet $gcs) (printf "%s && %s" $raylet $proxy) .head -}}
{{- $liveCmd := ternary (printf "%s && %s" $raylet $gcs) $raylet .head -}}
readinessProbe:
  exec:
    command: ["bash", "-c", {{ $readyCmd | quote }}]
  initialDelaySeconds: {{ int $r.initialDelaySeconds }}
  periodSeconds: {{ int $r.periodSeconds }}
  timeoutSeconds: {{ int $r.timeoutSeconds }}
  successThreshold: 1
  failureThreshold: {{ ternary (int $r.failureThreshold) 1 .head }}
livenessProbe:
  exec:
    command: ["bash", "-c", {{ $liveCmd | quote }}]
  initialDelaySeconds: {{ int $l.initialDelaySeconds }}
  periodSeconds: {{ int $l.periodSeconds }}
  timeoutSeconds: {{ int $l.timeoutSeconds }}
  successThreshold: 1
  failureThreshold: {{ int $l.failureThreshold }}
{{- end -}}

{{/* Volumes of head and workers: /dev/shm, the writable scratch dirs of a read-only root filesystem, the
weights PVC; workers (where the OpenAI ingress replica runs) also mount the API keys Secret. */}}
{{- define "hybrid-serve.volumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shm }}
- name: tmp
  emptyDir:
    sizeLimit: {{ .root.Values.scratch.tmpSizeLimit }}
- name: home
  emptyDir:
    sizeLimit: {{ .root.Values.scratch.homeSizeLimit }}
{{- if and .apiKeys .root.Values.auth.enabled }}
- name: api-keys
  secret:
    secretName: {{ include "hybrid-serve.apiKeysSecretName" .root }}
    defaultMode: 0440
    items:
      - key: {{ .root.Values.auth.secretKey }}
        path: {{ .root.Values.auth.secretKey }}
{{- end }}
{{- if .root.Values.weights.enabled }}
- name: weights
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-weights" (include "hybrid-serve.fullname" .root)) .root.Values.weights.existingClaim }}
    readOnly: true
{{- end }}
{{- end -}}

{{- define "hybrid-serve.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/ray
{{- if .root.Values.weights.enabled }}
- name: weights
  mountPath: {{ .root.Values.weights.mountPath }}
  readOnly: true
{{- end }}
{{- if and .apiKeys .root.Values.auth.enabled }}
- name: api-keys
  mountPath: {{ .root.Values.auth.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- /* Ray Serve data path settings of every Ray pod (serve.rayServeMode), as a YAML map. */ -}}
{{- define "hybrid-serve.rayServeEnv" -}}
{{- /* the raylet starts Serve replicas (and so the engine core processes) 15 nice levels down unless told: keep them at the pod's priority */}}
RAY_worker_niceness: "0"
{{- if eq .Values.serve.rayServeMode "high_throughput" }}
RAY_SERVE_ENABLE_HA_PROXY: "1"
RAY_SERVE_THROUGHPUT_OPTIMIZED: "1"
{{- end }}
{{- end -}}

{{- define "hybrid-serve.env" -}}
{{- range $k, $v := .map }}
- name: {{ $k }}
  value: {{ $v | toString | quote }}
{{- end }}
{{- with .list }}
{{ toYaml . }}
{{- end }}
{{- end -}}
