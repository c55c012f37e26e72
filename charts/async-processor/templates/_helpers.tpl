{{/* Names and labels. */}}
{{- define "async-processor.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "async-processor.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "async-processor.selectorLabels" -}}
app.kubernetes.io/name: {{ include "async-processor.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "async-processor.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "async-processor.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "async-processor.serviceAccountName" -}}
{{- if .Values.ap.serviceAccount.create -}}
{{- default (include "async-processor.fullname" .) .Values.ap.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.ap.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* repository:tag, or repository@digest when ap.image.digest pins the bytes. */}}
{{- define "async-processor.image" -}}
{{- if .Values.ap.image.digest -}}
{{- printf "%s@%s" .Values.ap.image.repository .Values.ap.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.ap.image.repository (default .Chart.AppVersion .Values.ap.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* REDIS_URL is handed over when a Redis URL or Secret is named (ap.redis.enabled, the Go
chart's switch, is not needed for it; it never installs a Redis). */}}
{{- define "async-processor.redisURLSet" -}}
{{- if or .Values.ap.redis.enabled .Values.ap.redis.url .Values.ap.redis.secretName -}}true{{- end -}}
{{- end -}}

{{/* Where the ConfigMap's files are mounted (read-only). */}}
{{- define "async-processor.configDir" -}}/etc/async-processor/config{{- end -}}

{{/* Redis URL Secret: chart-made <fullname>-redis (key url) or the user's. */}}
{{- define "async-processor.redisSecretName" -}}
{{- if .Values.ap.redis.url -}}
{{- printf "%s-redis" (include "async-processor.fullname" .) -}}
{{- else -}}
{{- .Values.ap.redis.secretName -}}
{{- end -}}
{{- end -}}

{{- define "async-processor.redisSecretKey" -}}
{{- if .Values.ap.redis.url -}}url{{- else -}}{{ .Values.ap.redis.secretKey }}{{- end -}}
{{- end -}}

{{/* The queue list key of the transport config: topics for gcp-pubsub, queues otherwise. */}}
{{- define "async-processor.queueKey" -}}
{{- if eq .Values.ap.transport "gcp-pubsub" -}}topics{{- else -}}queues{{- end -}}
{{- end -}}

{{/*
The transport config as JSON, with ap.igwBaseURL filled into entries that lack
igw_base_url. Fails with a clear message when an entry still has no gateway URL.
*/}}
{{- define "async-processor.transportConfig" -}}
{{- $key := include "async-processor.queueKey" . -}}
{{- $cfg := deepCopy (.Values.ap.transportConfig | default dict) -}}
{{- $entries := list -}}
{{- range $i, $q := (get $cfg $key | default list) -}}
{{- $e := deepCopy $q -}}
{{- if not $e.igw_base_url -}}
{{- if not $.Values.ap.igwBaseURL -}}
{{- fail (printf "ap.transportConfig.%s[%d] has no igw_base_url and ap.igwBaseURL is empty: set the llm-d gateway URL in one of them" $key $i) -}}
{{- end -}}
{{- $_ := set $e "igw_base_url" $.Values.ap.igwBaseURL -}}
{{- end -}}
{{- $entries = append $entries $e -}}
{{- end -}}
{{- $_ := set $cfg $key $entries -}}
{{- toPrettyJson $cfg -}}
{{- end -}}

{{/*
Seconds in a Go duration ("2m", "1h30m", "90s", "500ms", "0"), rounded up.
Helm has no duration parser, so the parts are summed here; values.schema.json pins the syntax.
*/}}
{{- define "async-processor.durationSeconds" -}}
{{- $units := dict "ns" 0.000000001 "us" 0.000001 "µs" 0.000001 "ms" 0.001 "s" 1.0 "m" 60.0 "h" 3600.0 -}}
{{- $total := 0.0 -}}
{{- range $part := regexFindAll "[0-9]*\\.?[0-9]+(ns|us|µs|ms|s|m|h)" . -1 -}}
{{- $num := regexFind "^[0-9]*\\.?[0-9]+" $part | float64 -}}
{{- $unit := regexReplaceAll "^[0-9]*\\.?[0-9]+" $part "" -}}
{{- $total = addf $total (mulf $num (get $units $unit)) -}}
{{- end -}}
{{- ceil $total | int -}}
{{- end -}}

{{/* Render-time checks: a bad install fails here with a message, not in a crash loop. */}}
{{- define "async-processor.validate" -}}
{{- $ap := .Values.ap -}}
{{- $key := include "async-processor.queueKey" . -}}
{{- $cfg := $ap.transportConfig | default dict -}}
{{- if not (get $cfg $key) -}}
{{- fail (printf "ap.transportConfig.%s is empty: the %s transport needs at least one entry" $key $ap.transport) -}}
{{- end -}}
{{- if hasPrefix "redis-" $ap.transport -}}
{{- if and $ap.redis.enabled (not $ap.redis.url) (not $ap.redis.secretName) -}}
{{- fail "ap.redis.enabled is true but neither ap.redis.url nor ap.redis.secretName is set: this chart installs no Redis, name the URL of yours" -}}
{{- end -}}
{{- if and (not (include "async-processor.redisURLSet" .)) (not $cfg.url) -}}
{{- fail (printf "the %s transport needs the URL of your Redis (this chart installs none): set ap.redis.url or ap.redis.secretName" $ap.transport) -}}
{{- end -}}
{{- if and $cfg.url (contains "@" (toString $cfg.url)) -}}
{{- fail "ap.transportConfig.url carries credentials and would land in a ConfigMap: use ap.redis.url or ap.redis.secretName instead" -}}
{{- end -}}
{{- else -}}
{{- if not $cfg.project_id -}}
{{- fail "ap.transportConfig.project_id is required for gcp-pubsub" -}}
{{- end -}}
{{- if not $cfg.result_topic_id -}}
{{- fail "ap.transportConfig.result_topic_id is required for gcp-pubsub" -}}
{{- end -}}
{{- end -}}
{{- include "async-processor.validateGateParams" . -}}
{{- if eq (int $ap.health.port) (int $ap.metrics.port) -}}
{{- fail (printf "ap.health.port and ap.metrics.port are both %d: the health and metrics servers need their own ports" (int $ap.health.port)) -}}
{{- end -}}
{{- if ne (empty $ap.tls.certKey) (empty $ap.tls.keyKey) -}}
{{- fail "ap.tls.certKey and ap.tls.keyKey must be set together (client certificate and its key)" -}}
{{- end -}}
{{- if and (or $ap.tls.caCertKey $ap.tls.certKey) (not $ap.tls.secretName) -}}
{{- fail "ap.tls.caCertKey/certKey/keyKey name files in ap.tls.secretName, which is empty" -}}
{{- end -}}
{{- /* KEDA reads the backlog from Prometheus, unless the exporter or (GCP) Pub/Sub reports it. */ -}}
{{- $prometheusTrigger := and (ne $ap.transport "gcp-pubsub") (not $ap.exporter.enabled) -}}
{{- if and $ap.keda.enabled $prometheusTrigger (not $ap.keda.serverAddress) -}}
{{- fail "ap.keda.enabled needs ap.keda.serverAddress (the Prometheus URL KEDA queries), or ap.exporter.enabled" -}}
{{- end -}}
{{- if and $ap.keda.enabled $prometheusTrigger (lt (int $ap.keda.minReplicaCount) 1) -}}
{{- fail "ap.keda.minReplicaCount 0 needs ap.exporter.enabled: without it the backlog metric comes from running replicas, so zero replicas would never scale up" -}}
{{- end -}}
{{- if and $ap.keda.enabled (eq $ap.transport "redis-pubsub") (lt (int $ap.keda.minReplicaCount) 1) -}}
{{- fail "ap.keda.minReplicaCount 0 is not possible with redis-pubsub: a message published while no replica subscribes is lost" -}}
{{- end -}}
{{- end -}}

{{/* Scrape relabeling shared by the PodMonitor and ServiceMonitor: the pod's release
becomes the series label `release`, which the PrometheusRule and the dashboard select on. */}}
{{- define "async-processor.releaseRelabeling" -}}
relabelings:
  - action: replace
    sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_instance]
    targetLabel: release
{{- end -}}

{{/* No password in a gate param: the config files are a ConfigMap. A gate param of exactly
"${NAME}" reads the environment variable NAME instead; ap.gateSecrets fills it from a Secret. */}}
{{- define "async-processor.validateGateParams" -}}
{{- $key := include "async-processor.queueKey" . -}}
{{- $owners := dict -}}
{{- range $i, $q := (get (.Values.ap.transportConfig | default dict) $key | default list) -}}
{{- $_ := set $owners (printf "ap.transportConfig.%s[%d]" $key $i) $q -}}
{{- end -}}
{{- range $i, $p := .Values.ap.workerPools -}}
{{- $_ := set $owners (printf "ap.workerPools[%d]" $i) $p -}}
{{- end -}}
{{- range $owner, $entry := $owners -}}
{{- $params := $entry.gate_params | default dict -}}
{{- if regexMatch "[A-Za-z][A-Za-z0-9+.-]*://[^/@\"\\s]*:[^/@\"\\s]+@" (kindIs "string" $params | ternary $params (toJson $params)) -}}
{{- fail (printf "%s.gate_params carries a password, which would land in a ConfigMap: put the URL in a Secret, list it in ap.gateSecrets and write \"${NAME}\" as the param" $owner) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The config-file flags, shared by the daemon and the exporter (which loads the same
config, so it looks at the same keys). */}}
{{- define "async-processor.configArgs" -}}
{{- $ap := .Values.ap -}}
{{- $dir := include "async-processor.configDir" . -}}
- --transport={{ $ap.transport }}
- --transport-config-file={{ $dir }}/transport-config.json
{{- if $ap.workerPools }}
- --pool-config-file={{ $dir }}/worker-pools.json
{{- end }}
{{- if $ap.requestMergePolicyConfig }}
- --request-merge-policy-config-file={{ $dir }}/request-merge-policy.json
{{- end }}
{{- if $ap.transformConfig }}
- --transform-config-file={{ $dir }}/transform-config.json
{{- end }}
{{- end -}}

{{/* "true" when the daemon applies queue changes without a restart: a sorted-set
transport and a watch interval other than zero (--transport-config-watch-interval; zero
in any spelling the schema takes, "0m0s" too: each part all zeros). */}}
{{- define "async-processor.watchesQueues" -}}
{{- $every := toString (.Values.ap.transportConfigWatchInterval | default "") -}}
{{- if and (eq .Values.ap.transport "redis-sortedset") $every (not (regexMatch "^[+]?([0.]+(ns|us|µs|μs|ms|s|m|h)?)+$" $every)) -}}
true
{{- end -}}
{{- end -}}

{{/* What a restart must follow when queues are reloaded in place: every config file, the
transport config without its queues. */}}
{{- define "async-processor.restartConfig" -}}
{{- $ap := .Values.ap -}}
{{- $transport := include "async-processor.transportConfig" . | fromJson -}}
{{- $_ := unset $transport "queues" -}}
{{- toJson (list $transport $ap.workerPools $ap.requestMergePolicyConfig $ap.transformConfig) -}}
{{- end -}}

{{/* The exporter's names and labels: its own app name, so the daemon's selectors (Service,
PodMonitor, PodDisruptionBudget) never pick its pod. */}}
{{- define "async-processor.exporterName" -}}
{{- printf "%s-exporter" (include "async-processor.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "async-processor.exporterSelectorLabels" -}}
app.kubernetes.io/name: {{ include "async-processor.name" . }}-exporter
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* A subscription's full path from (project_id, subscriber_id); a full path stays as is. */}}
{{- define "async-processor.subscription" -}}
{{- $project := index . 0 -}}{{- $id := index . 1 -}}
{{- if hasPrefix "projects/" $id -}}{{ $id }}{{- else -}}{{ printf "projects/%s/subscriptions/%s" $project $id }}{{- end -}}
{{- end -}}
