{{/* The container environment (empty when nothing applies). */}}
{{- define "async-processor.env" -}}
{{- if include "async-processor.redisURLSet" . }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "async-processor.redisSecretName" $ }}
      key: {{ include "async-processor.redisSecretKey" $ }}
{{- end }}
{{- if .Values.ap.otel.endpoint }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .Values.ap.otel.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: {{ .Values.ap.otel.insecure | toString | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .Values.ap.otel.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .Values.ap.otel.samplerArg | toString | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ .Values.ap.otel.serviceName | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.namespace.name=$(NAMESPACE),k8s.pod.name=$(POD_NAME),service.version={{ $.Chart.AppVersion }}"
{{- end }}
{{- range .Values.ap.gateSecrets }}
- name: {{ .env }}
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ .secretKey }}
{{- end }}
{{- with .Values.ap.extraEnv }}
{{- toYaml . | nindent 0 }}
{{- end }}
{{- end -}}
