{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "valora.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped base name: "valora" for a release named valora. */}}
{{- define "valora.fullname" -}}
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

{{- define "valora.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels; call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "valora.labels" -}}
helm.sh/chart: {{ include "valora.chart" .ctx }}
{{ include "valora.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: valora
{{- end -}}

{{- define "valora.selectorLabels" -}}
app.kubernetes.io/name: {{ include "valora.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "valora.cpuImage" -}}
{{- printf "%s:%s" .Values.image.cpu.repository (default .Chart.AppVersion .Values.image.cpu.tag) -}}
{{- end -}}

{{- define "valora.workerImage" -}}
{{- printf "%s:%s" .Values.image.worker.repository (default .Chart.AppVersion .Values.image.worker.tag) -}}
{{- end -}}

{{- define "valora.secretName" -}}
{{- if .Values.secrets.existingSecret -}}
{{- .Values.secrets.existingSecret -}}
{{- else -}}
{{- printf "%s-secrets" (include "valora.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Headless Service of the worker StatefulSet; also its serviceName. */}}
{{- define "valora.workerService" -}}
{{- printf "%s-worker" (include "valora.fullname" .) -}}
{{- end -}}

{{/*
Per-pod DNS names of the workers, comma-separated, as the scheduler's
VALORA_WORKER_ADDRESSES: <fullname>-worker-N.<fullname>-worker:<port> for N < replicas.
*/}}
{{- define "valora.workerAddresses" -}}
{{- $svc := include "valora.workerService" . -}}
{{- $port := int .Values.worker.port -}}
{{- $addresses := list -}}
{{- range $i := until (int .Values.worker.replicas) -}}
{{- $addresses = append $addresses (printf "%s-%d.%s:%d" $svc $i $svc $port) -}}
{{- end -}}
{{- join "," $addresses -}}
{{- end -}}

{{- define "valora.adapterStoreAddress" -}}
{{- printf "%s-adapter-store:%d" (include "valora.fullname" .) (int .Values.adapterStore.port) -}}
{{- end -}}

{{- define "valora.schedulerAddress" -}}
{{- printf "%s-scheduler:%d" (include "valora.fullname" .) (int .Values.scheduler.port) -}}
{{- end -}}

{{/* One secret key as an env entry; call with (list $ "VALORA_API_KEYS"). */}}
{{- define "valora.secretEnv" -}}
{{- $ctx := index . 0 -}}
{{- $key := index . 1 -}}
- name: {{ $key }}
  valueFrom:
    secretKeyRef:
      name: {{ include "valora.secretName" $ctx }}
      key: {{ $key }}
{{- end -}}

{{/* Pod annotations for annotation-based Prometheus scraping; call with (list $ port). */}}
{{- define "valora.metricsAnnotations" -}}
{{- $ctx := index . 0 -}}
{{- if $ctx.Values.metrics.podAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ index . 1 | quote }}
prometheus.io/path: /metrics
{{- end -}}
{{- end -}}

{{/* The model volume (hostPath or PVC, read-only). */}}
{{- define "valora.modelVolume" -}}
- name: model
{{- if .Values.model.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.existingClaim }}
    readOnly: true
{{- else if .Values.model.hostPath }}
  hostPath:
    path: {{ .Values.model.hostPath }}
    type: Directory
{{- else }}
{{- fail "set model.existingClaim or model.hostPath: the base model is a local path, never downloaded" }}
{{- end }}
{{- end -}}

{{- define "valora.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- with .Values.model.subPath }}
  subPath: {{ . }}
{{- end }}
{{- end -}}
