{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified release name. */}}
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

{{- define "kvgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object; the component is "gateway" unless given. */}}
{{- define "kvgate.labels" -}}
helm.sh/chart: {{ include "kvgate.chart" . }}
{{ include "kvgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "kvgate.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "kvgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvgate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvgate.adminSecretName" -}}
{{- default (printf "%s-admin" (include "kvgate.fullname" .)) .Values.admin.existingSecret }}
{{- end }}

{{- define "kvgate.discoveryNamespace" -}}
{{- default .Release.Namespace .Values.discovery.namespace }}
{{- end }}

{{/* memory | redis: the configured store, else redis when a Redis is configured, else memory. */}}
{{- define "kvgate.sessionStore" -}}
{{- if .Values.sessions.store }}
{{- .Values.sessions.store }}
{{- else if or .Values.redis.deploy .Values.redis.url .Values.redis.existingSecret }}
{{- print "redis" }}
{{- else }}
{{- print "memory" }}
{{- end }}
{{- end }}

{{/* Fails the render on value combinations that cannot work. */}}
{{- define "kvgate.validate" -}}
{{- $store := include "kvgate.sessionStore" . }}
{{- if and (gt (int .Values.replicaCount) 1) (eq $store "memory") (not .Values.sessions.allowPerReplicaSessions) }}
{{- fail "replicaCount > 1 needs sessions shared through Redis: set redis.deploy, redis.url or redis.existingSecret (or sessions.allowPerReplicaSessions: true)" }}
{{- end }}
{{- if and (eq $store "redis") (not (or .Values.redis.deploy .Values.redis.url .Values.redis.existingSecret)) }}
{{- fail "sessions.store is redis but no Redis is configured: set redis.deploy, redis.url or redis.existingSecret" }}
{{- end }}
{{- if and .Values.redis.deploy (or .Values.redis.url .Values.redis.existingSecret) }}
{{- fail "set either redis.deploy or an external Redis (redis.url / redis.existingSecret), not both" }}
{{- end }}
{{- if and .Values.discovery.enabled (not .Values.discovery.model) (not .Values.discovery.modelLabel) (not .Values.discovery.modelAnnotation) }}
{{- fail "discovery needs discovery.model, discovery.modelLabel or discovery.modelAnnotation" }}
{{- end }}
{{- end }}

{{/* The gateway YAML (router/config.py), as a dict rendered by the ConfigMap. Written as JSON (which is YAML):
toYaml writes a float under 1e-4 as 2e-05, which the gateway's YAML 1.1 loader reads as a string and refuses,
while JSON writes 0.00002 (exponents only below 1e-6). */}}
{{- define "kvgate.gatewayConfig" -}}
{{- $cfg := dict
  "listen" (dict "host" "0.0.0.0" "port" (int .Values.gateway.port))
  "models" .Values.gateway.models
  "policy" .Values.gateway.policy
  "admin" (dict "token_env" "KVGATE_ADMIN_TOKEN") }}
{{- if .Values.gateway.workers }}
{{- $_ := set $cfg "workers" .Values.gateway.workers }}
{{- end }}
{{- $sessions := dict "store" (include "kvgate.sessionStore" .) "idle_timeout_s" .Values.sessions.idleTimeoutS }}
{{- if eq (include "kvgate.sessionStore" .) "redis" }}
{{- $_ := set $sessions "key_prefix" .Values.sessions.keyPrefix }}
{{- if .Values.redis.deploy }}
{{- $_ := set $sessions "url" (printf "redis://%s-redis:6379/0" (include "kvgate.fullname" .)) }}
{{- else if .Values.redis.existingSecret }}
{{- $_ := set $sessions "url_env" "KVGATE_REDIS_URL" }}
{{- else }}
{{- $_ := set $sessions "url" .Values.redis.url }}
{{- end }}
{{- if and .Values.redis.passwordSecret (not .Values.redis.deploy) }}
{{- $_ := set $sessions "password_env" "KVGATE_REDIS_PASSWORD" }}
{{- end }}
{{- end }}
{{- $_ := set $cfg "sessions" $sessions }}
{{- if .Values.discovery.enabled }}
{{- $d := .Values.discovery }}
{{- $_ := set $cfg "discovery" (dict
  "kind" "kubernetes"
  "namespace" (include "kvgate.discoveryNamespace" .)
  "label_selector" $d.labelSelector
  "port" (int $d.port)
  "port_annotation" $d.portAnnotation
  "events_port" (ternary nil (int $d.eventsPort) (kindIs "invalid" $d.eventsPort))
  "replay_port" (ternary nil (int $d.replayPort) (kindIs "invalid" $d.replayPort))
  "model" $d.model
  "model_label" $d.modelLabel
  "model_annotation" $d.modelAnnotation
  "role_label" (default "" $d.roleLabel)
  "bootstrap_port_annotation" (default "" $d.bootstrapPortAnnotation)
  "worker" $d.worker
  "watch_timeout_s" $d.watchTimeoutS) }}
{{- end }}
{{- if .Values.endpointPicker.enabled }}
{{- $_ := set $cfg "endpoint_picker" (dict
  "host" "0.0.0.0"
  "port" (int .Values.endpointPicker.port)
  "num_fallback_endpoints" (int .Values.endpointPicker.numFallbackEndpoints)) }}
{{- end }}
{{- toPrettyJson (mergeOverwrite $cfg (deepCopy .Values.gateway.extraConfig)) }}
{{- end }}

{{/*
The InferencePool's selector: endpointPicker.inferencePool.matchLabels, else the equality terms of
discovery.labelSelector (the pods discovery watches are the pool's), which must then have no other kind of term.
*/}}
{{- define "kvgate.inferencePoolMatchLabels" -}}
{{- $labels := .Values.endpointPicker.inferencePool.matchLabels }}
{{- if not $labels }}
{{- $labels = dict }}
{{- range $term := splitList "," .Values.discovery.labelSelector }}
{{- $kv := splitList "=" (trim $term) }}
{{- if or (ne (len $kv) 2) (contains "!" $term) (not (index $kv 0)) }}
{{- fail (printf "endpointPicker.inferencePool: discovery.labelSelector term %q is not key=value; set endpointPicker.inferencePool.matchLabels" $term) }}
{{- end }}
{{- $_ := set $labels (trim (index $kv 0)) (trim (index $kv 1)) }}
{{- end }}
{{- end }}
{{- toYaml $labels }}
{{- end }}
